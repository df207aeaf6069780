"""Verifier benchmarks: throughput per mode, worst wall time per call on hostile input, and agreement of
`math_verify` mode with Math-Verify itself on free-form answers.

Throughput, baseline `dapo_strict` (DAPO's own scorer verbatim): responses are built from the real
DAPO-Math-17k ground truths (`data/dapo-math-17k.parquet` as `dapo-ray prepare --paper-data` writes it,
or the folder DAPO_DATA_DIR names; synthetic ones without), ~800 characters of reasoning each, with
the answer written in the ways models write it (plain, $..$, \\boxed{}, special tokens, leading zeros,
wrong, missing).

Worst wall time: every mode, on the main thread (in-process) and off it (the helper process), over the
hand-picked hostile cases of tests/unit/test_verifier_hostile.py and `--fuzz` random ones built from
the pieces the fuzz tests use. The promise is TIME_LIMIT_S per call; warm-up (imports, the helper's
start) is done first and not counted.

Hostile replies: the restated questions, expressions equal to the truth, assignments and hedges of
tests/algo/test_reward_hostile.py, scored by each mode and by Math-Verify's own `verify(parse(gold),
parse(response))`: how many each pays (every mode must pay none).

Agreement: ~50 Math-Verify-style responses ("The answer is 42", "so x = \\frac{1}{2}"), right and
wrong, scored by Math-Verify's own `verify(parse(gold), parse(response))` as the reference, by
`math_verify` mode now, and by the mode as it was before the free-form fallback (the `Answer:` line or
the last \\boxed{} only; kept here as the baseline, not as a mode).

    python bench/verifier.py [--n 4000] [--fuzz 300]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dapo_ray.algo.reward import (
    MODES,
    TAIL_CHARS,
    TIME_LIMIT_S,
    compute_score,
    extract_answer_line,
    last_boxed,
    strip_special_tokens,
)

ROOT = Path(__file__).resolve().parents[1]

FORMS = [
    "Answer: {a}", "Answer: ${a}$", "Answer: \\boxed{{{a}}}", "Answer: {a}<|im_end|>", "Answer: 0{a}",
    "Answer: {a}1", "so the result is \\boxed{{{a}}}", "I am not sure.",
]  # fmt: skip


def responses(n: int) -> list[tuple[str, str]]:
    data = Path(os.environ.get("DAPO_DATA_DIR", ROOT / "data")) / "dapo-math-17k.parquet"
    if data.exists():
        import pyarrow.parquet as pq

        truths = [
            r["ground_truth"] for r in pq.read_table(data, columns=["reward_model"]).column(0).to_pylist()
        ]
    else:
        truths = [str(i) for i in range(1000)]
    rng = random.Random(0)
    filler = "Let us compute step by step. We have x = 3 and y = 4, so x^2 + y^2 = 25. " * 11
    out = []
    for _ in range(n):
        a = rng.choice(truths)
        out.append((filler + "\n" + rng.choice(FORMS).format(a=a), a))
    return out


def bench(mode: str, items: list[tuple[str, str]]) -> tuple[float, float]:
    compute_score(*items[0], mode=mode)  # warm-up (imports)
    t0 = time.perf_counter()
    acc = sum(compute_score(r, gt, mode=mode)["acc"] for r, gt in items)
    dt = time.perf_counter() - t0
    return len(items) / dt, acc / len(items)


# --- worst wall time on hostile input ----------------------------------------------------------------


def _test_module(relative: str):
    """A test module, loaded by path for its case lists (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location(Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fuzz_cases(n: int, seed: int = 0) -> list[tuple[str, object]]:
    """Random responses glued from the fuzz tests' pieces (text, LaTeX, special tokens, code, surrogates)
    and their math pieces (towers, factorials), behind the ways answers are introduced."""
    pieces = _test_module("tests/algo/test_reward_fuzz.py").PIECES
    pieces = pieces + _test_module("tests/unit/test_verifier_hostile.py").MATH_PIECES
    rng = random.Random(seed)
    prefixes = ["", "Answer: ", "The answer is ", "\\boxed{", "Answer: $"]
    truths = ["3", "0", "\\frac{1}{2}", "10^{10}", "x^2+1", 13, None]
    return [
        (rng.choice(prefixes) + "".join(rng.choices(pieces, k=rng.randint(1, 40))), rng.choice(truths))
        for _ in range(n)
    ]


def worst_times(cases: list[tuple[object, object]]) -> list[tuple[float, str, str, str]]:
    """(seconds, mode, path, input) of the slowest call, per mode and path."""

    def timed(response, ground_truth, mode):
        start = time.perf_counter()
        compute_score(response, ground_truth, mode)
        return time.perf_counter() - start

    out = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        for mode in MODES:
            compute_score("Answer: \\sqrt{8}", "2\\sqrt{2}", mode)  # warm-up: imports (Math-Verify's path)
            pool.submit(compute_score, "Answer: \\sqrt{8}", "2\\sqrt{2}", mode).result()  # warm-up: the helper's start
            for path in ("main thread", "helper"):
                worst = (0.0, "")
                for response, ground_truth in cases:
                    if path == "main thread":
                        seconds = timed(response, ground_truth, mode)
                    else:
                        seconds = pool.submit(timed, response, ground_truth, mode).result()
                    if seconds > worst[0]:
                        worst = (seconds, f"{str(response)[:70]!r} vs {str(ground_truth)[:20]!r}")
                out.append((worst[0], mode, path, worst[1]))
    return out


# --- agreement with Math-Verify on free-form answers ---------------------------------------------------

AGREEMENT_CASES = [
    # Free-form, right.
    ("The answer is 42", "42"), ("so x = \\frac{1}{2}", "\\frac{1}{2}"),
    ("Therefore the result is $\\sqrt{2}$", "\\sqrt{2}"), ("We get 3/4.", "\\frac{3}{4}"),
    ("The final answer is $7$. I hope it is correct.", "7"), ("Thus the area is $x^2+1$", "x^2+1"),
    ("Adding the two gives \\(15\\).", "15"), ("Hence the probability is $\\frac{2}{3}$.", "\\frac{2}{3}"),
    ("The total cost is 1,250 dollars.", "1250"), ("So the answer is 0.25", "\\frac{1}{4}"),
    ("which simplifies to $2\\sqrt{3}$", "\\sqrt{12}"), ("The roots sum to -5.", "-5"),
    ("Final answer: the distance is 12 km", "12"), ("In total, $\\pi r^2 = 9\\pi$", "9\\pi"),
    ("the answer is \\(\\frac{\\pi}{2}\\)", "\\frac{\\pi}{2}"), ("Therefore, $x = 5$.", "5"),
    ("so we need 100 tiles", "100"), ("The minimum value is $-\\frac{1}{2}$.", "-\\frac{1}{2}"),
    ("It equals 3.5", "\\frac{7}{2}"), ("the answer is $\\{1, 2, 3\\}$", "\\{1,2,3\\}"),
    ("The interval is $(0, 1]$", "(0,1]"), ("The largest is $2^{10}$", "1024"),
    ("Thus the answer is $\\dfrac{3}{8}$", "\\frac{3}{8}"), ("This gives 25%", "0.25"),
    ("The solution is x = -3", "-3"),
    # Free-form, wrong.
    ("The answer is 41", "42"), ("so x = \\frac{1}{3}", "\\frac{1}{2}"),
    ("Therefore the result is $\\sqrt{3}$", "\\sqrt{2}"), ("We get 4/3.", "\\frac{3}{4}"),
    ("The final answer is $8$. I hope it is correct.", "7"), ("Thus the area is $x^2-1$", "x^2+1"),
    ("So the answer is 0.3", "\\frac{1}{4}"), ("The roots sum to 5.", "-5"), ("so we need 99 tiles", "100"),
    ("I could not solve it.", "3"), ("The answer is 12, not 13", "12"), ("Hence $y = 2x + 1$", "2x-1"),
    ("which is $\\frac{\\pi}{3}$", "\\frac{\\pi}{2}"),
    # With an Answer: line or a box (the baseline reads these too).
    ("Answer: 42", "42"), ("Answer: \\frac{1}{2}", "0.5"), ("so \\boxed{\\sqrt{2}}", "\\sqrt{2}"),
    ("Answer: 41", "42"), ("\\boxed{7}", "8"), ("Answer: $\\frac{3}{4}$", "0.75"),
    ("The answer is \\boxed{1024}.", "2^{10}"), ("Answer: x = 5", "5"),
    # Reasoning, then a bare final expression.
    ("First, 2+2=4. Then 4*3=12. The answer is 12.", "12"), ("Let a = 3 and b = 4. Then c = 5.", "5"),
    ("Step 1: 10/2 = 5\nStep 2: 5 + 1 = 6\nSo 6.", "6"), ("We have 1 + 1 = 2, so the answer is $2$", "2"),
    ("The mean is 4.5 and the median is 5", "5"), ("so the answer is $3 < x < 5$", "(3,5)"),
]  # fmt: skip


def math_verify_reference(response: str, gold: str) -> bool:
    from math_verify import parse, verify

    return bool(verify(parse(f"${gold}$"), parse(response)))


def answer_line_or_box_only(response: str, gold: str) -> bool:
    """`math_verify` mode before the free-form fallback: DAPO's string match, else Math-Verify on the
    `Answer:` line or the last \\boxed{}; no answer of either kind is wrong."""
    from math_verify import parse, verify

    if compute_score(response, gold, "dapo")["acc"]:
        return True
    tail = strip_special_tokens(response)[-TAIL_CHARS:]
    line = extract_answer_line(tail)
    answer = line if line is not None else last_boxed(tail)
    if answer is None or not answer.strip():
        return False
    answer = answer.strip()
    if "$" not in answer and "\\boxed" not in answer:
        answer = f"${answer}$"
    pred = parse(answer)
    return bool(pred) and bool(verify(parse(f"${gold}$"), pred))


def agreement() -> tuple[int, int, list[tuple[str, str, bool, bool]]]:
    """Cases where the baseline and the mode now agree with the reference, and where the mode does not."""
    before = after = 0
    misses = []
    for response, gold in AGREEMENT_CASES:
        reference = math_verify_reference(response, gold)
        now = compute_score(response, gold, "math_verify")["acc"]
        before += answer_line_or_box_only(response, gold) is reference
        after += now is reference
        if now is not reference:
            misses.append((response, gold, reference, now))
    return before, after, misses


def hostile_acceptance() -> tuple[int, dict[str, int], list[str]]:
    """(hostile replies, how many each mode and Math-Verify itself accept, the ones Math-Verify accepts)."""
    cases = _test_module("tests/algo/test_reward_hostile.py").HOSTILE
    paid = {mode: sum(compute_score(r, gold, mode)["acc"] for r, gold in cases) for mode in MODES}
    by_math_verify = [f"{r!r} for {gold}" for r, gold in cases if math_verify_reference(r, gold)]
    paid["Math-Verify itself"] = len(by_math_verify)
    return len(cases), paid, by_math_verify


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4000, help="responses per mode for throughput")
    p.add_argument("--fuzz", type=int, default=300, help="random hostile responses for the worst wall time")
    args = p.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core (the helper inherits it)
    assert threading.current_thread() is threading.main_thread()

    items = responses(args.n)
    base, base_acc = bench("dapo_strict", items)
    print(f"{'mode':12s} {'responses/s':>12s} {'vs dapo_strict':>15s} {'accepted':>9s}")
    print(f"{'dapo_strict':12s} {base:12,.0f} {1.0:14.2f}x {base_acc:9.1%}")
    for mode, n in (("dapo", args.n), ("math_verify", max(200, args.n // 10))):
        rate, acc = bench(mode, items[:n])
        print(f"{mode:12s} {rate:12,.0f} {rate / base:14.2f}x {acc:9.1%}")
    print("target: dapo >= 2,000 responses/s on one core\n")

    sentinel = Path(tempfile.mkdtemp()) / "pwned"
    hand_picked = [
        case[:2] for case in _test_module("tests/unit/test_verifier_hostile.py").hostile_cases(sentinel)
    ]
    fuzzed = fuzz_cases(args.fuzz)
    print(f"worst wall time per call: {len(hand_picked)} hand-picked + {len(fuzzed)} random responses")
    rows = worst_times(hand_picked + fuzzed)
    for seconds, mode, path, what in rows:
        print(f"  {mode:12s} {path:12s} {seconds:6.3f} s  {what}")
    seconds, mode, path, what = max(rows)
    print(f"worst: {seconds:.3f} s ({mode}, {path}) on {what}; limit {TIME_LIMIT_S} s")
    print(f"sentinel file created by any answer: {sentinel.exists()}\n")

    n, paid, by_math_verify = hostile_acceptance()
    print(f"hostile replies paid (restated questions, expressions equal to the truth, hedges), of {n}:")
    for who, count in paid.items():
        print(f"  {who:20s} {count:3d}")
    for case in by_math_verify:
        print(f"  Math-Verify pays {case}")
    print()

    before, after, misses = agreement()
    n = len(AGREEMENT_CASES)
    print(f"agreement with Math-Verify's verify(parse(gold), parse(response)) on {n} free-form-style cases:")
    print(f"  before (Answer: line or \\boxed{{}} only): {before}/{n} = {before / n:.0%}")
    print(f"  after  (math_verify mode now):            {after}/{n} = {after / n:.0%}")
    # A number ground truth is matched by the number stated, never by evaluating an expression: where
    # Math-Verify evaluates one (`$2^{10}$` for 1024) the mode differs on purpose.
    for response, gold, reference, now in misses:
        print(f"  differs: {response!r} vs {gold!r}: Math-Verify {reference}, math_verify mode {now}")


if __name__ == "__main__":
    main()
