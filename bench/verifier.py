"""Verifier throughput: responses scored per second, per mode, on one core.

Baseline: `dapo_strict`, DAPO's own scorer verbatim. Responses are built from the real DAPO-Math-17k
ground truths (or synthetic ones when ../shared/data is absent), ~800 characters of reasoning each,
with the answer written in the ways models write it (plain, $..$, \\boxed{}, special tokens, leading
zeros, wrong, missing).

    python bench/verifier.py [--n 4000]
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

from dapo_ray.algo.reward import compute_score

FORMS = [
    "Answer: {a}", "Answer: ${a}$", "Answer: \\boxed{{{a}}}", "Answer: {a}<|im_end|>", "Answer: 0{a}",
    "Answer: {a}1", "so the result is \\boxed{{{a}}}", "I am not sure.",
]  # fmt: skip


def responses(n: int) -> list[tuple[str, str]]:
    data = Path(__file__).resolve().parents[2] / "shared" / "data" / "dapo-math-17k.parquet"
    if data.exists():
        import pyarrow.parquet as pq

        truths = [r["ground_truth"] for r in pq.read_table(data, columns=["reward_model"]).column(0).to_pylist()]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4000, help="responses per mode")
    args = p.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    items = responses(args.n)
    base, base_acc = bench("dapo_strict", items)
    print(f"{'mode':12s} {'responses/s':>12s} {'vs dapo_strict':>15s} {'accepted':>9s}")
    print(f"{'dapo_strict':12s} {base:12,.0f} {1.0:14.2f}x {base_acc:9.1%}")
    for mode, n in (("dapo", args.n), ("math_verify", max(200, args.n // 10))):
        rate, acc = bench(mode, items[:n])
        print(f"{mode:12s} {rate:12,.0f} {rate / base:14.2f}x {acc:9.1%}")
    print("target: dapo >= 2,000 responses/s on one core")


if __name__ == "__main__":
    main()
