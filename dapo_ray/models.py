"""Where a run's model directory comes from (`rollout.model_source`): a path, or built on first use."""

from __future__ import annotations

from pathlib import Path


def ensure_model(cfg, only_if_missing: bool = False, log=None) -> Path:
    """The config's `rollout.model_path`, built first when `rollout.model_source` names a builder: the
    tiny model (`dapo_ray.tiny_model.build_for`) or SmolLM2 (`dapo_ray.smollm2.build_smollm2`). Each
    builder reuses a directory it already wrote for the same inputs. `only_if_missing`: leave any model
    directory that is there alone (`dapo-ray train`, which may be pointed at a model built elsewhere)."""
    r = cfg.rollout
    path = Path(r.model_path)
    if r.model_source != "path":
        _refuse_another_builders(path, r.model_source)
    if r.model_source == "path" or (only_if_missing and (path / "config.json").exists()):
        return path
    if r.model_source == "tiny":
        from dapo_ray.tiny_model import build_for

        return build_for(cfg, log=log)
    from dapo_ray.smollm2 import build_smollm2

    return build_smollm2(path, log=log)


# The stamp each builder leaves in the directory it writes (`make-random-model` has no model_source).
STAMPS = {"tiny": "dapo_ray_tiny.json", "smollm2": "dapo_ray_model.json", "make-random-model": "dapo_ray_random.json"}


def _refuse_another_builders(path: Path, source: str) -> None:
    """A model_source pointed at a directory another builder wrote would either train that model in its
    place or overwrite it (gpu_smoke.yaml's random model with `rollout.model_source=smollm2`): refuse."""
    from dapo_ray.config import ConfigError

    for builder, stamp in STAMPS.items():
        if builder != source and (path / stamp).exists():
            raise ConfigError(
                f"rollout.model_path {path} holds a model that {builder} built, but rollout.model_source is "
                f"{source!r}: give rollout.model_path a directory of its own for it (e.g. runs/{source}-model), "
                "or rollout.model_source=path to use the model that is there"
            )
