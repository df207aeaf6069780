"""dapo-ray against TRL's `GRPOTrainer`, side by side on one machine: the same model directory,
train/held-out split, verifier, group size, prompts per step, mini-batch, lengths, learning rate and
warm-up.

    pip install -e '.[bench]'                # TRL: a dependency of this bench only
    python bench/vs_trl.py                   # (a) the demo: 0.6M model, short answers, accuracy against time
    python bench/vs_trl.py --setting large   # (b) a 23M model, 128-token responses: throughput
    for s in 1 2 3; do python bench/vs_trl.py --seed $s; done   # (a) on three seeds
    python bench/vs_trl.py --setting smollm2 --seed 2         # (c) SmolLM2-135M-Instruct, 20 steps

Each side runs in its own process, one after the other (TRL first), and writes `<out>/<setting>-<side>.json`;
the comparison goes to stdout and `<out>/<setting>.md` (`--out`: runs/vs_trl). `--seed N` sets both
sides' seeds (TRL's `seed`; dapo-ray's `trainer.seed` and `data.seed`: sampling, shuffling) from the same
start model, and names the results `<setting>-sN`. `--trl-from DIR` takes the TRL side from an earlier comparison (DIR/trl.json) and runs dapo-ray alone. `--dapo-from RUN.json` takes the dapo-ray side from a
run of `bench/ablation.py` (rung `dapo`) with the same config, seed, steps and `--set` (its tracking switch aside) instead of running it again. `--set KEY=VALUE ...` overrides the config both sides
read (TRL takes only the shared settings above; e.g. `algorithm.carry_over=true
algorithm.max_policy_lag=2` changes dapo-ray alone). `--report` prints the comparison again from the
saved results without running anything.

dapo-ray runs a workflow config (`tiny_cpu.yaml` for (a), as `make demo-tiny` does: the full recipe with
dynamic sampling and generation overlapped with training). TRL runs `GRPOTrainer` with the same
settings read from that config: `loss_type="dapo"` (token-level loss), `epsilon`/`epsilon_high`
(clip-higher), `mask_truncated_completions` (overlong filtering), `beta=0` (no KL), the soft overlong
punishment as a second reward function (TRL's `get_soft_overlong_punishment`, Eq. 13), generation with
HF `generate` (TRL's vLLM path needs CUDA), model and tokenizer passed as objects. One dapo-ray step is
`train_batch_size` kept groups of n; TRL generates the same number of completions per step
(`generation_batch_size`) and takes the same optimizer steps on them (mini-batch by gradient
accumulation over micro-batches). TRL has no dynamic sampling: it trains on every group, including
those whose rewards are all equal (zero advantage, only the clip and length terms move).

(a) Held-out avg@8 on the config's 64 held-out problems, temperature 1, every `--eval-every` steps, by one
evaluator on both sides: dapo-ray's own (a vLLM replica on Ray Serve, the config's `eval` sampling and
verifier). dapo-ray's run evaluates as it trains; TRL saves its weights at those steps and they go through
`dapo-ray eval`'s path once training ends. Time spent evaluating or saving is taken off both clocks.
Printed: completions/s, seconds per step, the accuracy curve against training time, and the time each side
needs to reach the best accuracy both sides reach.

(c) As (a), on SmolLM2-135M-Instruct and `smollm2_cpu.yaml` (20 steps, evaluated every 5): a real BPE
tokenizer and ChatML template on both sides, both in bf16 (TRL by autocast), both scoring with the config's
`math_verify`, both with the config's `trainer.attn_implementation` (eager there) and
`trainer.gradient_checkpointing` (off there; TRL's own default is on).

(b) Throughput only: the 23M-parameter random model of `bench/rollout.py` (EOS suppressed, so every
response is `max_response_length` = 128 tokens) on the reasoning flavour's prompts, 8 prompts x n 8 per
step, no dynamic sampling (a random model scores -1 everywhere, so every group would be filtered):
completions/s and seconds per step over `--large-steps` steps after the first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

DEMO = ROOT / "workflows/configs/tiny_cpu.yaml"
SMOLLM2 = ROOT / "workflows/configs/smollm2_cpu.yaml"
# Per setting with an accuracy curve: the config, default steps and evaluation interval, and the accuracies
# whose first crossing the report times.
CURVES = {"demo": (DEMO, 300, 50, (0.3, 0.4)), "smollm2": (SMOLLM2, 20, 5, (0.5, 0.75, 0.9, 0.95, 0.99))}
REASONING = ROOT / "workflows/configs/tiny_cpu_reasoning.yaml"
SIDES = ("trl", "dapo-ray")  # run in this order: TRL first


def config(a: argparse.Namespace, out: Path):
    """The workflow config both sides read, with the bench's overrides."""
    from dapo_ray.config import load_config

    common = [f"trainer.output_dir={out / 'dapo-ray'}", "tracking.enabled=false", "trainer.save_every=0"]
    if a.seed is not None:
        common += [f"trainer.seed={a.seed}", f"data.seed={a.seed}"]
    common += a.extra
    if a.setting in CURVES:
        return load_config(CURVES[a.setting][0], common + [f"trainer.total_steps={a.steps}", f"eval.every={a.eval_every}"])
    return load_config(REASONING, common + [
        f"rollout.model_path={out / 'model-23m'}", "rollout.max_response_length=128",
        f"trainer.total_steps={a.large_steps + 1}", "trainer.train_batch_size=8", "trainer.gen_batch_size=8",
        "rollout.n=8", "trainer.mini_batch_size=64", "trainer.micro_batch_size=16",
        "algorithm.dynamic_sampling=false", "eval.every=0", "data.synthetic.num_eval=8",
    ])  # fmt: skip


def model_dir(a: argparse.Namespace, cfg, out: Path) -> Path:
    """Build the model both sides start from, once."""
    if a.setting == "demo":
        from dapo_ray.config import load_config
        from dapo_ray.tiny_model import build_for

        return build_for(load_config(DEMO))  # the demo's model, whatever --seed says (as make demo-tiny builds it)
    if a.setting == "smollm2":
        from dapo_ray.models import ensure_model

        return ensure_model(cfg)
    import rollout as rollout_bench

    path = Path(cfg.rollout.model_path)
    if not (path / "config.json").exists():
        rollout_bench.build_model("large", path, max_len=512)
    return path


# ---------------------------------------------------------------- the two sides (child processes)


def side_dapo(a: argparse.Namespace, cfg) -> dict:
    from dapo_ray.driver import run, training_s

    shutil.rmtree(cfg.trainer.output_dir, ignore_errors=True)  # a fresh run, not a resume
    summary = run(cfg)
    step_s = [e["metrics"]["timing/step_s"] for e in summary["steps_log"][1:]]
    return {
        "steps": summary["steps"], "time_s": training_s(summary, summary["steps"]),
        "generated": summary["totals"]["generated_groups"] * cfg.rollout.n,
        # The groups each step trained on: kept groups beyond the batch (carry-over off) are not.
        "trained": sum(e["metrics"]["dynamic_sampling/batch_groups"] for e in summary["steps_log"]) * cfg.rollout.n,
        "step_s": statistics.median(step_s) if step_s else None,
        "evals": [{"step": e["step"], "time_s": training_s(summary, e["step"]), "avg_at_8": e["eval/avg_at_k"]}
                  for e in summary["evals"]],
    }  # fmt: skip


def from_ablation(a: argparse.Namespace, cfg, path: Path) -> dict:
    """The dapo-ray side from a saved `bench/ablation.py` run of the same config, seed and steps."""
    import ablation

    run = ablation.load(path)
    if a.setting not in CURVES:
        raise SystemExit(f"--dapo-from needs an accuracy setting ({', '.join(CURVES)}), not {a.setting}")
    want = {"rung": "dapo", "config": str(CURVES[a.setting][0]), "seed": cfg.trainer.seed, "steps": cfg.trainer.total_steps}
    have = {"rung": run["rung"], "config": run.get("config"), "seed": run["seed"], "steps": len(run["steps"])}
    # Its overrides, less the step count and tracking (which change nothing the two sides compare), must
    # be this comparison's --set: TRL then reads the same settings.
    settings = [e for e in run["extra"] if not e.startswith(("trainer.total_steps=", "tracking."))]
    if want != have or settings != a.extra:
        raise SystemExit(f"{path} is not this comparison's dapo-ray run: it has {have}, overrides {settings}; "
                         f"this comparison needs {want} and --set {' '.join(a.extra) or '(none)'}")  # fmt: skip
    step_s = [s["timing/step_s"] for s in run["steps"][1:]]
    return {
        "steps": len(run["steps"]), "time_s": run["steps"][-1]["train_min"] * 60,
        "generated": run["totals"]["generated_groups"] * run["n"], "trained": run["totals"]["kept_groups"] * run["n"],
        "step_s": statistics.median(step_s) if step_s else None,
        "evals": [{"step": e["step"], "time_s": e["train_min"] * 60, "avg_at_8": e["eval/avg_at_k"]} for e in run["evals"]],
        "from": str(path),
    }  # fmt: skip


def side_trl(a: argparse.Namespace, cfg, path: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.rewards import get_soft_overlong_punishment

    from dapo_ray.algo.reward import compute_score
    from dapo_ray.tasks.sums import synthetic_rows

    t, al, r = cfg.trainer, cfg.algorithm, cfg.rollout
    train, _ = synthetic_rows(dataclasses.asdict(cfg.data.synthetic), cfg.data.template)
    per_step = t.train_batch_size * r.n  # completions generated per step
    updates = per_step // t.mini_batch_size  # optimizer steps per step
    steps = t.total_steps  # the same number of steps as the dapo-ray side
    tokenizer = AutoTokenizer.from_pretrained(path)
    snapshots = Path(t.output_dir).parent / "trl-snapshots"  # the weights at each evaluation step
    shutil.rmtree(snapshots, ignore_errors=True)
    # The trainer's attention kernel too (`trainer.attn_implementation`): a setting of the model, not of
    # either system, so neither side wins by it.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=t.attn_implementation)

    def correctness(completions, ground_truth, **_) -> list[float]:
        return [compute_score(c[0]["content"], gt, cfg.reward.mode)["score"]
                for c, gt in zip(completions, ground_truth, strict=True)]  # fmt: skip

    rewards = [correctness]
    if al.soft_overlong:
        rewards.append(get_soft_overlong_punishment(r.max_response_length, al.overlong_cache_length))
    if al.loss_agg_mode != "token-mean":
        raise SystemExit(f"TRL's dapo loss is token-mean; the config has {al.loss_agg_mode}")
    args = GRPOConfig(
        output_dir=str(Path(t.output_dir).parent / "trl"), report_to="none", save_strategy="no",
        disable_tqdm=True, logging_steps=10 * updates, use_cpu=True, bf16=t.dtype == "bfloat16", seed=t.seed,
        num_generations=r.n, generation_batch_size=per_step, per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.mini_batch_size // t.micro_batch_size, num_iterations=1,
        max_steps=steps * updates, max_completion_length=r.max_response_length,
        temperature=r.temperature, top_p=r.top_p, top_k=0,
        learning_rate=t.lr, lr_scheduler_type="constant_with_warmup", warmup_steps=t.warmup_steps * updates,
        gradient_checkpointing=t.gradient_checkpointing,  # TRL's default is on; the config's, as dapo-ray's
        weight_decay=t.weight_decay, adam_beta1=t.betas[0], adam_beta2=t.betas[1], max_grad_norm=t.grad_clip,
        loss_type="dapo", beta=0.0, epsilon=al.eps_low, epsilon_high=al.eps_high,
        mask_truncated_completions=al.overlong_filter, scale_rewards="group",
    )  # fmt: skip
    data = Dataset.from_list(
        [{"prompt": row["messages"], "ground_truth": row["ground_truth"]} for row in train]
    )

    class Clock(TrainerCallback):
        """Step ends and held-out evaluations on a clock that stops while evaluating."""

        def __init__(self) -> None:
            self.t0, self.eval_s, self.step_ends, self.evals = 0.0, 0.0, [], []

        def now(self) -> float:
            return time.time() - self.t0 - self.eval_s

        def evaluate(self, step: int, model) -> None:
            """Save the weights of `step`, to be evaluated after training (`evaluate_snapshots`)."""
            t0 = time.time()
            snap = snapshots / f"step-{step}"
            model.save_pretrained(snap)
            tokenizer.save_pretrained(snap)
            self.eval_s += time.time() - t0
            self.evals.append({"step": step, "time_s": self.now(), "dir": str(snap)})
            print(f"[trl] step {step}: weights saved for the held-out evaluation at {self.now():.0f}s", flush=True)

        def on_train_begin(self, args, state, control, model=None, **_):
            self.t0 = time.time()
            if a.setting in CURVES:
                self.evaluate(0, model)
                self.evals[0]["time_s"] = 0.0
            self.t0, self.eval_s = time.time(), 0.0

        def on_step_end(self, args, state, control, model=None, **_):
            if state.global_step % updates:
                return
            step = state.global_step // updates
            self.step_ends.append(self.now())
            if a.setting in CURVES and (step % a.eval_every == 0 or step == steps):
                self.evaluate(step, model)

    clock = Clock()
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=rewards, args=args,
                          train_dataset=data, callbacks=[clock])  # fmt: skip
    trainer.train()
    del trainer, model
    gaps = [b - a_ for a_, b in zip(clock.step_ends, clock.step_ends[1:], strict=False)]
    return {"steps": steps, "time_s": clock.step_ends[-1], "generated": steps * per_step, "trained": steps * per_step,
            "step_s": statistics.median(gaps) if gaps else None, "evals": evaluate_snapshots(cfg, clock.evals)}  # fmt: skip


def evaluate_snapshots(cfg, evals: list[dict]) -> list[dict]:
    """Held-out avg@k of the weights TRL saved at each evaluation step, by the evaluator dapo-ray's run uses
    (`dapo-ray eval`'s path: a vLLM replica on Ray Serve, the config's `eval` sampling and verifier), so both
    sides are measured alike; each snapshot is removed once evaluated."""
    import ray

    from dapo_ray.evaluate import evaluate_model, with_target
    from dapo_ray.ray_cluster import init_ray

    if not evals:
        return []
    init_ray(cfg)
    try:
        out = []
        for e in evals:
            snap = Path(e.pop("dir"))
            report = evaluate_model(with_target(cfg, model=str(snap)), out=snap.parent / f"{snap.name}.json")
            shutil.rmtree(snap)
            out.append(e | {"avg_at_8": report["avg_at_k"]})
            print(f"[trl] step {e['step']}: held-out avg@{cfg.eval.n} {report['avg_at_k']:.1%} at {e['time_s']:.0f}s",
                  flush=True)  # fmt: skip
        return out
    finally:
        ray.shutdown()


# ---------------------------------------------------------------- the comparison (parent process)


def first_time(evals: list[dict], target: float) -> float | None:
    """Training time of the first evaluation at or above `target`.

    >>> first_time([{"time_s": 0, "avg_at_8": 0.1}, {"time_s": 60, "avg_at_8": 0.4}], 0.3)
    60
    """
    return next((e["time_s"] for e in evals if e["avg_at_8"] >= target), None)


def report(a: argparse.Namespace, res: dict[str, dict], cfg) -> str:
    d, t = res["dapo-ray"], res["trl"]

    def ratio(x: float | None, y: float | None) -> str:
        return f"{x / y:.2f}x" if x and y else "-"

    per_step = cfg.trainer.train_batch_size * cfg.rollout.n  # trained per step, on both sides
    rows = [("completions generated per second (whole run)", d["generated"] / d["time_s"], t["generated"] / t["time_s"]),
            ("completions trained per second (whole run)", d["trained"] / d["time_s"], t["trained"] / t["time_s"]),
            ("seconds per step (median, first step left out)", d["step_s"], t["step_s"]),
            ("completions trained per second (steady: per step / median step)", per_step / d["step_s"],
             per_step / t["step_s"]),
            ("steps", d["steps"], t["steps"]), ("training time, s", d["time_s"], t["time_s"])]  # fmt: skip
    lines = ["| | dapo-ray | TRL | dapo-ray / TRL |", "|---|---|---|---|"]

    def num(x: float | int | None) -> str:
        return "-" if x is None else f"{x:,}" if isinstance(x, int) else f"{x:,.2f}"

    def seconds(x: float | None) -> str:
        return "not reached" if x is None else f"{x:,.0f}"

    lines += [f"| {name} | {num(x)} | {num(y)} | {ratio(x, y)} |" for name, x, y in rows]
    if a.setting in CURVES:
        best_trl = max(e["avg_at_8"] for e in t["evals"])
        target = min(max(e["avg_at_8"] for e in d["evals"]), max(e["avg_at_8"] for e in t["evals"]))
        td, tt = first_time(d["evals"], target), first_time(t["evals"], target)
        lines += [
            f"| held-out avg@{a.k} at start / end | {d['evals'][0]['avg_at_8']:.1%} / {d['evals'][-1]['avg_at_8']:.1%} "
            f"| {t['evals'][0]['avg_at_8']:.1%} / {t['evals'][-1]['avg_at_8']:.1%} | |",
            f"| training time to reach {target:.1%} (the best both reach), s | {td:,.0f} | {tt:,.0f} "
            f"| {ratio(tt, td)} faster |",
            *(f"| training time to reach {x:.1%}{what}, s | {seconds(xd)} | {seconds(xt)} | {ratio(xt, xd)} faster |"
              for x, what in [(best_trl, " (TRL's best)"), *((x, "") for x in CURVES[a.setting][3])]
              for xd, xt in [(first_time(d["evals"], x), first_time(t["evals"], x))]),
            "", f"Held-out avg@{a.k} against training time (s):", "",
        ]  # fmt: skip
        for name, side in (("dapo-ray", d), ("TRL", t)):
            lines.append(f"- {name}: " + ", ".join(f"step {e['step']} {e['time_s']:.0f}s {e['avg_at_8']:.1%}"
                                                    for e in side["evals"]))  # fmt: skip
    r = cfg.rollout
    if d.get("from"):
        lines += ["", f"The dapo-ray side is the run saved in {d['from']} (same config, seed and steps)."]
    if t.get("from"):
        lines += ["", f"The TRL side is the run saved in {t['from']} (same setting, seed and steps)."]
    lines += ["", f"Per step: {cfg.trainer.train_batch_size} prompts x n {r.n}, responses up to "
              f"{r.max_response_length} tokens, mini-batch {cfg.trainer.mini_batch_size}, lr {cfg.trainer.lr}."]  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", choices=[*CURVES, "large"], default="demo")
    ap.add_argument("--steps", type=int, help="(a), (c) steps per side (default: 300, 20)")
    ap.add_argument("--eval-every", type=int, help="(a), (c) steps between held-out evaluations (default: 50, 5)")
    ap.add_argument("--dapo-from", type=Path, help="the dapo-ray side from this bench/ablation.py run")
    ap.add_argument("--trl-from", type=Path,
                    help="the TRL side from this earlier comparison's folder (its trl.json: same setting, seed, steps "
                         "and shared settings), to run dapo-ray alone with overrides TRL does not read")  # fmt: skip
    ap.add_argument("--large-steps", type=int, default=4, help="(b) timed steps per side (one more is run)")
    ap.add_argument("--k", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=None, help="both sides' seeds (default: the config's)")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", dest="extra",
                    help="config overrides for both sides (TRL reads only the shared settings)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/vs_trl")
    ap.add_argument("--report", action="store_true", help="print the comparison of results already saved")
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a child process
    a = ap.parse_args()
    if a.setting in CURVES:
        a.steps = a.steps or CURVES[a.setting][1]
        a.eval_every = a.eval_every or CURVES[a.setting][2]
    name = a.setting if a.seed is None else f"{a.setting}-s{a.seed}"
    out = (a.out / name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = config(a, out)
    if a.side:
        path = model_dir(a, cfg, out)
        result = side_dapo(a, cfg) if a.side == "dapo-ray" else side_trl(a, cfg, path)
        (out / f"{a.side}.json").write_text(json.dumps(result))
        return 0

    if a.dapo_from:
        (out / "dapo-ray.json").write_text(json.dumps(from_ablation(a, cfg, a.dapo_from.resolve())))
    if a.trl_from:
        kept = json.loads((a.trl_from / "trl.json").read_text())
        (out / "trl.json").write_text(json.dumps(kept | {"from": str(a.trl_from.resolve())}))
    if not a.report:
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit("bench/vs_trl.py needs TRL: pip install -e '.[bench]'") from None
        model_dir(a, cfg, out)  # once, before either side's clock
        taken = {"trl": a.trl_from, "dapo-ray": a.dapo_from}  # a side taken from an earlier run is not run
        for side in [s for s in SIDES if not taken[s]]:
            print(f"[vs_trl] {a.setting}: {side} ...", flush=True)
            t0 = time.time()
            with (out / f"{side}.log").open("w") as f:
                rc = subprocess.call([sys.executable, __file__, *sys.argv[1:], "--side", side], stdout=f,
                                     stderr=subprocess.STDOUT, cwd=ROOT)  # fmt: skip
            if rc:
                print(f"[vs_trl] {side} failed (exit {rc}); see {out / f'{side}.log'}", flush=True)
                return rc
            print(f"[vs_trl]   {side}: {time.time() - t0:.0f}s in all", flush=True)
    res = {side: json.loads((out / f"{side}.json").read_text()) for side in SIDES}
    text = report(a, res, cfg)
    print(text)
    (out.parent / f"{name}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
