"""The Ray Train worker loop: DeepSpeed engine, old log-probs, DAPO mini-batch updates, weight publish,
checkpoints through `ray.train.report`.

Each step (`train_step`): pull this rank's shard from the channel -> old log-probs (the behaviour
policy's: recomputed with the current weights for fresh samples, the engine's for samples an older
version generated; the pass runs only on micro-batches holding fresh samples, and not at all when the
step makes one update, whose own forward pass gives them), with a KL term the reference model's, and with
`algorithm.rollout_is` the rollout-correction weights -> `ppo_epochs` passes over the mini-batches, each
accumulating micro-batch gradients of the policy loss (`algorithm.policy_loss`) into one optimizer step
-> rank 0 publishes the new weights as version step+1 -> report.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from dapo_ray.algo import POLICY_LOSSES, behaviour_logprobs, rollout_is_weights
from dapo_ray.config import Config
from dapo_ray.memory import peak_rss_gib
from dapo_ray.progress import quiet_libraries
from dapo_ray.ray_metrics import TrainerMetrics, run_name
from dapo_ray.trainer import collective
from dapo_ray.trainer.batch import Micro, pad_micro
from dapo_ray.trainer.channel import STOP
from dapo_ray.trainer.policy import PolicyLM, head_chunks

# Loss statistics averaged over tokens (weighted by each micro-batch's token count).
SUM_KEYS = ("pg_clipfrac", "clipfrac_high", "clipfrac_low", "pg_clipfrac_lower", "ppo_kl", "ratio_mean", "kl_loss")
# Rollout-correction statistics averaged over tokens (logged as rollout_corr/<key>, with rollout_is_max).
IS_KEYS = ("rollout_is_mean", "rollout_is_ratio_fraction_high", "rollout_is_masked_fraction")
PAD_ID = 0


def ds_config(cfg: Config, world: int) -> dict:
    t = cfg.trainer
    zero: dict = {"stage": t.zero_stage}
    if t.zero_hpz_partition_size > 1:
        # ZeRO++ hpZ: a second copy of the parameters partitioned within each node (Ray Train numbers
        # the workers of a node consecutively), so backward's all-gathers stay off the network.
        zero["zero_hpz_partition_size"] = t.zero_hpz_partition_size
    config = {
        # Nominal sizes: train_step marks each mini-batch's last micro-batch as the accumulation boundary
        # and scales the loss itself, so DeepSpeed's count is not used (micro_batch_tokens varies it).
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.mini_batch_size // world // t.micro_batch_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        # A NaN/inf gradient skips the update (counted in engine.skipped_steps) rather than poisoning the
        # weights: DeepSpeed's ZeRO optimizers check it for fp32, and for bf16 when asked; GuardedAdamW
        # does it without ZeRO.
        "bf16": {"enabled": t.dtype == "bfloat16", "check_grad_overflow": True},
        "steps_per_print": 10**9,
    }
    if t.dtype == "bfloat16":
        # Sum the micro-batches' gradients in fp32: in bf16 (8 significant bits) a micro-batch whose
        # gradient is under ~1/256 of the running sum adds nothing. DeepSpeed honours this under ZeRO 1
        # (as its BF16_Optimizer), 2 and 3, and refuses it without ZeRO (validate() refuses bf16 there).
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def logprob_chunks(cfg: Config) -> int:
    """Chunks of the output head in every forward (`PolicyLM`): the largest micro-batch (micro_batch_tokens,
    or one longest sequence if longer; without a budget micro_batch_size longest sequences) in chunks of
    about logprob_chunk_size tokens."""
    t = cfg.trainer
    longest = cfg.max_model_len
    largest = max(t.micro_batch_tokens, longest) if t.micro_batch_tokens else t.micro_batch_size * longest
    return head_chunks(largest, t.logprob_chunk_size)


class GuardedAdamW(torch.optim.AdamW):
    """AdamW that skips an update whose gradients hold a NaN or an inf, zeroing them instead. It sets
    `overflow` as DeepSpeed's own optimizers do, so the engine counts the update in `skipped_steps` and
    leaves the learning-rate schedule where it was. Gradients are all-reduced before the step, so every
    rank decides alike."""

    overflow = False

    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        self.overflow = any(not torch.isfinite(g).all() for g in grads)
        if self.overflow:
            self.zero_grad(set_to_none=True)
            return None
        return super().step(closure)


def make_optimizer(params, cfg: Config) -> torch.optim.Optimizer:
    """AdamW; without ZeRO, GuardedAdamW (ZeRO's optimizers skip non-finite updates themselves, and take
    only optimizer classes they know)."""
    t = cfg.trainer
    cls = GuardedAdamW if t.zero_stage == 0 else torch.optim.AdamW
    return cls(params, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)


def build_engines(cfg: Config, world: int):
    """(DeepSpeed engine of the policy, frozen reference policy or None). The reference model is only
    loaded when the loss has a KL term; under ZeRO-3 both are built partitioned (no rank holds a whole
    model)."""
    import deepspeed

    from dapo_ray.trainer.zero import load_causal_lm

    t = cfg.trainer
    dtype = torch.bfloat16 if t.dtype == "bfloat16" else torch.float32
    config = ds_config(cfg, world)
    lm = load_causal_lm(cfg.rollout.model_path, dtype, config, t.attn_implementation)
    if t.gradient_checkpointing:
        lm.gradient_checkpointing_enable()
    share = t.share_prompts and not t.gradient_checkpointing
    policy = PolicyLM(lm, logprob_chunks(cfg), share)
    optimizer = make_optimizer(policy.parameters(), cfg)
    engine, *_ = deepspeed.initialize(model=policy, optimizer=optimizer, config=config)
    ref = None
    if cfg.algorithm.kl_coef > 0:
        ref = PolicyLM(load_causal_lm(cfg.rollout.model_path, dtype, config, t.attn_implementation),
                       logprob_chunks(cfg), share)  # fmt: skip
        ref.requires_grad_(False)
        ref.eval()
        if t.zero_stage == 3:  # stays partitioned; DeepSpeed gathers each layer as it runs
            ref, *_ = deepspeed.initialize(model=ref, config=config)
        else:
            ref.to(engine.device)
    return engine, ref


def _grad_norm(engine) -> float:
    """The global gradient norm of the step just taken. DeepSpeed's ZeRO optimizers record it; under
    stage 0 it computes the norm for clipping and drops it, so compute it (gradients are all-reduced by
    then) before `engine.step()`."""
    params = [p for p in engine.module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm([p.grad for p in params])) if params else 0.0


@dataclass
class _Totals:
    """This rank's running sums over one step (float64, as the metrics divide them), summed over ranks by
    `reduced` in one all-reduce."""

    tokens: float = 0.0  # response tokens (counted in the first epoch)
    entropy: float = 0.0  # summed over those tokens
    logprob_diff: float = 0.0  # |recomputed - engine| summed over fresh tokens (of the current version)
    fresh_tokens: float = 0.0
    up_clipped_tokens: float = 0.0  # this and the next: means over epochs
    up_clipped_prob: float = 0.0  # the sum of their old probabilities
    # SUM_KEYS, each weighted by its micro-batch's tokens
    loss_stats: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SUM_KEYS, 0.0))

    def add_loss_stats(self, stats: dict[str, float], epochs: int) -> None:
        """One micro-batch's policy-loss statistics; each epoch's count 1/epochs (the mean over epochs)."""
        n = stats["n_tokens"] / epochs
        if stats["up_clipped_tokens"]:
            self.up_clipped_tokens += stats["up_clipped_tokens"] / epochs
            self.up_clipped_prob += stats["up_clipped_prob"] * stats["up_clipped_tokens"] / epochs
        for k in SUM_KEYS:
            self.loss_stats[k] += stats.get(k, 0.0) * n

    def reduced(self, device) -> _Totals:
        """The sums over all ranks (every rank must call it)."""
        head = [self.tokens, self.entropy, self.logprob_diff, self.fresh_tokens,
                self.up_clipped_tokens, self.up_clipped_prob]  # fmt: skip
        packed_N = torch.tensor([*head, *(self.loss_stats[k] for k in SUM_KEYS)], dtype=torch.float64)  # checked: collective.all_reduce copies it to the engine's device first
        summed = collective.all_reduce(packed_N, device).tolist()
        return _Totals(*summed[: len(head)], loss_stats=dict(zip(SUM_KEYS, summed[len(head) :], strict=True)))


@dataclass
class _CorrectionTotals:
    """The rollout correction's statistics on this rank: its tokens, the IS_KEYS means weighted by them, and
    the largest weight; `reduced` sums (and takes the maximum) over ranks."""

    tokens: float = 0.0
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(IS_KEYS, 0.0))
    max_weight: float = 0.0

    def add(self, st: dict[str, float]) -> None:
        self.tokens += st["n_tokens"]
        for k in IS_KEYS:
            self.sums[k] += st[k] * st["n_tokens"]
        if st["n_tokens"]:
            self.max_weight = max(self.max_weight, st["rollout_is_max"])

    def reduced(self, device) -> _CorrectionTotals:
        """Over all ranks: two all-reduces (a sum, then a maximum), which every rank must make."""
        sums_N = torch.tensor([self.tokens, *(self.sums[k] for k in IS_KEYS)], dtype=torch.float64)  # checked: collective.all_reduce copies it to the engine's device first
        summed = collective.all_reduce(sums_N, device)
        peak = collective.all_reduce(torch.tensor([self.max_weight], dtype=torch.float64), device, op="max")  # checked: collective.all_reduce copies it to the engine's device first
        tokens, *sums = summed.tolist()
        return _CorrectionTotals(tokens, dict(zip(IS_KEYS, sums, strict=True)), peak.item())


class _Prepared(NamedTuple):
    """A micro-batch ready for the update: its tensors and what the pass before the update made of it."""

    m: Micro
    old_BT: torch.Tensor | None  # behaviour log-probs (None: from the update's forward, `first_from_update`)
    ref_BT: torch.Tensor | None  # the reference model's, with a KL term
    is_w_BT: torch.Tensor | None  # rollout-correction weights, with `algorithm.rollout_is`


@dataclass
class _Updates:
    """What the update loop did on this rank."""

    grad_norms: list[float]  # of each update applied
    steps: int  # optimizer steps, skipped ones included
    skipped: int  # updates not applied: their gradient held a NaN/inf
    trailing_skipped: int  # of those, how many in a row ended the step
    tokens: float  # response tokens trained on, over all epochs


def train_step(engine, ref, shard: list[dict], version: int, cfg: Config, world: int) -> dict[str, float]:
    """One RL step's updates on this rank's shard; `version` is the policy version of the current
    weights. Returns metrics that are already reduced over ranks."""
    t = cfg.trainer
    t0 = time.time()
    lr = t.lr * min(1.0, (version + 1) / t.warmup_steps) if t.warmup_steps else t.lr
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    totals, correction = _Totals(), _CorrectionTotals()
    prepared = _prepare(engine, ref, shard, version, cfg, totals, correction)
    t_old = time.time() - t0
    updates = _update(engine, prepared, version, cfg, world, totals, correction)
    t_update = time.time() - t0 - t_old
    # Collectives, the same on every rank: the totals, then (when on) the correction's.
    totals = totals.reduced(engine.device)
    correction = correction.reduced(engine.device) if cfg.algorithm.rollout_is != "none" else None
    return _step_metrics(totals, correction, updates, lr, t_old, t_update, with_kl=ref is not None)


def _prepare(engine, ref, shard: list[dict], version: int, cfg: Config, totals: _Totals,
             correction: _CorrectionTotals) -> list[tuple[dict, list[_Prepared]]]:  # fmt: skip
    """Behaviour log-probs (and reference log-probs for the KL term), before any update; each mini-batch
    with its prepared micro-batches. A token an older policy sampled takes the engine's log-prob
    (`behaviour_logprobs`), so the trainer's own are needed only for tokens of the current version: the
    forward pass runs only for the micro-batches where some rank holds one, or all of them with a KL term.
    While generation overlaps training most batches hold none (no forward at all); a batch that needed a
    further generation round after the sync holds a few such groups. Every rank decides alike, micro-batch
    by micro-batch (each rank holds as many: `build_shards`): under ZeRO-3 a forward is a collective.

    With one PPO epoch and no KL term the first mini-batch needs no pass here: its update starts from the
    current weights, so its own forward pass gives their log-probs, taken detached as the old ones (as
    verl's actor does on-policy); `_micro_step` completes those micro-batches. A step of one optimizer
    update therefore runs no pass at all, and one of M updates runs it on M - 1 mini-batches."""
    first = 1 if first_from_update(ref, cfg) else 0
    prepared = [(mini, [_Prepared(pad_micro(samples, PAD_ID), None, None, None) for samples in mini["micro"]])
                for mini in shard[:first]]  # fmt: skip
    if len(shard) == first:
        return prepared
    fresh_here = [float(any(s["weight"] > 0 and max(s["token_versions"], default=-1) >= version for s in micro))
                  for mini in shard[first:] for micro in mini["micro"]]  # fmt: skip
    # Every rank joins this all-reduce, with a reference model too.
    fresh = collective.all_reduce(torch.tensor(fresh_here or [0.0]), engine.device, op="max").tolist()  # checked: collective.all_reduce copies it to the engine's device first
    engine.eval()
    j = 0
    with torch.no_grad():
        for mini in shard[first:]:
            micros = []
            for samples in mini["micro"]:
                m = pad_micro(samples, PAD_ID)
                recompute = ref is not None or fresh[j] > 0
                micros.append(_prepare_micro(engine, ref, m, version, recompute, cfg, totals, correction))
                j += 1
            prepared.append((mini, micros))
    return prepared


def first_from_update(ref, cfg: Config) -> bool:
    """Whether the first mini-batch's old log-probs come from its update's forward pass (`_prepare`): it
    is updated from the weights that sampled the step's current tokens, and never again."""
    return ref is None and cfg.trainer.ppo_epochs == 1


def _prepare_micro(engine, ref, m: Micro, version: int, recompute: bool, cfg: Config, totals: _Totals,
                   correction: _CorrectionTotals) -> _Prepared:  # fmt: skip
    """One micro-batch's behaviour (and reference) log-probs and rollout-correction weights."""
    temperature, logp_BT, ref_BT = cfg.rollout.temperature, None, None
    if recompute:
        ids_BL, att_BL = m.ids_BL.to(engine.device), m.att_BL.to(engine.device)
        logp_BT = engine(ids_BL, att_BL, temperature, first_target=m.first_target, prefix_B=m.prefix_B)[0].float().cpu()
        if ref is not None:
            ref_BT = ref(ids_BL, att_BL, temperature, first_target=m.first_target, prefix_B=m.prefix_B)[0].float().cpu()
    old_BT, is_w_BT = _behaviour(m, logp_BT, version, cfg, totals, correction)
    return _Prepared(m, old_BT, ref_BT, is_w_BT)


def _behaviour(m: Micro, logp_BT: torch.Tensor | None, version: int, cfg: Config, totals: _Totals,
               correction: _CorrectionTotals) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """A micro-batch's behaviour log-probs and rollout-correction weights, given the current weights'
    log-probs (`logp_BT`, on the CPU; None when none of its tokens is of the current version)."""
    a = cfg.algorithm
    off_policy_BT = m.version_BT < version
    fresh_BT = (m.mask_BT > 0).double() * (~off_policy_BT).double()
    totals.fresh_tokens += float(fresh_BT.sum())
    old_BT = m.rollout_BT
    if logp_BT is not None:
        old_BT = behaviour_logprobs(logp_BT, m.rollout_BT, off_policy_BT)
        totals.logprob_diff += float(((logp_BT - m.rollout_BT).abs() * fresh_BT).sum())
    # pi_old / pi_rollout: exactly 1 where `old` is the engine's log-prob already (older versions).
    # Every response lies whole in one micro-batch (batch.build_shards), as the sequence level needs.
    is_w_BT = None
    if a.rollout_is != "none":
        is_w_BT, stats = rollout_is_weights(
            old_BT, m.rollout_BT, m.mask_BT,
            level=a.rollout_is, threshold=a.rollout_is_threshold, mode=a.rollout_is_mode,
        )  # fmt: skip
        correction.add(stats)
    return old_BT, is_w_BT


def _update(engine, prepared: list[tuple[dict, list[_Prepared]]], version: int, cfg: Config, world: int,
            totals: _Totals, correction: _CorrectionTotals) -> _Updates:  # fmt: skip
    """ppo_epochs passes; each mini-batch is one optimizer step. The first pass also measures the
    policy's entropy, each mini-batch at the weights it is updated from (as verl does)."""
    t = cfg.trainer
    engine.train()
    steps_before, skipped_before = engine.global_steps, engine.skipped_steps
    grad_norms, trailing_skipped = [], 0
    for epoch in range(t.ppo_epochs):
        for mini, micros in prepared:
            for i, p in enumerate(micros):
                # The mini-batch's last micro-batch is the accumulation boundary (gradients reduced over
                # ranks, one optimizer step), marked here: with micro_batch_tokens the count varies from
                # one mini-batch to the next (it is the same on every rank: build_shards).
                engine.set_gradient_accumulation_boundary(i == len(micros) - 1)
                _micro_step(engine, p, mini, epoch == 0, version, cfg, world, totals, correction)
            norm = _optimizer_step(engine, t.zero_stage)
            if norm is None:  # this update held a NaN/inf: not applied
                trailing_skipped += 1
            else:
                trailing_skipped = 0
                grad_norms.append(norm)
    steps, skipped = engine.global_steps - steps_before, engine.skipped_steps - skipped_before
    return _Updates(grad_norms, steps, skipped, trailing_skipped, tokens=totals.tokens * t.ppo_epochs)


def _micro_step(engine, p: _Prepared, mini: dict, with_entropy: bool, version: int, cfg: Config, world: int,
                totals: _Totals, correction: _CorrectionTotals) -> None:  # fmt: skip
    """Forward, policy loss and backward of one micro-batch; its statistics go into `totals` (and, when its
    old log-probs come from this forward, `correction`)."""
    a, device, m = cfg.algorithm, engine.device, p.m
    ids_BL, att_BL = m.ids_BL.to(device), m.att_BL.to(device)
    logp_BT, ent_BT = engine(ids_BL, att_BL, cfg.rollout.temperature, with_entropy=with_entropy,
                             first_target=m.first_target, prefix_B=m.prefix_B)  # fmt: skip
    if p.old_BT is None:  # the step's first update: these are the current weights' log-probs (`first_from_update`)
        old_BT, is_w_BT = _behaviour(m, logp_BT.detach().float().cpu(), version, cfg, totals, correction)
        p = p._replace(old_BT=old_BT, is_w_BT=is_w_BT)
    if ent_BT is not None:
        real_BT = (m.mask_BT > 0).double()
        totals.tokens += float(real_BT.sum())
        totals.entropy += float((ent_BT.float().cpu() * real_BT).sum())
    loss, stats = POLICY_LOSSES[a.policy_loss](
        logp_BT, p.old_BT.to(device), m.adv_B.to(device), m.mask_BT.to(device),
        eps_low=a.eps_low, eps_high=a.eps_high, clip_ratio_c=a.clip_ratio_c,
        loss_agg_mode=a.loss_agg_mode, total_tokens=mini["total_tokens"], total_seqs=mini["total_seqs"],
        norm_length=cfg.rollout.max_response_length,
        kl_coef=a.kl_coef, ref_logp_BT=None if p.ref_BT is None else p.ref_BT.to(device),
        kl_estimator=a.kl_estimator, is_weights_BT=None if p.is_w_BT is None else p.is_w_BT.to(device),
    )  # fmt: skip
    # The global denominators already make the sum over micro-batches and ranks exact: DeepSpeed must not
    # divide by its accumulation count (scale_wrt_gas) and its average over ranks is undone.
    engine.backward(loss * world, scale_wrt_gas=False)
    totals.add_loss_stats(stats, cfg.trainer.ppo_epochs)


def _optimizer_step(engine, zero_stage: int) -> float | None:
    """The mini-batch's optimizer step: its gradient norm, or None when the update held a NaN/inf and was
    not applied (DeepSpeed counts it in `skipped_steps`)."""
    skipped_before = engine.skipped_steps
    stage0_norm = _grad_norm(engine) if zero_stage == 0 else None
    engine.step()
    if engine.skipped_steps > skipped_before:
        return None
    return stage0_norm if stage0_norm is not None else float(engine.get_global_grad_norm() or 0.0)


def _step_metrics(totals: _Totals, correction: _CorrectionTotals | None, updates: _Updates, lr: float,
                  t_old: float, t_update: float, with_kl: bool) -> dict[str, float]:  # fmt: skip
    """The step's metrics from the totals reduced over ranks (`correction` None without the correction)."""
    tok, norms = max(totals.tokens, 1.0), updates.grad_norms
    metrics = {
        "actor/entropy": totals.entropy / tok,
        "actor/off_policy_token_frac": 1.0 - totals.fresh_tokens / tok,
        **{f"actor/{k}": totals.loss_stats[k] / tok for k in SUM_KEYS},
        "actor/grad_norm": sum(norms) / len(norms) if norms else float("nan"),
        "actor/lr": lr,
        "actor/updates": updates.steps,
        "actor/skipped_updates": updates.skipped,
        "skip/trailing": updates.trailing_skipped,  # skipped at the end of the step, for the driver's streak
        "timing/old_logprob_s": t_old,
        "timing/update_s": t_update,
        "local/tokens": updates.tokens,  # this rank's, for its own Ray metrics; not sent to the driver
    }
    if not with_kl:
        del metrics["actor/kl_loss"]
    if totals.fresh_tokens > 0:  # undefined without a response of the current version
        metrics["actor/rollout_logprob_diff"] = totals.logprob_diff / totals.fresh_tokens
    if totals.up_clipped_tokens > 0:  # undefined when no token was clipped at the upper bound
        metrics["actor/up_clipped_prob"] = totals.up_clipped_prob / totals.up_clipped_tokens
    if correction is not None:
        n_is = max(correction.tokens, 1.0)
        metrics |= {f"rollout_corr/{k}": correction.sums[k] / n_is for k in IS_KEYS}
        metrics["rollout_corr/rollout_is_max"] = correction.max_weight
    return metrics


def publish_weights(engine, version: int, store, cfg: Config, rank: int, world: int) -> tuple[float, int]:
    """Publish the weights as `version`, bucket by bucket (`dapo_ray.weights`): every rank gathers every
    layer (ZeRO-3: a collective, one layer of extra accelerator memory), and the owner of each bucket
    (rank `index % world`) copies it into a reused host buffer and puts it in the object store from a
    thread while the ranks gather the next. Returns (seconds, bytes this rank put)."""
    import random

    from dapo_ray import weights
    from dapo_ray.trainer.zero import gathered, group_nbytes, layer_groups, tie_groups

    t0 = time.time()
    groups = tie_groups(layer_groups(engine.module.lm))  # a tied head travels once, with its embedding
    sizes = [group_nbytes(g) for g in groups]
    # One id for this publish on every rank: rank 0's, summed with the others' zeros.
    mine_id = float(random.getrandbits(52)) if rank == 0 else 0.0
    publish_id = int(collective.all_reduce(torch.tensor([mine_id], dtype=torch.float64), engine.device).item())  # checked: collective.all_reduce copies it to the engine's device first
    nbytes = weights.send_buckets(store, version, publish_id, groups, sizes, cfg.weight_sync.bucket_mb,
                                  open_group=lambda i: gathered(groups[i], cfg.trainer.zero_stage), rank=rank,
                                  world=world, pinned=torch.device(engine.device).type == "cuda")  # fmt: skip
    return time.time() - t0, nbytes


def _quiet_ray_train_reports() -> None:
    """Ray Train logs every report's whole metrics dict at INFO; the driver prints its own step line."""
    import logging

    try:
        from ray.train.v2._internal.execution import context
    except ImportError:
        return
    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def _report(engine, metrics: dict, save_state: dict, step: int, rank: int) -> None:
    """A checkpoint through `ray.train.report`: DeepSpeed state + the driver's state (data cursor,
    carried groups, counters), with the step's numbers. Steps without a checkpoint report nothing to Ray
    Train: their numbers reach the driver through the channel, and a report costs up to a second there
    (Ray Train keeps one unconsumed report per worker and its controller drains them on its own clock)."""
    import ray.train

    numbers = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
    tmp = Path(tempfile.mkdtemp(prefix="dapo-ckpt-"))  # checked: a worker's own scratch dir: written and read by this worker only, then handed to Ray Train, which uploads it
    engine.save_checkpoint(str(tmp), tag="ckpt")
    if rank == 0:
        (tmp / "driver_state.json").write_text(json.dumps(save_state | {"step": step}))
    ray.train.report(numbers, checkpoint=ray.train.Checkpoint.from_directory(str(tmp)))
    shutil.rmtree(tmp, ignore_errors=True)
    _wait_report_taken()


def _wait_report_taken() -> None:
    """Block until Ray Train's controller has taken this worker's report (it polls the workers every 2 s):
    only then is the checkpoint registered, so a worker that fails soon after restarts from it rather than
    from the one before."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context
    except ImportError:
        return
    get_train_context().get_result_queue().join()


def _save_final(engine, cfg: Config, final: str, rank: int) -> None:
    """The trained model as a HF directory (gathered layer by layer under ZeRO-3) with the tokenizer, at
    `final`: a directory, or object storage (written here, then uploaded)."""
    from dapo_ray import storage
    from dapo_ray.trainer.zero import full_state_dict_cpu

    state = full_state_dict_cpu(engine.module.lm, cfg.trainer.zero_stage, rank)
    if rank != 0:
        return
    local = Path(tempfile.mkdtemp(prefix="dapo-final-")) if storage.is_uri(final) else Path(final)  # checked: rank 0 writes it and uploads it itself (object storage); a local final dir must be a shared mount (trainer.output_dir)
    engine.module.lm.save_pretrained(local, state_dict=state, safe_serialization=True)
    for f in os.listdir(cfg.rollout.model_path):
        if f.startswith("tokenizer") or f in ("special_tokens_map.json", "chat_template.jinja", "generation_config.json"):
            shutil.copy(Path(cfg.rollout.model_path) / f, local / f)
    if storage.is_uri(final):
        storage.upload_dir(local, final)
        shutil.rmtree(local, ignore_errors=True)


def train_loop(params: dict) -> None:
    """`params`: {"config": Config, "channel": name, "store": name, "namespace": str, "probe_ids":
    list[int], "final_dir": str}."""
    import ray
    import ray.train

    _quiet_ray_train_reports()
    quiet_libraries()  # DeepSpeed's memory reports, at a quiet console
    cfg: Config = params["config"]
    t = cfg.trainer
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    channel = ray.get_actor(params["channel"], namespace=params["namespace"])
    store = ray.get_actor(params["store"], namespace=params["namespace"])
    torch.manual_seed(t.seed)
    engine, ref = build_engines(cfg, world)
    exported = TrainerMetrics(cfg.tracking.ray_metrics, run_name(cfg), rank)

    step, driver_state = 0, None
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        # Each worker fetches only the files its rank reads, into a directory of its own: `as_directory()`
        # shares one download among the workers of a node, and a worker that takes its lock after another
        # finished downloads again, over the files the other is reading (a truncated ZeRO shard).
        from dapo_ray.trainer.restore import restore

        driver_state = restore(engine, ckpt, tag="ckpt").driver_state
        step = driver_state["step"]
    publish_weights(engine, step, store, cfg, rank, world)
    if rank == 0:  # after a restart by Ray Train too: the driver goes back to this step and driver_state
        ray.get(channel.put_result.remote({"kind": "ready", "step": step, "driver_state": driver_state}))
    collective.barrier(engine.device)  # no rank takes a shard before the channel has heard "ready"

    while True:
        item = ray.get(channel.get_shard.remote(rank))
        if item is None or item == STOP:
            break
        if item["minis"] is None:  # checkpoint only (dynamic sampling stopped at its cap)
            _report(engine, {"step": step}, item["save"], step, rank)
            if rank == 0:
                ray.get(channel.put_result.remote({"kind": "saved", "step": step}))
            continue
        metrics = train_step(engine, ref, item["minis"], step, cfg, world)
        step += 1
        exported.trained(step, metrics.pop("local/tokens"), metrics["timing/old_logprob_s"], metrics["timing/update_s"])
        t1 = time.time()
        sync_s, sync_bytes = publish_weights(engine, step, store, cfg, rank, world)
        sync_bytes = int(collective.all_reduce(torch.tensor([float(sync_bytes)], dtype=torch.float64), engine.device).item())  # checked: collective.all_reduce copies it to the engine's device first
        peak = collective.all_reduce(torch.tensor([peak_rss_gib()], dtype=torch.float64), engine.device, op="max").item()  # checked: collective.all_reduce copies it to the engine's device first
        metrics |= {"step": step, "timing/weight_sync_s": time.time() - t1 if rank == 0 else 0.0,
                    "weight_sync/bytes": sync_bytes, "weight_sync/publish_s": sync_s,
                    "memory/trainer_peak_gib": peak}  # fmt: skip
        if params.get("probe_ids"):  # every rank runs it: under ZeRO-3 a forward is a collective
            with torch.no_grad():
                engine.eval()
                probe = torch.tensor([params["probe_ids"]], device=engine.device)
                probe_lp = engine(probe, torch.ones_like(probe), 1.0)[0][0].float().cpu().tolist()
            if rank == 0:
                metrics["probe_logprobs"] = probe_lp
        if item["save"] is not None:
            _report(engine, metrics, item["save"], step, rank)
        if rank == 0:
            ray.get(channel.put_result.remote({"kind": "step", **metrics}))

    if item is None and params.get("final_dir"):
        _save_final(engine, cfg, params["final_dir"], rank)
        if rank == 0:
            ray.get(channel.put_result.remote({"kind": "final", "path": params["final_dir"]}))
    exported.wait_exported()  # the last step's counters, before Ray Train ends this worker
