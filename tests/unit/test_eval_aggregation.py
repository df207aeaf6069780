"""avg@k, best@k (pass@k) and maj@k from hand-made scored groups; the eval set and the command line (no cluster)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_ray.config import ConfigError, load_config
from dapo_ray.evaluate import (
    INVALID,
    ProblemResult,
    first_words,
    load_eval_set,
    majority_vote,
    markdown_table,
    problem_result,
    summarize,
    with_target,
)
from dapo_ray.pipeline import ScoringSpec, score_group
from dapo_ray.tasks import RewardSpec

TINY_CFG = Path(__file__).resolve().parents[2] / "workflows" / "configs" / "tiny_cpu.yaml"
SPEC = ScoringSpec(RewardSpec("dapo"), max_response_length=20, soft_overlong=True, overlong_cache_length=4,
                   overlong_penalty_factor=1.0, overlong_filter=True, adv_eps=1e-6, adv_std_unbiased=True)  # fmt: skip


def result(preds: list[str], gt: str, uid: str = "p") -> ProblemResult:
    """A problem whose samples answered `preds` (`Answer: <pred>`); a sample is correct when its answer is `gt`."""
    return ProblemResult(uid=uid, problem="", ground_truth=gt, acc=tuple(p == gt for p in preds), preds=tuple(preds),
                         texts=tuple(f"Answer: {p}" for p in preds), lengths=(4,) * len(preds),
                         truncated=(False,) * len(preds))  # fmt: skip


def test_avg_best_and_maj_at_k():
    results = [
        result(["13", "13", "12", "13"], "13"),  # 3/4 right, majority right
        result(["5", "7", "7", INVALID], "5"),  # 1/4 right, majority (7) wrong
        result(["1", "2", "3", "4"], "9"),  # none right; a four-way tie of wrong answers
    ]
    s = summarize(results)
    assert s["avg_at_k"] == pytest.approx((3 / 4 + 1 / 4 + 0) / 3)
    assert s["pass_at_k"] == pytest.approx(2 / 3)  # best@k: any of the k samples right
    assert s["maj_at_k"] == pytest.approx(1 / 3)
    assert s["no_answer_ratio"] == pytest.approx(1 / 12)
    assert (s["problems"], s["samples"]) == (3, 12)


def test_a_tie_scores_the_share_of_tied_answers_that_are_right():
    assert majority_vote(["13", "12"], [True, False]).score == 0.5
    assert majority_vote(["12", "13"], [False, True]).score == 0.5  # the order of the samples does not matter
    assert majority_vote(["1", "2", "3"], [False, False, True]).score == pytest.approx(1 / 3)
    assert majority_vote(["1", "2", "1", "2"], [False] * 4).score == 0.0
    vote = majority_vote(["7", "8", "8", "7", "9"], [False, True, True, False, False])
    assert (vote.answers, vote.votes, vote.score) == (("7", "8"), 2, 0.5)  # in order of first appearance


def test_unparsable_answers_do_not_vote():
    vote = majority_vote([INVALID, INVALID, INVALID, "13"], [False, False, False, True])
    assert (vote.answers, vote.votes, vote.score) == (("13",), 1, 1.0)
    none = majority_vote([INVALID] * 4, [False] * 4)
    assert (none.answers, none.votes, none.score) == ((), 0, 0.0)
    s = summarize([result([INVALID] * 4, "13")])
    assert (s["avg_at_k"], s["pass_at_k"], s["maj_at_k"], s["no_answer_ratio"]) == (0.0, 0.0, 0.0, 1.0)


def test_invalid_is_the_verifiers_own_marker():
    from dapo_ray.algo.reward import INVALID as VERIFIER_INVALID
    from dapo_ray.algo.reward import compute_score

    assert INVALID == VERIFIER_INVALID == compute_score("no answer here", "13")["pred"]


def test_a_scored_row_votes_on_the_verifiers_extracted_answers():
    """score_group's row (as generate_round returns it) -> ProblemResult: `Answer: 025` and `Answer: 25`
    are one answer for the dapo verifier, so they vote together."""
    row = {"uid": "aime:3", "problem": "Find x.", "prompt_ids": [5, 6], "ground_truth": "25",
           "texts": ["x\nAnswer: 025", "Answer: 24", "Answer: 24", "Answer: 25.", "no idea"],
           "response_ids": [[9] * n for n in (6, 4, 4, 5, 20)], "rollout_logprobs": [[-0.5] * n for n in (6, 4, 4, 5, 20)],
           "finish_reasons": ["stop", "stop", "stop", "stop", "length"], "policy_version": 0}  # fmt: skip
    r = problem_result(score_group(row, SPEC))
    assert r.preds == ("25", "24", "24", "25", INVALID)
    assert r.texts == tuple(row["texts"])  # kept, for the replies an evaluation shows
    assert (r.correct, r.k, r.truncated) == (2, 5, (False, False, False, False, True))
    assert r.vote.answers == ("25", "24") and r.vote.score == 0.5
    d = r.to_dict()
    assert (d["uid"], d["problem"], d["correct"], d["no_answer"], d["majority_votes"]) == ("aime:3", "Find x.", 2, 1, 2)
    json.dumps(d)  # the report is JSON


def test_the_table_has_a_row_per_problem():
    results = [result(["13", "13"], "13", uid="a:0"), result([INVALID, INVALID], "x|y", uid="a:1")]
    results[0] = ProblemResult(**{**results[0].__dict__, "problem": first_words("Compute 1 | 2, then stop.")})
    lines = markdown_table(results).splitlines()
    assert len(lines) == 2 + 2
    assert lines[2] == "| a:0 | Compute 1 \\| 2, then stop. | 13 | 2/2 | 13 (2) | 0 |"
    assert lines[3] == "| a:1 |  | x\\|y | 0/2 | - | 2 |"
    assert len(markdown_table(results, limit=1).splitlines()) == 3


def test_first_words_drop_the_dapo_template():
    from dapo_ray.data import apply_dapo_template

    text = apply_dapo_template("Let $x$ be a real number such that the sum of the squares of its digits equals 97.")
    assert first_words(text) == "Let $x$ be a real number such that the sum..."
    assert first_words("12+7=") == "12+7="


def test_the_aime_file_is_30_problems(real_data):
    from dapo_ray.tiny_model import build_tokenizer

    cfg = with_target(load_config(TINY_CFG, ["data.max_prompt_length=1000"]),
                      files=[str(real_data / "aime-2024.parquet")], k=2)  # fmt: skip
    name, rows, dropped = load_eval_set(cfg, build_tokenizer())
    assert (name, len(rows), dropped, cfg.eval.n) == ("aime-2024", 30, 0, 2)
    assert len({r["uid"] for r in rows}) == 30 and all(r["ground_truth"].isdigit() for r in rows)
    assert not rows[0]["problem"].startswith("Solve the following")
    # The demo's prompt limit drops every AIME problem, and says so.
    short = with_target(load_config(TINY_CFG), files=[str(real_data / "aime-2024.parquet")])
    assert load_eval_set(short, build_tokenizer())[1:] == ([], 30)


def test_the_synthetic_held_out_set_is_the_training_runs():
    from dapo_ray.driver import prepare_prompts
    from dapo_ray.tiny_model import build_tokenizer

    cfg = load_config(TINY_CFG)
    tok = build_tokenizer()
    name, rows, dropped = load_eval_set(cfg, tok)
    _, held_out = prepare_prompts(cfg, tok)
    assert (name, dropped) == ("synthetic-held-out", 0)
    assert [(r["uid"], r["prompt_ids"], r["ground_truth"]) for r in rows] == [
        (r["uid"], r["prompt_ids"], r["ground_truth"]) for r in held_out]  # fmt: skip


def test_command_line_arguments_and_overrides():
    from dapo_ray.cli import build_parser
    from dapo_ray.evaluate import _split_files

    args = build_parser().parse_args(["eval", "--model", "m", "--files", "a.parquet", "eval.top_p=1.0", "--k", "4"])
    assert (args.model, args.k, args.out) == ("m", 4, None)
    assert _split_files(args.files, args.overrides) == (["a.parquet"], ["eval.top_p=1.0"])
    cfg = with_target(load_config(TINY_CFG, ["eval.top_p=0.7"]), model="/m", files=["a.parquet"], k=4)
    assert (cfg.rollout.model_path, cfg.eval.files, cfg.eval.n, cfg.eval.top_p) == ("/m", ("a.parquet",), 4, 0.7)
    assert with_target(cfg).eval == cfg.eval  # nothing given: the config's own
    with pytest.raises(ConfigError, match="eval.n"):
        with_target(cfg, k=0)
    files_cfg = with_target(load_config(TINY_CFG, ["data.source=files", "data.train_files=[x.parquet]"]))
    with pytest.raises(ConfigError, match="nothing to evaluate"):
        load_eval_set(files_cfg, tokenizer=None)


def test_importing_the_command_loads_no_heavy_library():
    """Every `dapo-ray` command builds the parser, which imports dapo_ray.evaluate."""
    code = ("import sys, dapo_ray.evaluate; "
            "print([m for m in ('torch', 'ray', 'vllm', 'transformers', 'pyarrow') if m in sys.modules])")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_accuracy_per_source_in_the_metrics_the_eval_table_and_the_report():
    """A benchmark's modules are its data_sources: avg@k per module, as `dapo-ray eval` prints it and as
    the report's table of `eval/avg_at_k/<source>` shows it."""
    from dapo_ray.evaluate import by_source, source_table
    from dapo_ray.metrics import check_known
    from dapo_ray.report import RunData, Series, sources_section

    gcd, add = "mathematics_dataset/numbers__gcd", "mathematics_dataset/arithmetic__add_or_sub"
    results = [ProblemResult(**{**result(p, "5", uid=u).__dict__, "data_source": s})
               for p, u, s in [(["5", "5"], "a", gcd), (["5", "4"], "b", gcd), (["4", "4"], "c", add)]]  # fmt: skip
    per = by_source(results)
    assert list(per) == [add, gcd]  # name order
    assert per[gcd] == {"avg_at_k": 0.75, "pass_at_k": 1.0, "problems": 2}
    assert per[add]["avg_at_k"] == 0.0
    table = source_table(per, 2, baseline={gcd: 0.146})
    assert f"| {gcd} | 2 | 75.0% | 100.0% | 14.6% |" in table and f"| {add} | 1 | 0.0% | 0.0% | - |" in table
    assert not check_known([f"eval/avg_at_k/{gcd}"]) and check_known(["eval/avg_at_k_typo"])
    run = RunData("r", [], "e", "", "FINISHED", {"eval.n": "2"},
                  {f"eval/avg_at_k/{gcd}": Series([0, 10], [0.25, 0.75], [0.0, 5.0]),
                   f"eval/avg_at_k/{add}": Series([10], [0.5], [5.0])}, 5.0)  # fmt: skip
    lines = sources_section(run)
    assert f"| {gcd} | 25.0% | 75.0% |" in lines and f"| {add} | - | 50.0% |" in lines
    assert sources_section(RunData("r", [], "e", "", "FINISHED", {}, {}, 0.0)) == []
