"""The trainer half of the GPU path on one GPU, in this process, without Ray or vLLM: DeepSpeed ZeRO-3 in
bf16 over NCCL (one rank), gradient checkpointing, on a randomly initialised model of Qwen2.5-0.5B's
shape, built from workflows/configs/gpu_smoke.yaml exactly as a Ray Train worker builds it
(`build_engines`, `train_step`, `full_state_dict_cpu`).

It checks what the CPU tier cannot: that the engine lands on the GPU in bf16, that two RL steps of
mixed fresh and older samples update the weights with finite numbers, that the trainer's bf16 log-probs
agree with a float32 forward of the same weights to bf16 precision (the engine's log-probs are compared
with the trainer's this way at every step: `actor/rollout_logprob_diff`), and that the layer-by-layer
gather hands out every weight, changed, in bf16, on the host. It prints its figures on one line
(`[gpu-trainer] {...}`): step and gather times, the gather's GB/s and the peak GPU memory.
Skipped without a CUDA GPU (tests/conftest.py)."""

import json
import math
import os
import random
import socket
import time
from pathlib import Path

import pytest
import torch

from dapo_ray.config import load_config

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def one_rank_nccl():
    """A one-rank NCCL process group, as Ray Train's TorchTrainer sets one up on a worker."""
    import deepspeed
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl")
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _samples(n: int, version: int, vocab: int, seed: int) -> list[dict]:
    """Random prompts and responses of the smoke config's lengths; every fourth response was sampled by
    the previous version (its denominator is the engine's log-prob, as for a carried-over group)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randrange(16, 96))]
        response = [rng.randrange(1, vocab) for _ in range(rng.randrange(8, 128))]
        out.append({"input_ids": prompt + response, "n_prompt": len(prompt), "weight": 1.0,
                    "advantage": rng.choice([-1.0, 1.0]) * rng.random(), "rollout_logprobs": [],
                    "token_versions": [version - (i % 4 == 0)] * len(response)})  # fmt: skip
    return out


@torch.no_grad()
def _fill_float32_logprobs(
    model_dir: Path, state: dict | None, batch: list[dict], temperature: float
) -> None:
    """The engine's stand-in: each response's log-probs from a float32 forward of the checkpoint, with the
    trainer's current weights (`state`, as gathered for a publish) in place of its own when given."""
    from transformers import AutoModelForCausalLM

    from dapo_ray.trainer.policy import PolicyLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if state is not None:
        lm.load_state_dict(state)
    policy = PolicyLM(lm.cuda().eval(), 1)
    for s in batch:
        ids = torch.tensor([s["input_ids"]], device="cuda")
        logp = policy(ids, torch.ones_like(ids), temperature)[0][0]
        s["rollout_logprobs"] = logp[s["n_prompt"] - 1 :].float().cpu().tolist()
    del policy, lm
    torch.cuda.empty_cache()


def test_zero3_bf16_steps_and_the_layer_gather_on_one_gpu(one_rank_nccl):
    from safetensors.torch import load_file

    from dapo_ray.random_model import build_random_model
    from dapo_ray.trainer.batch import build_shards
    from dapo_ray.trainer.loop import build_engines, train_step
    from dapo_ray.trainer.zero import full_state_dict_cpu

    model_dir = build_random_model(ROOT / ".cache" / "random-qwen2.5-0.5b", "qwen2.5-0.5b")
    # lr 1e-4, not the smoke run's 1e-6: two updates must move bf16 weights past their rounding.
    cfg = load_config(ROOT / "workflows" / "configs" / "gpu_smoke.yaml",
                      [f"rollout.model_path={model_dir}", "trainer.lr=1e-4", "tracking.enabled=false"])  # fmt: skip
    t = cfg.trainer
    initial = load_file(str(model_dir / "model.safetensors"))
    vocab = initial["model.embed_tokens.weight"].shape[0]
    torch.cuda.reset_peak_memory_stats()

    engine, ref = build_engines(cfg, 1)
    assert ref is None  # no KL term in the smoke config
    assert engine.device.type == "cuda"
    assert {p.ds_tensor.dtype for p in engine.module.parameters()} == {torch.bfloat16}

    figures: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    state = None  # the weights the "engine" serves: the checkpoint's, then the trainer's after step 0
    for version in (0, 1):
        batch = _samples(t.train_batch_size * cfg.rollout.n, version, vocab, seed=version)
        _fill_float32_logprobs(model_dir, state, batch, cfg.rollout.temperature)
        shards = build_shards(batch, 1, t.mini_batch_size, t.micro_batch_size, seed=version,
                              micro_batch_tokens=t.micro_batch_tokens)  # fmt: skip
        t0 = time.time()
        m = train_step(engine, ref, shards[0], version, cfg, 1)
        figures[f"step{version}_s"] = round(time.time() - t0, 3)
        bad = {
            k: v
            for k, v in m.items()
            if isinstance(v, float) and not math.isfinite(v) and k != "actor/up_clipped_prob"
        }
        assert not bad, m
        assert m["actor/updates"] == len(shards[0]) and m["actor/skipped_updates"] == 0, m
        assert m["actor/off_policy_token_frac"] > 0, m  # the older responses took the engine's log-probs
        # bf16 trainer against float32 of the same weights: bf16 precision (~1e-2 at most), not noise.
        assert m["actor/rollout_logprob_diff"] < 0.05, m
        figures[f"step{version}_rollout_logprob_diff"] = m["actor/rollout_logprob_diff"]
        figures[f"step{version}_grad_norm"] = m["actor/grad_norm"]
        if version == 0:
            state = full_state_dict_cpu(engine.module.lm, t.zero_stage, 0)

    torch.cuda.synchronize()
    t0 = time.time()
    state = full_state_dict_cpu(engine.module.lm, t.zero_stage, 0)
    gather_s = time.time() - t0
    assert set(state) == set(initial)
    assert all(
        v.device.type == "cpu" and v.dtype == torch.bfloat16 and v.shape == initial[k].shape
        for k, v in state.items()
    )
    changed = [k for k, v in state.items() if not torch.equal(v, initial[k])]
    assert len(changed) > len(state) // 2, f"only {len(changed)} of {len(state)} tensors changed"
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    figures |= _bucketed_copy(engine, t.zero_stage, state, cfg.weight_sync.bucket_mb)
    figures |= {"gather_s": round(gather_s, 3), "gather_GB": round(nbytes / 1e9, 3),
                "gather_GBps": round(nbytes / 1e9 / gather_s, 2),
                "peak_gpu_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2)}  # fmt: skip
    print("[gpu-trainer] " + json.dumps(figures), flush=True)


def _bucketed_copy(engine, zero_stage: int, state: dict, bucket_mb: float) -> dict:
    """What one publishing rank does on a GPU (`trainer.loop.publish_weights`) up to the object store: the
    layers gathered bucket by bucket and copied into two reused pinned host buffers, in turn. Checks the
    buffers hold the gathered weights; returns its time and rate."""
    from dapo_ray import buckets
    from dapo_ray.trainer.zero import full_nbytes, gathered, layer_groups

    groups = layer_groups(engine.module.lm)
    sizes = [sum(buckets.aligned(full_nbytes(x)) for _, x in g) for g in groups]
    plan = buckets.bucket_plan(sizes, int(bucket_mb * 2**20))
    capacity = max(sum(sizes[i] for i in b) for b in plan)
    buffers = [torch.empty(capacity, dtype=torch.uint8, pin_memory=True) for _ in range(2)]

    def copy_all(check: bool) -> float:
        torch.cuda.synchronize()
        t0 = time.time()
        for k, bucket in enumerate(plan):
            buf, offset, specs = buffers[k % 2], 0, []
            for i in bucket:
                with gathered(groups[i], zero_stage) as members:
                    for name, x in members:
                        spec, offset = buckets.copy_into(buf, offset, name, x)
                        specs.append(spec)
            torch.cuda.synchronize()
            for name, x in buckets.unpack_bucket((specs, buf[:offset].numpy())) if check else ():
                assert torch.equal(x, state[name]), name
        return time.time() - t0

    seconds = copy_all(check=False)
    copy_all(check=True)  # untimed: every bucket held the gathered weights
    return {
        "bucket_mb": bucket_mb,
        "buckets": len(plan),
        "bucketed_copy_s": round(seconds, 3),
        "bucketed_copy_GBps": round(
            sum(v.numel() * v.element_size() for v in state.values()) / 1e9 / seconds, 2
        ),
    }
