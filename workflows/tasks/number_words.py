"""An example task of your own: read a number written in words, reply with its digits.

    "Write seven hundred forty-two as a number. Reply with the number only."  ->  742

It is what a user brings to dapo-ray: a data file in verl's schema and a reward function in verl's
convention, nothing else. Neither is built in; the run names them in its config
(workflows/configs/number_words_cpu.yaml):

    python workflows/tasks/number_words.py --out-dir runs/data/number_words     # writes train / test parquet
    dapo-ray probe-reward --config workflows/configs/number_words_cpu.yaml      # is the reward hackable?
    dapo-ray demo --config workflows/configs/number_words_cpu.yaml

The question holds no digit, so a reply cannot be paid for copying a number from it; the reward reads the
number the reply states last and pays it only when it stands alone (not "742 or 743", not "700 + 42").
The file imports nothing but the standard library (and pyarrow to write the data): it runs on every node
the working directory reaches.
"""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

DATA_SOURCE = "number_words"
INSTRUCTION = "Reply with the number only."

_ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen " \
        "seventeen eighteen nineteen".split()  # fmt: skip
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def words(n: int) -> str:
    """English words for 0 <= n < 1,000,000, with a hyphen inside 21-99 and no "and".

    >>> words(742), words(15), words(40), words(1005), words(320019)
    ('seven hundred forty-two', 'fifteen', 'forty', 'one thousand five', 'three hundred twenty thousand nineteen')
    """
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else "-" + _ONES[n % 10])
    if n < 1000:
        return f"{_ONES[n // 100]} hundred" + ("" if n % 100 == 0 else " " + words(n % 100))
    return f"{words(n // 1000)} thousand" + ("" if n % 1000 == 0 else " " + words(n % 1000))


# --- the reward: verl's convention -------------------------------------------------------------------------

_NUMBER = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?![\d,])|(?<![\w.])-?\d+(?![\w.]*\d)")
_HEDGE_OR_SUM = re.compile(r"(?:\bor\b|\band\b|[+\-*/x×=<>?])\s*$", re.I)  # "742 or", "700 +": not standing alone
# "It is not 742.", "I can't say, but it isn't 742": `dapo-ray probe-reward` found this file's first version paying
# a denied number (a refusal or negation with the answer in it), which a policy would have learned to write.
_DENIED = re.compile(r"(?:\b(?:not|never|no)|n['\u2019]t)\s+(?:\w+\s+){0,2}(?:\$|\\boxed\{|\\\(|\()*$", re.I)


def stated_number(reply: str) -> int | None:
    """The number a reply states: its last number, when nothing joins it to another ("742 or 743", "700 + 42",
    "742?" state none), nor one denied. Commas between groups of three digits are thousands separators.

    >>> stated_number("It is 742."), stated_number("742 or 743"), stated_number("700 + 42"), stated_number("1,005")
    (742, None, None, 1005)
    >>> stated_number("The answer is not 742."), stated_number("It isn't $742$"), stated_number("742 is wrong.")
    (None, None, None)
    """
    reply = reply.strip()
    found = list(_NUMBER.finditer(reply))
    if not found:
        return None
    last = found[-1]
    before, after = reply[: last.start()], reply[last.end() :].strip()
    if _HEDGE_OR_SUM.search(before) or (after[:1] and after[0] in "+-*/x×=<>?") or re.match(r"(?i)or\b", after):
        return None
    if _DENIED.search(before) or re.match(r"(?i)(?:is|was)\s+(?:not|wrong)\b", after):
        return None
    return int(last.group().replace(",", ""))


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """verl's custom reward signature: +1 when the reply states the number, -1 otherwise (DAPO Eq. 7), with
    what was read (`pred`) and whether it was right (`acc`), as verl's DAPO scorer returns them."""
    stated = stated_number(solution_str[-300:])
    right = stated is not None and stated == int(ground_truth)
    return {"score": 1.0 if right else -1.0, "acc": right, "pred": "" if stated is None else str(stated)}


def states_reference(reply: str, reference: str) -> bool:
    """The hack alarm's check for this task: the reply writes the number's digits somewhere."""
    return any(int(m.group().replace(",", "")) == int(reference) for m in _NUMBER.finditer(reply))


# --- the data: verl's parquet schema -----------------------------------------------------------------------


def row(n: int) -> dict:
    """The verl-schema row that asks for `n`."""
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"Write {words(n)} as a number. {INSTRUCTION}"}],
            "ability": "reading", "reward_model": {"ground_truth": str(n), "style": "rule"},
            "extra_info": {"words": words(n), "digits": len(str(n))}}  # fmt: skip


def write(out_dir: str | Path, train: int = 800, test: int = 64, high: int = 999, seed: int = 0) -> dict:
    """`train.parquet` and a disjoint `test.parquet` of numbers from 0 to `high`, each number's length in
    digits drawn first, uniformly (a uniform draw of the number would be nearly all six-digit numbers)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    bands = [(lo, min(hi, high)) for lo, hi in ((0, 9), (10, 99), (100, 999), (1000, 9999), (10_000, 99_999),
                                                (100_000, 999_999)) if lo <= high]  # fmt: skip
    if train + test > high + 1:
        raise ValueError(f"only {high + 1} numbers up to {high}; {train} + {test} asked")
    seen: set[int] = set()
    split = {}
    for name, count in (("test", test), ("train", train)):  # test first: its numbers never reach training
        split[name] = []
        while len(split[name]) < count:
            open_bands = [(lo, hi) for lo, hi in bands if sum(lo <= s <= hi for s in seen) < hi - lo + 1]
            lo, hi = rng.choice(open_bands)
            n = rng.randint(lo, hi)
            if n not in seen:
                seen.add(n)
                split[name].append(row(n))
        pq.write_table(pa.Table.from_pylist(split[name]), out_dir / f"{name}.parquet")
    return {name: len(r) for name, r in split.items()}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default="runs/data/number_words")
    p.add_argument("--train", type=int, default=800)
    p.add_argument("--test", type=int, default=64)
    p.add_argument("--high", type=int, default=999, help="largest number (up to 999,999)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(write(a.out_dir, a.train, a.test, a.high, a.seed), "->", a.out_dir)
