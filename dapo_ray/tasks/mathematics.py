"""DeepMind's Mathematics Dataset (Saxton et al., ICLR 2019) from its generator on PyPI, as prompt files.

    rows = generate("train-easy", ["numbers__gcd"], per_module=100, seed=1)
    report = write_splits(["numbers__gcd", "arithmetic__add_or_sub"], "runs/data/mathematics", per_module=400)
    #  -> train-easy.parquet, interpolate.parquet, extrapolate.parquet (+ mathematics.json: the echo baseline)

`mathematics-dataset` 1.0.1 (Apache-2.0) generates 56 modules of school mathematics (arithmetic,
algebra, numbers, comparison, measurement, polynomials, probability, calculus), each question with one
answer string (`-18`, `3298`, `-2/11`, `12, 5, 0.3, -0.18, -2/11`, `True`). Its splits:

* `train-easy`, `train-medium`, `train-hard`: the training modules, their entropy range cut in thirds;
* `interpolate`: the same modules at one difficulty inside the training range (entropy 8 of 3-10 for most
  modules: `train-hard`'s level, harder than `train-easy`), for testing;
* `extrapolate`: harder variants (`arithmetic__add_or_sub_big`, `numbers__place_value_big`, ...).

Held-out problems come from `interpolate` and `extrapolate`, never from a training split, and a held-out
question that is also a training question is dropped. The package's hash split (`train_test_split.is_train`),
which keeps the values test questions are built from out of training questions, is used by its measurement
and probability modules only; elsewhere a test question differs from training by its draw and difficulty. The paper's metric is exact match of the answer: `algo.reward`'s `exact` mode,
which every row of this file is scored by (its `data_source` is `mathematics_dataset/<module>`, which
`dapo_ray.tasks` gives the `mathematics` task).

The package predates the Python stack it now installs into; `generator()` makes it run, in one place:

* sympy 1.14 moved `diophantine.base_solution_linear` (its polynomial modules import it);
* numpy 2 removed `np.object` and `ndarray.itemset`, which `sample/polynomials.py` uses (the polynomials
  and calculus modules, and `algebra__polynomial_roots_composed`): that module gets a numpy of its own
  whose arrays still have `itemset`;
* Python 3.12 refuses the float bounds (`-5.0`) that `modules/numbers.py`'s rounding questions pass to
  `random.randint`: that module gets a `random` whose `randint` takes them as the integers they are (the
  same draws from the same global generator);
* its composed questions pick variable names from a set (`util/composition.py`, `Context.pop`) and shuffle
  a set of entities, whose order changes with Python's hash seed and object addresses: that module's
  `random` puts the candidates in a fixed order first, so a seed gives the same files on every machine;
* `generate.init_modules` reads absl flags; the module dictionaries are built here without it.

Every question is put in a chat prompt: `plain` (the question and "Reply with the answer only.") or
`dapo` (DAPO's instruction template, which asks for an `Answer:` line). With `shots`, worked examples of
the same module (from the training split) come first as earlier chat turns, each replied to in that form.
"""

from __future__ import annotations

import functools
import importlib
import json
import random
import re
import sys
import time
import types
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from dapo_ray.tasks.task import Task, exact, states_reference

SPLITS = ("train-easy", "train-medium", "train-hard", "interpolate", "extrapolate")
TRAIN_SPLITS = SPLITS[:3]
SOURCE = "mathematics_dataset"
"""The `data_source` prefix of every row: `mathematics_dataset/<module>`."""
MATHEMATICS = Task("mathematics", (SOURCE,), exact, states_reference,
                   "DeepMind's Mathematics Dataset (dapo-ray prepare-mathematics), its exact match")  # fmt: skip
INSTRUCTION = "Reply with the answer only."
CPU_MODULES = (
    "algebra__linear_1d", "arithmetic__add_or_sub", "arithmetic__add_sub_multiple", "arithmetic__div",
    "arithmetic__mixed", "arithmetic__mul", "comparison__kth_biggest", "comparison__pair", "measurement__conversion",
    "numbers__div_remainder", "numbers__gcd", "numbers__is_prime", "numbers__lcm", "numbers__place_value",
    "numbers__round_number", "polynomials__evaluate",
)  # fmt: skip
"""`workflows/configs/mathematics_cpu.yaml`'s modules (`prepare-mathematics`'s default): those whose answers
SmolLM2-135M-Instruct sometimes states right in a few tokens, so that its groups are mixed."""
Template = Literal["plain", "dapo"]


class MathematicsError(ValueError):
    """A module or split that does not exist, or options that cannot be used."""


class _ItemsetArray:
    """numpy 2 without `np.object` and with arrays that keep `ndarray.itemset` (numpy 1's spelling of
    `a[index] = value`), for the one package module that uses both."""

    def __init__(self, np):
        self._np = np
        self.object = object

        class Array(np.ndarray):
            def itemset(self, index, value):
                self[index] = value

        self._array = Array

    def __getattr__(self, name):
        return getattr(self._np, name)

    def zeros(self, *args, **kwargs):
        return self._np.zeros(*args, **kwargs).view(self._array)

    def empty(self, *args, **kwargs):
        return self._np.empty(*args, **kwargs).view(self._array)


class _IntegralRandint:
    """The `random` module, with `randint` taking integral floats (`-5.0`) as Python 3.11 did."""

    def __getattr__(self, name):
        return getattr(random, name)

    @staticmethod
    def randint(a, b):
        return random.randint(int(a), int(b)) if a == int(a) and b == int(b) else random.randint(a, b)


def _fixed_order(items: list) -> list:
    """`items` in an order that does not depend on the process: letters sorted, entities by their handle
    and description."""
    if all(isinstance(x, str) for x in items):
        return sorted(items)
    if all(hasattr(x, "_handle") for x in items):  # `Entity`: reading `.handle` would mark it used
        return sorted(items, key=_entity_key)
    return items


def _entity_key(entity) -> tuple[str, str]:
    handle = entity._handle
    return (handle if isinstance(handle, str) else type(handle).__name__, str(getattr(entity, "_description", "")))


class _FixedOrderRandom(_IntegralRandint):
    """`random` for `util/composition.py`: `choice` and `shuffle` see their candidates in a fixed order."""

    @staticmethod
    def choice(seq):
        return random.choice(_fixed_order(list(seq)))

    @staticmethod
    def shuffle(x):
        x[:] = _fixed_order(list(x))
        random.shuffle(x)


@functools.cache
def generator() -> types.ModuleType:
    """`mathematics_dataset.modules.modules`, imported and made to work with sympy 1.14 and numpy 2."""
    import numpy as np

    moved = importlib.import_module("sympy.solvers.diophantine.diophantine")
    package = sys.modules["sympy.solvers.diophantine"]  # `sympy.solvers.diophantine` the attribute is a function
    if not hasattr(package, "base_solution_linear"):
        package.base_solution_linear = moved.base_solution_linear
    polynomials = importlib.import_module("mathematics_dataset.sample.polynomials")
    polynomials.np = _ItemsetArray(np)  # the same arrays, with `itemset`, on any numpy
    importlib.import_module("mathematics_dataset.modules.numbers").random = _IntegralRandint()
    importlib.import_module("mathematics_dataset.util.composition").random = _FixedOrderRandom()
    return importlib.import_module("mathematics_dataset.modules.modules")


def _entropy_third(level: int) -> Callable[[tuple[float, float]], tuple[float, float]]:
    """The package's difficulty levels: a third of each module's entropy range (`generate._make_entropy_fn`)."""

    def cut(range_: tuple[float, float]) -> tuple[float, float]:
        lo, hi = range_
        return lo + level / 3 * (hi - lo), lo + (level + 1) / 3 * (hi - lo)

    return cut


def _flatten(tree: dict, prefix: str = "") -> dict[str, Callable]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}__{key}" if prefix else key
        out.update(_flatten(value, name) if isinstance(value, dict) else {name: value})
    return out


@functools.cache
def modules_of(split: str) -> dict[str, Callable]:
    """Module name (`numbers__gcd`) -> its problem generator, for one split."""
    if split not in SPLITS:
        raise MathematicsError(f"unknown split {split!r}; the splits are {', '.join(SPLITS)}")
    m = generator()
    if split in TRAIN_SPLITS:
        tree = m.train(_entropy_third(TRAIN_SPLITS.index(split)))
    else:
        tree = m.test() if split == "interpolate" else m.test_extra()
    return dict(sorted(_flatten(tree).items()))


def extrapolate_modules(modules: Sequence[str]) -> list[str]:
    """The extrapolate modules that are harder variants of `modules` (`arithmetic__add_or_sub` ->
    `arithmetic__add_or_sub_big`): each extrapolate module whose name, or its name less its last `_word`, is one
    of them."""
    chosen = set(modules)
    return [name for name in modules_of("extrapolate") if name in chosen or name.rsplit("_", 1)[0] in chosen]


def _check_modules(split: str, modules: Sequence[str]) -> None:
    known = modules_of(split)
    unknown = [m for m in modules if m not in known]
    if unknown:
        raise MathematicsError(f"no module {', '.join(map(repr, unknown))} in split {split}; its modules are: "
                               f"{', '.join(known)}")  # fmt: skip


def sample(module: Callable) -> tuple[str, str]:
    """One (question, answer) of a module's generator, skipping the over-long ones as the package does
    (`generate.sample_from_module`: questions up to 160 characters, answers up to 30)."""
    from mathematics_dataset import generate_settings as limits

    while True:
        problem = module()
        question, answer = str(problem.question), str(problem.answer)
        if len(question) <= limits.MAX_QUESTION_LENGTH and len(answer) <= limits.MAX_ANSWER_LENGTH:
            return question, answer


def prompt_text(question: str, template: Template) -> str:
    """The user message for a question: `plain` adds "Reply with the answer only."; `dapo` wraps it in
    DAPO's instruction template (an `Answer:` line)."""
    from dapo_ray.data import apply_dapo_template

    if template == "dapo":
        return apply_dapo_template(question)
    if template != "plain":
        raise MathematicsError(f"template must be plain or dapo, not {template!r}")
    return f"{question} {INSTRUCTION}"


def reply_text(answer: str, template: Template) -> str:
    """A worked example's reply in the form the template asks for: the answer alone (`plain`), or an
    `Answer:` line (`dapo`). Both are what the benchmark's metric scores right."""
    return f"Answer: {answer}" if template == "dapo" else answer


def messages(question: str, template: Template, examples: Sequence[tuple[str, str]] = ()) -> list[dict]:
    """The chat prompt: each worked example as a user turn and the reply the template asks for, then the
    question (few-shot prompting as chat turns, as lm-evaluation-harness's `--apply_chat_template
    --fewshot_as_multiturn` does)."""
    turns: list[dict] = []
    for q, a in examples:
        turns += [{"content": prompt_text(q, template), "role": "user"}, {"content": reply_text(a, template), "role": "assistant"}]
    return turns + [{"content": prompt_text(question, template), "role": "user"}]


def shot_module(name: str, shot_split: str) -> str:
    """The training module that worked examples for `name` come from: itself, or for an extrapolate module
    the module it is a harder variant of (`arithmetic__add_or_sub_big` -> `arithmetic__add_or_sub`)."""
    known = modules_of(shot_split)
    for candidate in (name, name.rsplit("_", 1)[0]):
        if candidate in known:
            return candidate
    raise MathematicsError(f"no module of {shot_split} to take worked examples for {name!r} from")


SHOT_POOL = 32
"""Worked examples are drawn per row from this many problems of the module's training split."""


def _draw(split: str, name: str, count: int, key: str) -> list[tuple[str, str]]:
    """`count` distinct (question, answer) of one module, seeded by `key` (Python's, numpy's and sympy's
    generators, which the package draws from; the caller saves and restores them)."""
    import numpy as np
    import sympy.core.random as sympy_random

    random.seed(key)
    np.random.seed(random.getrandbits(32))
    sympy_random.rng.seed(random.getrandbits(32))  # sympy's own (`randprime` in the primality questions)
    seen: set[str] = set()
    out: list[tuple[str, str]] = []
    tries = 0
    while len(out) < count:
        tries += 1
        if tries > 20 * count + 100:
            raise MathematicsError(f"{split}/{name}: only {len(out)} distinct questions in {tries - 1} draws; ask "
                                   f"for fewer than {count}")  # fmt: skip
        question, answer = sample(modules_of(split)[name])
        if question not in seen:
            seen.add(question)
            out.append((question, answer))
    return out


def generate(split: str, modules: Sequence[str], per_module: int, seed: int, template: Template = "plain",
             progress: Callable[[str], None] | None = None, *, shots: int = 0,
             shot_split: str = "train-easy") -> list[dict]:  # fmt: skip
    """`per_module` distinct problems of each module of `split`, as rows in the verl/DAPO schema
    (`prepare.OUTPUT_SCHEMA`). With `shots`, each prompt first shows that many worked examples of the same
    module, drawn from `shot_split` (a training split: a held-out prompt never shows a test problem) and
    never the row's own question. Seeded: the same arguments give the same rows on any machine (the package
    draws from Python's, numpy's and sympy's generators, which are re-seeded per module and restored after),
    and the problems do not depend on `shots`."""
    import numpy as np
    import sympy.core.random as sympy_random

    _check_modules(split, modules)
    if per_module < 1:
        raise MathematicsError(f"per_module must be at least 1, got {per_module}")
    if not 0 <= shots < SHOT_POOL:
        raise MathematicsError(f"shots must be from 0 to {SHOT_POOL - 1}, got {shots}")
    rows: list[dict] = []
    saved = random.getstate(), np.random.get_state(), sympy_random.rng.getstate()
    try:
        for k, name in enumerate(modules):
            t0 = time.time()
            pool = _draw(shot_split, shot_module(name, shot_split), SHOT_POOL, f"{seed}/shots/{name}") if shots else []
            for i, (question, answer) in enumerate(_draw(split, name, per_module, f"{seed}/{split}/{name}")):
                others = [ex for ex in pool if ex[0] != question]
                examples = random.Random(f"{seed}/{split}/{name}/{i}").sample(others, shots)
                rows.append({
                    "data_source": f"{SOURCE}/{name}",
                    "prompt": messages(question, template, examples),
                    "ability": "MATH",
                    "reward_model": {"ground_truth": answer, "style": "rule"},
                    "extra_info": {"index": len(rows), "raw_problem": question,
                                   "source_file": f"{SOURCE}:{split}", "source_row": i},
                })  # fmt: skip
            if progress:
                progress(f"{split}: {name} ({k + 1}/{len(modules)}): {per_module} problems in {time.time() - t0:.1f}s")
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        sympy_random.rng.setstate(saved[2])
    return rows


def write_parquet(rows: list[dict], path: str | Path) -> None:
    """`rows` (from `generate`) as one parquet file in the schema `dapo-ray prepare` writes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dapo_ray.prepare import OUTPUT_SCHEMA

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA), str(path))


# --- the echo baseline ------------------------------------------------------------------------------------

_QUESTION_NUMBER_RE = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:/\d+)?(?![\w.]*\d)")


def echo_answers(question: str) -> dict[str, str]:
    """The answers a policy that only echoes the question could give: its last, smallest and largest
    number as written (none when the question has no number), and for a rounding question its number
    cut at the asked place (`truncate`).

    >>> echo_answers("What is the greatest common divisor of 1368 and 57?")
    {'last': '57', 'smallest': '57', 'largest': '1368'}
    """
    from dapo_ray.algo.stated import parse_number

    found = [(m.group(), parse_number(m.group())) for m in _QUESTION_NUMBER_RE.finditer(question)]
    found = [(text, value) for text, value in found if value is not None]
    if not found:
        return {}
    answers = {"last": found[-1][0], "smallest": min(found, key=lambda f: f[1])[0],
               "largest": max(found, key=lambda f: f[1])[0]}  # fmt: skip
    if (cut := truncated(question)) is not None:
        answers["truncate"] = cut
    return answers


ECHO_RULES = ("last", "smallest", "largest", "truncate", "constant")

_NUMBER_WORDS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten".split())}
_POWER_WORDS = {"integer": 0, "ten": 1, "one hundred": 2, "one thousand": 3, "ten thousand": 4,
                "one hundred thousand": 5, "one million": 6}  # fmt: skip
# The package's round_number: "Round {input} to {place}." or "What is {input} rounded to {place}?", where
# the place is "the nearest 1000" / "the nearest one thousand" / "the nearest integer" or "2 decimal
# places" / "two dps" (mathematics_dataset/modules/numbers.py, round_number).
_ROUNDING_RE = re.compile(r"^(?:Round|What is) (-?[\d.]+) (?:rounded )?to (?:the nearest ([a-z ]+|\d+)|(\w+) (?:decimal places?|dps?))\W*$")


def rounding_place(question: str) -> tuple[str, int] | None:
    """A rounding question's number as written and the power of ten it asks to round to (-2: two decimal
    places, 3: the nearest thousand); None for any other question."""
    m = _ROUNDING_RE.match(question.strip())
    if m is None:
        return None
    number, nearest, places = m.groups()
    if nearest is not None:
        power = len(nearest) - 1 if re.fullmatch(r"10*", nearest) else _POWER_WORDS.get(nearest)
    else:
        decimals = int(places) if places.isdigit() else _NUMBER_WORDS.get(places)
        power = None if decimals is None else -decimals
    return None if power is None else (number, power)


def truncated(question: str) -> str | None:
    """A rounding question's number cut toward zero at the asked place: what copying its digits up to that
    place answers. Right only where rounding changes none of them (the next digit under 5, for a positive
    number). None for any other question.

    >>> truncated("What is -160150.615109 rounded to the nearest integer?"), truncated("Round 1.7372 to 2 dps.")
    ('-160150', '1.73')
    >>> truncated("Round -24883209.2444 to the nearest ten thousand."), truncated("Is 7 prime?")
    ('-24880000', None)
    """
    from decimal import ROUND_DOWN, Decimal

    if (asked := rounding_place(question)) is None:
        return None
    number, power = asked
    step = Decimal(1).scaleb(power)
    cut = (Decimal(number) / step).to_integral_value(rounding=ROUND_DOWN) * step
    return format(cut.quantize(step) if power < 0 else cut.quantize(Decimal(1)), "f")


def commonest_answers(rows: list[dict]) -> dict[str, str]:
    """Module -> its commonest answer in `rows` (the training problems): what a policy that gives one answer
    to every question of a module would have learned to say."""
    answers: dict[str, Counter] = defaultdict(Counter)
    for row in rows:
        answers[row["data_source"].split("/", 1)[1]][row["reward_model"]["ground_truth"]] += 1
    return {module: c.most_common(1)[0][0] for module, c in answers.items()}


def echo_baseline(rows: list[dict], constants: dict[str, str] | None = None) -> dict[str, dict[str, float]]:
    """Per module: the accuracy (by the benchmark's metric) of answering every question with its last,
    smallest or largest number, with a rounding question's number cut at the asked place (`truncate`), or
    with one `constant` answer, the module's commonest training answer (`constants`, from
    `commonest_answers`; `False` in a primality module), and `best`, the highest of the five. Learning
    counts above it."""
    right: dict[str, Counter] = defaultdict(Counter)
    total: Counter = Counter()
    for row in rows:
        module = row["data_source"].split("/", 1)[1]
        total[module] += 1
        answers = echo_answers(row["extra_info"]["raw_problem"])
        if constants and module in constants:
            answers["constant"] = constants[module]
        for rule in ECHO_RULES:
            reply = answers.get(rule)
            right[module][rule] += bool(reply) and MATHEMATICS.score(reply, row["reward_model"]["ground_truth"], "")["acc"]
    out = {}
    for module, n in total.items():
        shares = {rule: right[module][rule] / n for rule in ECHO_RULES}
        out[module] = {**shares, "best": max(shares.values()), "problems": n}
    return out


# --- the files a config reads -----------------------------------------------------------------------------


def write_splits(modules: Sequence[str], out_dir: str | Path, *, train_split: str = "train-easy",
                 per_module: int = 400, held_out_per_module: int = 16, seed: int = 1,
                 template: Template = "plain", shots: int = 0, extrapolate: bool = True,
                 progress: Callable[[str], None] | None = print) -> dict:  # fmt: skip
    """Training problems from `train_split` and held-out problems from `interpolate` (and the harder
    `extrapolate` variants of the same modules) under `out_dir`, one parquet file per split, and
    `mathematics.json`: what was written and the echo baseline of each held-out module. A held-out question
    that also appears in training is dropped and counted."""
    if train_split not in TRAIN_SPLITS:
        raise MathematicsError(f"train_split must be one of {', '.join(TRAIN_SPLITS)}, not {train_split!r}")
    if not modules:
        raise MathematicsError("name at least one module")
    _check_modules(train_split, modules)
    _check_modules("interpolate", modules)
    out_dir = Path(out_dir)
    t0 = time.time()
    train = generate(train_split, modules, per_module, seed, template, progress, shots=shots, shot_split=train_split)
    seen = {r["extra_info"]["raw_problem"] for r in train}
    files = {train_split: train}
    held_out_splits = [("interpolate", list(modules))]
    if extrapolate and (harder := extrapolate_modules(modules)):
        held_out_splits.append(("extrapolate", harder))
    report: dict = {"modules": list(modules), "train_split": train_split, "seed": seed, "template": template,
                    "shots": shots, "files": {}, "dropped_seen_in_training": {}, "echo_baseline": {}}  # fmt: skip
    trained = commonest_answers(train)  # the constant rule's answers; an extrapolate module's: its training module's
    for split, names in held_out_splits:
        rows = generate(split, names, held_out_per_module, seed + 1, template, progress, shots=shots,
                        shot_split=train_split)  # fmt: skip
        kept = [r for r in rows if r["extra_info"]["raw_problem"] not in seen]
        report["dropped_seen_in_training"][split] = len(rows) - len(kept)
        for i, r in enumerate(kept):
            r["extra_info"]["index"] = i
        files[split] = kept
        report["echo_baseline"][split] = echo_baseline(kept, {m: trained[shot_module(m, train_split)] for m in names})
    for split, rows in files.items():
        path = out_dir / f"{split}.parquet"
        write_parquet(rows, path)
        report["files"][split] = {"path": str(path), "rows": len(rows)}
    report["seconds"] = round(time.time() - t0, 1)
    (out_dir / "mathematics.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def module_of(data_source: str) -> str | None:
    """`mathematics_dataset/numbers__gcd` -> `numbers__gcd`; None for a row of another source."""
    prefix, _, module = data_source.partition("/")
    return module if prefix == SOURCE and module else None


if __name__ == "__main__":  # pragma: no cover - a quick look: python -m dapo_ray.tasks.mathematics numbers__gcd
    for question, answer in (sample(modules_of("train-easy")[name]) for name in sys.argv[1:]):
        print(f"{question}  ->  {answer}")
