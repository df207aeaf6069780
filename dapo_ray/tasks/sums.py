"""The sums: a seeded arithmetic task generated here (`data.synthetic`), the demo's and most tests'.

    train, held_out = synthetic_rows({"num_train": 150, "num_eval": 64, "style": "question", ...}, "none")

Each row's `data_source` is `synthetic`, which gives it the `sums` task: scored by `reward.mode`'s scorer (the
demo: `math_verify`, the number the reply states), and the generic "states the reference" check.
"""

from __future__ import annotations

import random
from typing import Literal

from dapo_ray.data import template_messages
from dapo_ray.tasks.task import Task, by_mode, states_reference
from dapo_ray.types import PromptRow

SUMS = Task("sums", ("synthetic",), by_mode, states_reference,
            "generated arithmetic (data.synthetic), scored by reward.mode")  # fmt: skip

_OP_WORDS = {"+": "add {b}", "-": "subtract {b}", "*": "multiply by {b}"}


def synthetic_problem(rng: random.Random, num_terms: int, lo: int, hi: int, operators: str,
                      style: str = "words") -> tuple[str, str, list[str]]:  # fmt: skip
    """One left-to-right arithmetic problem: (problem text, answer, scratchpad lines). `style="words"`
    phrases it as a sentence; `"symbols"` writes the expression, evaluated left to right (`49+5=`);
    `"question"` asks for it as a user asks a chat model (`What is 49 + 5?`). Each
    scratchpad line is the expression with its first two terms replaced by their value, down to two
    terms, so every line needs one small operation on the line above it.

    >>> synthetic_problem(random.Random(0), 2, 0, 99, "+")
    ('Start with 49, add 5. What is the result?', '54', [])
    >>> synthetic_problem(random.Random(1), 4, 0, 9, "+", style="symbols")
    ('2+4+7+7=', '20', ['6+7+7', '13+7'])
    >>> synthetic_problem(random.Random(0), 2, 0, 99, "+", style="question")
    ('What is 49 + 5?', '54', [])
    """
    value = rng.randint(lo, hi)
    rest = [(rng.choice(operators), rng.randint(lo, hi)) for _ in range(num_terms - 1)]
    if style == "symbols":
        text = f"{_left_to_right(value, rest)}="
    elif style == "question":
        text = f"What is {_left_to_right(value, rest, spaced=True)}?"
    else:
        text = ", ".join([f"Start with {value}"] + [_OP_WORDS[op].format(b=b) for op, b in rest]) + ". What is the result?"
    steps = []
    for i, (op, b) in enumerate(rest):
        value = value + b if op == "+" else value - b if op == "-" else value * b
        steps.append(_left_to_right(value, rest[i + 1 :]))
    return text, str(value), steps[:-1]  # the last line would be the answer alone


def _left_to_right(value: int, rest: list[tuple[str, int]], spaced: bool = False) -> str:
    """`value` then each (operator, operand) of `rest`, evaluated left to right: a product that follows a
    sum is parenthesised. `spaced`: a space either side of each operator (`49 + 5`)."""
    expr, gap = str(value), " " if spaced else ""
    for op, b in rest:
        lhs = f"({expr})" if op == "*" and any(o in expr[1:] for o in "+-") else expr
        expr = f"{lhs}{gap}{op}{gap}{b}"
    return expr


def synthetic_prompts(
    num_train: int,
    num_eval: int,
    *,
    flavour: Literal["short", "reasoning"] = "short",
    num_terms: int = 2,
    min_terms: int = 0,
    min_operand: int = 0,
    max_operand: int = 99,
    operators: str = "+",
    style: Literal["words", "symbols", "question"] = "words",
    instruction: str = "",
    seed: int = 0,
) -> tuple[list[PromptRow], list[PromptRow]]:
    """Seeded arithmetic word problems with integer answers: (train rows, eval rows), never overlapping.
    Each problem has `num_terms` operands, or a number drawn from [min_terms, num_terms] when `min_terms`
    is set. `instruction`, when given, follows each problem after a space ("Reply with the number only.").

    `solution` is the reference response: `Answer: 54` (short) or the scratchpad lines then the
    `Answer:` line (reasoning), the format the DAPO verifier reads.
    """
    lowest = min_terms or num_terms
    if not 2 <= lowest <= num_terms or min_operand > max_operand:
        raise ValueError("need 2 <= min_terms <= num_terms and min_operand <= max_operand")
    values, ops = max_operand - min_operand + 1, len(operators)
    space = sum(values**k * ops ** (k - 1) for k in range(lowest, num_terms + 1))
    if space < num_train + num_eval:  # drawn by rejection: asking for all of a small space stays quick (all 441: about 3,000 draws)
        raise ValueError(
            f"only {space} distinct problems exist for these knobs; {num_train} + {num_eval} asked "
            "(widen max_operand or num_terms)"
        )
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: dict[str, list[PromptRow]] = {"train": [], "eval": []}
    for split, count in (("train", num_train), ("eval", num_eval)):
        while len(splits[split]) < count:
            terms = rng.randint(min_terms, num_terms) if min_terms else num_terms
            text, answer, steps = synthetic_problem(rng, terms, min_operand, max_operand, operators, style)
            if text in seen:
                continue
            seen.add(text)
            lines = (steps if flavour == "reasoning" else []) + [f"Answer: {answer}"]
            splits[split].append({
                "uid": f"synthetic-{split}:{len(splits[split])}",
                "messages": [{"role": "user", "content": f"{text} {instruction}" if instruction else text}],
                "ground_truth": answer,
                "data_source": "synthetic",
                "solution": "\n".join(lines),
            })  # fmt: skip
    return splits["train"], splits["eval"]


def synthetic_rows(synthetic: dict, template: Literal["dapo", "none"]) -> tuple[list[PromptRow], list[PromptRow]]:
    """`synthetic_prompts(**synthetic)` with `data.template` applied: `dapo` rebuilds each problem as DAPO's
    instruction template around it (which asks for an `Answer:` line), `none` keeps it as written."""
    train, held_out = synthetic_prompts(**synthetic)
    if template == "dapo":
        for row in train + held_out:
            template_messages(row["messages"], "always")
    return train, held_out
