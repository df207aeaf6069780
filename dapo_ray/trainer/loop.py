"""The Ray Train worker loop: DeepSpeed engine, old log-probs, DAPO mini-batch updates, weight publish,
checkpoints through `ray.train.report`.

Each step: pull this rank's shard from the channel -> recompute old log-probs (and entropy) with the
current weights -> for every mini-batch, accumulate micro-batch gradients of the DAPO loss and take one
optimizer step -> rank 0 writes the new weights and publishes them as version step+1 -> report.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from dapo_ray.algo import dapo_policy_loss, entropy_from_logits, token_logprobs
from dapo_ray.config import Config

SUM_KEYS = ("pg_clipfrac_upper", "pg_clipfrac_lower", "pg_clipfrac_dual", "ppo_kl", "ratio_mean")


def _pad(micro: list[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids [B, L], attention [B, L], response mask over targets [B, L-1] (weighted), adv [B],
    rollout logprobs aligned with targets [B, L-1]."""
    width = max(len(s["input_ids"]) for s in micro)
    B = len(micro)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    att = torch.zeros((B, width), dtype=torch.long)
    mask = torch.zeros((B, width - 1))
    roll = torch.zeros((B, width - 1))
    for i, s in enumerate(micro):
        n, p = len(s["input_ids"]), s["n_prompt"]
        ids[i, :n] = torch.tensor(s["input_ids"])
        att[i, :n] = 1
        mask[i, p - 1 : n - 1] = s["weight"]  # target t+1 is predicted at position t
        lp = s["rollout_logprobs"][: n - p]
        roll[i, p - 1 : p - 1 + len(lp)] = torch.tensor(lp)
    adv = torch.tensor([s["advantage"] for s in micro])
    return ids, att, mask, adv, roll


def _forward_logp(model, ids, att, temperature: float, with_entropy: bool = False):
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1]
    logp = token_logprobs(logits, ids[:, 1:], temperature)
    ent = entropy_from_logits(logits.detach(), temperature) if with_entropy else None
    return logp, ent


def publish_weights(engine, version: int, out_dir: Path, store, zero_stage: int, rank: int) -> tuple[float, int]:
    """Rank 0 writes the full state dict as safetensors and publishes (version, path); returns (s, bytes)."""
    from safetensors.torch import save_file

    t0 = time.time()
    if zero_stage == 3:
        import deepspeed

        ctx = deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)
    else:
        import contextlib

        ctx = contextlib.nullcontext()
    nbytes = 0
    with ctx:
        if rank == 0:
            sd = {k: v.detach().to("cpu").contiguous() for k, v in engine.module.state_dict().items()}
            path = out_dir / f"policy-v{version}.safetensors"
            save_file(sd, str(path))
            nbytes = path.stat().st_size
            import ray

            ray.get(store.publish.remote(version, str(path)))
            for old in out_dir.glob("policy-v*.safetensors"):  # keep the last two versions
                if int(old.stem.split("-v")[1]) < version - 1:
                    old.unlink(missing_ok=True)
    return time.time() - t0, nbytes


def _quiet_ray_train_reports() -> None:
    """Ray Train logs every report's whole metrics dict at INFO; the driver prints its own step line."""
    import logging

    try:
        from ray.train.v2._internal.execution import context
    except ImportError:
        return
    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def train_loop(params: dict) -> None:
    """`params`: {"config": Config, "channel": name, "store": name, "namespace": str, "weights_dir": str,
    "probe_ids": list[int]}."""
    import deepspeed
    import ray
    import ray.train
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    _quiet_ray_train_reports()
    cfg: Config = params["config"]
    t, a = cfg.trainer, cfg.algorithm
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    channel = ray.get_actor(params["channel"], namespace=params["namespace"])
    store = ray.get_actor(params["store"], namespace=params["namespace"])
    weights_dir = Path(params["weights_dir"])
    weights_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(t.seed)
    device = torch.device("cuda", torch.cuda.current_device()) if t.use_gpu else torch.device("cpu")

    dtype = torch.bfloat16 if t.dtype == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(cfg.rollout.model_path, dtype=dtype)
    if t.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    micro_per_mini = t.mini_batch_size // world // t.micro_batch_size
    ds_config = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": micro_per_mini,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": t.dtype == "bfloat16"},
        "steps_per_print": 10**9,
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    pad_id = 0

    step, driver_state = 0, None
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            engine.load_checkpoint(d, tag="ckpt", load_module_strict=True)
            driver_state = json.loads((Path(d) / "driver_state.json").read_text())
            step = driver_state["step"]
    publish_weights(engine, step, weights_dir, store, t.zero_stage, rank)
    if rank == 0:
        ray.get(channel.put_result.remote({"kind": "ready", "step": step, "driver_state": driver_state}))

    while True:
        item = ray.get(channel.get_shard.remote(rank))
        if item is None:
            break
        shard, save_state = item["minis"], item["save"]
        t0 = time.time()
        lr = t.lr * min(1.0, (step + 1) / t.warmup_steps) if t.warmup_steps else t.lr
        for group in optimizer.param_groups:
            group["lr"] = lr
        totals = torch.zeros(3 + len(SUM_KEYS), dtype=torch.float64)  # tokens, entropy, |old-rollout|, SUM_KEYS

        # Old log-probs under the weights that generated (or nearly: carried groups) the batch.
        engine.eval()
        with torch.no_grad():
            for mini in shard:
                mini["old"] = []
                for micro in mini["micro"]:
                    ids, att, mask, _, roll = _pad(micro, pad_id)
                    logp, ent = _forward_logp(engine, ids.to(device), att.to(device), cfg.rollout.temperature, True)
                    logp, ent = logp.float().cpu(), ent.float().cpu()
                    mini["old"].append(logp)
                    real = (mask > 0).double()
                    totals[0] += real.sum()
                    totals[1] += (ent * real).sum()
                    totals[2] += ((logp - roll).abs() * real).sum()
        t_old = time.time() - t0

        engine.train()
        grad_norms = []
        for mini in shard:
            for micro, old in zip(mini["micro"], mini["old"], strict=True):
                ids, att, mask, adv, _ = _pad(micro, pad_id)
                logp, _ = _forward_logp(engine, ids.to(device), att.to(device), cfg.rollout.temperature)
                loss, stats = dapo_policy_loss(
                    logp, old.to(device), adv.to(device), mask.to(device),
                    eps_low=a.eps_low, eps_high=a.eps_high, clip_ratio_c=a.clip_ratio_c,
                    loss_agg_mode=a.loss_agg_mode, total_tokens=mini["total_tokens"], total_seqs=mini["total_seqs"],
                )  # fmt: skip
                # DeepSpeed divides by the accumulation count and averages over ranks; the global
                # denominators already make the sum exact, so undo both.
                engine.backward(loss * micro_per_mini * world)
                engine.step()
                n = stats["n_tokens"]
                for i, k in enumerate(SUM_KEYS):
                    totals[3 + i] += stats[k] * n
            grad_norms.append(float(engine.get_global_grad_norm() or 0.0))
        t_update = time.time() - t0 - t_old
        dist.all_reduce(totals)

        step += 1
        t1 = time.time()
        sync_s, sync_bytes = publish_weights(engine, step, weights_dir, store, t.zero_stage, rank)
        tok = max(float(totals[0]), 1.0)
        metrics = {
            "step": step,
            "actor/entropy": float(totals[1]) / tok,
            "actor/rollout_logprob_diff": float(totals[2]) / tok,
            **{f"actor/{k}": float(totals[3 + i]) / tok for i, k in enumerate(SUM_KEYS)},
            "actor/grad_norm": sum(grad_norms) / len(grad_norms),
            "actor/lr": lr,
            "actor/updates": len(shard),
            "timing/old_logprob_s": t_old,
            "timing/update_s": t_update,
            "timing/weight_sync_s": time.time() - t1 if rank == 0 else 0.0,
            "weight_sync/bytes": sync_bytes,
            "weight_sync/publish_s": sync_s,
        }
        if rank == 0 and params.get("probe_ids"):
            with torch.no_grad():
                probe = torch.tensor([params["probe_ids"]], device=device)
                engine.eval()
                lp, _ = _forward_logp(engine, probe, torch.ones_like(probe), 1.0)
            metrics["probe_logprobs"] = lp[0].float().cpu().tolist()

        if save_state is not None:  # the driver asks for a checkpoint on this step
            tmp = Path(tempfile.mkdtemp(prefix="dapo-ckpt-"))
            engine.save_checkpoint(str(tmp), tag="ckpt")
            if rank == 0:
                (tmp / "driver_state.json").write_text(json.dumps(save_state | {"step": step}))
            ray.train.report({k: v for k, v in metrics.items() if isinstance(v, int | float)},
                             checkpoint=ray.train.Checkpoint.from_directory(str(tmp)))  # fmt: skip
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            ray.train.report({k: v for k, v in metrics.items() if isinstance(v, int | float)})
        if rank == 0:
            ray.get(channel.put_result.remote({"kind": "step", **metrics}))

    if rank == 0 and params.get("final_dir"):
        final = Path(params["final_dir"])
        engine.module.save_pretrained(final, safe_serialization=True)
        for f in os.listdir(cfg.rollout.model_path):
            if f.startswith("tokenizer") or f in ("special_tokens_map.json", "chat_template.jinja"):
                shutil.copy(Path(cfg.rollout.model_path) / f, final / f)
        ray.get(channel.put_result.remote({"kind": "final", "path": str(final)}))
