"""`dapo-ray probe-reward`: hostile replies built from a row, reward functions of the user's own tried on them
in real helper processes, the built-in scorers on the project's configs, and the command's exit codes."""

import argparse
import textwrap
from pathlib import Path

import pytest

from dapo_ray.algo.stated import parse_number
from dapo_ray.config import load_config
from dapo_ray.tasks.probe import (
    CONTROL_KINDS,
    HOSTILE_KINDS,
    LONG_CHARS,
    add_parser,
    arithmetic_of,
    bare_problem,
    controls,
    hostile_replies,
    probe,
    warn_lines,
    wrong_values,
)

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / "workflows" / "configs" / "smollm2_cpu.yaml"
TINY = ROOT / "workflows" / "configs" / "tiny_cpu.yaml"
SUM_ROW = {"messages": [{"role": "user", "content": "What is 14 + 3? Reply with the number only."}],
           "ground_truth": "17", "data_source": "synthetic"}  # fmt: skip

HACKABLE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if ground_truth in solution_str else 0.0
"""
MATH_VERIFY = """
from math_verify import parse, verify


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if verify(parse(ground_truth), parse(solution_str)) else 0.0
"""
HONEST = """
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    lines = solution_str.strip().splitlines()
    found = re.fullmatch(r"Answer:\\s*(-?\\d+)", lines[-1].strip()) if lines else None
    return 1.0 if found and found.group(1) == ground_truth else 0.0
"""
HACKABLE_TRL = """
def contains(completions, ground_truth, **kwargs):
    return [1.0 if g in c[0]["content"] else 0.0 for c, g in zip(completions, ground_truth)]
"""
FRAGILE = """
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if len(solution_str) > 5000:
        raise ValueError("too long")
    if "\\x00" in solution_str:
        time.sleep(30)
    return 1.0 if solution_str.strip() == f"Answer: {ground_truth}" else 0.0
"""


def _write(tmp_path, name: str, source: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    return name


def _by_kind(replies):
    out: dict[str, list[str]] = {}
    for kind, text in replies:
        out.setdefault(kind, []).append(text)
    return out


def _paid(report) -> dict[str, int]:
    return {k.kind: k.paid_rows for k in report.kinds if k.hostile and k.paid_rows}


# --- the replies ---------------------------------------------------------------------------------------


def test_hostile_replies_of_a_sum():
    replies = _by_kind(hostile_replies(SUM_ROW))
    assert tuple(replies) == HOSTILE_KINDS
    assert replies["echo"] == ["What is 14 + 3? Reply with the number only."]
    assert {"What is 14 + 3?", "14 + 3 = ?", "Answer: 14 + 3"} <= set(replies["restated"])
    assert replies["empty"] == [""] and not replies["whitespace"][0].strip()
    assert "17 or 18" in replies["hedge"] and "It is one of 16, 17, 18." in replies["hedge"]
    assert "I cannot solve this, but it is not 17." in replies["refusal"]
    assert "The answer is not 17." in replies["negation"]
    (long,) = replies["long"]
    assert len(long) == LONG_CHARS and long.count("Answer: 17\n") == 1 and not long.rstrip().endswith("17")
    for noise in replies["unicode"]:
        assert {"\x00", "\u202e", "\u200b", "\ufffd"} <= set(noise) and not any(c.isdigit() for c in noise)
    assert [k for k, _ in controls(SUM_ROW)] == list(CONTROL_KINDS)
    assert [t for _, t in controls(SUM_ROW)] == ["17", "The answer is 17.", "Answer: 17"]


def test_a_templated_problem_is_restated_bare():
    from dapo_ray.data import apply_dapo_template

    row = {"messages": [{"role": "user", "content": apply_dapo_template("Find the area of a 3 by 4 rectangle.")}],
           "ground_truth": "12", "data_source": "math_dapo"}  # fmt: skip
    replies = _by_kind(hostile_replies(row))
    assert replies["echo"] == [row["messages"][0]["content"]]
    assert replies["restated"] == ["Find the area of a 3 by 4 rectangle."]  # a word problem: no "= ?" form


@pytest.mark.parametrize(
    "problem, expr",
    [("What is 14 + 3?", "14 + 3"), ("49+5=", "49+5"), ("Calculate (-65)/90 + (-4)/(-8).", "(-65)/90 + (-4)/(-8)"),
     ("Start with 49, add 5, multiply by 3. What is the result?", "(49 + 5) * 3"),
     ("Which is smaller: 0 or -10/457?", None), ("Solve -5*q - 44 + 39 = 0 for q.", None),
     ("Let h(p) = 174 - 34*p. What is h(6)?", None),
     ("In triangle ABC, AB = 3 + 4 and the other sides are much longer; find the perimeter of it.", None)],
)  # fmt: skip
def test_arithmetic_questions_are_found(problem, expr):
    assert arithmetic_of(bare_problem(problem)) == expr


def test_wrong_values_are_near_and_never_the_reference():
    assert wrong_values("17", 2) == ["18", "16"]
    assert wrong_values("\\frac{1}{2}", 2) == ["\\frac{3}{2}", "-\\frac{1}{2}"]
    assert wrong_values("-2/11", 1) == ["9/11"] and wrong_values("0.5", 2) == ["1.5", "-0.5"]
    assert wrong_values("False", 1) == ["True"] and wrong_values("12:39 AM", 1) == ["12:40 AM"]
    for ref in ("17", "0", "-3", "0.25", "\\frac{1}{2}", "-2/11", "a", "[1, 2]", "True", "x**2 + 1"):
        others = wrong_values(ref, 40)
        assert ref not in others
        if parse_number(ref) is not None:
            assert parse_number(ref) not in {parse_number(o) for o in others}


# --- reward functions of the user's own ----------------------------------------------------------------


def test_a_function_that_pays_the_reference_anywhere_is_flagged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # reward.function paths are relative to the working directory
    name = _write(tmp_path, "hackable", HACKABLE)
    report = probe(load_config(SMOLLM2, [f"reward.function={name}.py:compute_score"]), 4)
    paid = _paid(report)
    assert {"hedge": 4, "refusal": 4, "negation": 4, "long": 4}.items() <= paid.items()
    assert "empty" not in paid and "unicode" not in paid
    assert not report.unpaid_controls and report.errors == report.timeouts == 0
    warned = "\n".join(warn_lines(report))
    assert all(f"pays {kind} replies" in warned for kind in ("hedge", "refusal", "negation", "long"))


def test_a_function_that_runs_math_verify_on_the_whole_reply_pays_the_restated_sum(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = _write(tmp_path, "whole_reply", MATH_VERIFY)
    report = probe(load_config(SMOLLM2, [f"reward.function={name}.py:compute_score"]), 4)
    paid = _paid(report)
    assert paid["restated"] == 4  # "14 + 3 = ?" evaluates to 17: the hack this project's demo learned
    assert {"hedge", "refusal", "negation"} <= set(paid)
    restated = next(k for k in report.kinds if k.kind == "restated")
    assert "= ?" in restated.example or "Answer:" in restated.example


def test_an_honest_function_passes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = _write(tmp_path, "honest", HONEST)
    report = probe(load_config(SMOLLM2, [f"reward.function={name}.py:compute_score"]), 4)
    assert report.findings == [] and warn_lines(report) == []
    answer_line = next(k for k in report.kinds if k.kind == "answer_line")
    assert answer_line.paid_rows == answer_line.rows == 4
    assert {k.kind for k in report.unpaid_controls} == {"bare", "stated"}  # a warning, not a failure


def test_a_trl_convention_function_is_probed_the_same_way(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = _write(tmp_path, "trl_reward", HACKABLE_TRL)
    report = probe(load_config(SMOLLM2, [f"reward.function={name}.py:contains"]), 2)
    assert {"hedge", "refusal", "negation", "long"} <= set(_paid(report))


def test_errors_and_timeouts_are_counted_apart_and_not_paid(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = _write(tmp_path, "fragile", FRAGILE)
    cfg = load_config(SMOLLM2, [f"reward.function={name}.py:compute_score", "reward.timeout_s=0.3"])
    report = probe(cfg, 1)
    kinds = {k.kind: k for k in report.kinds}
    assert kinds["long"].errors == 1 and kinds["unicode"].timeouts == 2
    assert report.errors == 1 and report.timeouts == 2 and report.findings == []
    assert report.failures and report.failures[0]["kind"] in ("error", "timeout")
    assert any("1 reward errors and 2 timeouts" in line for line in warn_lines(report))


# --- the built-in scorers ------------------------------------------------------------------------------

def _no_hostile_reply_paid(report) -> None:
    assert report.findings == [], _paid(report)
    assert report.errors == report.timeouts == 0
    assert any(k.paid_rows == k.rows for k in report.kinds if not k.hostile)  # at least one control form pays


def test_the_tiny_demo_scorer_pays_no_hostile_reply():
    report = probe(load_config(TINY), 8)
    _no_hostile_reply_paid(report)
    # `dapo` pays its `Answer:` line only
    assert {k.kind for k in report.unpaid_controls} == {"bare", "stated"}


def test_the_smollm2_demo_scorer_pays_no_hostile_reply():
    report = probe(load_config(SMOLLM2), 8)
    _no_hostile_reply_paid(report)


def test_the_smollm2_demo_scorer_pays_no_restated_sum_hedge_or_refusal():
    report = probe(load_config(SMOLLM2), 8)
    assert set(_paid(report)) <= {"negation"}, _paid(report)
    assert not report.unpaid_controls


@pytest.mark.parametrize("mode", ["dapo", "math_verify"])
def test_dapo_math_17k_rows(real_data, mode):
    overrides = ["data.source=files", f"data.train_files=[{real_data / 'dapo-math-17k.parquet'}]", "data.template=dapo",
                 f"reward.mode={mode}"]  # fmt: skip
    _no_hostile_reply_paid(probe(load_config(SMOLLM2, overrides), 8))


@pytest.fixture(scope="module")
def mathematics_file(tmp_path_factory):
    from dapo_ray.tasks import mathematics

    out = tmp_path_factory.mktemp("mathematics")
    mathematics.write_splits(mathematics.CPU_MODULES, out, per_module=3, held_out_per_module=1, extrapolate=False,
                             progress=None)  # fmt: skip
    return out / "train-easy.parquet"


def test_mathematics_dataset_rows_exact_match(mathematics_file):
    cfg = load_config(
        SMOLLM2, ["data.source=files", f"data.train_files=[{mathematics_file}]", "data.template=none"]
    )
    report = probe(cfg, 48)  # every module's rows: gcd, comparisons, fractions, True/False, polynomials
    _no_hostile_reply_paid(report)
    # The benchmark's metric reads the whole reply: "The answer is 4." is not the answer "4".
    assert {k.kind for k in report.unpaid_controls} == {"stated"}


# --- the command ---------------------------------------------------------------------------------------


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dapo-ray")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["probe-reward", *argv])
    return args.func(args)


def test_the_command_exits_1_0_and_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    hackable, honest = _write(tmp_path, "hackable", HACKABLE), _write(tmp_path, "honest", HONEST)
    config = ["--config", str(SMOLLM2), "--rows", "2"]
    assert _run([*config, f"reward.function={hackable}.py:compute_score"]) == 1
    out = capsys.readouterr().out
    assert "<- PAID" in out and "FAILED" in out and "negation" in out
    assert _run([*config, f"reward.function={honest}.py:compute_score"]) == 0
    out = capsys.readouterr().out
    assert "OK:" in out and "warning: the control 'bare'" in out
    assert _run([*config, "reward.function=missing.py:compute_score"]) == 2
    assert "missing.py" in capsys.readouterr().err
    (tmp_path / "broken.py").write_text("def compute_score(:\n")
    assert _run([*config, "reward.function=broken.py:compute_score"]) == 2
    assert "SyntaxError" in capsys.readouterr().err


def test_the_command_defaults_to_16_rows():
    parser = argparse.ArgumentParser(prog="dapo-ray")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["probe-reward", "reward.mode=dapo"])
    assert args.rows == 16 and args.overrides == ["reward.mode=dapo"]


def test_the_tiny_config_passes_the_command(capsys):
    assert _run(["--config", str(TINY), "--rows", "4"]) == 0
    assert "OK:" in capsys.readouterr().out


def test_the_worked_examples_of_the_docstrings():
    import doctest

    import dapo_ray.tasks.probe

    assert doctest.testmod(dapo_ray.tasks.probe).failed == 0


def test_dapo_ray_probe_reward(tmp_path, monkeypatch, capsys):
    from dapo_ray import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["probe-reward", "--config", str(TINY), "--rows", "2"]) == 0
    assert cli.main(["probe-reward", "--config", str(TINY), "reward.function=missing.py:compute_score"]) == 2
    assert "missing.py" in capsys.readouterr().err
