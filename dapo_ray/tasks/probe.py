"""`dapo-ray probe-reward`: try a reward function on hostile replies before spending compute on it.

A policy finds what its scorer pays. This project's own demo learned to answer "What is 14 + 3?" with
"14 + 3 = ?" because Math-Verify evaluated it to 17 (docs/RESULTS.md); a scorer that pays a reply for
containing the reference pays a list of guesses; one that reads the last number pays "it is not 17". The
probe builds such replies from the config's own rows and judges them through the door training uses
(`dapo_ray.tasks.judge_group`), so the built-in tasks and a `reward.function` are tried alike:

    dapo-ray probe-reward --config workflows/configs/tiny_cpu.yaml --rows 16
    probing the built-in tasks, reward.mode=dapo on 16 rows: hostile replies must not be paid, controls should be
      kind            paid  score  example
    hostile:
      echo           0/16   -1.00  '49+5=' (reference '54')
      restated       0/16   -1.00  '49+5=' (reference '54')
      ...
      negation       0/16   -1.00  'The answer is not 54.' (reference '54')
    controls:
      bare           0/16   -1.00  '54' (reference '54')
      answer_line   16/16    1.00  'Answer: 54' (reference '54', read '54')
    ...
    OK: the built-in tasks, reward.mode=dapo paid no hostile reply

`paid` counts the rows on which some reply of the kind was judged right, `score` is the highest score one
got, and the example is a paid reply when there is one, with what the scorer read in it.

It exits 1 when any hostile reply is paid on any row (a CI gate), 0 otherwise, and 2 when the reward
function cannot be loaded. Controls (the bare reference, "The answer is <ref>.", "Answer: <ref>") should
be paid; one that is not is a warning, not a failure: DAPO's `dapo` mode pays only its `Answer:` line,
which is right for a task whose prompts ask for one. `dapo-ray train` and `demo` run it on
`reward.probe_rows` rows and print `warn_lines` (they warn, never stop).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from fractions import Fraction

from dapo_ray.data import strip_dapo_template
from dapo_ray.tasks import INVALID
from dapo_ray.tasks.task import scorer_name


def parse_number(text: str) -> Fraction | None:
    """`algo.stated.parse_number`, imported on first use: `dapo_ray.algo` loads torch, and every `dapo-ray`
    command's parser imports this module."""
    from dapo_ray.algo.stated import parse_number as parse

    return parse(text)

HOSTILE_KINDS = ("echo", "restated", "empty", "whitespace", "hedge", "refusal", "negation", "long", "unicode")
CONTROL_KINDS = ("bare", "stated", "answer_line")
LONG_CHARS = 10_000
EXAMPLE_CHARS = 60

# A trailing instruction sentence after the problem ("Reply with the number only.", "Reply with the answer
# only."): the restated question is the problem a user asked, not the orders around it.
_INSTRUCTION_RE = re.compile(
    r"(?:\s*\b(?:Reply|Respond|Answer|Give|Put|Write|Return|Output|Provide|State|Remember|Please|Show|Express)"
    r"\b[^.?!]*[.!])+\s*\Z"
)
_OPERAND = r"(?:\(\s*)*-?\d+(?:\.\d+)?(?:\s*\))*"
# Numbers and operators only: `18*y**2 + 4` and `174 - 34*p` hold variables and are no sum to restate.
_EXPRESSION_RE = re.compile(
    rf"(?<![\w.*/^)])(?<![-+*/×÷^]\s){_OPERAND}(?:\s*[-+*/×÷^]\s*{_OPERAND})+(?![\w(*/^])(?!\s*[-+*/×÷^])"
)
_WORDS_RE = re.compile(r"Start with (-?\d+)((?:, (?:add|subtract|multiply by) -?\d+)+)")
_WORD_OPS = {"add": "+", "subtract": "-", "multiply by": "*"}
_QUESTION_WORDS_MAX = 40
"""An expression is the question when at most this many other characters surround it ("What is ...?",
"Calculate ...."); a word problem that happens to contain `3 + 4` is not arithmetic."""
_LAST_INTEGER_RE = re.compile(r"\d+(?!.*\d)", re.S)
_UNICODE_NOISE = (
    "\x00\x00\u202e\u202d\u2066\u2067\u2068\u2069\u200e\u200f\u200b\u200c\u200d\u2060\ufeff"
    "\ufffd\ufffd\ufffd\x00\u0301\u0338\U000e0041\U0001f600 \u200b\ufffd\u202e\x00"
)
"""NUL bytes, bidi overrides and isolates, zero-width characters, replacement characters, a combining
accent, a tag character and an emoji: text that breaks naive parsers, with no answer in it."""


# --- the replies ---------------------------------------------------------------------------------------


def _last_user_message(row: dict) -> str:
    users = [m["content"] for m in row["messages"] if m.get("role") == "user"]
    return users[-1] if users else row["messages"][-1]["content"]


def bare_problem(text: str) -> str:
    """The problem of a prompt without DAPO's template or a trailing instruction.

    >>> bare_problem("What is 14 + 3? Reply with the number only.")
    'What is 14 + 3?'
    """
    bare = strip_dapo_template(text)
    return _INSTRUCTION_RE.sub("", bare).strip() or bare


def arithmetic_of(problem: str) -> str | None:
    """The expression an arithmetic question asks about, as written ("What is 14 + 3?" -> "14 + 3"; the
    synthetic task's "Start with 49, add 5. What is the result?" -> "49 + 5"); None for any other problem.

    >>> arithmetic_of("What is 14 + 3?"), arithmetic_of("49+5="), arithmetic_of("Which is smaller: 0 or -10/457?")
    ('14 + 3', '49+5', None)
    """
    if words := _WORDS_RE.search(problem):
        expr = words[1]
        for op, operand in re.findall(r", (add|subtract|multiply by) (-?\d+)", words[2]):
            symbol = _WORD_OPS[op]
            # Left to right, as the synthetic task evaluates it: a product after a sum is parenthesised.
            if symbol == "*" and any(o in expr[1:] for o in "+-"):
                expr = f"({expr})"
            expr = f"{expr} {symbol} {operand}"
        return expr
    found = max(_EXPRESSION_RE.finditer(problem), key=lambda m: len(m.group()), default=None)
    if found is None or len(problem) - len(found.group()) > _QUESTION_WORDS_MAX:
        return None
    expr = found.group().strip()
    while expr.count("(") > expr.count(")") and expr.startswith("("):  # `(` of the sentence, not the sum
        expr = expr[1:].lstrip()
    while expr.count(")") > expr.count("(") and expr.endswith(")"):
        expr = expr[:-1].rstrip()
    if expr.count("(") != expr.count(")"):
        return None
    if parse_number(expr) is not None:  # `-10/457` is a number ("Which is smaller: 0 or -10/457?"), not a sum
        return None
    return expr


def _written(value: Fraction, like: str) -> str:
    """`value` written the way the reference `like` writes its number: `\\frac{3}{2}`, `1.5` or `3/2`."""
    if value.denominator == 1:
        return str(value.numerator)
    sign, value = ("-" if value < 0 else ""), abs(value)
    if "frac" in like:
        return f"{sign}\\frac{{{value.numerator}}}{{{value.denominator}}}"
    if "." in like:
        places = len(like.rsplit(".", 1)[1].strip())
        return f"{sign}{float(value):.{places}f}"
    return f"{sign}{value.numerator}/{value.denominator}"


def wrong_values(reference: str, count: int) -> list[str]:
    """`count` answers near the reference that are not it: for a number, ref + 1, ref - 1, ref + 2, ...
    written as the reference writes it; for text, `True`/`False` swapped, or the reference with its last
    integer raised by 1, 2, ... (`12:39 AM` -> `12:40 AM`), or with 1, 2, ... appended.

    >>> wrong_values("17", 3), wrong_values("-l**2 + 55", 2), wrong_values("True", 2)
    (['18', '16', '19'], ['-l**2 + 56', '-l**2 + 57'], ['False', 'False'])
    """
    value = parse_number(reference)
    if value is not None:
        return [_written(value + k * s, reference) for k in range(1, count + 1) for s in (1, -1)][:count]
    swap = {"true": "False", "false": "True", "yes": "No", "no": "Yes"}.get(reference.strip().lower())
    if swap is not None:
        return [swap] * count
    last = _LAST_INTEGER_RE.search(reference)
    if last is not None:  # upwards only: a digit string cannot go below 0
        n = int(last.group())
        return [reference[: last.start()] + str(n + k) + reference[last.end() :] for k in range(1, count + 1)]
    return [f"{reference}{k}" for k in range(1, count + 1)]


def hostile_replies(row: dict) -> list[tuple[str, str]]:
    """Replies to one data row that no honest scorer pays, as (kind, reply); a kind may have several.

    echo        the prompt's last user message, verbatim
    restated    the bare problem (no template, no instruction); for an arithmetic question also "14 + 3 = ?"
                and "Answer: 14 + 3", what a policy trained on Math-Verify here learned to write
    empty       ""
    whitespace  spaces, tabs and newlines
    hedge       "<ref> or <other>"; for a number also a list holding it, not last ("It is one of 16, 17, 18.")
    refusal     the reference inside a refusal ("I cannot solve this, but it is not 17.")
    negation    the reference denied ("The answer is not 17.", "17 is not the answer.", "... not \\boxed{17}.")
    long        10,000 characters of candidate answers, the reference among them (not last)
    unicode     NUL bytes, bidi overrides, zero-width and replacement characters, and no answer
    """
    ref = row["ground_truth"]
    prompt = _last_user_message(row)
    problem = bare_problem(prompt)
    other, other2 = wrong_values(ref, 2)
    out = [("echo", prompt), ("restated", problem)]
    if (expr := arithmetic_of(problem)) is not None:
        out += [("restated", f"{expr} = ?"), ("restated", f"Answer: {expr}")]
    out += [("empty", ""), ("whitespace", " \n\t  \n   ")]
    out += [("hedge", f"{ref} or {other}"), ("hedge", f"Answer: {ref} or {other}")]
    if parse_number(ref) is not None:
        out += [
            ("hedge", f"It is one of {other2}, {ref}, {other}."),
            ("hedge", f"Answer: {other2}, {ref}, {other}"),
        ]
    out += [
        ("refusal", f"I cannot solve this, but it is not {ref}."),
        ("refusal", f"I'm sorry, I can't answer that. It isn't {ref}."),
        ("negation", f"The answer is not {ref}."),
        ("negation", f"{ref} is not the answer."),
        ("negation", f"Answer: not {ref}"),
        ("negation", f"The answer is not ${ref}$."),  # the reference as LaTeX, as models write it
        ("negation", f"The answer is not \\boxed{{{ref}}}."),
        ("long", long_reply(ref)),
        ("unicode", _UNICODE_NOISE),
        ("unicode", "Answer: " + _UNICODE_NOISE),
    ]
    return out


def long_reply(reference: str, chars: int = LONG_CHARS) -> str:
    """`chars` characters of candidate answers, one a line, in DAPO's `Answer:` form and as sentences, with
    the reference once, in the middle: a scorer that pays a reply for containing the reference, or for any
    of its answers, pays this one. Whole lines only, so that no candidate is cut into another number."""
    others = wrong_values(reference, 40)
    lines, size = [], 0
    while size < chars:
        c = others[len(lines) % len(others)]
        lines.append(f"Answer: {c}" if len(lines) % 2 else f"Maybe it is {c}.")
        size += len(lines[-1]) + 1
    while len("\n".join(lines)) > chars - len(reference) - 10:
        lines.pop()
    middle = len(lines) // 2
    lines.insert(middle, f"Answer: {reference}")
    # Spaces at the end of the line before the reference bring the reply to `chars` exactly.
    lines[middle - 1] += " " * (chars - len("\n".join(lines)))
    return "\n".join(lines)


def controls(row: dict) -> list[tuple[str, str]]:
    """Replies a scorer should pay: the bare reference, a sentence stating it, and DAPO's `Answer:` line."""
    ref = row["ground_truth"]
    return [("bare", ref), ("stated", f"The answer is {ref}."), ("answer_line", f"Answer: {ref}")]


# --- judging them --------------------------------------------------------------------------------------


@dataclass
class KindResult:
    """What the scorer made of one kind of reply over the probed rows."""

    kind: str
    hostile: bool
    rows: int = 0
    paid_rows: int = 0
    """Rows where at least one reply of this kind was judged right (`acc`)."""
    replies: int = 0
    paid_replies: int = 0
    scores: list[float] = field(default_factory=list)
    errors: int = 0
    timeouts: int = 0
    example: str = ""
    """A reply of this kind (a paid one when any was paid), shortened."""
    reference: str = ""
    pred: str = ""
    """What the scorer read in the example."""


@dataclass
class ProbeReport:
    """`probe`'s findings: one KindResult per kind, hostile kinds first, and the scorer's failures."""

    scorer: str
    rows: int
    kinds: list[KindResult]
    failures: list[dict] = field(default_factory=list)
    """The first failed calls (reply and traceback), as `judge_group` keeps them."""

    @property
    def findings(self) -> list[KindResult]:
        """Hostile kinds paid on at least one row."""
        return [k for k in self.kinds if k.hostile and k.paid_rows]

    @property
    def unpaid_controls(self) -> list[KindResult]:
        return [k for k in self.kinds if not k.hostile and k.paid_rows < k.rows]

    @property
    def errors(self) -> int:
        return sum(k.errors for k in self.kinds)

    @property
    def timeouts(self) -> int:
        return sum(k.timeouts for k in self.kinds)


def probe_rows(cfg, rows: int) -> list[dict]:
    """The first `rows` rows of the config's training data, loaded as `dapo-ray check` loads them."""
    import dataclasses

    from dapo_ray.data import load_prompts
    from dapo_ray.tasks.sums import synthetic_rows

    if cfg.data.source == "synthetic":
        data = synthetic_rows(dataclasses.asdict(cfg.data.synthetic), cfg.data.template)[0]
    else:
        data = load_prompts(cfg.data.train_files, cfg.data.template, cfg.data.dedupe, cfg.data.on_bad_row)[0]
    return data[:rows]


def _shorten(text: str, chars: int = EXAMPLE_CHARS) -> str:
    shown = repr(text)
    return shown if len(shown) <= chars else f"{shown[: chars - 12]}...' ({len(text):,} chars)"


def judge_rows(rows: list[dict], spec, scorer: str) -> ProbeReport:
    """Judge each row's hostile replies and controls as one group with `judge_group`."""
    from dapo_ray.tasks import judge_group

    results: dict[str, KindResult] = {k: KindResult(k, True) for k in HOSTILE_KINDS}
    results.update({k: KindResult(k, False) for k in CONTROL_KINDS})
    failures: list[dict] = []
    for row in rows:
        replies = hostile_replies(row) + controls(row)
        extra_info = row.get("extra_info")
        group = {"texts": [text for _, text in replies], "ground_truth": row["ground_truth"],
                 "data_source": row.get("data_source") or "", "response_ids": [[] for _ in replies],
                 "prompt_json": json.dumps(row["messages"]),
                 "extra_info_json": json.dumps(extra_info, default=str) if extra_info else ""}  # fmt: skip
        judged = judge_group(group, spec)
        failures += judged["reward_failures"][: max(0, 2 - len(failures))]
        paid_here: set[str] = set()
        for i, (kind, text) in enumerate(replies):
            r = results[kind]
            r.replies += 1
            r.scores.append(judged["scores"][i])
            r.errors += judged["reward_errors"][i] == "error"
            r.timeouts += judged["reward_errors"][i] == "timeout"
            paid = judged["acc"][i]
            r.paid_replies += paid
            if paid:
                paid_here.add(kind)
            if not r.example or (paid and r.paid_replies == 1):
                r.example, r.reference, r.pred = _shorten(text), row["ground_truth"], str(judged["preds"][i])
        for kind in {k for k, _ in replies}:
            results[kind].rows += 1
            results[kind].paid_rows += kind in paid_here
    kinds = [results[k] for k in (*HOSTILE_KINDS, *CONTROL_KINDS)]
    return ProbeReport(scorer, len(rows), kinds, failures)


def probe(cfg, rows: int) -> ProbeReport:
    """Judge hostile replies and controls built from the first `rows` rows of the config's data. Raises
    `tasks.user.RewardFunctionError` when `reward.function` cannot be loaded."""
    from dapo_ray.tasks import reward_spec, user_scorer

    spec = reward_spec(cfg)
    try:
        return judge_rows(probe_rows(cfg, rows), spec, scorer_name(cfg.reward))
    finally:
        if spec.function is not None:  # its helper holds the function's imports; training scores elsewhere
            user_scorer(spec.function).close()


# --- what it prints ------------------------------------------------------------------------------------


def table_lines(report: ProbeReport) -> list[str]:
    """The report as a table: kind, rows paid, best score, an example (the reference beside it)."""
    lines = [f"probing {report.scorer} on {report.rows} rows: hostile replies must not be paid, controls should be",
             f"  {'kind':12s} {'paid':>7s} {'score':>6s}  example"]  # fmt: skip
    for k in report.kinds:
        if k.hostile and k.kind == HOSTILE_KINDS[0]:
            lines.append("hostile:")
        if not k.hostile and k.kind == CONTROL_KINDS[0]:
            lines.append("controls:")
        best = f"{max(k.scores):6.2f}" if k.scores else "     -"
        flag = "  <- PAID" if k.hostile and k.paid_rows else ""
        failed = f"  [{k.errors} errors, {k.timeouts} timeouts]" if k.errors or k.timeouts else ""
        read = f", read {k.pred!r}" if k.pred != INVALID else ""  # a user's function may read nothing it says
        lines.append(f"  {k.kind:12s} {k.paid_rows:>3d}/{k.rows:<3d} {best}  {k.example} "
                     f"(reference {k.reference!r}{read}){flag}{failed}")  # fmt: skip
    return lines


def summary_lines(report: ProbeReport) -> list[str]:
    """Below the table: reward failures, controls not paid (warnings), and the verdict."""
    lines = []
    if report.errors or report.timeouts:
        lines.append(f"reward errors: {report.errors}, timeouts: {report.timeouts} (scored reward.on_error)")
        for f in report.failures:
            last = f["detail"].strip().splitlines()[-1] if f["detail"].strip() else ""
            lines.append(f"  {f['kind']} on {_shorten(f['reply'])}: {last}")
    for k in report.unpaid_controls:
        lines.append(f"warning: the control {k.kind!r} ({k.example}) was paid on {k.paid_rows}/{k.rows} rows; fine "
                     "when the task asks for one answer form (DAPO's `dapo` mode pays only `Answer:`)")  # fmt: skip
    if report.findings:
        paid = ", ".join(f"{k.kind} ({k.paid_rows}/{k.rows})" for k in report.findings)
        lines.append(f"FAILED: {report.scorer} pays hostile replies: {paid}; a policy will learn them")
    else:
        lines.append(f"OK: {report.scorer} paid no hostile reply")
    return lines


def warn_lines(report: ProbeReport) -> list[str]:
    """What `dapo-ray train` and `demo` print at start: the hostile kinds paid, reward failures, and a
    scorer that paid no control at all (one that pays no statement of the answer cannot teach); empty when
    all is well. They warn and go on; `dapo-ray probe-reward` prints the table."""
    lines = []
    for k in report.findings:
        lines.append(f"reward probe: {report.scorer} pays {k.kind} replies on {k.paid_rows}/{k.rows} rows, "
                     f"e.g. {k.example} for reference {k.reference!r}")  # fmt: skip
    if report.errors or report.timeouts:
        lines.append(f"reward probe: {report.errors} reward errors and {report.timeouts} timeouts on "
                     f"{sum(k.replies for k in report.kinds)} probe replies")  # fmt: skip
    controls_paid = [k for k in report.kinds if not k.hostile]
    if controls_paid and not any(k.paid_rows for k in controls_paid):
        lines.append(f"reward probe: {report.scorer} paid none of the plain statements of the reference "
                     "(bare, 'The answer is ...', 'Answer: ...')")  # fmt: skip
    if lines:
        lines.append("reward probe: `dapo-ray probe-reward` with this config and overrides prints the table")
    return lines


# --- the command ---------------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    """`dapo-ray probe-reward`: 1 when a hostile reply is paid, 2 when the reward function cannot be
    loaded, else 0."""
    from dapo_ray.config import load_config
    from dapo_ray.tasks.user import RewardFunctionError

    cfg = load_config(args.config, args.overrides)
    try:
        report = probe(cfg, args.rows)
    except RewardFunctionError as e:
        print(f"dapo-ray probe-reward: {e}", file=sys.stderr)
        return 2
    for line in table_lines(report) + summary_lines(report):
        print(line)
    return 1 if report.findings else 0


def add_parser(sub) -> None:
    """Register `dapo-ray probe-reward` on the CLI's subparsers."""
    from dapo_ray.config import DEFAULT_CONFIG

    p = sub.add_parser("probe-reward",
                       help="try the config's reward (built-in tasks or reward.function) on hostile replies built "
                            "from its data; exits 1 when one is paid")  # fmt: skip
    p.add_argument("--config", default=DEFAULT_CONFIG, help="YAML config file")
    p.add_argument(
        "--rows", type=int, default=16, help="data rows to build replies from (default: %(default)s)"
    )
    p.add_argument(
        "overrides", nargs="*", help="section.key=value overrides, e.g. reward.function=my_reward.py:score"
    )
    p.set_defaults(func=main)
