import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_ray.algo.reward import INVALID, compute_score, last_boxed, normalize_final_answer

ALL_MODES = ["dapo", "dapo_strict", "math_verify"]


@pytest.mark.parametrize(
    "response, gt, dapo, strict, mv",
    [
        ("x = 13\nAnswer: 13", "13", True, True, True),
        ("Answer: $13$", "13", True, True, True),
        ("Answer: \\boxed{13}", "13", True, True, True),
        ("the answer is \\boxed{13}", "13", False, False, True),  # no Answer: line -> DAPO says invalid
        ("Answer: 13<|im_end|>", "13", True, False, True),
        ("Answer: 13<|im_end|><|endoftext|>", "13", True, False, True),
        ("Answer: 1,000", "1000", True, True, True),
        ("Answer: 1{,}000", "1000", True, True, True),
        ("Answer: 2,500", "2500", True, True, True),  # a thousands separator
        ("Answer: 1,000,000", "1000000", True, True, True),
        ("Answer: 2,5", "25", False, True, False),  # a list or a decimal comma: DAPO's (and verl's) bug
        ("Answer: 25", "2,5", False, True, False),
        ("Answer: 12,34", "1234", False, True, False),
        ("Answer: 2,50", "250", False, True, False),
        ("Answer: 2, 5", "25", False, True, False),
        ("Answer: 2,5", "2,5", True, True, True),
        ("Answer: 025", "25", True, False, True),  # leading zeros: value equality (documented)
        ("Answer: 25", "025", True, False, True),
        ("Answer: 13.", "13", True, False, True),
        ("Answer: 12", "13", False, False, False),
        ("Answer: \\frac{1}{2}", "0.5", True, False, True),  # a number by value (dapo)
        ("Answer: 130", "13", False, False, False),
        ("Answer: 7\nAnswer: 13", "13", True, True, True),  # the last Answer line counts
        ("Answer: 13 dollars", "13", True, True, True),
        ("no answer at all", "13", False, False, False),
        ("", "13", False, False, False),
    ],
)
def test_modes_on_known_cases(response, gt, dapo, strict, mv):
    assert compute_score(response, gt, "dapo")["acc"] is dapo
    assert compute_score(response, gt, "dapo_strict")["acc"] is strict
    assert compute_score(response, gt, "math_verify")["acc"] is mv


def test_score_shape_matches_verl():
    out = compute_score("Answer: 5", "5")
    assert out == {"score": 1.0, "acc": True, "pred": "5"}
    out = compute_score("nothing", "5")
    assert out == {"score": -1.0, "acc": False, "pred": INVALID}


def test_only_last_300_chars_are_read():
    # DAPO reads the tail only: an Answer line far from the end is not seen.
    response = "Answer: 13\n" + "x" * 400
    assert compute_score(response, "13", "dapo_strict")["acc"] is False


def test_normalisation_matches_dapo():
    assert normalize_final_answer("\\$1{,}000 dollars") == "1000"
    assert normalize_final_answer("x = \\boxed{42}") == "42"
    assert normalize_final_answer("\\text{(B)}") == "(B)"


def test_commas_are_dropped_only_between_groups_of_three_digits():
    assert normalize_final_answer("2,5") == "25"  # DAPO verbatim (dapo_strict)
    assert normalize_final_answer("2,5", thousands_only=True) == "2,5"
    assert normalize_final_answer("2,500", thousands_only=True) == "2500"
    assert normalize_final_answer("12,345,678", thousands_only=True) == "12345678"
    assert normalize_final_answer("1,0000", thousands_only=True) == "1,0000"
    assert normalize_final_answer(",500", thousands_only=True) == ",500"


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**9), st.sets(st.integers(1, 9), max_size=3))
def test_a_comma_answer_matches_its_integer_only_as_thousands_separators(n, cuts):
    digits = str(n)
    cuts = sorted(c for c in cuts if c < len(digits))
    written = ",".join(digits[i:j] for i, j in zip([0, *cuts], [*cuts, len(digits)], strict=True))
    grouped = f"{n:,}"
    for mode in ("dapo", "math_verify"):
        assert compute_score(f"Answer: {written}", digits, mode)["acc"] is (written in (digits, grouped)), mode
    assert compute_score(f"Answer: {written}", digits, "dapo_strict")["acc"] is True


def test_last_boxed_nested():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unbalanced") is None


def test_bad_mode_names_choices():
    with pytest.raises(ValueError, match="dapo_strict"):
        compute_score("Answer: 1", "1", mode="verbatim")


def test_never_executes_model_text(tmp_path):
    marker = tmp_path / "pwned"
    attack = f"Answer: __import__('os').system('touch {marker}')"
    for mode in ALL_MODES:
        assert compute_score(attack, "0", mode)["score"] == -1.0
    assert not marker.exists()


@pytest.mark.parametrize("answer", ["9^{9^{9^{9}}}", "(10^{10})!", "10!!!!!!!!", "\\frac{" * 50])
def test_pathological_answers_are_bounded(answer):
    import time

    t0 = time.time()
    out = compute_score(f"Answer: {answer}", "\\sqrt{3}", "math_verify")  # not a number: Math-Verify's path
    assert out["score"] == -1.0
    assert time.time() - t0 < 3.0


def test_math_verify_off_the_main_thread():
    # Math-Verify's SIGALRM timeout fails outside the main thread; the scorer must still work there.
    results = {}

    def work():
        results["ok"] = compute_score("Answer: \\sqrt{8}", "2\\sqrt{2}", "math_verify")
        results["bad"] = compute_score("Answer: 3", "2\\sqrt{2}", "math_verify")

    t = threading.Thread(target=work)
    t.start()
    t.join(60)
    assert results["ok"]["acc"] is True
    assert results["bad"]["acc"] is False


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=600), st.text(max_size=20))
def test_never_raises_dapo(response, gt):
    for mode in ("dapo", "dapo_strict"):
        out = compute_score(response, gt, mode)
        assert out["score"] in (1.0, -1.0) and isinstance(out["pred"], str)


@settings(max_examples=60, deadline=None)
@given(st.from_regex(r"Answer: [0-9+\-*/^(){}\\a-z!.,$ ]{0,40}", fullmatch=True))
def test_never_raises_math_verify(response):
    for truth in ("12", "2\\sqrt{3}"):  # a number (read as stated) and not one (Math-Verify)
        out = compute_score(response, truth, "math_verify")
        assert out["score"] in (1.0, -1.0)


def test_non_string_response_scores_minus_one():
    assert compute_score(None, "1")["score"] == -1.0  # type: ignore[arg-type]
