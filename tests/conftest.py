import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_CFG = ROOT / "workflows" / "configs" / "tiny_cpu.yaml"
SHARED_DATA = Path(os.environ.get("DAPO_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real DAPO parquet files; tests that need them skip with a reason when they are absent."""
    if not (SHARED_DATA / "aime-2024.parquet").exists():
        pytest.skip(f"real data folder not found at {SHARED_DATA} (set DAPO_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The demo's tiny model, built once and cached under .cache/ (a short warm-up is enough here). Not
    under /tmp: every node of the multinode tier sees it, as a model volume or image would be."""
    import dataclasses

    from dapo_ray.config import load_config
    from dapo_ray.tiny_model import build_tiny_model

    cfg = load_config(TINY_CFG)
    out = ROOT / ".cache" / "test-tiny-model"
    return build_tiny_model(out, synthetic=dataclasses.asdict(cfg.data.synthetic), target_acc=0.05,
                            max_warmup_s=150, seed=cfg.trainer.seed)  # fmt: skip


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
        if "gpu" in item.keywords:
            item.add_marker(skip)
