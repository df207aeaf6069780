"""A model_source pointed at a directory another builder wrote is refused before anything runs."""

import json

import pytest

from dapo_ray.config import ConfigError, load_config
from dapo_ray.models import STAMPS, ensure_model

SMOKE = "workflows/configs/gpu_smoke.yaml"


@pytest.mark.parametrize("only_if_missing", [False, True])  # `dapo-ray train` passes True
def test_smollm2_over_the_smoke_runs_random_model_is_refused(tmp_path, only_if_missing):
    random_dir = tmp_path / "random-qwen2.5-0.5b"
    random_dir.mkdir()
    (random_dir / "config.json").write_text("{}")
    (random_dir / STAMPS["make-random-model"]).write_text(json.dumps({"shape": "qwen2.5-0.5b"}))
    cfg = load_config(SMOKE, [f"rollout.model_path={random_dir}", "rollout.model_source=smollm2"])
    with pytest.raises(ConfigError, match="make-random-model built, but rollout.model_source is 'smollm2'"):
        ensure_model(cfg, only_if_missing=only_if_missing)
    # The random model itself, as the smoke config names it, is left alone.
    assert ensure_model(load_config(SMOKE, [f"rollout.model_path={random_dir}"])) == random_dir


def test_a_builder_may_reuse_its_own_directory(tmp_path, monkeypatch):
    own = tmp_path / "tiny"
    own.mkdir()
    (own / STAMPS["tiny"]).write_text("{}")
    import dapo_ray.tiny_model

    monkeypatch.setattr(dapo_ray.tiny_model, "build_for", lambda cfg, log=None: own)  # the builder, not its work
    cfg = load_config("workflows/configs/tiny_cpu.yaml", [f"rollout.model_path={own}"])
    assert ensure_model(cfg) == own
