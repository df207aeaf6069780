import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo_ray.data import DAPO_PREFIX, BadRowError, apply_dapo_template, load_prompts
from dapo_ray.tasks.sums import synthetic_prompts


def test_aime_real_file(real_data):
    rows, rep = load_prompts([real_data / "aime-2024.parquet"])
    # 30 problems x 32 copies: de-duplication keeps 30 and says it dropped 930.
    assert rep.rows_read == 960 and rep.kept == 30 and rep.duplicates == 930
    assert rep.templated == 0  # the file carries the DAPO template already
    assert all(r["messages"][0]["content"].startswith(DAPO_PREFIX) for r in rows)
    assert all(r["ground_truth"].isdigit() for r in rows)


def test_aime_without_dedupe_keeps_avg_at_32_layout(real_data):
    rows, rep = load_prompts([real_data / "aime-2024.parquet"], dedupe=False)
    assert len(rows) == 960 and rep.duplicates == 0


def test_dapo_17k_real_file_is_templated_and_deduped(real_data):
    rows, rep = load_prompts([real_data / "dapo-math-17k.parquet"])
    assert rep.rows_read == 17917
    # The data README counts 17,290 distinct raw texts; 35 of them differ only in surrounding
    # whitespace, which templating strips, so they are duplicates of the same prompt.
    assert rep.kept == 17255 and rep.duplicates == 662
    assert rep.templated == 17917
    content = rows[0]["messages"][0]["content"]
    assert content.startswith(DAPO_PREFIX) and content.endswith('after "Answer:".')


def test_mini16_short_prefix_is_not_repeated(real_data):
    rows, _ = load_prompts([real_data / "dapo-math-mini16.parquet"])
    assert len(rows) == 16
    for r in rows:
        assert r["messages"][0]["content"].count("Solve the following math problem") == 1


def test_template_none_leaves_text(real_data):
    rows, rep = load_prompts([real_data / "dapo-math-mini16.parquet"], template="none")
    assert rep.templated == 0 and "Answer:" not in rows[0]["messages"][0]["content"]


def _write(tmp_path, rows):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


GOOD = {"data_source": "x", "prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2", "style": "rule"}}


def test_malformed_parquet_row_names_file_and_row(tmp_path):
    bad = dict(GOOD, reward_model={"ground_truth": "", "style": "rule"})
    path = _write(tmp_path, [GOOD, dict(GOOD, prompt=[{"role": "user", "content": "2+2?"}]), bad])
    with pytest.raises(BadRowError, match=r"bad\.parquet: row 2: ground truth"):
        load_prompts([path])
    rows, rep = load_prompts([path], on_bad_row="skip")
    assert len(rows) == 2 and rep.bad_rows == 1 and "row 2" in rep.first_bad


def test_parquet_missing_column(tmp_path):
    path = _write(tmp_path, [{"data_source": "x", "reward_model": {"ground_truth": "2", "style": "r"}}])
    with pytest.raises(BadRowError, match="row 0: column 'prompt' is missing"):
        load_prompts([path])


def test_jsonl_loader_and_bad_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"problem": "What is 2+3?", "answer": 5}) + "\n\n"
        + "{not json\n"
        + json.dumps({"question": "What is 1+1?", "ground_truth": "2"}) + "\n"
        + json.dumps({"answer": "3"}) + "\n"
    )  # fmt: skip
    with pytest.raises(BadRowError, match=r"p\.jsonl: row 2: not valid JSON"):
        load_prompts([path])
    rows, rep = load_prompts([path], on_bad_row="skip", template="none")
    assert [r["ground_truth"] for r in rows] == ["5", "2"] and rep.bad_rows == 2
    assert rows[0]["messages"][0]["content"] == "What is 2+3?"


def test_unknown_suffix_and_missing_file(tmp_path):
    (tmp_path / "a.csv").write_text("x")
    with pytest.raises(ValueError, match="unsupported"):
        load_prompts([tmp_path / "a.csv"])
    with pytest.raises(FileNotFoundError):
        load_prompts([tmp_path / "nope.parquet"])


@pytest.mark.parametrize("content", [b"", b"hello", b"PAR1" + b"\0" * 64])
def test_a_file_that_is_not_parquet_is_named(tmp_path, content):
    (tmp_path / "train.parquet").write_bytes(content)
    with pytest.raises(BadRowError, match=r"train.parquet: not a parquet file that can be read"):
        load_prompts([tmp_path / "train.parquet"])


def test_apply_template_once():
    t = apply_dapo_template("What is 1+1?")
    assert t.startswith(DAPO_PREFIX) and "What is 1+1?" in t


def test_synthetic_is_seeded_disjoint_and_scored_correct():
    from dapo_ray.algo import compute_score

    tr, ev = synthetic_prompts(200, 50, num_terms=3, operators="+-*", seed=3, flavour="reasoning")
    tr2, ev2 = synthetic_prompts(200, 50, num_terms=3, operators="+-*", seed=3, flavour="reasoning")
    assert tr == tr2 and ev == ev2
    texts = {r["messages"][0]["content"] for r in tr}
    assert not texts & {r["messages"][0]["content"] for r in ev}
    assert len(texts) == 200
    for r in tr + ev:  # every reference solution is judged correct by the DAPO verifier
        assert compute_score(r["solution"], r["ground_truth"])["acc"]
        assert r["solution"].count("\n") == 1  # one scratchpad line, then the answer


def test_reasoning_scratchpad_reduces_the_expression_line_by_line():
    import random as _random

    from dapo_ray.tasks.sums import synthetic_problem

    text, answer, steps = synthetic_problem(_random.Random(1), 4, 0, 9, "+", style="symbols")
    assert (text, answer, steps) == ("2+4+7+7=", "20", ["6+7+7", "13+7"])
    rng = _random.Random(7)
    for _ in range(200):  # every line evaluates (left to right, as written) to the answer
        text, answer, steps = synthetic_problem(rng, 5, 0, 20, "+-*", style="symbols")
        assert len(steps) == 3 and all(eval(line) == int(answer) for line in steps), (text, steps)
    tr, ev = synthetic_prompts(300, 30, flavour="reasoning", num_terms=8, min_terms=3, max_operand=9, style="symbols")
    terms = {r["messages"][0]["content"].count("+") + 1 for r in tr + ev}
    assert terms == set(range(3, 9))  # a mix of lengths, so some responses are long
    with pytest.raises(ValueError, match="min_terms"):
        synthetic_prompts(10, 5, num_terms=3, min_terms=4)


def test_synthetic_short_flavour_and_too_small_space():
    tr, _ = synthetic_prompts(10, 5, max_operand=9)
    assert all(r["solution"] == f"Answer: {r['ground_truth']}" for r in tr)
    with pytest.raises(ValueError, match="distinct problems"):
        synthetic_prompts(100, 10, max_operand=3)
    # Every problem of a small space can be asked for: the demo trains on all the sums the held-out set leaves.
    tr, ev = synthetic_prompts(377, 64, max_operand=20, style="question")
    texts = [r["messages"][0]["content"] for r in tr + ev]
    assert len(texts) == len(set(texts)) == 441  # none twice, none both trained and held out


def test_symbols_style_is_left_to_right():
    import random as _random

    from dapo_ray.tasks.sums import synthetic_problem

    text, answer, steps = synthetic_problem(_random.Random(0), 2, 0, 99, "+", style="symbols")
    assert text == "49+5=" and answer == "54"
    rng = _random.Random(5)
    for _ in range(200):
        text, answer, _ = synthetic_problem(rng, 3, 0, 20, "+-*", style="symbols")
        assert eval(text[:-1]) == int(answer), text  # the test evaluates its own generated text


def test_question_style_asks_as_a_user_asks_a_chat_model_and_carries_the_instruction():
    import random as _random

    from dapo_ray.tasks.sums import synthetic_problem

    assert synthetic_problem(_random.Random(0), 2, 0, 99, "+", style="question")[:2] == ("What is 49 + 5?", "54")
    rng = _random.Random(5)
    for _ in range(200):  # the same left-to-right expression as the symbols style, spaced
        text, answer, _ = synthetic_problem(rng, 3, 0, 20, "+-*", style="question")
        assert text.startswith("What is ") and eval(text[len("What is ") : -1]) == int(answer), text
    tr, ev = synthetic_prompts(20, 5, max_operand=20, style="question", instruction="Reply with the number only.")
    assert all(r["messages"][0]["content"].endswith("? Reply with the number only.") for r in tr + ev)


def test_synthetic_rows_take_the_dapo_template_when_asked():
    from dapo_ray.data import strip_dapo_template
    from dapo_ray.tasks.sums import synthetic_rows

    kw = dict(num_train=10, num_eval=5, max_operand=20, style="question")
    plain, _ = synthetic_rows(kw, "none")
    templated, held_out = synthetic_rows(kw, "dapo")
    assert [r["messages"] for r in plain] == [r["messages"] for r in synthetic_prompts(**kw)[0]]
    for a, b in zip(plain, templated, strict=True):
        text = b["messages"][0]["content"]
        assert text.startswith(DAPO_PREFIX) and strip_dapo_template(text) == a["messages"][0]["content"]
    assert all(r["messages"][0]["content"].startswith(DAPO_PREFIX) for r in held_out)
