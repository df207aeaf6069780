"""Answer verification: the +1 / -1 correctness reward of DAPO Eq. 7.

`compute_score(response, ground_truth, mode=...)` returns `{"score", "acc", "pred"}`, the same shape as
verl's `math_dapo.compute_score`, so a user can swap scorers without touching anything else.

Modes
-----
``dapo_strict``
    DAPO's own scorer, verbatim: look at the last 300 characters of the response, take the last line of
    the form ``Answer: ...``, normalise it Minerva-style (strip units, ``$``, ``\\text{}``, ``\\boxed{}``,
    every comma of an answer made of digits and commas...) and compare strings with the normalised
    ground truth. Use it to re-run the paper's numbers exactly, bug included: ``Answer: 2,5`` is
    correct for ground truth 25 (verl's ``math_dapo`` shares it).
``dapo`` (default)
    ``dapo_strict`` plus five fixes for failures users report. The first four only accept answers
    DAPO wrongly rejects, and none of them can turn a wrong answer right:
      * trailing special tokens (``<|im_end|>``, ``<|endoftext|>``, ``</s>``) are removed first, so
        ``Answer: 13<|im_end|>`` is 13, not ``13<|im_end|>``;
      * a trailing full stop is dropped (``Answer: 13.`` is 13);
      * plain integers are compared by value, so leading zeros do not matter: AIME writes answers as three
        digits, and ``Answer: 025`` is correct for ground truth ``25`` (strict mode says wrong);
      * when the ground truth is a number, an answer written as a number is compared by value
        (``0.5``, ``1/2`` and ``\\frac{1}{2}`` are one number; ``17.0`` is 17): see `stated.parse_number`.
    The fifth only rejects answers DAPO wrongly accepts:
      * a comma is dropped only as a thousands separator, between groups of three digits (``2,500`` is
        2500); otherwise the answer is a list or has a decimal comma, and ``2,5``, ``12,34`` or ``2,50``
        do not match 25, 1234 or 250 (strict mode says they do).
``math_verify``
    Reads answers without an ``Answer:`` line too. The answer is the ``Answer:`` line if there is one,
    else the last ``\\boxed{}``, else (free text) what the reply states last.
      * **A ground truth that is a number** (an integer, a decimal or a fraction: every DAPO-Math-17k
        and AIME answer, every synthetic task's) is matched only by the number the reply states,
        written as a number and compared by value (`dapo_ray.algo.stated`): ``Answer: 17``, ``\\boxed{17}``,
        ``14 + 3 = 17``, ``The sum is 17.``, ``0.5`` for ``\\frac{1}{2}``. Nothing is evaluated on the
        reply's behalf: ``14 + 3 = ?``, ``Answer: 14 + 3``, ``\\boxed{14+3}``, ``So the total is 9 + 8.``,
        ``Answer: 34/2``, ``x = 20 - 3`` state no number and are wrong, however they evaluate; so is a
        hedge (``Answer: 17 or 18``, ``It is 17 or 18.``). Math-Verify is not called.
      * **Any other ground truth** (``\\frac{\\sqrt{3}}{2}``, intervals, sets, expressions): correct when
        ``dapo`` (with its comma rule) says so, or when Math-Verify (HF, sympy-based) finds the answer
        equivalent. In free text the answer is the last one Math-Verify's own extraction finds in the
        last 300 characters (its default LaTeX and plain-expression configs). It reads ``2,5`` as the set
        {2, 5}, never as 25. Slower (~ms per response).
    Why: a scorer that evaluates expressions pays a policy for restating the question, and one did
    ("14 + 3 = ?" for "What is 14 + 3?": 99.6% "right" by Math-Verify, 1.8% stating the sum;
    docs/RESULTS.md). Tests that try to game every mode: tests/algo/test_reward_hostile.py.

``exact``
    The Mathematics Dataset's own metric (Saxton et al. 2019; `dapo_ray.tasks.mathematics`): the answer is the
    ``Answer:`` line, or else **the whole reply** (trimmed of spaces, a final full stop, ``$...$``,
    ``\\boxed{}`` or ``**`` around it), and it must be the reference: numbers by value as written
    (``-2/11``, ``0.30`` for ``0.3``; never an expression), lists item by item in order, ``True`` /
    ``False`` in any case, anything else (``-l**2 - 109*l + 55``, ``12:39 AM``, ``a``) as the same text
    without spaces. Not "the last number of the reply": in gcd, comparison and k-th-biggest questions
    the question's own last number is often the answer, and a reply restating the question would be paid.
    Every row whose ``data_source`` is ``mathematics_dataset/...`` is scored this way (its task's scorer:
    `dapo_ray.tasks`, which picks a row's scorer by its ``data_source``).

Safety, for any input in every mode: no exception escapes, no model text is run as code, and a call
returns within `TIME_LIMIT_S` (after a process's first ``math_verify`` call, which imports and warms up
sympy, and off the main thread starts the helper: seconds, once). A response with no parsable answer, a
non-string response, or a ground truth that is neither text nor a number scores -1 with
``pred = "[INVALID]"``.
  * ``dapo`` modes only do linear-time string work on the last 300 characters (and a linear scan for
    trailing special tokens).
  * Math-Verify only sees the 300-character tail, an extracted answer is cut to `MAX_ANSWER_CHARS`,
    and its plain-expression parser (sympy's ``parse_expr``, which uses ``eval``) only receives digits
    and arithmetic operators, by Math-Verify's extraction regex.
  * sympy's work is cut after `VERIFY_BUDGET_S` (``10^{10^{10}}``, ``(10^{10})!``) and scores -1, like
    any exception. Math-Verify's own timeouts use whole-second ``signal.alarm`` (calls took 1.02 s), so
    the scorer turns them off and runs its own sub-second timer instead (`_within_budget`). An answer
    that honestly needs longer (none of DAPO's) scores -1 as well, and near the budget its verdict
    can depend on the machine's load.
"""

from __future__ import annotations

import functools
import json
import numbers
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Literal, TypedDict, TypeVar

from dapo_ray.algo.stated import denied, parse_number, stated_answer, stated_number

Mode = Literal["dapo", "dapo_strict", "math_verify", "exact"]
MODES: tuple[str, ...] = ("dapo", "dapo_strict", "math_verify", "exact")

INVALID = "[INVALID]"
TAIL_CHARS = 300  # DAPO scores only the last 300 characters of a response.
MAX_ANSWER_CHARS = 200  # Longest extracted answer handed to sympy (bounds parse time).
MAX_GROUND_TRUTH_CHARS = 1000  # DAPO's normalisation is quadratic in length; DAPO-Math-17k's longest is 23.
TIME_LIMIT_S = 1.0  # The promise: one call, overhead included (tests/unit/test_verifier_hostile.py).
VERIFY_BUDGET_S = 0.5  # sympy's share of it; the rest covers the signal's latency and the helper's pipe.
HELPER_DEADLINE_S = 0.85  # Off the main thread: a helper that has not answered by then is killed.
HELPER_START_TIMEOUT_S = 120.0  # The helper's one-off start (importing sympy) on a busy machine.

_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_TRAILING_TOKEN_RE = re.compile(r"(?:<\|[^|<>\n]{1,40}\|>|</s>|<eos>|<pad>)\Z")
_LONGEST_TOKEN = 44  # "<|" + 40 characters + "|>"


class Score(TypedDict):
    score: float
    acc: bool
    pred: str


def _invalid() -> Score:
    return {"score": -1.0, "acc": False, "pred": INVALID}


# --- DAPO's Minerva-style normalisation (verl: verl/utils/reward_score/math_dapo.py) ---------------

_SUBSTITUTIONS = [
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""),
    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
]  # fmt: skip
_REMOVED_EXPRESSIONS = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
    r",\!", "{,}", '"', "\\dots",
]  # fmt: skip


_THOUSANDS_RE = re.compile(r"\d{1,3}(?:,\d{3})+")


def normalize_final_answer(answer: str, thousands_only: bool = False) -> str:
    """DAPO's normalisation of an extracted answer, verbatim. `"\\$1{,}000 dollars"` -> `"1000"`.

    DAPO drops every comma of an answer made of digits and commas, so `2,5` becomes `25`.
    `thousands_only` (the `dapo` and `math_verify` modes) drops them only where they separate groups of
    three digits (`2,500` -> `2500`): `2,5`, `12,34` or `2,50` are a list or a decimal comma and stay."""
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in _REMOVED_EXPRESSIONS:
        answer = answer.replace(expr, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit() and (not thousands_only or _THOUSANDS_RE.fullmatch(answer)):
        answer = answer.replace(",", "")
    return answer.strip()


def strip_special_tokens(text: str) -> str:
    """Remove trailing chat special tokens: `"Answer: 13<|im_end|>"` -> `"Answer: 13"`.

    Strips the run of tokens (and the whitespace after it) one token at a time from the end, in linear
    time; the one-regex form `(token)+ whitespace* $` backtracks quadratically: hours on a 1 MB response
    of special tokens followed by one other character."""
    body = text.rstrip()
    end = len(body)
    while match := _TRAILING_TOKEN_RE.search(body, max(0, end - _LONGEST_TOKEN), end):
        end = match.start()
    return body[:end] if end < len(body) else text


def extract_answer_line(text: str) -> str | None:
    """The text after the last `Answer:` in `text`, up to the end of that line; None if there is none."""
    found = _ANSWER_RE.findall(text)
    return found[-1] if found else None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (nested braces allowed); None if absent or unbalanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _canonical_integer(s: str) -> str:
    """`"025"` -> `"25"`, `"-0"` -> `"0"`; anything that is not a plain integer is returned unchanged."""
    if re.fullmatch(r"[+-]?\d+", s):
        return str(int(s))
    return s


def _dapo(response: str, ground_truth: str, strict: bool) -> Score:
    if not strict:
        response = strip_special_tokens(response)
    tail = response[-TAIL_CHARS:]
    line = extract_answer_line(tail)
    pred = normalize_final_answer(line, thousands_only=not strict) if line is not None else INVALID
    gt = normalize_final_answer(ground_truth, thousands_only=not strict)
    if not strict and line is not None:
        pred = _canonical_integer(pred.rstrip("."))
        gt = _canonical_integer(gt)
        truth, value = parse_number(gt), stated_answer(pred)
        if truth is not None and value is not None:  # a number compared by value: 0.5 = 1/2 = \frac{1}{2}
            return _verdict(value == truth, str(value))
    return _verdict(pred == gt, pred)


_PROSE_RE = re.compile(r"[A-Za-z]{2,}")  # an answer in words, read as free text; `1#3` is not


def _verdict(acc: bool, pred: str) -> Score:
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


def _stated(tail: str, truth) -> Score:
    """A number ground truth `truth` against the number the reply states (`dapo_ray.algo.stated`): the
    `Answer:` line (or the last `\\boxed{}`) when it is a number, or when written in words the number it
    states read as free text; with neither, the free text's last number standing alone. An expression is never evaluated:
    `Answer: 14 + 3` is wrong for 17, and its `pred` is `14+3`."""
    answer = extract_answer_line(tail)
    if answer is None:
        answer = last_boxed(tail)
        if answer is not None:  # `The answer is not \boxed{17}.` denies what it boxes
            start = tail.rfind("\\boxed{")
            if denied(tail[:start], tail[start + len("\\boxed{") + len(answer) + 1 :]):
                return _invalid()
    if answer is None:
        value = stated_number(tail)
        return _invalid() if value is None else _verdict(value == truth, str(value))
    text = normalize_final_answer(answer, thousands_only=True)
    value = stated_answer(text)
    if value is None and _PROSE_RE.search(answer):  # `Answer: the distance is 12 km` states 12
        value = stated_number(answer)
    if value is None:
        return _invalid() if not text else _verdict(False, text[:MAX_ANSWER_CHARS])
    return _verdict(value == truth, str(value))


# --- Math-Verify, bounded in time ----------------------------------------------------------------------


def _sympy_verdict(tail: str, ground_truth: str) -> Score:
    """Math-Verify's verdict on the answer in `tail` (unbounded in time: see `_bounded_verdict`)."""
    from math_verify import parse, verify  # lazy: pulls in sympy and antlr

    line = extract_answer_line(tail)
    answer = line if line is not None else last_boxed(tail)
    if answer is None:
        # Free-form text ("The answer is 42"): Math-Verify's own extraction, default configs (LaTeX, then
        # plain expressions), takes the last answer it finds.
        pred = parse(tail, parsing_timeout=None)
    elif not answer.strip():
        return _invalid()
    else:
        answer = answer.strip()[:MAX_ANSWER_CHARS]
        # Math-Verify finds math inside $...$ or \boxed{}; wrap a bare answer so `13` and `\frac{1}{2}` parse.
        if "$" not in answer and "\\boxed" not in answer:
            answer = f"${answer}$"
        pred = parse(answer, parsing_timeout=None)
    if not pred:
        return _invalid()
    gold = parse(f"${ground_truth}$", parsing_timeout=None)
    acc = bool(verify(gold, pred, timeout_seconds=None))
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": str(pred[-1])}


class _OutOfTime(BaseException):
    """The budget ran out. A BaseException, so that sympy's many `except Exception` cannot swallow it."""


T = TypeVar("T")


def _within_budget(budget_s: float, fn: Callable[..., T], *args) -> T | None:
    """`fn(*args)`, or None when it has not returned within `budget_s` seconds. Main thread only.

    A SIGALRM timer interrupts `fn` between bytecodes, which also stops CPython's big-integer powers
    (`10**10**10` checks for signals); it repeats every 50 ms in case library code swallows one, and the
    handler raises only while `fn` is on the stack, so a late alarm cannot escape into the caller. A
    timer the caller had running (pytest-timeout, say) is given back what is left of it."""

    def run():
        return fn(*args)

    def on_alarm(signum, frame):
        while frame is not None:
            if frame.f_code is run.__code__:
                raise _OutOfTime
            frame = frame.f_back

    start = time.monotonic()
    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, budget_s, 0.05)
    try:
        return run()
    except _OutOfTime:
        return None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay:
            left = max(old_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, old_interval)


@functools.cache
def _load_math_verify() -> None:
    """Import Math-Verify and verify a few answers of each kind once: first uses import parts of sympy
    (sets, intervals, evalf) for up to ~0.5 s, a one-off cost that must not eat a call's budget."""
    from math_verify import grader, parser

    # Its timeouts are off (whole-second alarms); say so once here rather than warn in every process.
    parser.TIMEOUT_WARNING_SHOWN = grader.TIMEOUT_WARNING_SHOWN = True
    for tail, ground_truth in [
        ("Answer: 0.5", "\\frac{1}{2}"), ("Answer: \\sqrt{8}", "2\\sqrt{2}"), ("We get 3/4.", "0.75"),
        ("Answer: x \\in [1, 2]", "[1,2]"), ("Answer: 1 < x < 2", "(1,2)"), ("Answer: \\{2, 1\\}", "\\{1,2\\}"),
        ("Thus $x^2+1$", "x^2+1"), ("Answer: 10\\%", "0.1"), ("so x = 5!", "120"), ("Answer: \\pi", "3.14"),
    ]:  # fmt: skip
        _sympy_verdict(tail, ground_truth)


def _forget_interrupted_work() -> None:
    """Empty sympy's and Math-Verify's caches after a timeout: an interrupted computation can leave
    half-evaluated objects in them (assumptions stored as unknown), and no later verdict may depend on
    what an earlier call happened to get through."""
    from math_verify import parser
    from sympy.core.cache import clear_cache

    clear_cache()
    for cached in (parser.parse_latex_cached, parser.parse_expr_cached, parser.extract_latex):
        cached.cache_clear()


def _bounded_verdict(tail: str, ground_truth: str) -> Score:
    """`_sympy_verdict` cut at VERIFY_BUDGET_S; out of time scores -1. Main thread only."""
    _load_math_verify()
    verdict = _within_budget(VERIFY_BUDGET_S, _sympy_verdict, tail, ground_truth)
    if verdict is None:
        _forget_interrupted_work()
        return _invalid()
    return verdict


# The SIGALRM timer only works in the main thread; elsewhere (Ray actors with concurrency, thread pools)
# we ask one helper process, whose main thread can use it, over a pipe of JSON lines. The helper runs
# this file as a script: importing the package would pull in torch and take many seconds to start.
# If the helper overruns anyway (a single C call that outlasts the budget) it is killed by the deadline.
_helper: subprocess.Popen | None = None
_helper_lock = threading.Lock()


def _start_helper() -> subprocess.Popen | None:
    """A helper that has said it is ready (Math-Verify imported, warmed up), or None if it did not."""
    helper = subprocess.Popen(
        [sys.executable, "-P", __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
    )
    ready, _, _ = select.select([helper.stdout], [], [], HELPER_START_TIMEOUT_S)
    if ready and helper.stdout.readline().strip() == "ready":
        return helper
    helper.kill()
    helper.wait()
    return None


def close_helper() -> None:
    """Stop this process's Math-Verify helper, if one runs (it ends by itself when this process exits and
    its pipe closes; a test suite stops it before checking that nothing it started is still running)."""
    global _helper
    with _helper_lock:
        if _helper is not None:
            _helper.kill()
            _helper.wait()
            for pipe in (_helper.stdin, _helper.stdout):
                pipe.close()
            _helper = None


def _verdict_from_helper(tail: str, ground_truth: str) -> Score:
    """`_bounded_verdict` in the helper. Concurrent callers take turns; the deadline starts at a turn."""
    global _helper
    with _helper_lock:
        if _helper is None or _helper.poll() is not None:
            _helper = _start_helper()  # one-off (or after a kill), outside the per-call deadline
            if _helper is None:
                return _invalid()
        deadline = time.monotonic() + HELPER_DEADLINE_S
        _helper.stdin.write(json.dumps([tail, ground_truth]) + "\n")
        _helper.stdin.flush()
        ready, _, _ = select.select([_helper.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if ready:
            line = _helper.stdout.readline()
            if line:
                return json.loads(line)
        _helper.kill()
        _helper.wait()
        _helper = None
        return _invalid()


def _serve() -> None:
    """The helper's loop: "ready" once warmed up, then one `[tail, ground_truth]` JSON line in, one Score
    JSON line out. Replies go to a copy of the pipe; anything a library prints goes to stderr instead,
    so it cannot put the replies out of step."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    _load_math_verify()
    replies.write("ready\n")
    replies.flush()
    for line in sys.stdin:
        try:
            out = _bounded_verdict(*json.loads(line))
        except Exception:  # noqa: BLE001
            out = _invalid()
        replies.write(json.dumps(out) + "\n")
        replies.flush()


def _math_verify(response: str, ground_truth: str) -> Score:
    tail = strip_special_tokens(response)[-TAIL_CHARS:]
    truth = parse_number(ground_truth)
    if truth is not None:
        return _stated(tail, truth)
    by_string = _dapo(response, ground_truth, strict=False)
    if by_string["acc"]:
        return by_string
    if threading.current_thread() is threading.main_thread():
        return _bounded_verdict(tail, ground_truth)
    return _verdict_from_helper(tail, ground_truth)


_WRAPPERS = (("$", "$"), ("\\boxed{", "}"), ("**", "**"), ("\\(", "\\)"))


def _trimmed(answer: str) -> str:
    """An answer without the spaces, final full stop and one wrapper (`$`, `\\boxed{}`, `**`) around it."""
    answer = answer.strip().removesuffix(".").strip()
    for start, end in _WRAPPERS:
        if answer.startswith(start) and answer.endswith(end) and len(answer) >= len(start) + len(end):
            return answer[len(start) : len(answer) - len(end)].strip().removesuffix(".").strip()
    return answer


def _same_item(answer: str, truth: str) -> bool:
    value = parse_number(truth)
    if value is not None:
        return parse_number(answer) == value
    if truth in ("True", "False"):
        return answer.lower() == truth.lower()
    return "".join(answer.split()) == "".join(truth.split())


def _exact(response: str, ground_truth: str) -> Score:
    """The Mathematics Dataset's exact match (module docstring, ``exact``): the `Answer:` line or the whole
    reply must be the reference; a list is compared item by item."""
    text = strip_special_tokens(response)
    line = extract_answer_line(text[-TAIL_CHARS:])
    answer = _trimmed(line if line is not None else text)
    if not answer:
        return _invalid()
    pred = answer[:MAX_ANSWER_CHARS]
    if len(answer) > TAIL_CHARS:
        return _verdict(False, pred)
    truth = ground_truth.strip()
    if "," in truth and parse_number(truth) is None:  # `12, 5, 0.3`: a list, in order
        items, truths = answer.split(","), truth.split(",")
        same = len(items) == len(truths) and all(_same_item(a.strip(), t.strip()) for a, t in zip(items, truths, strict=True))
        return _verdict(same, pred)
    return _verdict(_same_item(answer, truth), pred)


def _is_answer(ground_truth: object) -> bool:
    """Text or a number; `str(None)` would make "Answer: None" correct for a row with no answer."""
    return isinstance(ground_truth, str) or (
        isinstance(ground_truth, numbers.Real) and not isinstance(ground_truth, bool)
    )


def compute_score(response: str, ground_truth: str | int | float, mode: Mode = "dapo") -> Score:
    """Score one response against its ground truth: +1 if equivalent, -1 otherwise (DAPO Eq. 7).

    Never raises on model text or data: a malformed or unparsable answer, a response that is not a
    string, or a ground truth that is neither text nor a number (`None`, bytes) scores -1. The returned
    `pred` is always valid UTF-8 (lone surrogates become "?").

    >>> compute_score("so x = 12+1.\\nAnswer: $13$", "13")
    {'score': 1.0, 'acc': True, 'pred': '13'}
    """
    if mode not in MODES:
        raise ValueError(f"reward mode {mode!r} is not one of {MODES}")
    try:
        if not isinstance(response, str) or not _is_answer(ground_truth):
            return _invalid()
        ground_truth = str(ground_truth)
        if len(ground_truth) > MAX_GROUND_TRUTH_CHARS:
            return _invalid()
        if mode == "math_verify":
            out = _math_verify(response, ground_truth)
        elif mode == "exact":
            out = _exact(response, ground_truth)
        else:
            out = _dapo(response, ground_truth, strict=mode == "dapo_strict")
        return {**out, "pred": out["pred"].encode("utf-8", "replace").decode("utf-8")}
    except Exception:  # noqa: BLE001 - the verifier must never take a training step down
        return _invalid()


if __name__ == "__main__":
    _serve()
