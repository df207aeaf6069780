"""Where `dapo-ray prepare` reads from (dapo_ray/datasets.py), and that no config or doc of the project
names a file outside the repository. The Hub download itself cannot run here (no hub is reachable):
the resolution around it is tested with a stand-in downloader."""

import re
from pathlib import Path

import pytest

from dapo_ray.tasks.dapo_math import PAPER_DATA, DataSourceError, hub_id, paper_data_sources, resolve_inputs

ROOT = Path(__file__).resolve().parents[2]


def test_an_input_is_a_local_file_a_uri_or_a_hub_data_set(tmp_path):
    local = tmp_path / "a"
    local.mkdir()  # an existing path that looks like OWNER/NAME is a path
    assert hub_id(str(local)) is None
    assert hub_id("hf://datasets/BytedTsinghua-SIA/DAPO-Math-17k") == "BytedTsinghua-SIA/DAPO-Math-17k"
    assert hub_id("BytedTsinghua-SIA/AIME-2024") == "BytedTsinghua-SIA/AIME-2024"
    assert hub_id("s3://bucket/train.parquet") is None
    assert hub_id("data/dapo-math-17k.parquet") is None  # a file name, even where it does not exist yet
    assert hub_id("a/b/c") is None


def test_hub_data_sets_become_their_files_in_order():
    asked = []

    def download(repo: str) -> list[str]:
        asked.append(repo)
        return [f"/cache/{repo}/part-{i}.parquet" for i in range(2)]

    files = resolve_inputs(["x.jsonl", "hf://datasets/o/n", "y.parquet"], download=download)
    assert files == ["x.jsonl", "/cache/o/n/part-0.parquet", "/cache/o/n/part-1.parquet", "y.parquet"]
    assert asked == ["o/n"]


def test_paper_data_reads_local_copies_by_the_hub_files_names(tmp_path):
    assert paper_data_sources(None) == {name: f"hf://datasets/{d.hub_id}" for name, d in PAPER_DATA.items()}
    with pytest.raises(DataSourceError, match="aime-2024.parquet not found"):
        paper_data_sources(str(tmp_path))
    for d in PAPER_DATA.values():
        (tmp_path / Path(d.file).name).write_bytes(b"")
    assert paper_data_sources(str(tmp_path)) == {
        "dapo-math-17k": str(tmp_path / "dapo-math-17k.parquet"), "aime-2024": str(tmp_path / "aime-2024.parquet")}


def test_the_reference_config_reads_what_paper_data_writes():
    from dapo_ray.config import load_config

    cfg = load_config(ROOT / "workflows" / "configs" / "dapo_qwen2.5_32b.yaml")
    # The paper's two files (`prepare --paper-data`), and MATH-500 beside AIME 2024 (`prepare --benchmarks math500`).
    assert [*cfg.data.train_files, *cfg.eval.files] == [f"data/{name}.parquet" for name in PAPER_DATA] + ["data/math500.parquet"]


def _docs_and_configs() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
    for folder, pattern in (("docs", "*.md"), ("cluster", "*"), ("workflows", "*"), ("dapo_ray", "*.py"),
                            ("bench", "*.py"), ("dashboards", "*"), ("scripts", "*")):  # fmt: skip
        files += [p for p in (ROOT / folder).rglob(pattern) if p.is_file() and "__pycache__" not in p.parts]
    return files


def test_no_config_or_doc_names_a_path_outside_the_repository():
    """A user's clone has nothing beside it: data come from `dapo-ray prepare`, models from their own paths."""
    outside = re.compile(r"\.\./shared|\bshared/data\b|parents?\[\d\]\s*/\s*\"shared\"|parent\s*/\s*\"shared\"")
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in _docs_and_configs()
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if outside.search(line)]  # fmt: skip
    assert not found, "\n".join(found)
    configs = list((ROOT / "workflows" / "configs").glob("*.yaml"))
    assert configs
    for p in configs:  # every data path of a config is inside the run's working directory or absolute
        text = p.read_text()
        assert not re.search(r"(train_files|files):\s*\[[^\]]*\.\./", text), p
