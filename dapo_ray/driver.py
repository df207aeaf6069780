"""The DAPO run, top to bottom: sample, score, filter, train, sync, evaluate, save.

`run(cfg)` starts (or joins) a Ray cluster, deploys the vLLM rollout replicas on Ray Serve, starts the
Ray Train TorchTrainer workers (DeepSpeed) in the background, and then drives one RL step at a time.
Re-running the same command resumes from the last checkpoint (Ray Train's, under trainer.output_dir);
when Ray Train restarts failed trainer workers from it mid-run, the driver goes back to it too.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dapo_ray import storage
from dapo_ray.algo import BatchFiller
from dapo_ray.config import Config, check_model_fits
from dapo_ray.data import load_prompts, synthetic_prompts
from dapo_ray.metrics import Tracker, end_failed_run
from dapo_ray.pipeline import SamplingSpec, ScoringSpec, generate_round
from dapo_ray.placement import worker_resources
from dapo_ray.producer import Producer
from dapo_ray.progress import Pace, StatusLine, duration
from dapo_ray.ray_metrics import DriverMetrics, run_name
from dapo_ray.stopping import StopRequest
from dapo_ray.trainer.batch import build_shards, flatten_groups


@dataclass
class PromptCursor:
    """Walks the prompt list epoch by epoch, reshuffled each epoch; its state is checkpointed."""

    rows: list[dict]
    shuffle: bool
    seed: int
    epoch: int = 0
    index: int = 0
    order: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._reorder()

    def _reorder(self) -> None:
        self.order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(self.order)

    def take(self, k: int) -> list[dict]:
        out = []
        while len(out) < k:
            if self.index == len(self.order):
                self.epoch, self.index = self.epoch + 1, 0
                self._reorder()
            # "epoch:index" names this draw, so the prompt ledger can check each is used exactly once.
            out.append(self.rows[self.order[self.index]] | {"draw": f"{self.epoch}:{self.index}"})
            self.index += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._reorder()


_status: StatusLine | None = None  # the live status line of the running training loop, if any


def log(msg: str) -> None:
    if _status:
        _status.clear()
    print(f"[dapo-ray {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prepare_prompts(cfg: Config, tokenizer) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) with `prompt_ids`, prompts over max_prompt_length dropped."""
    d = cfg.data
    if d.source == "synthetic":
        train, held_out = synthetic_prompts(**dataclasses.asdict(d.synthetic))
        log(f"synthetic task ({d.synthetic.flavour}): {len(train)} train / {len(held_out)} held-out problems")
    else:
        train, report = load_prompts(d.train_files, d.template, d.dedupe, d.on_bad_row)
        log(f"train data: {report}")
        held_out = []
    if cfg.eval.files:
        held_out, report = load_prompts(cfg.eval.files, d.template, dedupe=True, on_bad_row=d.on_bad_row)
        log(f"eval data: {report}")

    def tokenize(rows: list[dict]) -> list[dict]:
        out = tokenize_prompts(rows, tokenizer, d.max_prompt_length)
        if len(out) < len(rows):
            log(f"dropped {len(rows) - len(out)} prompts longer than {d.max_prompt_length} tokens")
        return out

    return tokenize(train), tokenize(held_out)


def tokenize_prompts(rows: list[dict], tokenizer, max_prompt_length: int) -> list[dict]:
    """Rows with `prompt_ids` (the chat template, with the generation prompt), `uid`, `ground_truth`;
    prompts longer than `max_prompt_length` tokens are left out."""
    out = []
    for r in rows:
        ids = tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "input_ids") or isinstance(ids, dict):
            ids = ids["input_ids"]
        if len(ids) <= max_prompt_length:
            out.append({"uid": r["uid"], "prompt_ids": list(ids), "ground_truth": r["ground_truth"]})
    return out


def evaluate(cfg: Config, rows: list[dict], app: str, concurrency: int) -> dict[str, float]:
    """avg@k, pass@k and maj@k on held-out problems, through the same Ray Data + Serve path as training
    (the code of `dapo-ray eval`, dapo_ray/evaluate.py)."""
    from dapo_ray.evaluate import eval_sampling, sample_and_score, summarize

    if not rows:
        return {}
    s = summarize(sample_and_score(rows, app, eval_sampling(cfg), _scoring(cfg), concurrency))
    return {"eval/avg_at_k": s["avg_at_k"], "eval/pass_at_k": s["pass_at_k"], "eval/maj_at_k": s["maj_at_k"]}


def _scoring(cfg: Config) -> ScoringSpec:
    a = cfg.algorithm
    return ScoringSpec(cfg.reward.mode, cfg.rollout.max_response_length, a.soft_overlong, a.overlong_cache_length,
                       a.overlong_penalty_factor, a.overlong_filter, a.adv_eps, a.adv_std_unbiased)  # fmt: skip


def batch_metrics(batch: list[dict], generated: list[dict], version: int) -> dict[str, float]:
    """Reward, accuracy, length and solve-all statistics of the step (see metrics.py)."""
    lengths = [len(ids) for g in batch for ids in g["response_ids"]]
    lps = [lp for g in batch for seq in g["rollout_logprobs"] for lp in seq]
    all_acc = [a for g in generated for a in g["acc"]]
    return {
        "critic/score/mean": statistics.fmean(s for g in batch for s in g["scores"]),
        "critic/acc/mean": statistics.fmean(a for g in batch for a in g["acc"]),
        # A step filled entirely from carried-over groups generated nothing new: report its batch.
        "rollout/acc_all_generated": statistics.fmean(all_acc or [a for g in batch for a in g["acc"]]),
        "rollout/solve_all_ratio": statistics.fmean(all(g["acc"]) for g in generated or batch),
        "rollout/solve_none_ratio": statistics.fmean(not any(g["acc"]) for g in generated or batch),
        "response_length/mean": statistics.fmean(lengths),
        "response_length/clip_ratio": statistics.fmean(t for g in batch for t in g["truncated"]),
        "rollout/policy_version_lag": statistics.fmean(version - g["policy_version"] for g in batch),
        "rollout/policy_version_lag_max": max(version - g["policy_version"] for g in batch),
        "rollout/replicas_sampling": len({g.get("replica") for g in generated or batch}),
        "actor/mean_token_prob": statistics.fmean(math.exp(x) for x in lps) if lps else 0.0,
    }


class Stack:
    """The running system: vLLM replicas on Serve, TorchTrainer workers in the background, and the
    weight store and channel that join them. `close()` shuts down what it started."""

    def __init__(self, cfg: Config, probe_ids: list[int]):
        import ray
        from ray.train import ScalingConfig
        from ray.train.torch import TorchTrainer

        from dapo_ray.rollout.deployment import APP_NAME, deploy_rollout
        from dapo_ray.trainer.channel import Channel
        from dapo_ray.trainer.loop import train_loop
        from dapo_ray.weights import NAMESPACE, create_store

        t, r = cfg.trainer, cfg.rollout
        output = t.output_dir
        name = storage.name(output)
        self.app = APP_NAME
        self.num_workers = t.num_workers
        self.store = create_store(f"weights-{name}", cfg.weight_sync.keep_versions)
        self.sync_timeout_s = cfg.weight_sync.timeout_s
        self.channel = Channel.options(name=f"channel-{name}", namespace=NAMESPACE).remote(t.num_workers)
        self.generation = 0  # "ready" messages read: the worker group that shards are for
        log(f"deploying {r.num_replicas} vLLM rollout replica(s) of {r.model_path}")
        self.handle = deploy_rollout(r, cfg.max_model_len, f"weights-{name}", t.seed, run=run_name(cfg),
                                     export_metrics=cfg.tracking.ray_metrics)  # fmt: skip
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"config": cfg, "channel": f"channel-{name}", "store": f"weights-{name}",
                               "namespace": NAMESPACE, "probe_ids": probe_ids,
                               "final_dir": storage.join(output, "final_model")},
            scaling_config=ScalingConfig(num_workers=t.num_workers, use_gpu=t.use_gpu,
                                         resources_per_worker=worker_resources(t)),
            run_config=_run_config(name, storage.join(output, "ray_train"), t.max_failures),
        )  # fmt: skip
        self.fit_error: list[BaseException] = []
        self.fit_thread = threading.Thread(target=_fit, args=(trainer, self.fit_error), daemon=True)
        self.fit_thread.start()
        self._ray = ray

    def next_result(self, kind: str) -> dict:
        """The trainer's next message: `kind` ("ready", "step", "saved" or "final"), or a "ready" from
        workers that Ray Train restarted from their last checkpoint after one failed. Raises if the
        trainer stopped (failures beyond trainer.max_failures)."""
        while True:
            res = self._ray.get(self.channel.get_result.remote(5.0))
            if res is not None:
                if res["kind"] not in (kind, "ready"):
                    raise RuntimeError(f"expected a {kind!r} message from the trainer, got {res['kind']!r}")
                self.generation += res["kind"] == "ready"
                return res
            if not self.fit_thread.is_alive():
                raise RuntimeError(f"the trainer stopped: {self.fit_error[0] if self.fit_error else 'no error given'}")

    def train(self, shards: list, save_state: dict | None) -> dict:
        """The step's statistics, or "ready" if the workers restarted meanwhile."""
        self._put([{"minis": s, "save": save_state} for s in shards])
        return self.next_result("step")

    def save(self, save_state: dict) -> dict:
        """A checkpoint of the current weights and `save_state`, without training ("saved", or "ready" if
        the workers restarted meanwhile)."""
        self._put([{"minis": None, "save": save_state}] * self.num_workers)
        return self.next_result("saved")

    def _put(self, shards: list | None) -> None:
        """Queue shards for the current workers. If a restarted group has started meanwhile they are
        dropped, and its "ready" is the next result."""
        self._ray.get(self.channel.put_shards.remote(shards, self.generation))

    def sync(self, version: int) -> dict[str, int]:
        from dapo_ray.rollout.deployment import wait_synced

        return wait_synced(self.store, version, self.sync_timeout_s)

    def finish(self, step: int) -> str:
        """Tell the workers to save the final model and stop; returns its path. Workers restarted meanwhile
        are told again if they came back at `step` (its checkpoint), else the run must be resumed."""
        while True:
            self._put(None)
            res = self.next_result("final")
            if res["kind"] == "final":
                self.fit_thread.join(timeout=120)
                return res["path"]
            if res["step"] != step:
                raise RuntimeError(f"the trainer workers restarted from the checkpoint of step {res['step']} while "
                                   f"saving the model of step {step}; run the same command again to resume")  # fmt: skip

    def close(self) -> None:
        from ray import serve

        if not self._ray.is_initialized():  # serve.delete would start a new local cluster
            return
        try:
            serve.delete(self.app)
        finally:
            for actor in (self.channel, self.store):
                self._ray.kill(actor)


def run(cfg: Config) -> dict:
    """Train with DAPO as configured; returns a summary (eval before/after, each evaluation's step, generation and time, sync history)."""
    from transformers import AutoTokenizer

    t_start = time.time()
    cfg = _absolute_paths(cfg)
    t, a, r = cfg.trainer, cfg.algorithm, cfg.rollout
    check_model_fits(cfg)
    if not storage.is_uri(t.output_dir):
        Path(t.output_dir).mkdir(parents=True, exist_ok=True)
    _init_ray(cfg)
    tokenizer = AutoTokenizer.from_pretrained(r.model_path)
    train_rows, eval_rows = prepare_prompts(cfg, tokenizer)
    cursor = PromptCursor(train_rows, cfg.data.shuffle, cfg.data.seed)
    filler: BatchFiller[dict] = BatchFiller(t.train_batch_size, a.max_gen_rounds, a.on_cap, a.carry_over,
                                            enabled=a.dynamic_sampling, max_lag=a.max_policy_lag)  # fmt: skip
    probe_ids = train_rows[0]["prompt_ids"] + tokenizer.encode("Answer: 0", add_special_tokens=False)
    with StopRequest(log) as stop:
        stack = Stack(cfg, probe_ids)
        try:
            return _loop(cfg, stack, cursor, filler, eval_rows, probe_ids, t_start, stop)
        except BaseException:
            end_failed_run()
            raise
        finally:
            stack.close()


def _loop(cfg: Config, stack: Stack, cursor: PromptCursor, filler: BatchFiller, eval_rows: list[dict],
          probe_ids: list[int], t_start: float, stop: StopRequest) -> dict:  # fmt: skip
    """The RL steps: take a batch -> train -> publish and sync -> evaluate; checkpoints ride along with
    train. The producer samples, scores and filters (the next batch meanwhile, with max_policy_lag >= 1).
    A stop request (`dapo_ray.stopping`) ends the loop after the step in progress, with a checkpoint."""
    t, r = cfg.trainer, cfg.rollout
    totals = {"generated_groups": 0, "kept_groups": 0, "rounds": 0, "partial_steps": 0, "skipped_steps": 0,
              "stale_dropped": 0}  # fmt: skip
    # What workers restarted before the first checkpoint go back to.
    start = copy.deepcopy({"cursor": cursor.state_dict(), "filler": filler.state_dict(), "totals": totals})

    def restore(ready: dict) -> int:
        """Go back to where the (re)started workers are: their checkpoint's step, with the data cursor,
        carried groups and totals saved with it (the run's start without one), once every replica serves
        their weights. Returns that step."""
        nonlocal totals
        state = copy.deepcopy(ready["driver_state"] or start)
        cursor.load_state_dict(state["cursor"])
        filler.load_state_dict(state["filler"])
        totals = state["totals"]
        stack.sync(ready["step"])
        return ready["step"]

    ready = stack.next_result("ready")
    step = restore(ready)
    if ready["driver_state"]:
        log(f"resumed from the checkpoint of step {step} (epoch {cursor.epoch}, prompt {cursor.index})")
    concurrency = r.max_replicas * 2
    tracker = Tracker(cfg.tracking.enabled, _tracking_uri(cfg), cfg.tracking.experiment, run_name(cfg),
                      cfg.flat(), resume=step > 0, config_yaml=cfg.to_yaml(),
                      system_metrics=cfg.tracking.system_metrics)  # fmt: skip
    exported = DriverMetrics(cfg.tracking.ray_metrics, run_name(cfg))
    summary: dict = {"start_step": step, "start_cursor": cursor.state_dict(), "evals": [], "steps_log": [],
                     "empty_step_draws": [], "eval_s": 0.0, "restarts": []}  # fmt: skip

    def evaluate_now() -> dict:  # sums the time spent evaluating after training started (train_s includes it)
        t0 = time.time()
        ev = evaluate(cfg, eval_rows, stack.app, concurrency)
        summary["eval_s"] += time.time() - t0
        return ev

    def evaluated(ev: dict, train_s: float) -> None:  # the held-out curve against time, step and generation
        summary["evals"].append({"step": step, "train_s": train_s, "eval_s": summary["eval_s"],
                                 "generated": totals["generated_groups"] * r.n, **ev})  # fmt: skip

    if step == 0 and eval_rows:
        ev = evaluate(cfg, eval_rows, stack.app, concurrency)  # before the training clock starts
        summary["eval_before"] = ev
        evaluated(ev, 0.0)
        tracker.log(ev, step=0)
        exported.record(ev, step=0)
        log(f"held-out before training: avg@{cfg.eval.n} {ev['eval/avg_at_k']:.1%}, pass@{cfg.eval.n} {ev['eval/pass_at_k']:.1%}")

    sampling = SamplingSpec(r.n, r.temperature, r.top_p, r.max_response_length, t.seed if r.seed_per_prompt else None)
    scoring = _scoring(cfg)

    def rollout(prompts: list[dict]) -> list[dict]:
        return generate_round(prompts, stack.app, sampling, scoring,
                              prompts_per_call=max(1, len(prompts) // concurrency), max_concurrency=concurrency)  # fmt: skip

    def new_producer() -> Producer:
        return Producer(cursor, filler, rollout, t.gen_batch_size, overlap=cfg.algorithm.max_policy_lag >= 1)

    def restarted(ready: dict) -> int:
        """Ray Train restarted the workers after one failed: the steps since their checkpoint are trained
        again, from the prompts and carried groups saved with it. Returns the step to go on from."""
        nonlocal producer, pace, skip_streak
        producer.close()  # a prefetch in flight is discarded, as on a resume
        failed_at = step + 1
        log(f"a trainer worker failed in step {failed_at}; Ray Train restarted the workers from the checkpoint of "
            f"step {ready['step']} ({failed_at - 1 - ready['step']} trained step(s) lost, trained again)")  # fmt: skip
        back_to = restore(ready)
        summary["restarts"].append({"failed_at_step": failed_at, "resumed_step": back_to, "cursor": cursor.state_dict(),
                                    "carried_groups": len(filler.state_dict()["kept"])})  # fmt: skip
        producer, pace, skip_streak = new_producer(), Pace(t.total_steps), 0
        pace.mark(back_to)
        return back_to

    producer = new_producer()
    t_train = time.time()
    empty_steps = 0
    pace = Pace(t.total_steps)
    skip_streak = 0  # optimizer updates skipped in a row for a NaN/inf gradient
    pace.mark(step)
    live = {"started": time.time(), "last": "", "held_out": ""}
    if eval_rows and "eval_before" in summary:
        live["held_out"] = f"held-out avg@{cfg.eval.n} {summary['eval_before']['eval/avg_at_k']:.1%} at step 0"
    global _status
    _status = StatusLine(lambda: f"step {step + 1}/{t.total_steps} running {duration(time.time() - live['started'])}"
                                 f"  {pace.eta()}  {live['last']}  {live['held_out']}")  # fmt: skip
    try:
        while step < t.total_steps:
            if t.max_generated and totals["generated_groups"] * r.n >= t.max_generated:
                log(f"stopping at step {step}: {totals['generated_groups'] * r.n} responses generated "
                    f"(trainer.max_generated={t.max_generated})")
                break
            # 1. Take a batch of kept groups (dynamic sampling); the next one may start generating now.
            t0 = time.time()
            b = producer.take(step, prefetch=step + 1 < t.total_steps)
            fill = b.fill
            for k in ("generated_groups", "kept_groups", "rounds", "stale_dropped"):
                totals[k] = totals.get(k, 0) + getattr(fill, k)
            totals["partial_steps"] += fill.outcome == "partial"
            totals["skipped_steps"] += fill.outcome == "empty"
            if fill.outcome != "full":
                log(fill.message)
            if fill.outcome == "stopped":  # checkpoint first: the kept groups and the data cursor survive
                if (res := stack.save(b.state | {"totals": totals}))["kind"] == "ready":
                    step = restarted(res)
                    continue
                log(f"saved a checkpoint at step {step} with {fill.carried_out} kept groups; re-run to resume")
                summary["stopped"] = {"step": step, "kept_groups": fill.carried_out}
                break
            if fill.outcome == "empty":  # nothing to train on: its prompts were all filtered out
                summary["empty_step_draws"] += b.draws["filtered"]
                empty_steps += 1
                if empty_steps == 3:
                    log("stopping: 3 steps in a row found no group with both right and wrong answers; the task "
                        "is too hard or too easy for this model (check eval accuracy and rollout settings)")
                    break
                continue
            empty_steps = 0

            # 2. Train on it: one shard per worker; a checkpoint (with the producer's state) when due.
            t1 = time.time()
            due = (t.save_every and (step + 1) % t.save_every == 0) or step + 1 == t.total_steps
            shards = build_shards(flatten_groups(b.groups), t.num_workers, t.mini_batch_size, t.micro_batch_size,
                                  seed=t.seed + step, micro_batch_tokens=t.micro_batch_tokens)  # fmt: skip
            t2 = time.time()
            res = stack.train(shards, b.state | {"totals": totals} if due else None)
            if res["kind"] == "ready":
                step = restarted(res)
                continue
            step = res["step"]
            skip_streak = skip_streak + res["actor/updates"] if res["actor/skipped_updates"] == res["actor/updates"] \
                else res["skip/trailing"]  # fmt: skip
            del res["skip/trailing"]

            # 3. Sync: every replica serves the new version before the next on-policy rollout; check it.
            t3 = time.time()
            versions = stack.sync(step)
            t4 = time.time()
            engine_version, engine_lp = stack.handle.sequence_logprobs.remote(probe_ids).result()
            probe_diff = max(abs(x - y) for x, y in zip(engine_lp, res.pop("probe_logprobs"), strict=True))
            t5 = time.time()
            metrics = {
                **batch_metrics(b.groups, b.generated, step - 1),
                **{f"dynamic_sampling/{k}": v for k, v in fill.__dict__.items() if isinstance(v, int)},
                "dynamic_sampling/partial": float(fill.outcome == "partial"),
                **{f"ledger/{k}": v for k, v in dataclasses.asdict(producer.ledger).items()},
                **{k: v for k, v in res.items() if k not in ("kind", "step")},
                "weight_sync/wait_s": t4 - t3,
                "weight_sync/logprob_max_diff": probe_diff,
                "weight_sync/replicas": len(versions),
                "timing/generate_s": b.generate_s,
                "timing/wait_batch_s": b.waited_s,
                "timing/shard_s": t2 - t1,
                "timing/train_s": t3 - t2,
                "timing/sync_s": t4 - t3,
                "timing/probe_s": t5 - t4,
            }
            metrics |= _phases(metrics, step_s=time.time() - t0)
            summary["steps_log"].append({"step": step, "replica_versions": versions, "probe_version": engine_version,
                                         "draws": b.draws, "metrics": metrics,
                                         "sampled_by": [(g.get("replica"), g["policy_version"]) for g in b.generated]})  # fmt: skip
            tracker.log(metrics, step=step)
            exported.record(metrics, step=step)
            pace.mark(step)
            live.update(started=time.time(), last=f"last step: reward {metrics['critic/score/mean']:+.3f} "
                                                  f"acc {metrics['rollout/acc_all_generated']:.1%}")  # fmt: skip
            _print_step(step, t.total_steps, metrics, fill, pace.eta(), live["held_out"])
            if metrics["actor/skipped_updates"]:
                log(f"step {step}: {metrics['actor/skipped_updates']} of {metrics['actor/updates']} updates skipped for a "
                    f"NaN or inf gradient ({skip_streak} in a row; trainer.max_skipped_updates={t.max_skipped_updates})")  # fmt: skip
            if skip_streak >= t.max_skipped_updates:
                log(f"stopping: {skip_streak} updates in a row had a NaN or inf gradient and were skipped; the "
                    f"weights are those before the first of them. Lower trainer.lr or check the data and rewards")  # fmt: skip
                summary["stopped"] = {"step": step, "skipped_updates_in_a_row": skip_streak}
                break

            # 4. Evaluate every eval.every steps.
            if eval_rows and cfg.eval.every and step % cfg.eval.every == 0 and step < t.total_steps and not stop.signal:
                ev = evaluate_now()
                tracker.log(ev, step=step)
                exported.record(ev, step=step)
                evaluated(ev, time.time() - t_train)
                live["held_out"] = f"held-out avg@{cfg.eval.n} {ev['eval/avg_at_k']:.1%} at step {step}"
                log(f"held-out at step {step}: avg@{cfg.eval.n} {ev['eval/avg_at_k']:.1%}")

            # 5. A stop request: checkpoint this step (unless it just did) and leave.
            if stop.signal:
                if not due and (res := stack.save(b.state | {"totals": totals}))["kind"] == "ready":
                    log(f"the trainer workers restarted from the checkpoint of step {res['step']} while saving")
                    step = res["step"]
                summary["stopped"] = {"step": step, "signal": stop.signal}
                break
    finally:
        producer.close()
        _status.close()
        _status = None

    if stop.signal:  # no final model and no final evaluation: the run is not over
        tracker.close(status="KILLED")
        summary.update(steps=step, end_cursor=cursor.state_dict(), train_s=time.time() - t_train, totals=totals,
                       wall_s=time.time() - t_start)  # fmt: skip
        log(f"stopped by {stop.signal} at step {step} of {t.total_steps}, checkpoint saved in {t.output_dir}; "
            f"to resume, run the same command again: {resume_command()}")  # fmt: skip
        return summary

    final = stack.finish(step)
    summary.update(steps=step, end_cursor=cursor.state_dict(), final_model=final, train_s=time.time() - t_train,
                   totals=totals)  # fmt: skip
    log(f"dynamic sampling over the run: kept {totals['kept_groups']}/{totals['generated_groups']} groups in "
        f"{totals['rounds']} rounds; {totals['partial_steps']} partial and {totals['skipped_steps']} skipped steps; "
        f"{totals.get('stale_dropped', 0)} carried groups dropped as older than max_policy_lag")
    if eval_rows:
        ev = evaluate_now()
        summary["eval_after"] = ev
        evaluated(ev, time.time() - t_train)
        tracker.log(ev, step=step)
        exported.record(ev, step=step)
        log(f"held-out after training: avg@{cfg.eval.n} {ev['eval/avg_at_k']:.1%}, pass@{cfg.eval.n} {ev['eval/pass_at_k']:.1%}")
    if cfg.tracking.log_model and not storage.is_uri(final):
        # Trainer rank 0 wrote it, maybe on another node: only a shared output_dir shows it here.
        if Path(final).is_dir():
            tracker.log_artifacts(final, "final_model")
        else:
            log(f"final model not stored with the MLflow run: {final} is not on the driver's machine")
    if cfg.tracking.enabled and cfg.tracking.report:
        summary["report"] = _report(cfg, tracker)
    tracker.close()
    summary["wall_s"] = time.time() - t_start
    log(f"final model: {final}  ({summary['wall_s']:.0f}s in all)")
    return summary


def resume_command() -> str:
    """This process's command line, as a shell would take it."""
    import shlex
    import sys

    return shlex.join(sys.argv)


def _report(cfg: Config, tracker: Tracker) -> str:
    """The run's figures and summary (`dapo-ray report`) into output_dir/report and MLflow; returns that
    directory ("" when output_dir is object storage: then they go to MLflow only)."""
    import tempfile

    from dapo_ray.report import load_run, write_report

    tracker.flush()
    run = load_run(_tracking_uri(cfg), run_id=tracker.run.info.run_id)
    if storage.is_uri(cfg.trainer.output_dir):
        with tempfile.TemporaryDirectory(prefix="dapo-report-") as tmp:
            write_report(run, Path(tmp))
            tracker.log_artifacts(tmp, "report")
        log("report: stored with the MLflow run")
        return ""
    out = Path(cfg.trainer.output_dir) / "report"
    write_report(run, out)
    tracker.log_artifacts(str(out), "report")
    log(f"report: {out / 'summary.md'} (and in the MLflow run)")
    return str(out)


def _print_step(step: int, total: int, m: dict, fill, eta: str, held_out: str) -> None:
    """One line per step: the console's and the job log's record of the run."""
    log(f"step {step}/{total}  {eta}  reward {m['critic/score/mean']:+.3f}  acc {m['rollout/acc_all_generated']:.1%}  "
        f"kept {fill.kept_groups}/{fill.generated_groups} groups in {fill.rounds} round(s)"
        f"{f' +{fill.carried_in} carried' if fill.carried_in else ''}  "
        f"entropy {m['actor/entropy']:.3f}  len {m['response_length/mean']:.1f}  "
        f"clip+ {m['actor/clipfrac_high']:.3f} clip- {m['actor/clipfrac_low']:.3f}  "
        f"sync diff {m['weight_sync/logprob_max_diff']:.1e}  replicas {m['weight_sync/replicas']}  step {m['timing/step_s']:.2f}s = "
        + " ".join(f"{k.removeprefix('phase/').removesuffix('_s')} {m[k]:.2f}" for k in PHASES)
        + (f"  | {held_out}" if held_out else ""))  # fmt: skip


PHASES = ("phase/generate_s", "phase/old_logprob_s", "phase/update_s", "phase/publish_s", "phase/sync_s",
          "phase/other_s")  # fmt: skip


def _phases(m: dict, step_s: float) -> dict[str, float]:
    """Where the step's wall time went, on the critical path: waiting for the batch (generation and
    scoring not hidden behind the previous step's training), old log-probs, updates, the weight publish,
    the replicas' sync, and the rest (shards, channel and report hops, the probe check)."""
    named = {
        "phase/generate_s": m["timing/wait_batch_s"],
        "phase/old_logprob_s": m["timing/old_logprob_s"],
        "phase/update_s": m["timing/update_s"],
        "phase/publish_s": m["weight_sync/publish_s"],
        "phase/sync_s": m["timing/sync_s"],
    }
    return {**named, "phase/other_s": step_s - sum(named.values()), "timing/step_s": step_s}


def _absolute_paths(cfg: Config) -> Config:
    """Ray workers and replicas do not share the driver's working directory: resolve paths here."""
    from dataclasses import replace

    model = Path(cfg.rollout.model_path)
    if not (model / "config.json").exists():
        raise FileNotFoundError(f"rollout.model_path={cfg.rollout.model_path!r} is not a local HF model directory "
                                "(no config.json); models are loaded from paths, never downloaded")  # fmt: skip
    return replace(
        cfg,
        rollout=replace(cfg.rollout, model_path=str(model.resolve())),
        trainer=replace(cfg.trainer, output_dir=storage.resolve(cfg.trainer.output_dir)),
        data=replace(cfg.data, train_files=tuple(str(Path(f).resolve()) for f in cfg.data.train_files)),
        eval=replace(cfg.eval, files=tuple(str(Path(f).resolve()) for f in cfg.eval.files)),
    )


def _run_config(name: str, location: str, max_failures: int):
    """Ray Train's checkpoints under `location` (a path, or object storage through pyarrow.fs), and the
    worker failures it restarts the workers after."""
    from ray.train import FailureConfig, RunConfig

    failures = FailureConfig(max_failures=max_failures)
    if not storage.is_uri(location):
        return RunConfig(name=name, storage_path=location, failure_config=failures)
    fs, path = storage.filesystem(location)
    return RunConfig(name=name, storage_path=path, storage_filesystem=fs, failure_config=failures)


def _tracking_uri(cfg: Config) -> str:
    """tracking.tracking_uri, else a SQLite store beside the run: in trainer.output_dir when it is a
    directory, else under ./runs/<name>/ on the driver's machine (object storage holds no database)."""
    if cfg.tracking.tracking_uri:
        return cfg.tracking.tracking_uri
    out = cfg.trainer.output_dir
    db_dir = Path("runs", storage.name(out)).resolve() if storage.is_uri(out) else Path(out)
    db_dir.mkdir(parents=True, exist_ok=True)
    if storage.is_uri(out):
        log(f"MLflow: {db_dir / 'mlflow.db'} on the driver's machine (set tracking.tracking_uri for a server)")
    return f"sqlite:///{db_dir / 'mlflow.db'}"


def _fit(trainer, errors: list) -> None:
    try:
        trainer.fit()
    except BaseException as e:  # noqa: BLE001 - surfaced by the driver
        errors.append(e)


def start_local_ray(**kwargs):
    """Start a Ray cluster of this machine alone that listens on loopback only: GCS, dashboard, metrics.
    Returns `ray.init`'s context.

    Ray binds them to the node's IP, so on every interface of a laptop or a shared host, and `ray.init`
    replaces a loopback node IP by the machine's address unless Ray's multi-node switch is off (its
    default on macOS and Windows): it is turned off for this call."""
    import ray
    from ray._private import ray_constants

    multi_node = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        return ray.init(address="local", _node_ip_address="127.0.0.1", dashboard_host="127.0.0.1", **kwargs)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = multi_node


def dashboard_line(dashboard_url: str | None) -> str:
    """Where the Ray dashboard is, and how to sign in to it. Ray turns token authentication on for a
    cluster that `ray.init` starts (and for `ray start` where ~/.ray/auth_token exists), unless
    RAY_AUTH_MODE says otherwise; `ray.init` then sets RAY_AUTH_MODE=token in this process."""
    if not dashboard_url:
        return "Ray dashboard: not running (include_dashboard is off)"
    url = dashboard_url if "://" in dashboard_url else f"http://{dashboard_url}"
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        return (f"Ray dashboard: {url} (token authentication is on: paste the token that `ray get-auth-token` "
                f"prints when the page asks; `ray job submit` and other CLI calls need RAY_AUTH_MODE=token)")  # fmt: skip
    return f"Ray dashboard: {url}"


def _init_ray(cfg: Config) -> None:
    import logging

    import ray
    from ray.data import DataContext

    data_ctx = DataContext.get_current()
    data_ctx.enable_progress_bars = False
    data_ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    if ray.is_initialized():
        return
    env = {"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu" if not cfg.trainer.use_gpu else "cuda"),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    if "TORCH_EXTENSIONS_DIR" in os.environ:
        env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS") or None
    if address:
        # Under `ray job submit` the job's runtime_env already reaches every worker, and Ray refuses a
        # driver runtime_env that repeats one of its variables: add only what is not set here yet.
        env = {k: v for k, v in env.items() if k not in os.environ}
        ctx = ray.init(address=address, runtime_env={"env_vars": env} if env else None)
    else:
        ctx = start_local_ray(num_cpus=cfg.cluster.num_cpus, runtime_env={"env_vars": env})  # always our own
    log(dashboard_line(ctx.dashboard_url))
