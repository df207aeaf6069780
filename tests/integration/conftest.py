"""One local Ray cluster for the whole integration tier (it is slow to start)."""

import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def ray_cluster():
    """The cluster; its Prometheus endpoint (every process's Ray metrics, reported each second) is at
    `.metrics_url`."""
    import ray

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    env = {"DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false",
           "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"]}  # fmt: skip
    metrics_port = _free_port()
    ray.init(num_cpus=8, runtime_env={"env_vars": env}, include_dashboard=False, _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 1000})  # fmt: skip
    yield SimpleNamespace(metrics_url=f"http://127.0.0.1:{metrics_port}/metrics")
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def small_random_model_dir(tmp_path_factory) -> Path:
    """A small random float32 Qwen2 (untied), saved as a normal HF directory."""
    import torch
    from transformers import Qwen2ForCausalLM

    from dapo_ray.tiny_model import tiny_config

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("small-random") / "tiny"
    Qwen2ForCausalLM(tiny_config(vocab_size=97, hidden=64, layers=2)).save_pretrained(out)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
