"""What a reply states: the number it gives as its answer, read as written, never evaluated.

A scorer that evaluates expressions pays a policy for restating the question: Math-Verify reads
"14 + 3 = ?" as 17, and a policy trained on it learned to answer exactly that. DAPO's answers are
integers so that the stated answer can be compared as written (paper section 2.2, Eq. 7); this module
is that reading, for every scorer of `reward.py`:

* a **number** is written as one: an integer (`17`, `-3`, `017`, `2,500`), a decimal (`0.5`, `17.0`) or a
  fraction in lowest terms (`1/2`, `-2/11`, `\\frac{1}{2}`, `\\dfrac{-1}{2}`). `34/2`, `2/4`, `14+3`,
  `2*3` and `5!` are expressions: they state no number, whatever their value;
* in free text the **stated** number is the last number of the reply, and only when it stands alone:
  not an operand (`14 + 3 = ?`, `so the total is 9 + 8.`, `x = 20 - 3`, `\\sqrt{289}`), not one of several
  offered (`17 or 18`, `3, 4`), not a question (`17?`). `14 + 3 = 17`, `The sum is 17.`, `x = -3` and
  `25%` state 17, 17, -3 and 25 (a percentage is the number written: "what percent" asks for it);
* a number **denied** states nothing (`denied`): `The answer is not 17.`, `I cannot solve this, but it is
  not 17.`, `It isn't 17.`, `17 is not the answer.`, `anything other than 17`. Neither does the reply whose
  last number is denied after it stated another (`It is 17, not 18.`): the reader never looks back past
  the last number, so that stating an answer and then denying it cannot be paid either way.

`states_reference` is the hack alarm's test: does a reply contain the reference answer at all, as
written? A rewarded reply that does not is how a scorer's hole shows (see `dapo_ray.replies`).

Plain Python, linear-time regular expressions on text the caller has already cut to its tail.
"""

from __future__ import annotations

import re
from fractions import Fraction

# One number as written. Fractions first, so that `1/2` is read whole; a thousands group needs its commas
# between groups of three (`2,500`), otherwise `3,4` is two numbers.
_NUMBER = (
    r"\\[dt]?frac\{\s*[+-]?\d+\s*\}\{\s*\d+\s*\}"
    r"|\d{1,3}(?:,\d{3})+(?![\d,])(?:\.\d+)?"
    r"|\d+\s*/\s*\d+"
    r"|\d+(?:\.\d+)?"
    r"|\.\d+"
)
_NUMBER_RE = re.compile(rf"(?<![\w.])(?:{_NUMBER})(?![\w.]*\d)")
_LITERAL_RE = re.compile(
    r"(?P<sign>[+-]?)(?:"
    r"\\[dt]?frac\{(?P<fsign>[+-]?)(?P<fnum>\d+)\}\{(?P<fden>\d+)\}"
    r"|(?P<num>\d+)/(?P<den>\d+)"
    r"|(?P<dec>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
    r")"
)
_MINUS = str.maketrans({"\u2212": "-", "\u2013": "-"})  # the minus sign and the en dash models write
_OPERATOR_BEFORE_RE = re.compile(r"(?:[*/×÷^·<>]|\\times|\\cdot|\\div|\\pm|±|\b(?:plus|minus|times|over|or|and|nor)\b)\s*\Z", re.I)  # fmt: skip
_OPERATOR_AFTER_RE = re.compile(r"\A\s*(?:[-+*/×÷^·=<>?!]|\\times|\\cdot|\\div|\\pm|±|\b(?:plus|minus|times|over|or)\b)", re.I)  # fmt: skip
# Inside a LaTeX command's argument (`\\sqrt{4}`, `2^{3}`, `\\frac{x}{2}`), except the ones that only wrap an answer.
_IN_COMMAND_RE = re.compile(r"(?:\\(?!boxed|text|mathrm|mathbf|textbf)[A-Za-z]+|[_^]|\})\s*\{\s*\Z")
_OPERAND_BEFORE_SIGN_RE = re.compile(r"(?:[\d)\]}!]|(?<![A-Za-z])[A-Za-z])\s*\Z")  # `20 - 3`, `x - 3`: binary
_LIST_BEFORE_RE = re.compile(r"\d\s*[,;]\s*\Z")  # `3, 4`: the last of a list
# A denial just before the number, with the few words that may stand between (`is not equal to 17`,
# `cannot be 17`, `not the number $17$`), or just after it (`17 is not the answer`, `17 is wrong`).
_NEGATION_BEFORE_RE = re.compile(
    r"(?:\b(?:not|never|cannot|neither|nor|except|excluding|unlike)\b|n['\u2019]t\b|\b(?:other|rather)\s+than\b"
    r"|\bdifferent\s+from\b|\binstead\s+of\b|\u2260|\\neq?\b|!=)"
    r"(?:\s+(?:be|equal|equals|to|exactly|quite|just|simply|the|an?|answer|number|value|result|of))*"
    r"(?:\s|\$|\\\(|\\boxed\{|\{|\()*\Z",
    re.I,
)
_NEGATION_AFTER_RE = re.compile(
    r"\A(?:\s|\$|\\\)|\}|\))*(?:\(\s*)?(?:(?:is|was|are|would\s+be|will\s+be|seems|['\u2019]s)\s+)?"
    r"(?:not|never|wrong|incorrect|false|\w*n['\u2019]t)\b",
    re.I,
)


def parse_number(text: str) -> Fraction | None:
    """The value of `text` when it is one number as written (see the module docstring), else None.

    >>> parse_number("-\\\\frac{1}{2}"), parse_number("017"), parse_number("2,500"), parse_number("0.50")
    (Fraction(-1, 2), Fraction(17, 1), Fraction(2500, 1), Fraction(1, 2))
    >>> parse_number("34/2"), parse_number("14+3"), parse_number("17 or 18"), parse_number("2/4")
    (None, None, None, None)
    """
    match = _LITERAL_RE.fullmatch("".join(text.translate(_MINUS).split()))
    if match is None:
        return None
    negative = (match["sign"] == "-") != (match["fsign"] == "-")
    if match["dec"] is not None:
        value = Fraction(match["dec"].replace(",", ""))
    else:
        num, den = int(match["fnum"] or match["num"]), int(match["fden"] or match["den"])
        if den < 2 or Fraction(num, den).denominator != den:  # `34/2`, `2/4`, `3/1`: expressions, not numbers
            return None
        value = Fraction(num, den)
    return -value if negative else value


def stated_number(text: str) -> Fraction | None:
    """The number a free-form reply states as its answer: its last number, when it stands alone (module
    docstring), with its sign; None when the reply ends in an expression, a hedge or no number.

    >>> stated_number("14 + 3 = 17."), stated_number("The sum is -4"), stated_number("x = 20 - 3")
    (Fraction(17, 1), Fraction(-4, 1), None)
    >>> stated_number("14 + 3 = ?"), stated_number("It is 17 or 18."), stated_number("17?")
    (None, None, None)
    >>> stated_number("The answer is not 17."), stated_number("I cannot solve this, but it is not 17.")
    (None, None)
    """
    text = text.translate(_MINUS)
    last = next(reversed(list(_NUMBER_RE.finditer(text))), None)  # the tail is at most 300 characters
    if last is None:
        return None
    before, after = text[: last.start()], text[last.end() :]
    if _OPERATOR_AFTER_RE.match(after) or _LIST_BEFORE_RE.search(before):
        return None
    sign = ""
    stripped = before.rstrip()
    if stripped.endswith(("-", "+")):
        if _OPERAND_BEFORE_SIGN_RE.search(stripped[:-1]):
            return None  # `20 - 3`: an operand
        sign, stripped = stripped[-1], stripped[:-1]
    if _OPERATOR_BEFORE_RE.search(stripped) or _IN_COMMAND_RE.search(stripped) or denied(stripped, after):
        return None
    return parse_number(sign + last.group())


def denied(before: str, after: str) -> bool:
    """Whether the number written between `before` and `after` is denied: a negation right before it
    (`not`, `never`, `isn't`, `cannot be`, `other than`, `\\neq`) or right after it (`is not`, `is wrong`).
    Only the text next to the number is read, so `not only 3 but 17` and `No, it is 17` deny nothing.

    >>> denied("The answer is not ", "."), denied("It isn't $", "$."), denied("", " is not the answer.")
    (True, True, True)
    >>> denied("The answer is ", "."), denied("I am not sure; the sum is ", "."), denied("No, it is ", "")
    (False, False, False)
    """
    return bool(_NEGATION_BEFORE_RE.search(before[-80:]) or _NEGATION_AFTER_RE.match(after[:80]))


def stated_answer(answer: str) -> Fraction | None:
    """The value of an extracted answer (an `Answer:` line or a `\\boxed{}`, normalised by the caller)
    when it is one number as written; a trailing full stop or percent sign is allowed (`25\\%` is 25).
    `14+3` -> None."""
    return parse_number(answer.strip().removesuffix(".").removesuffix("%").removesuffix("\\"))


def numbers_in(text: str) -> list[Fraction]:
    """Every number written in `text`, with the sign written before it (`x = -3` gives -3 and 3)."""
    text = text.translate(_MINUS)
    out = []
    for m in _NUMBER_RE.finditer(text):
        if (value := parse_number(m.group())) is not None:
            out.append(value)
            if text[max(0, m.start() - 8) : m.start()].rstrip().endswith("-"):  # a few characters: linear time
                out.append(-value)
    return out


def _canonical_text(text: str) -> str:
    return "".join(text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\left", "")
                   .replace("\\right", "").translate(_MINUS).split())  # fmt: skip


def states_reference(response: str, ground_truth: str) -> bool:
    """True when the reply contains the reference answer as written: for a number ground truth, some number
    written in the reply equals it by value (`17`, `17.0`, `\\boxed{17}`, `017`); otherwise the ground
    truth's text (spaces dropped) appears in the reply's.

    >>> states_reference("14 + 3 = 17", "17"), states_reference("14 + 3 = ?", "17")
    (True, False)
    """
    truth = parse_number(ground_truth)
    if truth is None:
        return _canonical_text(ground_truth) in _canonical_text(response)
    return truth in numbers_in(response)
