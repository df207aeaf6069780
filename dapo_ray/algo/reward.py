"""Answer verification: the +1 / -1 correctness reward of DAPO Eq. 7.

`compute_score(response, ground_truth, mode=...)` returns `{"score", "acc", "pred"}`, the same shape as
verl's `math_dapo.compute_score`, so a user can swap scorers without touching anything else.

Modes
-----
``dapo_strict``
    DAPO's own scorer, verbatim: look at the last 300 characters of the response, take the last line of
    the form ``Answer: ...``, normalise it Minerva-style (strip units, ``$``, ``\\text{}``, ``\\boxed{}``,
    thousands separators of plain integers...) and compare strings with the normalised ground truth.
    Use it to re-run the paper's numbers exactly.
``dapo`` (default)
    ``dapo_strict`` plus three fixes for failures users report, none of which can turn a wrong answer
    right:
      * trailing special tokens (``<|im_end|>``, ``<|endoftext|>``, ``</s>``) are removed first, so
        ``Answer: 13<|im_end|>`` is 13, not ``13<|im_end|>``;
      * a trailing full stop is dropped (``Answer: 13.`` is 13);
      * plain integers are compared by value, so leading zeros do not matter: AIME writes answers as three
        digits, and ``Answer: 025`` is correct for ground truth ``25`` (strict mode says wrong).
``math_verify``
    Correct when ``dapo`` says so, or when Math-Verify (HF, sympy-based) finds the answer equivalent to
    the ground truth; the answer is the ``Answer:`` line if there is one, else the last ``\\boxed{}``.
    Adds ``1/2`` vs ``\\frac{1}{2}``, ``0.5`` vs ``1/2`` and so on. Slower (~ms per response).

Safety: no mode evaluates model text as code; sympy only parses the short extracted answer (at most
`MAX_ANSWER_CHARS`), Math-Verify runs with its own timeouts, and any exception scores -1. A response
with no parsable answer scores -1 with ``pred = "[INVALID]"``.
"""

from __future__ import annotations

import json
import re
import select
import subprocess
import sys
import threading
from typing import Literal, TypedDict

Mode = Literal["dapo", "dapo_strict", "math_verify"]
MODES: tuple[str, ...] = ("dapo", "dapo_strict", "math_verify")

INVALID = "[INVALID]"
TAIL_CHARS = 300  # DAPO scores only the last 300 characters of a response.
MAX_ANSWER_CHARS = 200  # Longest extracted answer handed to sympy (bounds parse time).

_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_SPECIAL_TOKEN_RE = re.compile(r"(<\|[^|<>\n]{1,40}\|>|</s>|<eos>|<pad>)+\s*$")


class Score(TypedDict):
    score: float
    acc: bool
    pred: str


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


def normalize_final_answer(answer: str) -> str:
    """DAPO's normalisation of an extracted answer, verbatim. `"\\$1{,}000 dollars"` -> `"1000"`."""
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
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def strip_special_tokens(text: str) -> str:
    """Remove trailing chat special tokens: `"Answer: 13<|im_end|>"` -> `"Answer: 13"`."""
    return _SPECIAL_TOKEN_RE.sub("", text)


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
    pred = normalize_final_answer(line) if line is not None else INVALID
    gt = normalize_final_answer(ground_truth)
    if not strict and line is not None:
        pred = _canonical_integer(pred.rstrip("."))
        gt = _canonical_integer(gt)
    acc = pred == gt
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


def _math_verify(response: str, ground_truth: str) -> Score:
    from math_verify import parse, verify  # lazy: pulls in sympy and antlr

    by_string = _dapo(response, ground_truth, strict=False)
    if by_string["acc"]:
        return by_string
    tail = strip_special_tokens(response)[-TAIL_CHARS:]
    line = extract_answer_line(tail)
    answer = line if line is not None else last_boxed(tail)
    if answer is None or not answer.strip():
        return {"score": -1.0, "acc": False, "pred": INVALID}
    answer = answer.strip()[:MAX_ANSWER_CHARS]
    # Math-Verify finds math inside $...$ or \boxed{}; wrap a bare answer so `13` and `\frac{1}{2}` parse.
    if "$" not in answer and "\\boxed" not in answer:
        answer = f"${answer}$"
    gold = parse(f"${ground_truth}$", parsing_timeout=1)
    pred = parse(answer, parsing_timeout=1)
    acc = bool(pred) and bool(verify(gold, pred, timeout_seconds=1))
    shown = str(pred[-1]) if pred else INVALID
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": shown}


# Math-Verify bounds its time with SIGALRM, which only works in the main thread; elsewhere (Ray actors
# with concurrency, thread pools) it raises, and every answer would silently score -1. Off the main
# thread we therefore ask one helper process, whose main thread can
# use the alarm, over a pipe of JSON lines. A helper that hangs past HELPER_TIMEOUT_S is killed.
_helper: subprocess.Popen | None = None
_helper_lock = threading.Lock()
HELPER_TIMEOUT_S = 5.0
HELPER_START_TIMEOUT_S = 120.0


def _math_verify_off_main_thread(response: str, ground_truth: str) -> Score:
    global _helper
    with _helper_lock:
        if _helper is None or _helper.poll() is not None:
            _helper = subprocess.Popen(
                [sys.executable, "-c", "from dapo_ray.algo.reward import _serve; _serve()"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            )  # fmt: skip
            # Its start-up (importing sympy and Math-Verify) takes seconds on a busy machine: wait for it
            # apart, so the per-answer timeout below bounds the verification alone.
            ready, _, _ = select.select([_helper.stdout], [], [], HELPER_START_TIMEOUT_S)
            if not ready or _helper.stdout.readline().strip() != "ready":
                _helper.kill()
                _helper.wait()
                _helper = None
                return {"score": -1.0, "acc": False, "pred": INVALID}
        helper = _helper
        helper.stdin.write(json.dumps([response, ground_truth]) + "\n")
        helper.stdin.flush()
        ready, _, _ = select.select([helper.stdout], [], [], HELPER_TIMEOUT_S)
        if ready:
            line = helper.stdout.readline()
            if line:
                return json.loads(line)
        helper.kill()
        helper.wait()
        _helper = None
        return {"score": -1.0, "acc": False, "pred": INVALID}


def _serve() -> None:
    """The helper's loop: "ready" once imported, then one `[response, ground_truth]` JSON line in, one
    Score JSON line out."""
    import math_verify  # noqa: F401 - the slow import, before saying ready

    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        response, ground_truth = json.loads(line)
        try:
            out = _math_verify(response, ground_truth)
        except Exception:  # noqa: BLE001
            out = {"score": -1.0, "acc": False, "pred": INVALID}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


def compute_score(response: str, ground_truth: str, mode: Mode = "dapo") -> Score:
    """Score one response against its ground truth: +1 if equivalent, -1 otherwise (DAPO Eq. 7).

    Never raises on model text: a malformed or unparsable answer scores -1.

    >>> compute_score("so x = 12+1.\\nAnswer: $13$", "13")
    {'score': 1.0, 'acc': True, 'pred': '13'}
    """
    if mode not in MODES:
        raise ValueError(f"reward mode {mode!r} is not one of {MODES}")
    if not isinstance(response, str):
        return {"score": -1.0, "acc": False, "pred": INVALID}
    try:
        if mode == "math_verify":
            if threading.current_thread() is threading.main_thread():
                return _math_verify(response, str(ground_truth))
            return _math_verify_off_main_thread(response, str(ground_truth))
        return _dapo(response, str(ground_truth), strict=mode == "dapo_strict")
    except Exception:  # noqa: BLE001 - the verifier must never take a training step down
        return {"score": -1.0, "acc": False, "pred": INVALID}
