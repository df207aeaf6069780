"""Replies that try to game the scorers, in every mode; any change to a scorer runs against them.

A policy trained with the old `math_verify` learned to answer "What is 14 + 3?" with "14 + 3 = ?", which
Math-Verify evaluated to 17: a restated question, an expression equal to the truth, an assignment, a hedge,
the reference denied or inside a refusal, or the prompt echoed must never be paid, and the plain statements
of the answer must stay right.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_ray.algo.reward import MODES, compute_score
from dapo_ray.algo.stated import parse_number, stated_number, states_reference

HOSTILE = [
    # the restated question, in each shape the scorer reads
    ("14 + 3 = ?", "17"),
    ("Answer: 14 + 3", "17"),
    ("The answer is \\boxed{14+3}.", "17"),
    ("So the total is 9 + 8.", "17"),
    ("14 + 3", "17"),
    ("14+3=", "17"),
    ("$14 + 3$", "17"),
    ("The sum of 14 and 3.", "17"),
    ("14 plus 3", "17"),
    ("What is 14 + 3? Reply with the number only.", "17"),  # the prompt echoed
    ("What is 14 + 3?", "17"),
    # another expression equal to the truth
    ("Answer: 2*3", "6"),
    ("Answer: 10 + 7", "17"),
    ("Answer: 34/2", "17"),
    ("\\boxed{\\frac{34}{2}}", "17"),
    ("Answer: 3 \\times 6 - 1", "17"),
    ("Answer: 17 + 0", "17"),
    ("Answer: (14+3)", "17"),
    ("Answer: \\sqrt{289}", "17"),
    ("so x = 5!", "120"),
    ("Answer: 2/4", "\\frac{1}{2}"),
    ("Answer: 0.25 + 0.25", "0.5"),
    # an assignment whose right side is an expression
    ("x = 20 - 3", "17"),
    ("Answer: x = 20 - 3", "17"),
    ("y = 2 \\cdot 3", "6"),
    # hedges
    ("Answer: 17 or 18", "17"),
    ("It is 17 or 18.", "18"),
    ("17 or 18", "18"),
    ("Answer: 17, 18", "17"),
    ("I think 16, 17", "17"),
    ("Answer: 16 < x < 18", "17"),
    ("Maybe 17?", "17"),
    ("Answer: 17 \\pm 1", "17"),
    # the reference denied, or inside a refusal: it is written, but not as the answer
    ("The answer is not 17.", "17"),
    ("I cannot solve this, but it is not 17.", "17"),
    ("I'm sorry, I can't answer that. It isn't 17.", "17"),
    ("It isn\u2019t 17.", "17"),
    ("It is never 17.", "17"),
    ("17 is not the answer.", "17"),
    ("17 is wrong", "17"),
    ("Answer: not 17", "17"),
    ("Answer: It is not 17", "17"),
    ("Answer: 17 is wrong", "17"),
    ("Answer: 17 (not)", "17"),
    ("\\boxed{not 17}", "17"),
    ("It is not $17$.", "17"),
    ("It cannot be 17.", "17"),
    ("It is not equal to 17.", "17"),
    ("x \\neq 17", "17"),
    ("anything other than 17", "17"),
    ("It is not -3.", "-3"),
    ("It is 17, not 18.", "18"),  # the last number is denied; the reader does not look back past it
    # no answer at all
    ("I do not know.", "17"),
    ("", "17"),
]

# (reply, ground truth, the modes that read it: all three, or the free-text reader only)
CONTROLS = [
    ("Answer: 17", "17", MODES),
    ("Answer: $17$", "17", MODES),
    ("Answer: \\boxed{17}", "17", MODES),
    ("x = 14 + 3\nAnswer: 17", "17", MODES),
    ("Answer: 14 + 3 = 17", "17", ("dapo", "dapo_strict", "math_verify")),  # `exact`: the line must be the answer
    ("Answer: 017", "17", ("dapo", "math_verify")),
    ("Answer: 17.", "17", ("dapo", "math_verify")),
    ("Answer: 17<|im_end|>", "17", ("dapo", "math_verify")),
    ("Answer: 0.5", "\\frac{1}{2}", ("dapo", "math_verify")),
    ("Answer: 1/2", "0.5", ("dapo", "math_verify")),
    ("Answer: \\frac{-2}{11}", "-2/11", ("dapo", "math_verify")),
    ("17", "17", ("math_verify",)),
    ("14 + 3 = 17", "17", ("math_verify",)),
    ("The sum is 17.", "17", ("math_verify",)),
    ("17<|im_end|>", "17", ("math_verify",)),
    ("\\boxed{119}", "119", ("math_verify",)),
    ("The answer is \\boxed{17}.", "17", ("math_verify",)),
    ("x = -3", "-3", ("math_verify",)),
    ("The difference is \u22123.", "-3", ("math_verify",)),
    ("so x = \\frac{1}{2}", "0.5", ("math_verify",)),
    ("14 + 3 = 17.0", "17", ("math_verify",)),
    ("The total is 1,000 apples.", "1000", ("math_verify",)),
    ("The roots sum to -5.", "-5", ("math_verify",)),
    ("Final answer: the distance is 12 km", "12", ("math_verify",)),
    ("Answer: the sum is 17", "17", ("math_verify",)),
    ("The discount is 25%.", "25", ("math_verify",)),
    ("Answer: 25\\%", "25", ("math_verify",)),
    # a negation elsewhere in the reply denies nothing
    ("It is not 16 but 17.", "17", ("math_verify",)),
    ("I am not sure, but the sum is 17.", "17", ("math_verify",)),
    ("No, it is 17.", "17", ("math_verify",)),
    ("Not 16: the answer is 17.", "17", ("math_verify",)),
    ("It is not odd; it is 17.", "17", ("math_verify",)),
    # a ground truth that is not a number keeps Math-Verify's symbolic equivalence
    ("Answer: \\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt{3}}{2}", MODES),
    ("Answer: \\sqrt{3}/2", "\\frac{\\sqrt{3}}{2}", ("math_verify",)),
    ("Answer: [1, 2]", "[1,2]", ("math_verify",)),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reply, truth", HOSTILE)
def test_hostile_replies_score_wrong_in_every_mode(reply, truth, mode):
    out = compute_score(reply, truth, mode)
    assert out["acc"] is False and out["score"] == -1.0, out


@pytest.mark.parametrize("reply, truth, modes", CONTROLS)
def test_plain_statements_of_the_answer_stay_right(reply, truth, modes):
    for mode in modes:
        assert compute_score(reply, truth, mode)["acc"] is True, mode


@pytest.mark.parametrize("reply, truth", HOSTILE)
def test_no_hostile_reply_states_a_number_equal_to_the_truth(reply, truth):
    assert stated_number(reply) != parse_number(truth)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 999), st.integers(0, 999), st.sampled_from(["+", "-", "*"]),
       st.sampled_from(["{q} = ?", "Answer: {q}", "\\boxed{{{q}}}", "So it is {q}.", "x = {q}", "What is {q}?"]))  # fmt: skip
def test_no_restated_question_is_paid(a, b, op, shape):
    truth = str({"+": a + b, "-": a - b, "*": a * b}[op])
    reply = shape.format(q=f"{a} {op} {b}")
    for mode in MODES:
        assert compute_score(reply, truth, mode)["acc"] is False, (reply, mode)


@settings(max_examples=150, deadline=None)
@given(st.integers(-999, 999), st.sampled_from(["{v}", "{q} = {v}", "The answer is {v}.", "Answer: {v}"]))
def test_a_stated_sum_is_paid_and_states_the_reference(v, shape):
    reply = shape.format(q="4 + 5", v=v)
    out = compute_score(reply, str(v), "math_verify")
    assert out["acc"] is True and out["pred"] == str(v)
    assert states_reference(reply, str(v))


@settings(max_examples=150, deadline=None)
@given(st.integers(-999, 999),
       st.sampled_from(["The answer is not {v}.", "It isn't {v}.", "{v} is not the answer.", "Answer: not {v}",
                        "I cannot solve this, but it is not {v}.", "It is never ${v}$.", "Answer: {v} is wrong"]))  # fmt: skip
def test_a_denied_reference_is_never_paid(v, shape):
    reply = shape.format(v=v)
    for mode in MODES:
        assert compute_score(reply, str(v), mode)["acc"] is False, (reply, mode)


def test_a_denied_boxed_answer_is_not_paid():
    assert compute_score("The answer is not \\boxed{17}.", "17", "math_verify")["acc"] is False


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789+-*/=?. xabAnswer:\\{}boxed,or", max_size=40), st.integers(-30, 30))
def test_a_number_truth_is_paid_only_when_the_reply_contains_it(reply, truth):
    # The hack alarm's premise: under the fixed scorers a rewarded reply always contains the reference.
    for mode in MODES:
        if compute_score(reply, str(truth), mode)["acc"]:
            assert states_reference(reply, str(truth)), (reply, mode)


@pytest.mark.parametrize(
    "reply, truth, states",
    [("14 + 3 = ?", "17", False), ("14 + 3 = 17", "17", True), ("\\boxed{17}", "17", True), ("17.0", "17", True),
     ("x = -3", "-3", True), ("x = 3", "-3", False), ("\\frac{\\sqrt{3}}{2}", "\\dfrac{\\sqrt{3}}{2}", True),
     ("017 apples", "17", True), ("170", "17", False)],
)  # fmt: skip
def test_states_reference(reply, truth, states):
    assert states_reference(reply, truth) is states


def test_the_worked_examples_of_the_docstrings():
    import doctest

    import dapo_ray.algo.stated

    assert doctest.testmod(dapo_ray.algo.stated).failed == 0
