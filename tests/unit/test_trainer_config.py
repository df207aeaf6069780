"""The trainer's config checks (validate()): each refusal names the keys involved."""

from pathlib import Path

import pytest

from dapo_ray.config import ConfigError, load_config

RECIPE = Path(__file__).resolve().parents[2] / "workflows" / "configs" / "dapo_qwen2.5_32b.yaml"

BASE = ["data.source=synthetic", "trainer.num_workers=4", "trainer.mini_batch_size=512", "trainer.micro_batch_size=8"]


def cfg(*overrides: str):
    return load_config(overrides=[*BASE, *overrides])


def test_accepted():
    c = cfg("trainer.micro_batch_tokens=24576", "trainer.zero_stage=3", "trainer.zero_hpz_partition_size=2",
            "trainer.dtype=bfloat16")  # fmt: skip
    assert c.trainer.micro_batch_tokens == 24576 and c.trainer.zero_hpz_partition_size == 2
    assert cfg().trainer.micro_batch_tokens == 0 and cfg().trainer.zero_hpz_partition_size == 1


@pytest.mark.parametrize("overrides, match", [
    (["trainer.micro_batch_tokens=-1"], "micro_batch_tokens"),
    (["trainer.zero_stage=3", "trainer.zero_hpz_partition_size=3"], "must divide trainer.num_workers"),
    (["trainer.zero_stage=1", "trainer.zero_hpz_partition_size=2"], "zero_stage 3"),
    (["trainer.zero_stage=3", "trainer.zero_hpz_partition_size=2", "algorithm.kl_coef=0.1"], "kl_coef 0"),
    (["trainer.zero_stage=0", "trainer.dtype=bfloat16"], "zero_stage >= 1"),
])  # fmt: skip
def test_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        cfg(*overrides)


def test_the_32b_recipe_loads():
    c = load_config(RECIPE)
    t = c.trainer
    assert (t.micro_batch_tokens, t.zero_hpz_partition_size, t.zero_stage, t.dtype) == (24576, 8, 3, "bfloat16")
    assert t.micro_batch_tokens >= c.max_model_len  # a full-length response fits a micro-batch
