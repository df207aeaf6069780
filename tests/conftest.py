import os
from pathlib import Path

import pytest

SHARED_DATA = Path(os.environ.get("DAPO_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real DAPO parquet files; tests that need them skip with a reason when they are absent."""
    if not (SHARED_DATA / "aime-2024.parquet").exists():
        pytest.skip(f"real data folder not found at {SHARED_DATA} (set DAPO_SHARED_DATA)")
    return SHARED_DATA


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
