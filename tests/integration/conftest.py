"""One local Ray cluster and one tiny model for the whole integration tier (they are slow to start)."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY_CFG = ROOT / "workflows" / "configs" / "tiny_cpu.yaml"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The demo's tiny model, built once and cached under .cache/ (a short warm-up is enough here)."""
    import dataclasses

    from dapo_ray.config import load_config
    from dapo_ray.tiny_model import build_tiny_model

    cfg = load_config(TINY_CFG)
    out = ROOT / ".cache" / "test-tiny-model"
    return build_tiny_model(out, synthetic=dataclasses.asdict(cfg.data.synthetic), target_acc=0.05,
                            max_warmup_s=150, seed=cfg.trainer.seed)  # fmt: skip


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    env = {"DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false",
           "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"]}  # fmt: skip
    ray.init(num_cpus=8, runtime_env={"env_vars": env}, include_dashboard=False)
    yield
    from ray import serve

    serve.shutdown()
    ray.shutdown()
