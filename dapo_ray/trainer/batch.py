"""Turn kept groups into per-rank training shards (driver side, plain Python).

Every rank gets the same structure, so DeepSpeed's fixed gradient-accumulation count and its
collectives line up: `mini_batches` x `micro_per_mini` micro-batches of `micro_batch_size` responses.
A partial batch (dynamic sampling hit its cap) is padded with zero-weight dummy responses, which add
nothing to the loss, its gradient or the token counts.

Each mini-batch carries its global `total_tokens` / `total_seqs` (over all ranks and micro-batches),
which the loss divides by, so the update is the same however the batch is split (Eq. 12).
"""

from __future__ import annotations

import math
import random
from typing import TypedDict


class Sample(TypedDict):
    input_ids: list[int]
    n_prompt: int
    weight: float
    advantage: float
    rollout_logprobs: list[float]


def flatten_groups(groups: list[dict]) -> list[Sample]:
    """One Sample per response of every group (needs: prompt_ids, response_ids, loss_weights,
    advantages, rollout_logprobs)."""
    out: list[Sample] = []
    for g in groups:
        for ids, w, a, lp in zip(g["response_ids"], g["loss_weights"], g["advantages"], g["rollout_logprobs"], strict=True):
            out.append({"input_ids": list(g["prompt_ids"]) + list(ids), "n_prompt": len(g["prompt_ids"]),
                        "weight": float(w) if ids else 0.0, "advantage": float(a), "rollout_logprobs": list(lp)})  # fmt: skip
    return out


DUMMY: Sample = {"input_ids": [0, 0], "n_prompt": 1, "weight": 0.0, "advantage": 0.0, "rollout_logprobs": [0.0]}


def build_shards(samples: list[Sample], world_size: int, mini_batch_size: int, micro_batch_size: int,
                 seed: int) -> list[list[dict]]:  # fmt: skip
    """shards[rank] = list of mini-batches; a mini-batch = {"micro": [[Sample]], "total_tokens", "total_seqs"}."""
    samples = list(samples)
    random.Random(seed).shuffle(samples)
    per_rank = mini_batch_size // world_size
    micro_per_mini = per_rank // micro_batch_size
    n_mini = max(1, math.ceil(len(samples) / mini_batch_size))
    shards: list[list[dict]] = [[] for _ in range(world_size)]
    for m in range(n_mini):
        chunk = samples[m * mini_batch_size : (m + 1) * mini_batch_size]
        tokens = sum((len(s["input_ids"]) - s["n_prompt"]) * s["weight"] for s in chunk)
        seqs = sum(1 for s in chunk if s["weight"] > 0 and len(s["input_ids"]) > s["n_prompt"])
        chunk = chunk + [DUMMY] * (mini_batch_size - len(chunk))
        for r in range(world_size):
            mine = chunk[r::world_size]
            micro = [mine[i * micro_batch_size : (i + 1) * micro_batch_size] for i in range(micro_per_mini)]
            shards[r].append({"micro": micro, "total_tokens": float(tokens), "total_seqs": float(seqs)})
    return shards
