"""`dapo-ray prepare` on the session's Ray cluster: real DAPO files and hand-made bad ones.

The output must load with `load_prompts` exactly as the inputs do (same prompts, answers and order), and
every dropped row must be counted under its reason with its file and row number.
"""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo_ray.cli import main
from dapo_ray.data import DAPO_PREFIX, BadRowError, load_prompts
from dapo_ray.prepare import OUTPUT_SCHEMA, PrepareError, prepare, report_path

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _rows(path) -> list[tuple]:
    rows, report = load_prompts([path], template="none")
    assert report.duplicates == 0 and report.bad_rows == 0, report  # the output needs no more cleaning
    return [(r["messages"], r["ground_truth"]) for r in rows]


def test_real_files_match_the_loader_across_files_and_blocks(ray_cluster, real_data, tmp_path):
    files = [str(real_data / f) for f in ("aime-2024.parquet", "dapo-math-mini16.parquet", "dapo-math-17k.parquet")]
    out = str(tmp_path / "train.parquet")
    # ~6,000 rows a read task (the 17k file is read in 3 pieces) and 2 hash partitions: copies of a prompt
    # are read in different blocks and meet only after the shuffle.
    report = prepare(files, out, rows_per_piece=6000, partitions=2)

    ref, ref_report = load_prompts(files)  # the loader's de-duplication: first occurrence in file order
    assert _rows(out) == [(r["messages"], r["ground_truth"]) for r in ref]
    assert report.rows_read == ref_report.rows_read == 960 + 16 + 17917
    assert report.written == ref_report.kept == 17285
    aime, mini, big = report.files
    assert (aime["rows"], aime["written"], aime["dropped"]) == (960, 30, {"duplicate": 930})  # 30 problems x 32
    assert (mini["rows"], mini["written"], mini["dropped"]) == (16, 16, {})
    # The 17k copy: 662 copies of its own rows (627 identical texts, 35 differing only in surrounding
    # whitespace), and the 16 problems the mini file already gave.
    assert (big["rows"], big["written"], big["dropped"]) == (17917, 17239, {"duplicate": 678})
    assert report.dropped == {"duplicate": 1608} and report.templated == 16 + 17239
    assert report.examples["duplicate"][0] == f"{files[0]}: row 9: same prompt as {files[0]} row 7"

    table = pq.read_table(out)
    assert table.schema.remove_metadata() == OUTPUT_SCHEMA
    extra = table["extra_info"].to_pylist()
    assert [e["index"] for e in extra] == list(range(17285))
    assert extra[30] == {"index": 30, "raw_problem": extra[30]["raw_problem"], "source_file": "dapo-math-mini16.parquet",
                         "source_row": 0}  # fmt: skip
    assert all(e["raw_problem"] and not e["raw_problem"].startswith("Solve the following math problem") for e in extra)
    prompts = [p[0]["content"] for p in table["prompt"].to_pylist()]
    assert all(p.startswith(DAPO_PREFIX) and p.count("Solve the following math problem") == 1 for p in prompts)
    assert set(table["data_source"].to_pylist()) == {"math_dapo", "math_dapo_cispo_cold_start_model", "DAPO-17k"}
    assert json.loads(Path(report_path(out)).read_text())["dropped"] == {"duplicate": 1608}


def _bad_files(tmp_path) -> list[str]:
    """One file per input kind, each row a known case: (row -> reason) is in the test below."""

    def msg(text):
        return [{"role": "user", "content": text}]

    def rm(gt):
        return {"ground_truth": gt, "style": "rule"}

    verl = [
        {"prompt": msg("1+1?"), "reward_model": rm("2")},
        {"prompt": msg("1+1?"), "reward_model": rm("2")},  # duplicate of row 0
        {"prompt": None, "reward_model": rm("2")},  # missing_problem
        {"prompt": [], "reward_model": rm("2")},  # empty_problem
        {"prompt": msg("   "), "reward_model": rm("2")},  # empty_problem
        {"prompt": [{"role": "user", "content": None}], "reward_model": rm("2")},  # bad_prompt_type
        {"prompt": msg("2+3?"), "reward_model": None},  # missing_ground_truth
        {"prompt": msg("2+4?"), "reward_model": rm(None)},  # missing_ground_truth
        {"prompt": msg("2+5?"), "reward_model": rm("  ")},  # empty_ground_truth
        {"prompt": msg("2+2?"), "reward_model": rm(" 4 ")},
    ]
    a = tmp_path / "verl.parquet"
    schema = pa.schema([OUTPUT_SCHEMA.field("prompt"), OUTPUT_SCHEMA.field("reward_model")])
    pq.write_table(pa.Table.from_pylist(verl, schema=schema), a)
    b = tmp_path / "flat.jsonl"
    b.write_text("\n".join([
        json.dumps({"problem": "What is 3+3?", "answer": 6}),
        "",  # blank lines are not rows
        "{not json",  # bad_record
        "[1, 2]",  # bad_record
        json.dumps({"answer": "3"}),  # missing_problem
        json.dumps({"question": 5, "answer": "1"}),  # bad_prompt_type
        json.dumps({"problem": "p", "answer": True}),  # bad_ground_truth_type
        json.dumps({"problem": "q", "answer": [1]}),  # bad_ground_truth_type
        json.dumps({"problem": "1+1?", "answer": "2"}),  # duplicate of verl.parquet row 0
        json.dumps({"question": "What is 5+5?", "ground_truth": 10.0}),
    ]) + "\n")  # fmt: skip
    c = tmp_path / "flat.parquet"  # a user's parquet with question/answer columns
    pq.write_table(pa.table({"question": ["What is 7+7?", "What is 8+8?"], "answer": ["14", None]}), c)
    d = tmp_path / "nested.parquet"  # reward_model of the wrong type
    pq.write_table(pa.table({"prompt": [["What?"]], "reward_model": ["2"]}), d)
    return [str(a), str(b), str(c), str(d)]


def test_bad_rows_are_counted_with_file_and_row(ray_cluster, tmp_path):
    a, b, c, d = files = _bad_files(tmp_path)
    out = str(tmp_path / "out" / "clean.parquet")
    report = prepare(files, out)

    assert report.dropped == {
        "duplicate": 2, "bad_record": 2, "missing_problem": 2, "empty_problem": 2, "bad_prompt_type": 2,
        "missing_ground_truth": 3, "bad_ground_truth_type": 3, "empty_ground_truth": 1,
    }  # fmt: skip
    assert [f["rows"] for f in report.files] == [10, 9, 2, 1] and report.written == 5
    assert report.examples["duplicate"] == [f"{a}: row 1: same prompt as {a} row 0",
                                            f"{b}: row 8: same prompt as {a} row 0"]  # fmt: skip
    assert report.examples["bad_record"][0].startswith(f"{b}: row 2: not valid JSON")
    assert report.examples["missing_ground_truth"] == [
        f"{a}: row 6: column 'reward_model' with field 'ground_truth' is missing",
        f"{a}: row 7: ground truth is missing: None", f"{c}: row 1: ground truth is missing: None",
    ]  # fmt: skip
    assert report.examples["bad_ground_truth_type"][-1].startswith(f"{d}: row 0: 'reward_model' must be a struct")
    saved = json.loads(Path(report_path(out)).read_text())
    assert saved["dropped"] == report.dropped and saved["examples"] == report.examples
    assert set(saved["reasons"]) == set(report.dropped)

    # The same rows as the loader keeps (it cannot read the question/answer parquet), then that file's row.
    ref, _ = load_prompts([a, b], on_bad_row="skip")
    assert _rows(out) == [(r["messages"], r["ground_truth"]) for r in ref] + [(_rows(out)[-1][0], "14")]
    assert [gt for _, gt in _rows(out)] == ["2", "4", "6", "10", "14"]

    with pytest.raises(BadRowError, match=rf"{b}: row 2: not valid JSON.*\(6 bad row\(s\) in all"):
        prepare([b], str(tmp_path / "strict.parquet"), strict=True)
    assert not (tmp_path / "strict.parquet").exists()


def test_inputs_that_cannot_be_read(tmp_path):
    fake = tmp_path / "notes.parquet"
    fake.write_text("this is not parquet\n")
    with pytest.raises(PrepareError, match=rf"{fake}: not a parquet file"):
        prepare([str(fake)], str(tmp_path / "o.parquet"))
    (tmp_path / "a.csv").write_text("q,a\n")
    with pytest.raises(PrepareError, match="unsupported file type '.csv'"):
        prepare([str(tmp_path / "a.csv")], str(tmp_path / "o.parquet"))
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        prepare([str(tmp_path / "nope.parquet")], str(tmp_path / "o.parquet"))
    with pytest.raises(PrepareError, match="must name a .parquet file"):
        prepare([str(fake)], str(tmp_path / "out_dir"))


def test_cli_template_always_shuffle_limit(ray_cluster, real_data, tmp_path, capsys):
    aime, mini = str(real_data / "aime-2024.parquet"), str(real_data / "dapo-math-mini16.parquet")
    out = str(tmp_path / "eval.parquet")
    argv = ["prepare", "--input", aime, mini, "--output", out, "--apply-template", "always", "--shuffle",
            "--seed", "1", "--limit", "10", "--data-source", "mixed"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "dropped 930 duplicate" in printed and f"report written to {report_path(out)}" in printed

    saved = json.loads(Path(report_path(out)).read_text())
    assert saved["written"] == 10 and saved["dropped"] == {"duplicate": 930, "over_limit": 36}
    assert sum(f["written"] for f in saved["files"]) == 10
    table = pq.read_table(out)
    prompts = [p[0]["content"] for p in table["prompt"].to_pylist()]
    assert all(p.startswith(DAPO_PREFIX) and p.count("Answer: $Answer") == 1 for p in prompts)  # never twice
    assert set(table["data_source"].to_pylist()) == {"mixed"}
    rows = table["extra_info"].to_pylist()
    order = [(r["source_file"], r["source_row"]) for r in rows]
    assert order != sorted(order)  # shuffled, and still numbered in file order
    assert [r["index"] for r in rows] == list(range(10))

    assert main(["prepare", "--input", str(tmp_path / "missing.jsonl"), "--output", out]) == 1
    assert "input file not found" in capsys.readouterr().err


def test_paper_data_from_local_copies_is_what_the_reference_config_reads(ray_cluster, real_data, tmp_path, capsys,
                                                                          monkeypatch):  # fmt: skip
    """`dapo-ray prepare --paper-data --from DIR`, the offline path (no hub is reachable here), run where a
    user runs it: it writes the two files the 32B config names, relative to the working directory."""
    from dapo_ray.config import load_config

    monkeypatch.chdir(tmp_path)
    assert main(["prepare", "--paper-data", "--from", str(real_data)]) == 0
    cfg = load_config(ROOT / "workflows" / "configs" / "dapo_qwen2.5_32b.yaml")
    # MATH-500 beside AIME comes from `dapo-ray prepare --benchmarks math500` (tests/unit/test_benchmarks.py).
    assert [*cfg.data.train_files, *cfg.eval.files] == ["data/dapo-math-17k.parquet", "data/aime-2024.parquet",
                                                        "data/math500.parquet"]  # fmt: skip
    train, train_report = load_prompts(cfg.data.train_files, cfg.data.template)
    held_out, _ = load_prompts(cfg.eval.files[:1], cfg.data.template)
    assert train_report.duplicates == 0 and len(train) == len(load_prompts([real_data / "dapo-math-17k.parquet"])[0])
    assert len(held_out) == 30  # the file's 960 rows: 30 problems x 32
    assert Path(report_path("data/aime-2024.parquet")).exists()

    # A local folder without the files, and neither or both of --input and --paper-data: clear errors.
    assert main(["prepare", "--paper-data", "--from", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err
    assert "nowhere" in err and "aime-2024.parquet not found (it should hold dapo-math-17k.parquet" in err
    assert main(["prepare", "--paper-data", "--input", "x.parquet", "--output", "y.parquet"]) == 2
    assert main(["prepare"]) == 2
