"""What the model says: the replies of a held-out evaluation, their shapes, and the hack alarm.

A reward that pays something other than right answers shows in the replies, not in the curves: a policy
trained with the `math_verify` scorer learned to reply "14 + 3 = ?" to "What is 14 + 3?", the scorer
evaluated the expression to 17 and paid it, and avg@k rose. So every held-out evaluation keeps a sample
of replies (the first sample of the first problems), the commonest reply *shapes* (digits masked, so
"14 + 3 = ?" and "25 + 8 = ?" are one shape), and the share of rewarded replies that never write the
reference answer (`dapo_ray.algo.stated.states_reference`). That share above `reward.alarm_share`, over at
least `ALARM_MIN_REWARDED` rewarded replies, is the hack alarm.

Plain Python. `states_reference` is imported inside the functions that call it: `dapo_ray.algo` loads
torch, and `dapo_ray.evaluate` (imported by every `dapo-ray` command) imports this module.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

ALARM_MIN_REWARDED = 8
"""Fewer rewarded replies than this never raise the alarm: one odd reply of three is not a pattern."""

_SPECIAL_TOKEN = re.compile(r"<\|[^|<>]{1,40}\|>|</?s>")  # <|im_end|>, <|endoftext|>, </s>
_DIGITS = re.compile(r"\d+")


def one_line(text: str, width: int) -> str:
    """`text` on one line, whitespace collapsed; a longer one keeps its start and its end (where the
    answer usually is), joined by ` ... `.

    >>> one_line("Let me think.\\n\\n  Answer: 17", 80)
    'Let me think. Answer: 17'
    >>> one_line("We add the two numbers step by step. Answer: 17", 30)
    'We add the t ... p. Answer: 17'
    """
    flat = " ".join(text.split())
    if len(flat) <= width:
        return flat
    head = (width - 5) // 2
    return f"{flat[:head]} ... {flat[len(flat) - (width - 5 - head) :]}"


def reply_shape(text: str, width: int = 80) -> str:
    """The form of a reply: on one line, special tokens dropped, each run of digits written `N`, cut to
    `width` characters (`one_line`).

    >>> reply_shape("14 + 3 = ?<|im_end|>")
    'N + N = ?'
    >>> reply_shape("25 + 8 = 33\\nAnswer: 33")
    'N + N = N Answer: N'
    """
    return one_line(_DIGITS.sub("N", _SPECIAL_TOKEN.sub(" ", text)), width)


def commonest_shapes(texts: Sequence[str], top: int = 8) -> list[tuple[str, float, int]]:
    """The `top` commonest reply shapes: (shape, share of `texts`, count), commonest first.

    >>> commonest_shapes(["14 + 3 = ?", "25 + 8 = ?", "Answer: 17", "9 + 9 = ?"], top=2)
    [('N + N = ?', 0.75, 3), ('Answer: N', 0.25, 1)]
    """
    counts = Counter(reply_shape(t) for t in texts)
    return [(shape, count / len(texts), count) for shape, count in counts.most_common(top)]


def unstated_rewarded_ratio(texts: Sequence[str], ground_truths: Sequence[str], accs: Sequence[bool],
                            stated: Sequence[bool] | None = None) -> tuple[float, int]:  # fmt: skip
    """(share of the replies judged right that do not state their reference answer, how many were judged
    right); (0.0, 0) when none was. One entry per reply in each sequence. `stated`: each reply's task's own
    verdict on that (`tasks.judge_group`); without it, the generic check (`algo.stated.states_reference`).

    >>> unstated_rewarded_ratio(["14 + 3 = ?", "Answer: 17", "Answer: 5"], ["17", "17", "6"], [True, True, False])
    (0.5, 2)
    """
    if stated is None:
        from dapo_ray.algo.stated import states_reference

        stated = [states_reference(t, g) for t, g in zip(texts, ground_truths, strict=True)]
    rewarded = [s for s, a in zip(stated, accs, strict=True) if a]
    if not rewarded:
        return 0.0, 0
    return sum(not s for s in rewarded) / len(rewarded), len(rewarded)


def alarm_up(ratio: float, rewarded: int, share: float) -> bool:
    """The hack alarm: more than `share` of at least `ALARM_MIN_REWARDED` rewarded replies do not state
    the reference answer (`reward.alarm_share`)."""
    return rewarded >= ALARM_MIN_REWARDED and ratio > share


def alarm_message(ratio: float, rewarded: int, where: str, replies_at: str) -> str:
    """The line the driver and `dapo-ray eval` print when the alarm is up.

    >>> print(alarm_message(0.62, 130, "at step 7", "report/summary.md"))
    HACK ALARM: 62% of the 130 replies the scorer rewarded at step 7 do not state the reference answer: the reward may pay something other than right answers; read the replies (report/summary.md)
    """
    return (f"HACK ALARM: {ratio:.0%} of the {rewarded} replies the scorer rewarded {where} do not state the "
            f"reference answer: the reward may pay something other than right answers; read the replies "
            f"({replies_at})")  # fmt: skip


def reply_sample(results: Sequence, n: int) -> list[dict]:
    """The replies an evaluation keeps: the first sample of each of the first `n` problems of `results`
    (`dapo_ray.evaluate.ProblemResult`s), each with what the verifier made of it and whether it states
    the reference answer."""
    from dapo_ray.algo.stated import states_reference

    return [{"uid": r.uid, "problem": r.problem, "ground_truth": r.ground_truth, "reply": r.texts[0],
             "pred": r.preds[0], "acc": r.acc[0],
             "states_reference": r.stated[0] if r.stated else states_reference(r.texts[0], r.ground_truth)}
            for r in results[:n] if r.texts]  # fmt: skip


def replies_record(results: Sequence, n: int) -> dict:
    """What an evaluation keeps of its replies, as JSON: the commonest shapes over all of them and the
    first reply of each of the first `n` problems (`reply_sample`)."""
    shapes = commonest_shapes([t for r in results for t in r.texts])
    return {"shapes": [{"shape": shape, "share": share, "count": count} for shape, share, count in shapes],
            "replies": reply_sample(results, n)}  # fmt: skip


def reply_lines(sample: Sequence[dict], n: int, width: int = 100) -> list[str]:
    """A few replies of `reply_sample` for the console, one line each; a right one that does not state the
    reference answer says so.

    >>> reply_lines([{"problem": "What is 14 + 3?", "ground_truth": "17", "reply": "14 + 3 = ?", "pred": "17",
    ...               "acc": True, "states_reference": False}], 4)
    ['right  What is 14 + 3? -> "14 + 3 = ?"  (extracted 17, reference 17, not stated)']
    """
    return [f"{'right' if s['acc'] else 'wrong'}  {s['problem']} -> \"{one_line(s['reply'], width)}\"  (extracted "
            f"{s['pred']}, reference {s['ground_truth']}{', not stated' if s['acc'] and not s['states_reference'] else ''})"
            for s in sample[:n]]  # fmt: skip


# --- markdown ------------------------------------------------------------------------------------------


def cell(text: str, width: int) -> str:
    """`text` as a markdown table cell: on one line (`one_line`), `|` escaped, and `<` written as an entity
    so that a reply's `<think>` or `<|im_end|>` shows instead of being read as HTML.

    >>> print(cell("x | y\\n<|im_end|>", 40))
    x \\| y &lt;\\|im_end\\|>
    """
    return one_line(text, width).replace("|", "\\|").replace("<", "&lt;")


def shapes_table(shapes: Sequence[dict]) -> str:
    """The shapes of `replies_record` as a markdown table."""
    lines = ["| share | replies | shape |", "|---|---|---|"]
    lines += [f"| {s['share']:.1%} | {s['count']} | {cell(s['shape'], 90)} |" for s in shapes]
    return "\n".join(lines)


def replies_table(sample: Sequence[dict], width: int = 300) -> str:
    """`reply_sample` as a markdown table; a reply longer than `width` characters keeps its start and end."""
    lines = ["| problem | ground truth | reply | extracted | verdict | states the reference |", "|---|---|---|---|---|---|"]
    lines += [f"| {cell(s['problem'], 80)} | {cell(s['ground_truth'], 30)} | {cell(s['reply'], width)} | "
              f"{cell(s['pred'], 30)} | {'right' if s['acc'] else 'wrong'} | {'yes' if s['states_reference'] else 'no'} |"
              for s in sample]  # fmt: skip
    return "\n".join(lines)
