"""The paper's task: DAPO-Math-17k and AIME 2024, where `dapo-ray prepare` finds them, and how they are scored.

    dapo-ray prepare --paper-data                    # from the Hugging Face Hub (a machine online)
    dapo-ray prepare --paper-data --from DIR         # from local copies (offline): DIR/dapo-math-17k.parquet, ...

writes `data/dapo-math-17k.parquet` and `data/aime-2024.parquet`, the files the reference config
(`workflows/configs/dapo_qwen2.5_32b.yaml`) reads: each input de-duplicated and checked by `prepare`,
with a report beside it. Paths are relative to where the command runs (the repository's root for the
README's commands). On a cluster, point the config at the cluster's storage instead (cluster/README.md).

An `--input` is a local path or URI as it stands, or a Hub data set: `hf://datasets/OWNER/NAME` (or
`OWNER/NAME` where no such local path exists), whose parquet files are downloaded into the Hub's cache
first. The Hub path is real code but has never run here: these machines reach no hub, so the tests
use the local-file path (`DAPO_DATA_DIR`, see tests/conftest.py).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dapo_ray.tasks.task import Task, by_mode, states_reference

HUB_PREFIX = "hf://datasets/"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class PaperDataset:
    hub_id: str
    file: str
    """The parquet file in the Hub repository; local copies go by its base name."""
    role: str


PAPER_DATA: dict[str, PaperDataset] = {
    "dapo-math-17k": PaperDataset("BytedTsinghua-SIA/DAPO-Math-17k", "data/dapo-math-17k.parquet",
                                  "training prompts (data.train_files)"),
    "aime-2024": PaperDataset("BytedTsinghua-SIA/AIME-2024", "data/aime-2024.parquet",
                              "held-out AIME 2024 (eval.files)"),
}  # fmt: skip
"""What `--paper-data` writes, by output name (`<out_dir>/<name>.parquet`)."""


DAPO_MATH = Task("dapo_math", ("math_dapo", "aime", "math"), by_mode, states_reference,
                 "DAPO-Math-17k and AIME 2024 (dapo-ray prepare --paper-data) and any other source, scored by reward.mode")  # fmt: skip
"""The paper's task: DAPO's `Answer:` line by default (reward.mode), and the task of every row whose source
no other task takes (a user's own parquet without reward.function)."""


class DataSourceError(ValueError):
    """An input that names no readable file and no reachable Hub data set."""


def hub_id(spec: str) -> str | None:
    """The Hub data set an `--input` names, or None for a local path or a URI.

    >>> hub_id("hf://datasets/BytedTsinghua-SIA/AIME-2024"), hub_id("s3://bucket/x.parquet")
    ('BytedTsinghua-SIA/AIME-2024', None)
    """
    if spec.startswith(HUB_PREFIX):
        return spec[len(HUB_PREFIX) :].strip("/")
    if "://" in spec or os.path.exists(spec) or spec.endswith((".parquet", ".jsonl", ".json")):
        return None
    return spec if _HUB_ID.match(spec) else None


def download_hub_dataset(repo_id: str) -> list[str]:
    """The parquet files of a Hub data set, downloaded into the Hub's local cache (`HF_HOME`)."""
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo_id=repo_id, repo_type="dataset", allow_patterns=["*.parquet", "**/*.parquet"])
    except Exception as e:  # noqa: BLE001 - offline, unknown repository, no access: all say the same to the user
        raise DataSourceError(
            f"could not download the data set {repo_id!r} from the Hugging Face Hub ({type(e).__name__}: {e}). "
            f"On a machine without access, copy its parquet files here and pass them by path "
            f"(--input FILE, or --paper-data --from DIR)"
        ) from e
    files = sorted(str(p) for p in Path(local).rglob("*.parquet"))
    if not files:
        raise DataSourceError(f"the Hub data set {repo_id!r} has no parquet file")
    return files


def resolve_inputs(specs: Sequence[str], download: Callable[[str], list[str]] = download_hub_dataset) -> list[str]:
    """`--input` values -> the files to read, in order: a Hub data set becomes its parquet files."""
    files: list[str] = []
    for spec in specs:
        repo = hub_id(spec)
        if repo is None:
            files.append(spec)
        else:
            print(f"[prepare] {spec}: the Hugging Face Hub data set {repo}", flush=True)
            files += download(repo)
    return files


def paper_data_sources(local_dir: str | None) -> dict[str, str]:
    """For each of PAPER_DATA, the input to read: the local copy `<local_dir>/<file's base name>` (which
    must exist), else the Hub data set."""
    if local_dir is None:
        return {name: HUB_PREFIX + d.hub_id for name, d in PAPER_DATA.items()}
    sources = {name: os.path.join(local_dir, os.path.basename(d.file)) for name, d in PAPER_DATA.items()}
    missing = [p for p in sources.values() if not os.path.exists(p)]
    if missing:
        wanted = ", ".join(os.path.basename(d.file) for d in PAPER_DATA.values())
        raise DataSourceError(f"--from {local_dir}: {', '.join(missing)} not found (it should hold {wanted}, "
                              f"as the Hub repositories name them)")  # fmt: skip
    return sources
