"""The Mathematics Dataset's metric (`exact` mode): the `Answer:` line or the whole reply is the answer.

In gcd, comparison and k-th-biggest questions the question's own last number is often the answer, so a
reply that restates the question must not be paid by reading its last number; nor is an expression, a
hedge or a list in another order.
"""

import pytest

from dapo_ray.algo.reward import compute_score
from dapo_ray.pipeline import ScoringSpec, score_group
from dapo_ray.tasks import RewardSpec, task_for

GCD = "What is the greatest common divisor of 1368 and 57?"

HOSTILE = [
    ("The greatest common divisor of 1368 and 57", "57"),  # the question restated: its last number is the answer
    ("gcd(1368, 57) = 57?", "57"),
    (GCD, "57"),  # the prompt echoed
    ("Which is bigger: 3 or 5? 5", "5"),
    ("1419 + 2", "1421"),  # an expression equal to the truth
    ("Answer: 1419 + 2", "1421"),
    ("Answer: 2842/2", "1421"),
    ("57?", "57"),
    ("Answer: 3 or 5", "5"),  # a hedge
    ("3, 5", "5"),
    ("-2, -174, 0", "-174, -2, 0"),  # a list in another order
    ("-174, -2", "-174, -2, 0"),  # a list cut short
    ("-174, -2, 0, 1", "-174, -2, 0"),
    ("Yes", "True"),  # the reference is True, written
    ("It is True", "True"),
    ("-0.18", "-2/11"),  # a fraction is written as the reference writes it
    ("-4/22", "-2/11"),
    ("The answer is 57.", "57"),  # the whole reply must be the answer (or an `Answer:` line)
    ("", "57"),
    ("57" * 200, "57"),
]

RIGHT = [
    ("57", "57"),
    (" 57.\n", "57"),
    ("Answer: 57", "57"),
    ("The gcd is the largest number dividing both.\nAnswer: 57", "57"),
    ("$57$", "57"),
    ("\\boxed{57}", "57"),
    ("**57**", "57"),
    ("57<|im_end|>", "57"),
    ("057", "57"),
    ("0.30", "0.3"),
    ("-2/11", "-2/11"),
    ("\\frac{-2}{11}", "-2/11"),
    ("-174, -2, 0", "-174, -2, 0"),
    ("-174,-2,0", "-174, -2, 0"),
    ("12, 5, 0.3, -0.18, -2/11", "12, 5, 0.3, -0.18, -2/11"),
    ("True", "True"),
    ("false", "False"),
    ("-l**2 - 109*l + 55", "-l**2 - 109*l + 55"),
    ("-l**2-109*l+55", "-l**2 - 109*l + 55"),
    ("12:39 AM", "12:39 AM"),
    ("a", "a"),
]


@pytest.mark.parametrize(("reply", "truth"), HOSTILE)
def test_hostile_replies_are_wrong(reply, truth):
    assert compute_score(reply, truth, "exact")["acc"] is False


@pytest.mark.parametrize(("reply", "truth"), RIGHT)
def test_the_answer_as_written_is_right(reply, truth):
    out = compute_score(reply, truth, "exact")
    assert out["acc"] is True and out["score"] == 1.0


def test_an_unparsable_reply_scores_minus_one_and_never_raises():
    for reply in ("", "   ", None, b"57", "\x00" * 10_000):
        assert compute_score(reply, "57", "exact")["score"] == -1.0


def test_a_benchmark_row_is_scored_by_its_own_metric_whatever_the_runs_mode():
    assert task_for("mathematics_dataset/numbers__gcd").name == "mathematics"
    assert task_for("math_dapo").name == task_for("").name == "dapo_math"
    spec = ScoringSpec(RewardSpec("math_verify"), 64, False, 16, 1.0, False, 1e-6, True)
    row = {"prompt_ids": [1], "ground_truth": "57", "data_source": "mathematics_dataset/numbers__gcd",
           "texts": ["The gcd is 57.", "57"], "response_ids": [[1] * 9, [1]],
           "rollout_logprobs": [[-0.1] * 9, [-0.1]], "finish_reasons": ["stop", "stop"], "policy_version": 0}  # fmt: skip
    assert score_group(dict(row), spec)["acc"] == [False, True]
    # The same reply in a row of another source is read by math_verify, which takes the number it states.
    assert score_group({**row, "data_source": "math_dapo"}, spec)["acc"] == [True, True]
