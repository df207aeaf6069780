"""The verifier against hostile input, in every mode and on both of its paths (in-process on the main
thread, the helper process off it): it never raises, never runs model text as code, scores the
pathological answers -1, gives the same verdict twice and on both paths, and each call is ended by the
code's own time budget within TIME_LIMIT_S. bench/verifier.py reports the worst wall time over the same
cases (`hostile_cases`) and over random ones."""

import builtins
import signal
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_ray.algo import reward
from dapo_ray.algo.reward import INVALID, TIME_LIMIT_S, VERIFY_BUDGET_S, compute_score

MINUS = -1.0
SYMBOLIC = ("Answer: \\sqrt{8}", "2\\sqrt{2}", "math_verify")  # not a number: Math-Verify's path, the helper's
EITHER = None  # the verdict may go either way (it must still be well formed and repeatable)


def hostile_cases(sentinel: Path) -> list[tuple[object, object, float | None]]:
    """(response, ground truth, expected score or EITHER). Code in answers tries to create `sentinel`."""
    code = f"__import__('os').system('touch {sentinel}')"
    return [
        # Code in the answer line, the box, free text, math and text mode.
        (f"Answer: {code}", "x+1", MINUS),
        (f"\\boxed{{{code}}}", "x+1", MINUS),
        (f"The answer is {code}", "x+1", MINUS),
        (f"Answer: ${code}$", "x+1", MINUS),
        (f"Answer: \\text{{{code}}}", "x+1", MINUS),
        (f'Answer: eval("{code}")', "x+1", MINUS),
        (f'so x = exec("{code}")', "x+1", MINUS),
        ("Answer: ().__class__.__base__.__subclasses__()", "x+1", MINUS),
        ("Answer: lambda: open('/etc/passwd').read()", "x+1", MINUS),
        ("Answer: {{7*7}}", "49", EITHER),
        # Numbers too big to compute.
        ("Answer: 10^10^10^10", "\\sqrt{3}", MINUS),
        ("Answer: 10^{10^{10^{10}}}", "\\sqrt{3}", MINUS),
        ("Answer: (10^10)!", "\\sqrt{3}", MINUS),
        ("Answer: (10^{10})!", "\\sqrt{3}", MINUS),
        ("Answer: 9**9**9**9", "\\sqrt{3}", MINUS),
        ("\\boxed{9^{9^{9^{9}}}}", "\\sqrt{3}", MINUS),
        ("The answer is 9**9**9**9", "\\sqrt{3}", MINUS),
        ("so the result is $(10^{10})!$", "\\sqrt{3}", MINUS),
        ("Answer: 10!!!!!!!!", "\\sqrt{3}", MINUS),
        ("Answer: \\binom{10^{9}}{10^{5}}", "\\sqrt{3}", MINUS),
        ("Answer: 2^{2^{2^{2^{2^{2}}}}}", "\\sqrt{3}", MINUS),
        ("Answer: 10^{10^{7}}", "\\sqrt{3}", MINUS),
        ("Answer: 10^{10^{6}} \\cdot 10^{10^{6}}", "10^{10^{7}}", MINUS),
        ("Answer: 10^{10^{10}}", "9^{9^{9^{9}}}", MINUS),
        ("Answer: e^{10^{10}}", "\\sqrt{3}", MINUS),
        ("Answer: \\sin(10^{10^{10}})", "\\sqrt{3}", MINUS),
        ("Answer: \\lfloor 10^{10^{7}} / 7 \\rfloor", "\\sqrt{3}", MINUS),
        ("Answer: " + "9" * 5000, "3", MINUS),
        ("Answer: 0." + "1" * 5000, "3", MINUS),
        # Deep nesting.
        ("Answer: " + "{" * 10_000, "3", MINUS),
        ("\\boxed{" * 10_000, "3", MINUS),
        ("\\boxed{" * 10_000 + "3" + "}" * 10_000, "3", EITHER),
        ("Answer: " + "(" * 10_000 + "3" + ")" * 10_000, "3", MINUS),
        ("$" + "\\sqrt{" * 5000 + "2" + "}" * 5000 + "$", "3", MINUS),
        ("Answer: " + "\\frac{" * 5000, "3", MINUS),
        ("Answer: " + "{" * 100 + "3" + "}" * 100, "3", EITHER),
        ("x^{" * 5000, "3", MINUS),
        # A megabyte.
        ("x" * 1_000_000, "3", MINUS),
        ("Answer: 3\n" * 100_000, "3", 1.0),
        ("<|im_end|>" * 100_000 + "x", "3", MINUS),
        ("Answer: 3" + "<|im_end|>" * 100_000, "3", EITHER),
        ("Answer: " + "9" * 1_000_000, "3", MINUS),
        ("$" * 1_000_000, "3", MINUS),
        ("\\boxed{" + "1" * 1_000_000 + "}", "3", MINUS),
        ("1+" * 500_000, "3", MINUS),
        ("The answer is " + "1 " * 500_000, "3", MINUS),
        ("\x00" * 1_000_000, "3", MINUS),
        # Thousands of boxes.
        ("\\boxed{1}" * 5000, "1", EITHER),
        ("\\boxed{}" * 5000, "3", MINUS),
        ("\\boxed{" * 5000, "3", MINUS),
        ("\\boxed{9^{9^{9^{9}}}}" * 2000, "3", MINUS),
        # Control characters, NUL, lone surrogates, invalid UTF-8, bidi and BOM.
        ("Answer: 13\x00", "13", EITHER),
        ("Answer: \x00\x01\x02\x1b[2J", "3", MINUS),
        ("Answer: 1\ud8003", "3", MINUS),
        (b"Answer: \xff\xfe3".decode("utf-8", "surrogateescape"), "3", EITHER),
        ("\\boxed{\udcff}", "3", MINUS),
        ("Answer: \u202e3", "3", EITHER),
        ("\ufeffAnswer: 3", "3", EITHER),
        ("Answer: 3", "3\ud800", EITHER),
        # Unbalanced LaTeX.
        ("Answer: \\frac{1}{", "3", MINUS),
        ("\\boxed{\\frac{1}{2}", "3", MINUS),
        ("$\\left( 1 + $", "3", MINUS),
        ("Answer: \\begin{pmatrix} 1 & 2", "3", MINUS),
        ("Answer: }}}{{{", "3", MINUS),
        ("\\boxed{" + "}" * 100, "3", MINUS),
        ("$$$$$$", "3", MINUS),
        ("\\end{document}\\begin{", "3", MINUS),
        ("Answer: \\frac{\\frac{\\frac{}{}}{}}{}", "3", MINUS),
        ("Answer: \\sqrt[", "3", MINUS),
        # Ground truths and responses that are not text.
        ("Answer: None", None, MINUS),
        ("Answer: b'3'", b"3", MINUS),
        ("Answer: True", True, MINUS),
        ("Answer: 3", 3, 1.0),
        ("Answer: 0.5", 0.5, 1.0),
        ("Answer: nan", float("nan"), EITHER),
        ("Answer: 3", "3" * 100_000, MINUS),
        (None, "3", MINUS),
        (b"Answer: 3", "3", MINUS),
        (3, "3", MINUS),
    ]


def wall_time(call):
    start = time.perf_counter()
    out = call()
    return out, time.perf_counter() - start


def fastest(call, first_s: float) -> float:
    """`first_s`, or when it overran TIME_LIMIT_S the fastest of two more runs: a loaded machine can
    deschedule the process for longer than the slack left after the budget, which is not the code's doing."""
    if first_s < TIME_LIMIT_S:
        return first_s
    return min([first_s] + [wall_time(call)[1] for _ in range(2)])


def assert_well_formed(out) -> None:
    assert set(out) == {"score", "acc", "pred"}
    assert out["score"] in (1.0, -1.0) and out["acc"] is (out["score"] == 1.0)
    out["pred"].encode("utf-8")  # a str, and valid UTF-8: raises on a lone surrogate


@pytest.fixture(scope="module")
def off_main_thread():
    """Runs a call in a worker thread, where math_verify mode goes through the helper process (started
    and warmed up here, outside any timing)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        assert pool.submit(compute_score, *SYMBOLIC).result()["acc"] is True
        yield lambda call: pool.submit(call).result()


@pytest.mark.parametrize("mode", ["dapo", "dapo_strict", "math_verify"])
def test_hostile_inputs(mode, tmp_path, off_main_thread):
    sentinel = tmp_path / "pwned"
    compute_score(*SYMBOLIC[:2], mode)  # warm-up (imports) outside the timing
    worst = (0.0, None)
    for i, (response, ground_truth, expected) in enumerate(hostile_cases(sentinel)):
        what = f"case {i}: {str(response)[:60]!r} vs {str(ground_truth)[:20]!r} in {mode}"

        def call(response=response, ground_truth=ground_truth):
            return compute_score(response, ground_truth, mode)

        out, first_s = wall_time(call)
        again, again_s = wall_time(call)
        helper_out, helper_s = off_main_thread(lambda call=call: wall_time(call))
        if helper_out["score"] != out["score"]:
            # Near the helper's deadline a verdict depends on the machine's load (the helper process can
            # be descheduled past it): ask once more, so only a mismatch that repeats fails.
            helper_out, _ = off_main_thread(lambda call=call: wall_time(call))
        for verdict in (out, again, helper_out):
            assert_well_formed(verdict)
        # The score repeats; in math_verify mode `pred` can differ when one call ran out of time near the
        # budget (shown as [INVALID]) and the next, with warmer caches, did not.
        assert again["score"] == out["score"], f"{what}: not repeatable"
        assert helper_out["score"] == out["score"], f"{what}: off the main thread {helper_out} != {out}"
        if mode != "math_verify":
            assert again == out == helper_out, what
        if expected is not None:
            assert out["score"] == expected, what

        def call_off_main_thread(call=call):
            return off_main_thread(call)

        seconds = max(fastest(call, first_s), fastest(call, again_s), fastest(call_off_main_thread, helper_s))
        assert seconds < TIME_LIMIT_S, f"{what}: {seconds:.3f} s"
        worst = max(worst, (max(first_s, again_s, helper_s), what), key=lambda w: w[0])
    assert not sentinel.exists()
    print(f"slowest call {worst[0]:.3f} s: {worst[1]}")


def test_model_text_never_reaches_eval_or_exec(tmp_path, monkeypatch):
    # sympy's parse_expr does eval code it builds from text; Math-Verify only hands it what its regex lets
    # through (digits and arithmetic). The spy records what eval/exec get: source text, or the names and
    # constants of code compiled from a string (imports, compiled from files, are left out).
    seen = []

    def spy(real):
        def wrapped(source, *args, **kwargs):
            if isinstance(source, str):
                seen.append(source)
            elif isinstance(source, types.CodeType) and source.co_filename == "<string>":
                seen.append(" ".join(map(str, source.co_names + source.co_consts)))
            return real(source, *args, **kwargs)

        return wrapped

    compute_score(*SYMBOLIC)  # warm-up (imports) before spying
    monkeypatch.setattr(builtins, "eval", spy(builtins.eval))
    monkeypatch.setattr(builtins, "exec", spy(builtins.exec))
    for response, ground_truth, _ in hostile_cases(tmp_path / "pwned")[:10]:
        for mode in ("dapo", "dapo_strict", "math_verify"):
            assert compute_score(response, ground_truth, mode)["score"] == -1.0 or ground_truth == "49"
    a = time.time_ns() % 9000 + 1000  # a fresh sum, past Math-Verify's parse cache
    # A number ground truth is never evaluated on the reply's behalf; Math-Verify's own verdict (what a
    # ground truth that is not a number gets) still evaluates the plain sum, which the spy must see.
    assert compute_score(f"The answer is {a}+4321", str(a + 4321), "math_verify")["acc"] is False
    assert reward._bounded_verdict(f"The answer is {a}+4321", str(a + 4321))["acc"] is True
    monkeypatch.undo()
    assert any(str(a) in source for source in seen), "the spy missed sympy's eval of the plain sum"
    assert not (tmp_path / "pwned").exists()
    attacker_words = ("__import__", "system", "open", "__class__", "lambda", "pwned")
    for source in seen:
        assert not any(word in source for word in attacker_words), source[:80]


def test_the_budget_ends_runaway_work():
    def spin():
        while True:
            pass

    def swallow_once_then_spin():
        try:
            spin()
        except BaseException:  # noqa: BLE001 - library code that catches everything
            pass
        spin()

    for work in (spin, swallow_once_then_spin, lambda: 10 ** (10**9)):
        out, seconds = wall_time(lambda work=work: reward._within_budget(0.2, work))
        assert out is None
        assert seconds < TIME_LIMIT_S
    assert reward._within_budget(0.2, lambda: 42) == 42


def test_the_budget_leaves_the_callers_alarm_as_it_found_it():
    fired = []

    def handler(signum, frame):
        fired.append(signum)

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 30.0)
    try:
        compute_score("Answer: 9^{9^{9^{9}}}", "\\sqrt{3}", "math_verify")  # runs until the budget ends it
        assert signal.getsignal(signal.SIGALRM) is handler
        assert 28.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 30.0 - VERIFY_BUDGET_S
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not fired


def test_a_helper_past_its_deadline_is_killed_and_replaced(monkeypatch, off_main_thread):
    # An answer that takes sympy its whole budget (0.5 s) against a deadline of 0.05 s: the reply cannot
    # come in time however the machine is loaded (with a deadline of 0, a fast reply could).
    monkeypatch.setattr(reward, "HELPER_DEADLINE_S", 0.05)
    out = off_main_thread(lambda: compute_score("Answer: (10^{10})!", "\\sqrt{3}", "math_verify"))
    assert out == {"score": -1.0, "acc": False, "pred": INVALID}
    assert reward._helper is None
    monkeypatch.undo()
    assert off_main_thread(lambda: compute_score(*SYMBOLIC))["acc"] is True


# Random math on both paths: well-formed expressions (towers, factorials, binomials grow fast, so some
# run into the budget) and pieces glued at random, behind the ways answers are introduced.
MATH_PIECES = [
    "Answer: ", "The answer is ", "\\boxed{", "{", "}", "$", "^", "^{", "!", "**", "9", "10", "3", "0.5", "(", ")",
    "\\frac{", "\\sqrt{", "\\binom{", "\\cdot", "e^{", "\\sin(", "x", "=", "+", "-", "/", " ", "\n", "\\pi",
    "<|im_end|>", "\x00", "\ud800", "9^{9^{9^{9}}}", "(10^{10})!",
]  # fmt: skip
math_expression = st.recursive(
    st.one_of(st.integers(0, 99).map(str), st.sampled_from(["x", "\\pi", "e"])),
    lambda inner: st.one_of(
        st.tuples(inner, st.sampled_from(["+", "-", "\\cdot", "/"]), inner).map(" ".join),
        st.tuples(inner, inner).map(lambda ab: f"{{{ab[0]}}}^{{{ab[1]}}}"),
        inner.map(lambda a: f"({a})!"),
        st.tuples(inner, inner).map(lambda ab: f"\\frac{{{ab[0]}}}{{{ab[1]}}}"),
        st.tuples(inner, inner).map(lambda ab: f"\\binom{{{ab[0]}}}{{{ab[1]}}}"),
        inner.map(lambda a: f"\\sqrt{{{a}}}"),
    ),
    max_leaves=6,
)
math_soup = st.one_of(
    st.tuples(
        st.sampled_from(
            [("Answer: ", ""), ("Answer: $", "$"), ("\\boxed{", "}"), ("The answer is $", "$."), ("", "")]
        ),
        math_expression,
    ).map(lambda wrap_expr: wrap_expr[0][0] + wrap_expr[1] + wrap_expr[0][1]),
    st.lists(st.sampled_from(MATH_PIECES), min_size=1, max_size=20).map("".join),
)
small_truths = st.sampled_from(["3", "\\frac{1}{2}", "10^{10}", "x^2+1", "\\pi"])


@settings(max_examples=100, deadline=None)
@given(response=math_soup, ground_truth=small_truths)
def test_math_verify_on_random_math_in_process(response, ground_truth):
    out, seconds = wall_time(lambda: compute_score(response, ground_truth, "math_verify"))
    assert_well_formed(out)
    assert fastest(lambda: compute_score(response, ground_truth, "math_verify"), seconds) < TIME_LIMIT_S


@settings(max_examples=100, deadline=None)
@given(response=math_soup, ground_truth=small_truths)
def test_math_verify_on_random_math_off_main_thread(response, ground_truth, off_main_thread):
    def call():
        return compute_score(response, ground_truth, "math_verify")

    out, seconds = off_main_thread(lambda: wall_time(call))
    assert_well_formed(out)
    assert fastest(lambda: off_main_thread(call), seconds) < TIME_LIMIT_S
