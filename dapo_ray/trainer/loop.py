"""The Ray Train worker loop: DeepSpeed engine, old log-probs, DAPO mini-batch updates, weight publish,
checkpoints through `ray.train.report`.

Each step (`train_step`): pull this rank's shard from the channel -> old log-probs (the behaviour
policy's: recomputed with the current weights for fresh samples, the engine's for samples an older
version generated; the pass is skipped when all were), with a KL term the reference model's, and with
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
from pathlib import Path

import torch

from dapo_ray.algo import POLICY_LOSSES, behaviour_logprobs, rollout_is_weights
from dapo_ray.config import Config
from dapo_ray.ray_metrics import TrainerMetrics, run_name
from dapo_ray.trainer import collective
from dapo_ray.trainer.batch import pad_micro
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
    lm = load_causal_lm(cfg.rollout.model_path, dtype, config)
    if t.gradient_checkpointing:
        lm.gradient_checkpointing_enable()
    policy = PolicyLM(lm, logprob_chunks(cfg))
    optimizer = make_optimizer(policy.parameters(), cfg)
    engine, *_ = deepspeed.initialize(model=policy, optimizer=optimizer, config=config)
    ref = None
    if cfg.algorithm.kl_coef > 0:
        ref = PolicyLM(load_causal_lm(cfg.rollout.model_path, dtype, config), logprob_chunks(cfg))
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


def train_step(engine, ref, shard: list[dict], version: int, cfg: Config, world: int) -> dict[str, float]:
    """One RL step's updates on this rank's shard; `version` is the policy version of the current
    weights. Returns metrics that are already reduced over ranks."""
    t, a = cfg.trainer, cfg.algorithm
    temperature = cfg.rollout.temperature
    device = engine.device
    t0 = time.time()
    lr = t.lr * min(1.0, (version + 1) / t.warmup_steps) if t.warmup_steps else t.lr
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    # tokens, entropy sum, |recomputed - engine| sum over fresh tokens (tokens of the current version),
    # fresh tokens, up-clipped tokens and the sum of their old probabilities, SUM_KEYS sums
    totals = torch.zeros(6 + len(SUM_KEYS), dtype=torch.float64)
    # rollout correction: tokens, then IS_KEYS sums (means weighted by tokens), and the largest weight
    is_totals, is_max = torch.zeros(1 + len(IS_KEYS), dtype=torch.float64), torch.zeros(1, dtype=torch.float64)

    # 1. Behaviour log-probs (and reference log-probs for the KL term), before any update. A token an
    # older policy sampled takes the engine's log-prob (`behaviour_logprobs`), so the trainer's own are
    # needed only for tokens of the current version. When no rank holds one and there is no KL term
    # (the steady state while generation overlaps training), the forward pass is skipped. Every rank
    # decides alike: under ZeRO-3 a forward is a collective.
    fresh_here = any(s["weight"] > 0 and max(s["token_versions"], default=-1) >= version
                     for mini in shard for micro in mini["micro"] for s in micro)  # fmt: skip
    any_fresh = collective.all_reduce(torch.tensor([float(fresh_here)]), device, op="max")
    recompute = ref is not None or bool(any_fresh.item())
    engine.eval()
    prepared = []
    with torch.no_grad():
        for mini in shard:
            micros = []
            for samples in mini["micro"]:
                m = pad_micro(samples, PAD_ID)
                off_policy_BT = m.version_BT < version
                fresh = (m.mask_BT > 0).double() * (~off_policy_BT).double()
                totals[3] += fresh.sum()
                old, ref_logp = m.rollout_BT, None
                if recompute:
                    ids, att = m.ids_BL.to(device), m.att_BL.to(device)
                    logp = engine(ids, att, temperature)[0].float().cpu()
                    old = behaviour_logprobs(logp, m.rollout_BT, off_policy_BT)
                    totals[2] += ((logp - m.rollout_BT).abs() * fresh).sum()
                    if ref is not None:
                        ref_logp = ref(ids, att, temperature)[0].float().cpu()
                # pi_old / pi_rollout: exactly 1 where `old` is the engine's log-prob already (older versions).
                # Every response lies whole in one micro-batch (batch.build_shards), as the sequence level needs.
                is_w = None
                if a.rollout_is != "none":
                    is_w, st = rollout_is_weights(old, m.rollout_BT, m.mask_BT, level=a.rollout_is,
                                                  threshold=a.rollout_is_threshold, mode=a.rollout_is_mode)  # fmt: skip
                    is_totals[0] += st["n_tokens"]
                    for j, k in enumerate(IS_KEYS):
                        is_totals[1 + j] += st[k] * st["n_tokens"]
                    if st["n_tokens"]:
                        is_max[0] = max(float(is_max[0]), st["rollout_is_max"])
                micros.append((m, old, ref_logp, is_w))
            prepared.append((mini, micros))
    t_old = time.time() - t0

    # 2. ppo_epochs passes; each mini-batch is one optimizer step. The first pass also measures the
    # policy's entropy, each mini-batch at the weights it is updated from (as verl does).
    engine.train()
    grad_norms, steps_before, skipped_before = [], engine.global_steps, engine.skipped_steps
    skipped_seen, trailing_skipped = skipped_before, 0
    policy_loss = POLICY_LOSSES[a.policy_loss]
    for epoch in range(t.ppo_epochs):
        for mini, micros in prepared:
            for i, (m, old, ref_logp, is_w) in enumerate(micros):
                # The mini-batch's last micro-batch is the accumulation boundary (gradients reduced over
                # ranks, one optimizer step), marked here: with micro_batch_tokens the count varies from
                # one mini-batch to the next (it is the same on every rank: build_shards).
                engine.set_gradient_accumulation_boundary(i == len(micros) - 1)
                ids, att = m.ids_BL.to(device), m.att_BL.to(device)
                logp, ent = engine(ids, att, temperature, with_entropy=epoch == 0)
                if ent is not None:
                    real = (m.mask_BT > 0).double()
                    totals[0] += real.sum()
                    totals[1] += (ent.float().cpu() * real).sum()
                loss, stats = policy_loss(
                    logp, old.to(device), m.adv_B.to(device), m.mask_BT.to(device),
                    eps_low=a.eps_low, eps_high=a.eps_high, clip_ratio_c=a.clip_ratio_c,
                    loss_agg_mode=a.loss_agg_mode, total_tokens=mini["total_tokens"], total_seqs=mini["total_seqs"],
                    norm_length=cfg.rollout.max_response_length,
                    kl_coef=a.kl_coef, ref_logp_BT=None if ref_logp is None else ref_logp.to(device),
                    kl_estimator=a.kl_estimator, is_weights_BT=None if is_w is None else is_w.to(device),
                )  # fmt: skip
                # The global denominators already make the sum over micro-batches and ranks exact:
                # DeepSpeed must not divide by its accumulation count (scale_wrt_gas) and its average
                # over ranks is undone.
                engine.backward(loss * world, scale_wrt_gas=False)
                n = stats["n_tokens"] / t.ppo_epochs  # statistics: the mean over epochs
                if stats["up_clipped_tokens"]:
                    totals[4] += stats["up_clipped_tokens"] / t.ppo_epochs
                    totals[5] += stats["up_clipped_prob"] * stats["up_clipped_tokens"] / t.ppo_epochs
                for j, k in enumerate(SUM_KEYS):
                    totals[6 + j] += stats.get(k, 0.0) * n
            stage0_norm = _grad_norm(engine) if t.zero_stage == 0 else None
            engine.step()
            if engine.skipped_steps > skipped_seen:  # this update held a NaN/inf: not applied
                skipped_seen, trailing_skipped = engine.skipped_steps, trailing_skipped + 1
            else:
                trailing_skipped = 0
                grad_norms.append(stage0_norm if stage0_norm is not None else float(engine.get_global_grad_norm() or 0.0))
    t_update = time.time() - t0 - t_old
    local_tokens = float(totals[0]) * t.ppo_epochs
    totals = collective.all_reduce(totals, device)

    tok = max(float(totals[0]), 1.0)
    metrics = {
        "actor/entropy": float(totals[1]) / tok,
        "actor/off_policy_token_frac": 1.0 - float(totals[3]) / tok,
        **{f"actor/{k}": float(totals[6 + i]) / tok for i, k in enumerate(SUM_KEYS)},
        "actor/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
        "actor/lr": lr,
        "actor/updates": engine.global_steps - steps_before,
        "actor/skipped_updates": engine.skipped_steps - skipped_before,
        "skip/trailing": trailing_skipped,  # skipped updates at the end of the step, for the driver's streak
        "timing/old_logprob_s": t_old,
        "timing/update_s": t_update,
        "local/tokens": local_tokens,  # this rank's, for its own Ray metrics; not sent to the driver
    }
    if ref is None:
        del metrics["actor/kl_loss"]
    if totals[3] > 0:  # undefined without a response of the current version
        metrics["actor/rollout_logprob_diff"] = float(totals[2] / totals[3])
    if totals[4] > 0:  # undefined when no token was clipped at the upper bound
        metrics["actor/up_clipped_prob"] = float(totals[5] / totals[4])
    if a.rollout_is != "none":  # the same on every rank: each joins both reductions
        is_totals = collective.all_reduce(is_totals, device)
        is_max = collective.all_reduce(is_max, device, op="max")
        n_is = max(float(is_totals[0]), 1.0)
        metrics |= {f"rollout_corr/{k}": float(is_totals[1 + j]) / n_is for j, k in enumerate(IS_KEYS)}
        metrics["rollout_corr/rollout_is_max"] = float(is_max[0])
    return metrics


def publish_weights(engine, version: int, store, cfg: Config, rank: int, world: int) -> tuple[float, int]:
    """Publish the weights as `version`, bucket by bucket (`dapo_ray.weights`): every rank gathers every
    layer (ZeRO-3: a collective, one layer of extra accelerator memory), and the owner of each bucket
    (rank `index % world`) copies it into a reused host buffer and puts it in the object store from a
    thread while the ranks gather the next. Returns (seconds, bytes this rank put)."""
    import random

    from dapo_ray import buckets, weights
    from dapo_ray.trainer.zero import full_nbytes, gathered, layer_groups

    t0 = time.time()
    groups = layer_groups(engine.module.lm)
    sizes = [sum(buckets.aligned(full_nbytes(t)) for _, t in g) for g in groups]
    # One id for this publish on every rank: rank 0's, summed with the others' zeros.
    mine_id = float(random.getrandbits(52)) if rank == 0 else 0.0
    publish_id = int(collective.all_reduce(torch.tensor([mine_id], dtype=torch.float64), engine.device).item())
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
    tmp = Path(tempfile.mkdtemp(prefix="dapo-ckpt-"))
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
    local = Path(tempfile.mkdtemp(prefix="dapo-final-")) if storage.is_uri(final) else Path(final)
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
        if item is None:
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
        sync_bytes = int(collective.all_reduce(torch.tensor([float(sync_bytes)], dtype=torch.float64), engine.device).item())
        metrics |= {"step": step, "timing/weight_sync_s": time.time() - t1 if rank == 0 else 0.0,
                    "weight_sync/bytes": sync_bytes, "weight_sync/publish_s": sync_s}  # fmt: skip
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

    if params.get("final_dir"):
        _save_final(engine, cfg, params["final_dir"], rank)
        if rank == 0:
            ray.get(channel.put_result.remote({"kind": "final", "path": params["final_dir"]}))
    exported.wait_exported()  # the last step's counters, before Ray Train ends this worker
