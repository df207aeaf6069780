"""DeepMind's Mathematics Dataset from its PyPI generator: every module generates on today's sympy and
numpy, the polynomial modules' answers are right, files are seeded and load as training data, and the
held-out files come from the test splits with each module's echo baseline."""

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import sympy

from dapo_ray.algo.reward import compute_score
from dapo_ray.data import load_prompts
from dapo_ray.tasks import mathematics


def test_every_module_of_every_split_generates():
    for split in mathematics.SPLITS:
        modules = mathematics.modules_of(split)
        assert len(modules) == (15 if split == "extrapolate" else 56)
        for name, module in modules.items():
            question, answer = mathematics.sample(module)
            assert question and answer, (split, name)


def test_the_numpy_2_shim_keeps_the_polynomial_modules_right():
    """`sample/polynomials.py` builds coefficient arrays with `itemset` (gone in numpy 2); its answers,
    checked with sympy, are what the question asks."""
    random.seed(3)
    np.random.seed(3)
    collect = mathematics.modules_of("train-easy")["polynomials__collect"]
    for _ in range(20):
        question, answer = mathematics.sample(collect)
        expression = question.removeprefix("Collect the terms in ").removesuffix(".")
        assert sympy.simplify(sympy.sympify(expression) - sympy.sympify(answer)) == 0, (question, answer)
    array = mathematics._ItemsetArray(np).empty((2,), dtype=object)
    array.itemset(1, [1, 2])
    assert array[1] == [1, 2]


def test_generation_is_seeded_and_leaves_the_global_generators_alone():
    random.seed(0)
    np.random.seed(0)
    before = random.random(), np.random.random()
    random.seed(0)
    np.random.seed(0)
    a = mathematics.generate("train-easy", ["numbers__gcd", "arithmetic__add_or_sub"], 5, seed=7)
    assert (random.random(), np.random.random()) == before
    assert a == mathematics.generate("train-easy", ["numbers__gcd", "arithmetic__add_or_sub"], 5, seed=7)
    assert a != mathematics.generate("train-easy", ["numbers__gcd", "arithmetic__add_or_sub"], 5, seed=8)
    assert [r["data_source"] for r in a] == ["mathematics_dataset/numbers__gcd"] * 5 + ["mathematics_dataset/arithmetic__add_or_sub"] * 5
    assert len({r["extra_info"]["raw_problem"] for r in a}) == 10  # distinct within a module


def test_a_wrong_module_or_split_names_the_choices():
    with pytest.raises(mathematics.MathematicsError, match="numbers__gcd"):
        mathematics.generate("train-easy", ["numbers__gdc"], 5, seed=1)
    with pytest.raises(mathematics.MathematicsError, match="interpolate"):
        mathematics.modules_of("test")
    with pytest.raises(mathematics.MathematicsError, match="plain or dapo"):
        mathematics.prompt_text("What is 1 + 1?", "chat")


def test_echo_answers_and_baseline():
    assert mathematics.echo_answers("Which is smaller: 4510 or -4508.5?") == {
        "last": "-4508.5", "smallest": "-4508.5", "largest": "4510"}  # fmt: skip
    assert mathematics.echo_answers("Is it prime?") == {}
    rows = [{"data_source": "mathematics_dataset/numbers__gcd", "extra_info": {"raw_problem": q},
             "reward_model": {"ground_truth": a}}
            for q, a in [("What is the greatest common divisor of 1368 and 57?", "57"),
                         ("What is the greatest common divisor of 12 and 18?", "6")]]  # fmt: skip
    b = mathematics.echo_baseline(rows)["numbers__gcd"]
    assert (b["last"], b["smallest"], b["largest"], b["truncate"], b["constant"], b["best"], b["problems"]) == (
        0.5, 0.5, 0.0, 0.0, 0.0, 0.5, 2)  # fmt: skip
    # where no number of the question is the answer, the commonest training answer given to every
    # question is the baseline; it is learned from training, never from the held-out answers themselves
    def prime_rows(pairs):
        return [{"data_source": "mathematics_dataset/numbers__is_prime", "extra_info": {"raw_problem": f"Is {n} prime?"},
                 "reward_model": {"ground_truth": a}} for n, a in pairs]  # fmt: skip

    constants = mathematics.commonest_answers(prime_rows([(4, "False"), (7, "True"), (9, "False")]))
    assert constants == {"numbers__is_prime": "False"}
    b = mathematics.echo_baseline(prime_rows([(91, "False"), (97, "True"), (1001, "False")]), constants)["numbers__is_prime"]
    assert (b["last"], b["constant"], b["best"]) == (0.0, 2 / 3, 2 / 3)
    assert mathematics.echo_baseline(prime_rows([(97, "True")]), constants)["numbers__is_prime"]["best"] == 0.0


@pytest.mark.parametrize("question, cut", [
    ("Round 312.64272 to one decimal place.", "312.6"),
    ("What is -1.08435613 rounded to 4 decimal places?", "-1.0843"),
    ("Round 0.065688126 to 5 dps.", "0.06568"),
    ("Round -0.00005011334 to seven decimal places.", "-0.0000501"),
    ("What is 0.65710938 rounded to one dp?", "0.6"),
    ("Round 14.5 to zero decimal places.", "14"),
    ("What is -160150.615109 rounded to the nearest integer?", "-160150"),
    ("Round 1406.7598 to the nearest one thousand.", "1000"),
    ("Round -5626472300 to the nearest 1000000.", "-5626000000"),
    ("What is -58346002 rounded to the nearest ten thousand?", "-58340000"),
    ("What is 10645052.7 rounded to the nearest one million?", "10000000"),
    ("What is 97 rounded to the nearest ten?", "90"),
])  # fmt: skip
def test_truncation_echo_cuts_a_rounding_question_at_its_place(question, cut):
    assert mathematics.truncated(question) == cut
    assert mathematics.echo_answers(question)["truncate"] == cut


def test_truncation_echo_is_only_for_rounding_questions():
    for question in ("What is the greatest common divisor of 1368 and 57?", "Round 12 to the nearest 300.",
                     "Round 1.5 to the nearest fifth.", "What is 2.5 rounded to many decimal places?"):  # fmt: skip
        assert mathematics.truncated(question) is None, question
        assert "truncate" not in mathematics.echo_answers(question), question
    # where the dropped digit is under 5 the cut is the rounded number, so a copying policy is paid there
    rows = [{"data_source": "mathematics_dataset/numbers__round_number", "extra_info": {"raw_problem": q},
             "reward_model": {"ground_truth": a}}
            for q, a in [("Round 312.64272 to one decimal place.", "312.6"), ("Round 1.737 to 2 dps.", "1.74")]]  # fmt: skip
    b = mathematics.echo_baseline(rows)["numbers__round_number"]
    assert (b["truncate"], b["best"]) == (0.5, 0.5)


def test_truncation_echo_over_the_package_questions():
    """Every rounding question the package writes is read; where the cut is not the answer, the rounding
    moved the last kept digit by one (the dropped digits were 5 or more), so the cut is all a copy can be."""
    from decimal import Decimal

    module = mathematics.modules_of("train-medium")["numbers__round_number"]
    random.seed(3)
    right = 0
    for _ in range(200):
        question, answer = mathematics.sample(module)
        number, power = mathematics.rounding_place(question)
        cut = mathematics.truncated(question)
        assert Decimal(number).is_finite() and -7 <= power <= 6, question
        if Decimal(cut) == Decimal(answer):
            right += 1
        else:
            assert abs(Decimal(answer) - Decimal(cut)) == Decimal(1).scaleb(power), (question, answer, cut)
    assert 0.3 < right / 200 < 0.7, right


def test_write_splits_gives_files_a_run_loads(tmp_path):
    modules = ["numbers__gcd", "arithmetic__add_or_sub"]
    report = mathematics.write_splits(modules, tmp_path, per_module=30, held_out_per_module=10, seed=3, progress=None)
    assert set(report["files"]) == {"train-easy", "interpolate", "extrapolate"}
    train, _ = load_prompts([str(tmp_path / "train-easy.parquet")], template="none")
    held_out, _ = load_prompts([str(tmp_path / "interpolate.parquet")], template="none")
    harder, _ = load_prompts([str(tmp_path / "extrapolate.parquet")], template="none")
    assert len(train) == 60 and len(held_out) == 20 - report["dropped_seen_in_training"]["interpolate"]
    assert {r["data_source"] for r in harder} == {"mathematics_dataset/arithmetic__add_or_sub_big"}
    seen = {r["messages"][0]["content"] for r in train}
    assert not seen & {r["messages"][0]["content"] for r in held_out + harder}
    assert all(r["messages"][0]["content"].endswith(" Reply with the answer only.") for r in train)
    # the reference itself, as a reply, is right by the benchmark's metric
    assert all(compute_score(r["ground_truth"], r["ground_truth"], "exact")["acc"] for r in train + held_out + harder)
    written = json.loads((tmp_path / "mathematics.json").read_text())
    assert set(written["echo_baseline"]["interpolate"]) == set(modules)
    assert 0.0 <= written["echo_baseline"]["interpolate"]["numbers__gcd"]["best"] <= 1.0


def test_the_dapo_template_asks_for_an_answer_line():
    (row,) = mathematics.generate("train-easy", ["numbers__gcd"], 1, seed=1, template="dapo")
    text = row["prompt"][0]["content"]
    assert "Answer:" in text and row["extra_info"]["raw_problem"] in text


def test_the_command_and_the_config(tmp_path, capsys):
    from dapo_ray.cli import main
    from dapo_ray.config import load_config

    out = tmp_path / "m"
    assert main(["prepare-mathematics", "--modules", "numbers__gcd", "--per-module", "5", "--held-out-per-module", "3",
                 "--out-dir", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "echo baseline, interpolate" in printed and "numbers__gcd" in printed
    assert {p.name for p in out.iterdir()} == {"train-easy.parquet", "interpolate.parquet", "mathematics.json"}
    assert main(["prepare-mathematics", "--modules", "numbers__gdc", "--out-dir", str(out)]) == 1
    assert "numbers__gcd" in capsys.readouterr().err  # the valid choices
    assert main(["prepare-mathematics", "--list"]) == 0 and "extrapolate: " in capsys.readouterr().out
    cfg = load_config(Path(__file__).resolve().parents[2] / "workflows/configs/mathematics_cpu.yaml")
    assert cfg.reward.mode == "exact" and cfg.data.train_files == ("runs/data/mathematics/train-easy.parquet",)
    assert set(mathematics.CPU_MODULES) <= set(mathematics.modules_of("interpolate"))


def test_the_same_seed_gives_the_same_files_in_any_process():
    """Variable names come from a set, entities are shuffled from a set and primes come from sympy's own
    generator: without fixing those, each process (hash seed) wrote other questions."""
    import subprocess
    import sys

    code = ("import hashlib, json; from dapo_ray.tasks import mathematics as m; print(hashlib.md5(json.dumps(m.generate("
            "'interpolate', ['algebra__linear_1d', 'numbers__is_prime', 'numbers__gcd_composed', "
            "'polynomials__evaluate_composed'], 6, seed=2)).encode()).hexdigest())")  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root,
                              env={**os.environ, "PYTHONHASHSEED": str(h), "PYTHONPATH": str(root)}).stdout
               for h in (1, 2)}  # fmt: skip
    assert len(digests) == 1


def test_worked_examples_come_before_the_question_from_the_training_split():
    plain = mathematics.generate("interpolate", ["numbers__gcd"], 6, seed=4)
    shown = mathematics.generate("interpolate", ["numbers__gcd"], 6, seed=4, shots=2)
    # the problems and their order do not depend on the examples
    assert [r["extra_info"] for r in shown] == [r["extra_info"] for r in plain]
    assert [r["reward_model"] for r in shown] == [r["reward_model"] for r in plain]
    pool = dict(mathematics._draw("train-easy", "numbers__gcd", mathematics.SHOT_POOL, "4/shots/numbers__gcd"))
    for row, bare in zip(shown, plain, strict=True):
        turns = row["prompt"]
        assert [t["role"] for t in turns] == ["user", "assistant", "user", "assistant", "user"]
        assert turns[-1] == bare["prompt"][0]
        for asked, reply in [(turns[0], turns[1]), (turns[2], turns[3])]:
            question = asked["content"].removesuffix(" Reply with the answer only.")
            assert pool[question] == reply["content"] and question != row["extra_info"]["raw_problem"]
    assert len({r["prompt"][0]["content"] for r in shown}) > 1  # drawn per row, not one fixed example
    # an extrapolate module shows examples of the training module it is a harder variant of, in the
    # template's reply form
    (big,) = mathematics.generate("extrapolate", ["arithmetic__add_or_sub_big"], 1, seed=4, shots=1, template="dapo")
    assert big["prompt"][1]["content"].startswith("Answer: ")
    assert mathematics.shot_module("arithmetic__add_or_sub_big", "train-easy") == "arithmetic__add_or_sub"
    with pytest.raises(mathematics.MathematicsError, match="shots must be from 0"):
        mathematics.generate("interpolate", ["numbers__gcd"], 1, seed=4, shots=mathematics.SHOT_POOL)


def test_prompts_with_worked_examples_load_and_show_their_question(tmp_path):
    from dapo_ray.evaluate import first_words, with_problems

    mathematics.write_splits(["numbers__gcd"], tmp_path, per_module=5, held_out_per_module=3, shots=1,
                             extrapolate=False, progress=None)  # fmt: skip
    rows, report = load_prompts([str(tmp_path / "interpolate.parquet")], template="none")
    assert report.kept == len(rows) > 0 and all(len(r["messages"]) == 3 for r in rows)
    shown = with_problems([{"uid": r["uid"]} for r in rows], rows)
    assert [s["problem"] for s in shown] == [first_words(r["messages"][-1]["content"], 100) for r in rows]
    assert json.loads((tmp_path / "mathematics.json").read_text())["shots"] == 1


def test_the_ablation_reads_accuracy_over_the_modules_no_echo_can_solve(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import ablation

    report = tmp_path / "mathematics.json"
    report.write_text(json.dumps({"echo_baseline": {"interpolate": {
        "numbers__gcd": {"best": 0.25}, "arithmetic__add_or_sub": {"best": 0.0}, "numbers__is_prime": {"best": 0.049}}}}))
    modules = ablation.low_echo_modules(report)
    assert modules == ["arithmetic__add_or_sub", "numbers__is_prime"]
    key = "eval/avg_at_k/mathematics_dataset/"
    result = {"rung": "dapo", "seed": 1, "eval_n": 4, "evals": [
        {"train_min": 0.0, key + "numbers__gcd": 0.5, key + "arithmetic__add_or_sub": 0.02, key + "numbers__is_prime": 0.04},
        {"train_min": 30.0, key + "numbers__gcd": 0.9, key + "arithmetic__add_or_sub": 0.10, key + "numbers__is_prime": 0.20}]}
    ablation.with_low_echo(result, modules)
    assert [round(e["eval/avg_at_k/low-echo"], 6) for e in result["evals"]] == [0.03, 0.15]  # gcd left out
    table = ablation.low_echo_table([result], modules)
    assert "| dapo seed 1 | 3.0% | 15.0% | 5.00x | +12.0 | 30.0 |" in table
    assert table.startswith("Held-out avg@4 over the 2 modules")  # the run's own k, not a fixed 8
    # A result saved before it carried its k reads it from its config: the Mathematics one samples 4.
    config = Path(__file__).resolve().parents[2] / "workflows/configs/mathematics_cpu.yaml"
    saved = {"rung": "naive-grpo", "config": str(config), "extra": []}
    assert ablation.eval_k(saved) == 4
    assert ablation.eval_k({**saved, "extra": ["eval.n=2"]}) == 2
