"""The ablation ladder of DAPO Table 1 on the reasoning-length task (`tiny_cpu_reasoning.yaml`): naive
GRPO, then + overlong filtering, + clip-higher, + soft overlong punishment, + token-level loss,
+ dynamic sampling (`dapo_ray.ablation.LADDER`), several seeds per rung.

Every run starts from the same warmed-up tiny model and stops at the same number of generated responses
(`trainer.max_generated`): dynamic sampling spends more generation per step, so rungs are compared at
equal generation; the table also gives each rung's accuracy at an equal wall time (the fastest rung's
total). Held-out avg@k (k: the config's `eval.n`) is evaluated every `--eval-every` steps.

    python bench/ablation.py                                 # 6 rungs x 3 seeds, about 1.5 h on 2 cores
    python bench/ablation.py --rungs naive-grpo dapo --seeds 1 --max-generated 2048   # a quick look
    python bench/ablation.py --rungs naive-grpo dapo --set algorithm.max_policy_lag=0 --out runs/ablation-lag0
    python bench/ablation.py --rungs dapo --config workflows/configs/tiny_cpu.yaml --max-generated 24576   # the tiny demo
    python bench/ablation.py --rungs dapo dapo+gspo dapo+cispo dapo+drgrpo dapo+tis   # other methods' choices

`--rungs` also takes the variants of `dapo_ray.ablation.VARIANTS` (DAPO with GSPO's, CISPO's or Dr. GRPO's
loss, or the rollout correction); `--set` composes any other switch, e.g.
`--rungs dapo --set algorithm.rollout_is=sequence algorithm.rollout_is_mode=mask --out runs/ablation-seq-mis`.

`--set` adds config overrides to every run (after the rung's own), e.g. the same ladder strictly
on-policy instead of with generation overlapped as the reasoning config has it.

Each run is its own process with its own local Ray cluster, one after another; its result is kept in
`<out>/runs/<rung>-s<seed>.json` (`--out`: runs/ablation), so an interrupted ladder resumes where it
stopped. The table goes to stdout and `<out>/ablation.md`, the plots (held-out accuracy, mean reward,
response length and entropy: mean and min-max over seeds) to `<out>/ablation.png` against generated responses
and to `<out>/ablation-minutes.png` against minutes of training (the steps' own time: held-out evaluations,
start-up and the final save not counted).

    python bench/ablation.py --rungs dapo --config workflows/configs/smollm2_cpu.yaml \
        --max-generated 100000 --eval-every 5 --set trainer.total_steps=20 --out runs/smollm2-lag0   # SmolLM2, 3 seeds
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dapo_ray.ablation import LADDER, VARIANTS, overrides_for  # noqa: E402

CONFIG = ROOT / "workflows/configs/tiny_cpu_reasoning.yaml"
RUNGS = [name for name, _ in LADDER]
NAMES = RUNGS + [name for name, _ in VARIANTS]


def run_one(rung: str, seed: int, max_generated: int, eval_every: int, out: Path, extra: list[str],
            config: Path = CONFIG) -> dict:  # fmt: skip
    """One run of the ladder, in this process; returns what the table and plots need."""
    from dapo_ray.config import load_config
    from dapo_ray.driver import run
    from dapo_ray.models import ensure_model

    base = load_config(config)
    # Without dynamic sampling a step generates train_batch_size groups: that many steps fit the budget.
    steps = -(-max_generated // (base.trainer.train_batch_size * base.rollout.n))
    cfg = load_config(config, overrides_for(rung) + [
        f"trainer.seed={seed}", f"data.seed={seed}", f"trainer.max_generated={max_generated}",
        f"trainer.total_steps={steps}", "trainer.save_every=0", f"eval.every={eval_every}",
        f"trainer.output_dir={out / 'runs' / f'{rung}-s{seed}'}", "tracking.enabled=false", *extra,
    ])  # fmt: skip
    # One start for every run: the config's model (the tiny one built with the config's own seed, as
    # `dapo-ray demo` does, or SmolLM2 from its wheel).
    ensure_model(base)
    summary = run(cfg)
    steps = [
        {"step": e["step"], "generated": g, **{k: e["metrics"].get(k, 0) for k in (
            "actor/entropy", "response_length/mean", "response_length/clip_ratio", "critic/acc/mean", "critic/score/mean",
            "timing/step_s", "response_length/generated_mean", "dynamic_sampling/stale_dropped",
            "dynamic_sampling/generated_groups", "ledger/resampled")}}
        for e, g in zip(summary["steps_log"], _cumulative(summary["steps_log"], cfg.rollout.n), strict=True)
    ]  # fmt: skip
    evals = [{k: v for k, v in e.items() if k in ("step", "generated", "train_s", "eval/avg_at_k", "eval/pass_at_k")
              or k.startswith("eval/avg_at_k/")} for e in summary["evals"]]  # per data_source too  # fmt: skip
    return {"rung": rung, "seed": seed, "config": str(config), "max_generated": max_generated, "extra": extra,
            "train_s": summary["train_s"], "eval_s": summary["eval_s"], "totals": summary["totals"],
            "n": cfg.rollout.n, "eval_n": cfg.eval.n, "steps": steps, "evals": evals}  # fmt: skip


def load(path: Path) -> dict:
    """A saved run with minutes of training (the steps' own time, as `driver.training_s` counts it) at the
    end of each step and at each evaluation (those of the step it follows)."""
    result, minutes = json.loads(path.read_text()), 0.0
    for s in result["steps"]:
        minutes += s["timing/step_s"] / 60
        s["train_min"] = minutes
    for e in result["evals"]:
        e["train_min"] = max((s["train_min"] for s in result["steps"] if s["step"] <= e["step"]), default=0.0)
    return result


def eval_k(result: dict) -> int:
    """The samples a problem of the run's held-out evaluations (the k of avg@k); a result saved without it
    gets it from its config and overrides."""
    if "eval_n" in result:
        return result["eval_n"]
    from dapo_ray.config import load_config

    return load_config(Path(result["config"]), overrides_for(result["rung"]) + result["extra"]).eval.n


LOW_ECHO = 0.05
"""A Mathematics Dataset module counts towards `--low-echo` when its echo baseline is under this."""


def low_echo_modules(report: Path, split: str = "interpolate") -> list[str]:
    """The held-out modules of `dapo-ray prepare-mathematics`'s report whose echo baseline (a number of the
    question, or one constant answer) is under 5%: where learning cannot be echoing."""
    baseline = json.loads(report.read_text())["echo_baseline"][split]
    return sorted(m for m, b in baseline.items() if b["best"] < LOW_ECHO)


def with_low_echo(result: dict, modules: list[str]) -> dict:
    """`result` with `eval/avg_at_k/low-echo` at each evaluation: the mean over `modules` of their
    held-out accuracy (each module weighs the same)."""
    for e in result["evals"]:
        e["eval/avg_at_k/low-echo"] = statistics.fmean(e[f"eval/avg_at_k/mathematics_dataset/{m}"] for m in modules)
    return result


def low_echo_table(results: list[dict], modules: list[str]) -> str:
    """Per run: held-out accuracy over the low-echo modules at the start and at the end, its ratio and
    gain, and minutes of training."""
    k = "/".join(sorted({str(eval_k(r)) for r in results}))
    lines = [f"Held-out avg@{k} over the {len(modules)} modules whose echo baseline is under {LOW_ECHO:.0%} "
             f"({', '.join(modules)}):", "",
             "| run | start | end | end / start | gain, points | minutes of training |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        a, b = r["evals"][0]["eval/avg_at_k/low-echo"], r["evals"][-1]["eval/avg_at_k/low-echo"]
        ratio = f"{b / a:.2f}x" if a else "-"
        lines.append(f"| {r['rung']} seed {r['seed']} | {a:.1%} | {b:.1%} | {ratio} | {100 * (b - a):+.1f} | "
                     f"{r['evals'][-1]['train_min']:.1f} |")  # fmt: skip
    return "\n".join(lines)


def _cumulative(steps_log: list[dict], n: int) -> list[int]:
    total, out = 0, []
    for e in steps_log:
        total += e["metrics"]["dynamic_sampling/generated_groups"] * n
        out.append(total)
    return out


def at(points: list[tuple[float, float]], x: float) -> float:
    """The value of a step curve at x: the last point at or before x.

    >>> at([(0, 0.1), (10, 0.3), (20, 0.5)], 15)
    0.3
    """
    value = points[0][1]
    for px, py in points:
        if px <= x:
            value = py
    return value


def table(results: list[dict]) -> str:
    """Per rung: held-out avg@k at the start, at equal generation (the end) and at equal wall time,
    mean and spread over seeds, with entropy and length over the last fifth of each run."""
    by_rung = {r: [x for x in results if x["rung"] == r] for r in NAMES}
    by_rung = {r: xs for r, xs in by_rung.items() if xs}
    equal_time = min(x["evals"][-1]["train_min"] for xs in by_rung.values() for x in xs)

    def fmt(values: list[float]) -> str:
        mean = statistics.fmean(values)
        return f"{mean:.1%} ± {statistics.pstdev(values):.1%}" if len(values) > 1 else f"{mean:.1%}"

    k = "/".join(sorted({str(eval_k(r)) for r in results}))
    lines = [f"| rung | seeds | held-out avg@{k} at start | at equal generation | at equal time ({equal_time:.1f} min of training) "
             "| steps | minutes of training | entropy (last 20%) | response length (last 20%) | truncated (last 20%) |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for rung, xs in by_rung.items():
        tail = [s for x in xs for s in x["steps"][-max(1, len(x["steps"]) // 5) :]]
        lines.append("| " + " | ".join([
            rung, str(len(xs)),
            fmt([x["evals"][0]["eval/avg_at_k"] for x in xs]),
            fmt([x["evals"][-1]["eval/avg_at_k"] for x in xs]),
            fmt([at([(e["train_min"], e["eval/avg_at_k"]) for e in x["evals"]], equal_time) for x in xs]),
            f"{statistics.fmean(len(x['steps']) for x in xs):.0f}",
            f"{statistics.fmean(x['evals'][-1]['train_min'] for x in xs):.1f}",
            f"{statistics.fmean(s['actor/entropy'] for s in tail):.3f}",
            f"{statistics.fmean(s['response_length/mean'] for s in tail):.1f}",
            f"{statistics.fmean(s['response_length/clip_ratio'] for s in tail):.1%}",
        ]) + " |")  # fmt: skip
    return "\n".join(lines)


def plot(results: list[dict], path: Path, x: str = "generated", held_out: str = "eval/avg_at_k") -> None:
    """Held-out avg@k (each seed's own points; `held_out`: which), mean reward, response length and entropy
    (mean and min-max over seeds) against `x`: generated responses ("generated") or minutes of training
    ("train_min")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title = "held-out avg@k" + (", low-echo modules" if held_out.endswith("low-echo") else "")
    panels = [(title, "evals", held_out), ("mean reward", "steps", "critic/score/mean"),
              ("response length (tokens)", "steps", "response_length/mean"), ("entropy", "steps", "actor/entropy")]  # fmt: skip
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for ax, (title, series, key) in zip(axes, panels, strict=True):
        for rung in NAMES:
            xs = [r for r in results if r["rung"] == rung and all(key in p for p in r[series])]
            if not xs:
                continue
            if series == "evals":  # a few points per seed, at different x: each seed's own line
                color = ax.plot([], [], label=rung)[0].get_color()
                for r in xs:
                    ax.plot([p[x] for p in r[series]], [p[key] for p in r[series]], marker="o", color=color, alpha=0.6)
                continue
            grid = sorted({p[x] for r in xs for p in r[series]})
            curves = [[at([(p[x], p[key]) for p in r[series]], g) for g in grid] for r in xs]
            mean = [statistics.fmean(c[i] for c in curves) for i in range(len(grid))]
            ax.plot(grid, mean, label=rung)
            ax.fill_between(grid, [min(c[i] for c in curves) for i in range(len(grid))],
                            [max(c[i] for c in curves) for i in range(len(grid))], alpha=0.15)  # fmt: skip
        ax.set_title(title)
        ax.set_xlabel("generated responses" if x == "generated" else "minutes of training")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rungs", nargs="+", default=RUNGS, choices=NAMES,
                    help="ladder rungs and variants to run (default: the ladder)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per rung (1, 2, ...)")
    ap.add_argument("--max-generated", type=int, default=12288, help="generated responses per run")
    ap.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", dest="extra",
                    help="config overrides for every run, after the rung's own")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/ablation")
    ap.add_argument("--config", type=Path, default=CONFIG, help="the task (default: the reasoning-length one)")
    ap.add_argument("--low-echo", type=Path, metavar="MATHEMATICS_JSON",
                    help="prepare-mathematics's report: also give held-out accuracy over the modules whose echo "
                         "baseline is under 5%% (table, and the plots' held-out panel)")  # fmt: skip
    ap.add_argument("--one", nargs=2, metavar=("RUNG", "SEED"), help=argparse.SUPPRESS)  # a child process
    args = ap.parse_args()
    out = args.out.resolve()
    if args.one:
        rung, seed = args.one[0], int(args.one[1])
        result = run_one(rung, seed, args.max_generated, args.eval_every, out, args.extra, args.config.resolve())
        (out / "runs" / f"{rung}-s{seed}.json").write_text(json.dumps(result))
        return 0

    from dapo_ray.config import load_config

    for rung in args.rungs:  # a typo in --set, or a clash with a rung's switches, fails here before any run
        load_config(args.config, overrides_for(rung) + args.extra)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    todo = [(rung, seed) for seed in range(1, args.seeds + 1) for rung in args.rungs]
    t0 = time.time()
    for i, (rung, seed) in enumerate(todo, 1):
        done = out / "runs" / f"{rung}-s{seed}.json"
        kept = json.loads(done.read_text()) if done.exists() else {}
        if kept.get("max_generated") == args.max_generated and kept.get("extra", []) == args.extra:
            print(f"[ablation] {i}/{len(todo)} {rung} seed {seed}: done before", flush=True)
            continue
        print(f"[ablation] {i}/{len(todo)} {rung} seed {seed} ({(time.time() - t0) / 60:.0f} min so far)", flush=True)
        log = out / "runs" / f"{rung}-s{seed}.log"
        with log.open("w") as f:
            rc = subprocess.call([sys.executable, __file__, "--one", rung, str(seed), "--out", str(out),
                                  "--max-generated", str(args.max_generated), "--eval-every", str(args.eval_every),
                                  "--config", str(args.config.resolve()),
                                  *(["--set", *args.extra] if args.extra else [])],
                                 stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)  # fmt: skip
        if rc != 0:
            print(f"[ablation] {rung} seed {seed} failed (exit {rc}); see {log}", flush=True)
            return rc
        result = load(done)
        evals = result["evals"]
        print(f"[ablation]   held-out avg@{eval_k(result)} {evals[0]['eval/avg_at_k']:.1%} -> {evals[-1]['eval/avg_at_k']:.1%}", flush=True)

    results = [load(out / "runs" / f"{r}-s{s}.json") for r, s in todo]
    text = table(results)
    if args.extra:
        text = f"Overrides on every run: `{' '.join(args.extra)}`\n\n{text}"
    held_out = "eval/avg_at_k"
    if args.low_echo:
        modules = low_echo_modules(args.low_echo)
        results = [with_low_echo(r, modules) for r in results]
        text += "\n\n" + low_echo_table(results, modules)
        held_out = "eval/avg_at_k/low-echo"
    print(text)
    (out / "ablation.md").write_text(text + "\n")
    plot(results, out / "ablation.png", held_out=held_out)
    plot(results, out / "ablation-minutes.png", x="train_min", held_out=held_out)
    print(f"[ablation] {out / 'ablation.md'}, {out / 'ablation.png'}  ({(time.time() - t0) / 60:.0f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
