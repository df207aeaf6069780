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
    if r.model_source == "path" or (only_if_missing and (path / "config.json").exists()):
        return path
    if r.model_source == "tiny":
        from dapo_ray.tiny_model import build_for

        return build_for(cfg, log=log)
    from dapo_ray.smollm2 import build_smollm2

    return build_smollm2(path, log=log)
