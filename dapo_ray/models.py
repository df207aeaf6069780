"""Where a run's model directory comes from (`rollout.model_source`): a path, or built on first use."""

from __future__ import annotations

from pathlib import Path


def ensure_model(cfg, only_if_missing: bool = False, log=None) -> Path:
    """The config's `rollout.model_path`, built first when `rollout.model_source` names a builder: the
    tiny model (`dapo_ray.tiny_model.build_for`) or SmolLM2 (`dapo_ray.smollm2.build_smollm2`). Each
    builder reuses a directory it already wrote for the same inputs. `only_if_missing`: leave any model
    directory that is there alone (`dapo-ray train`, which may be pointed at a model built elsewhere).
    A builder writes only a directory it wrote before or one whose name names it, so that a model's path
    says which model it holds."""
    r = cfg.rollout
    path = Path(r.model_path)
    if r.model_source != "path":
        _refuse_another_builders(path, r.model_source)
    if r.model_source == "path" or (only_if_missing and (path / "config.json").exists()):
        return path
    _refuse_a_name_that_says_otherwise(path, r.model_source)
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


def _refuse_a_name_that_says_otherwise(path: Path, source: str) -> None:
    """A builder about to write a directory it has not written before needs the directory's name to name
    it (`runs/smollm2-135m-instruct`, `runs/tiny-model`): gpu_smoke.yaml's runs/random-qwen2.5-0.5b with
    `rollout.model_source=smollm2` would otherwise get SmolLM2 under the random model's name."""
    from dapo_ray.config import ConfigError

    if (path / STAMPS[source]).exists() or source in path.name.lower():
        return
    raise ConfigError(
        f"rollout.model_source is {source!r}, which would write its model into rollout.model_path {path}, whose "
        f"name says nothing of {source!r}: give rollout.model_path a directory named for it (e.g. "
        f"runs/{source}-model), or rollout.model_source=path to use a model that is already at {path}"
    )
