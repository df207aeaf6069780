"""A model_source pointed at a directory another builder wrote is refused before anything runs."""

import json
from pathlib import Path

import pytest

from dapo_ray.config import ConfigError, load_config
from dapo_ray.models import STAMPS, ensure_model

SMOKE = "workflows/configs/gpu_smoke.yaml"
TINY = "workflows/configs/tiny_cpu.yaml"


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


@pytest.mark.parametrize("only_if_missing", [False, True])
def test_smollm2_is_not_written_under_the_smoke_runs_random_model_name(tmp_path, monkeypatch, only_if_missing):
    """gpu_smoke.yaml names runs/random-qwen2.5-0.5b; with rollout.model_source=smollm2 and that directory not
    built yet, SmolLM2 would be written under the random model's name. A builder writes only a directory
    named for it."""
    import dapo_ray.smollm2

    built = []
    monkeypatch.setattr(dapo_ray.smollm2, "build_smollm2", lambda path, log=None: built.append(path) or path)
    not_yet = tmp_path / Path(load_config(SMOKE).rollout.model_path).name
    cfg = load_config(SMOKE, [f"rollout.model_path={not_yet}", "rollout.model_source=smollm2"])
    with pytest.raises(ConfigError, match=r"random-qwen2\.5-0\.5b.*'smollm2'.*rollout\.model_source=path"):
        ensure_model(cfg, only_if_missing=only_if_missing)
    assert built == [] and not not_yet.exists()
    named = tmp_path / "smollm2-135m-instruct"
    cfg = load_config(SMOKE, [f"rollout.model_path={named}", "rollout.model_source=smollm2"])
    assert ensure_model(cfg, only_if_missing=only_if_missing) == named and built == [named]


def test_the_tiny_model_is_not_written_under_another_models_name(tmp_path, monkeypatch):
    import dapo_ray.tiny_model

    monkeypatch.setattr(dapo_ray.tiny_model, "build_for", lambda cfg, log=None: pytest.fail("built"))
    cfg = load_config(TINY, [f"rollout.model_path={tmp_path / 'Qwen2.5-32B'}"])
    with pytest.raises(ConfigError, match=r"Qwen2\.5-32B.*'tiny'"):
        ensure_model(cfg)


def test_a_directory_its_builder_wrote_is_reused_whatever_its_name(tmp_path, monkeypatch):
    own = tmp_path / "model"
    own.mkdir()
    (own / STAMPS["tiny"]).write_text("{}")
    import dapo_ray.tiny_model

    monkeypatch.setattr(dapo_ray.tiny_model, "build_for", lambda cfg, log=None: own)
    assert ensure_model(load_config(TINY, [f"rollout.model_path={own}"])) == own
