"""The GPU smoke path (workflows/configs/gpu_smoke.yaml, docs/GPU.md): one GPU shared by a CUDA vLLM
replica and a DeepSpeed ZeRO-3 trainer worker, on a randomly initialised model of Qwen2.5-0.5B's shape.
Skipped without a CUDA GPU (tests/conftest.py)."""

import math
import os
from pathlib import Path

import pytest

from dapo_ray.config import load_config
from dapo_ray.random_model import build_random_model

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def test_two_steps_on_one_shared_gpu(tmp_path):
    import ray

    from dapo_ray.driver import run

    model = build_random_model(ROOT / ".cache" / "random-qwen2.5-0.5b", "qwen2.5-0.5b")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cfg = load_config(ROOT / "workflows" / "configs" / "gpu_smoke.yaml",
                      [f"rollout.model_path={model}", "trainer.total_steps=2", "trainer.save_every=1",
                       f"trainer.output_dir={tmp_path / 'run'}", "tracking.enabled=false"])  # fmt: skip
    try:
        summary = run(cfg)
    finally:
        ray.shutdown()
    assert summary["steps"] == 2
    for entry in summary["steps_log"]:
        # the synced version, or the next step's for a replica that took the probe after that publish
        # (checked against the trainer's log-probs at the version it answered with)
        assert entry["probe_version"] in (entry["step"], entry["step"] + 1)
        m = entry["metrics"]
        # bf16 on both sides, different kernels: agreement to bf16 precision, not float32's.
        assert m["weight_sync/logprob_max_diff"] < 0.1, m
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
        assert m["actor/updates"] >= 1 and m["weight_sync/bytes"] > 0
