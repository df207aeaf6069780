"""One local Ray cluster for the whole integration tier (it is slow to start)."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
