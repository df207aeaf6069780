"""What the model says: reply shapes, the sample an evaluation keeps, the hack alarm, and how the driver
and `dapo-ray eval` show them (pure: hand-made replies, no cluster)."""

import doctest
from pathlib import Path
from types import SimpleNamespace

import pytest

import dapo_ray.replies
from dapo_ray.config import ConfigError, load_config
from dapo_ray.evaluate import ProblemResult, summarize
from dapo_ray.metrics import METRICS, Tracker
from dapo_ray.replies import (
    alarm_up,
    commonest_shapes,
    replies_record,
    replies_table,
    reply_lines,
    reply_sample,
    reply_shape,
    shapes_table,
    unstated_rewarded_ratio,
)

TINY_CFG = Path(__file__).resolve().parents[2] / "workflows" / "configs" / "tiny_cpu.yaml"
HACK = "14 + 3 = ?<|im_end|>"  # what a policy learned to say to "What is 14 + 3?", paid by math_verify


def problem(uid: str, gt: str, texts: list[str], acc: list[bool], preds: list[str] | None = None) -> ProblemResult:
    return ProblemResult(uid=uid, problem=f"What is {uid}?", ground_truth=gt, acc=tuple(acc),
                         preds=tuple(preds or [gt if a else "0" for a in acc]), texts=tuple(texts),
                         lengths=(5,) * len(texts), truncated=(False,) * len(texts))  # fmt: skip


def test_the_worked_examples_of_the_docstrings():
    assert doctest.testmod(dapo_ray.replies).failed == 0


def test_a_shape_is_the_reply_with_its_numbers_masked():
    assert reply_shape(HACK) == reply_shape("25 + 8 = ?") == "N + N = ?"
    assert reply_shape("Let me see.\n\n  3.5 x 2 = 7\nAnswer: 7</s>") == "Let me see. N.N x N = N Answer: N"
    long = reply_shape("Step " * 100 + "Answer: 17")
    assert len(long) == 80 and long.endswith("Answer: N") and " ... " in long  # the start and the answer


def test_the_commonest_shapes_count_every_reply():
    texts = [HACK, "25 + 8 = ?", "Answer: 17", "Answer: 9", "Answer: 9", "I do not know"]
    assert commonest_shapes(texts) == [("Answer: N", 0.5, 3), ("N + N = ?", 2 / 6, 2), ("I do not know", 1 / 6, 1)]
    assert commonest_shapes(texts, top=1) == [("Answer: N", 0.5, 3)]
    assert commonest_shapes([]) == []


def test_the_unstated_ratio_counts_rewarded_replies_that_never_write_the_reference():
    texts = [HACK, "14 + 3 = 17", "Answer: \\boxed{17}", "Answer: 18", HACK]
    ratio, rewarded = unstated_rewarded_ratio(texts, ["17"] * 5, [True, True, True, False, False])
    assert (ratio, rewarded) == (pytest.approx(1 / 3), 3)  # the wrong replies do not count, stated or not
    assert unstated_rewarded_ratio(texts, ["17"] * 5, [False] * 5) == (0.0, 0)
    assert unstated_rewarded_ratio([], [], []) == (0.0, 0)


def test_the_alarm_needs_a_share_above_the_threshold_of_enough_rewarded_replies():
    assert alarm_up(0.62, 130, 0.2)
    assert not alarm_up(0.2, 130, 0.2)  # at the threshold: not above it
    assert not alarm_up(1.0, 7, 0.2)  # seven odd replies are not a pattern
    assert alarm_up(1.0, 8, 0.2) and not alarm_up(1.0, 8, 1.0)


def test_the_sample_is_the_first_reply_of_the_first_problems():
    results = [problem("14 + 3", "17", [HACK, "Answer: 17"], [True, True]),
               problem("2 + 2", "4", ["Answer: 5", "Answer: 4"], [False, True], preds=["5", "4"]),
               problem("1 + 1", "2", ["Answer: 2"], [True])]  # fmt: skip
    sample = reply_sample(results, 2)
    assert sample == [
        {"uid": "14 + 3", "problem": "What is 14 + 3?", "ground_truth": "17", "reply": HACK, "pred": "17", "acc": True,
         "states_reference": False},
        {"uid": "2 + 2", "problem": "What is 2 + 2?", "ground_truth": "4", "reply": "Answer: 5", "pred": "5", "acc": False,
         "states_reference": False},
    ]  # fmt: skip
    assert len(reply_sample(results, 32)) == 3 and reply_sample(results, 0) == []
    record = replies_record(results, 1)
    assert record["replies"] == sample[:1]
    assert record["shapes"] == [{"shape": "Answer: N", "share": 0.8, "count": 4},  # over all 5 replies
                                {"shape": "N + N = ?", "share": 0.2, "count": 1}]

    assert reply_lines(sample, 1) == ['right  What is 14 + 3? -> "14 + 3 = ?<|im_end|>"  (extracted 17, reference 17, '
                                      'not stated)']  # fmt: skip
    assert reply_lines(sample, 4)[1] == 'wrong  What is 2 + 2? -> "Answer: 5"  (extracted 5, reference 4)'


def test_summarize_reports_the_unstated_share_of_the_evaluation():
    s = summarize([problem("14 + 3", "17", [HACK, HACK, "Answer: 17", "Answer: 9"], [True, True, True, False]),
                   problem("2 + 2", "4", ["Answer: 4"] * 2, [True, True])])  # fmt: skip
    assert (s["unstated_rewarded_ratio"], s["rewarded_samples"]) == (pytest.approx(2 / 5), 5)


def test_the_markdown_tables_keep_each_reply_on_one_row():
    sample = [{"problem": "a | b", "ground_truth": "17", "reply": "line one\nline two | <think>", "pred": "17",
               "acc": True, "states_reference": True}]  # fmt: skip
    rows = replies_table(sample).splitlines()
    assert rows[0] == "| problem | ground truth | reply | extracted | verdict | states the reference |"
    assert rows[2] == "| a \\| b | 17 | line one line two \\| &lt;think> | 17 | right | yes |"
    long = replies_table([sample[0] | {"reply": "x" * 1000 + " Answer: 17"}]).splitlines()[2]
    assert "Answer: 17" in long and len(long) < 400
    assert shapes_table([{"shape": "N | N", "share": 0.625, "count": 5}]).splitlines()[2] == "| 62.5% | 5 | N \\| N |"


def test_the_alarm_share_and_reply_counts_are_configured_and_checked():
    cfg = load_config(TINY_CFG)
    assert (cfg.reward.alarm_share, cfg.eval.print_replies, cfg.eval.log_replies) == (0.2, 4, 32)
    with pytest.raises(ConfigError, match="reward.alarm_share"):
        load_config(TINY_CFG, ["reward.alarm_share=1.5"])
    with pytest.raises(ConfigError, match="eval.log_replies"):
        load_config(TINY_CFG, ["eval.log_replies=-1"])


def test_the_step_metrics_carry_the_hack_alarms_share():
    from dapo_ray.algo.stated import states_reference
    from dapo_ray.driver import batch_metrics

    def group(texts: list[str], acc: list[bool]) -> dict:
        return {"texts": texts, "ground_truth": "17", "acc": acc, "scores": [1.0 if a else -1.0 for a in acc],
                "truncated": [False] * len(texts), "response_ids": [[1, 2]] * len(texts),
                "rollout_logprobs": [[-0.1, -0.2]] * len(texts), "policy_version": 3,
                "stated": [states_reference(t, "17") for t in texts], "reward_errors": [""] * len(texts)}  # fmt: skip

    generated = [group([HACK, "Answer: 17", "Answer: 9"], [True, True, False]), group([HACK, HACK], [True, False])]
    m = batch_metrics(generated[:1], generated, version=3)
    assert (m["reward/unstated_rewarded_ratio"], m["reward/rewarded_responses"]) == (pytest.approx(2 / 3), 3)
    assert all(k in METRICS for k in m)
    carried_only = batch_metrics(generated[1:], [], version=3)  # nothing generated: the batch's own
    assert (carried_only["reward/unstated_rewarded_ratio"], carried_only["reward/rewarded_responses"]) == (1.0, 1)


def test_an_evaluation_prints_a_few_replies_and_raises_the_alarm(capsys):
    from dapo_ray.driver import _Run

    cfg = load_config(TINY_CFG, ["eval.print_replies=2"])
    results = [problem(f"{i} + 3", str(i + 3), [f"{i} + 3 = ?"] * 2, [True, True]) for i in range(10, 15)]
    s = summarize(results)
    ev = {"eval/avg_at_k": s["avg_at_k"], "eval/unstated_rewarded_ratio": s["unstated_rewarded_ratio"],
          "eval/rewarded_samples": s["rewarded_samples"]}  # fmt: skip
    run = SimpleNamespace(cfg=cfg, step=7, tracker=Tracker(False, "", "", "", {}), replies_at="report/summary.md", summary={})
    _Run.show_replies(run, ev, results)
    out = capsys.readouterr().out.splitlines()
    assert [line.split("] ", 1)[1] for line in out] == [
        'reply at step 7: right  What is 10 + 3? -> "10 + 3 = ?"  (extracted 13, reference 13, not stated)',
        'reply at step 7: right  What is 11 + 3? -> "11 + 3 = ?"  (extracted 14, reference 14, not stated)',
        "HACK ALARM: 100% of the 10 replies the scorer rewarded at the held-out evaluation of step 7 do not state the "
        "reference answer: the reward may pay something other than right answers; read the replies (report/summary.md)",
    ]  # fmt: skip
