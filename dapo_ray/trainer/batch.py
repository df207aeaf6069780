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
from dataclasses import dataclass
from typing import TypedDict

import torch


class Sample(TypedDict):
    input_ids: list[int]
    n_prompt: int
    weight: float
    advantage: float
    rollout_logprobs: list[float]
    policy_version: int


def flatten_groups(groups: list[dict]) -> list[Sample]:
    """One Sample per response of every group (needs: prompt_ids, response_ids, loss_weights,
    advantages, rollout_logprobs, policy_version)."""
    out: list[Sample] = []
    for g in groups:
        for ids, w, a, lp in zip(g["response_ids"], g["loss_weights"], g["advantages"], g["rollout_logprobs"], strict=True):
            out.append({"input_ids": list(g["prompt_ids"]) + list(ids), "n_prompt": len(g["prompt_ids"]),
                        "weight": float(w) if ids else 0.0, "advantage": float(a), "rollout_logprobs": list(lp),
                        "policy_version": int(g["policy_version"])})  # fmt: skip
    return out


DUMMY: Sample = {"input_ids": [0, 0], "n_prompt": 1, "weight": 0.0, "advantage": 0.0, "rollout_logprobs": [0.0],
                 "policy_version": 0}  # fmt: skip


@dataclass
class Micro:
    """One padded micro-batch. L = longest prompt + response; T = L - 1 target positions (position t
    predicts token t + 1)."""

    ids_BL: torch.Tensor
    att_BL: torch.Tensor
    mask_BT: torch.Tensor
    """Loss weight of each target: the sample's weight on response tokens, 0 on prompt and padding."""
    adv_B: torch.Tensor
    rollout_BT: torch.Tensor
    """The engine's log-probs of the response tokens, aligned with the targets."""
    version_B: torch.Tensor
    """Policy version that generated each response."""


def pad_micro(micro: list[Sample], pad_id: int) -> Micro:
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
    version = torch.tensor([s["policy_version"] for s in micro])
    return Micro(ids, att, mask, adv, roll, version)


def build_shards(samples: list[Sample], world_size: int, mini_batch_size: int, micro_batch_size: int,
                 seed: int) -> list[list[dict]]:  # fmt: skip
    """shards[rank] = list of mini-batches; a mini-batch = {"micro": [[Sample]], "total_tokens", "total_seqs",
    "positions": [target positions of each micro-batch index, the same on every rank]}."""
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
        micro = [[chunk[r::world_size][i * micro_batch_size : (i + 1) * micro_batch_size] for i in range(micro_per_mini)]
                 for r in range(world_size)]  # fmt: skip
        # The longest sequence of each micro-batch index over all ranks: every rank runs the chunked
        # output head over as many positions, so its ZeRO-3 gathers line up (PolicyLM.forward).
        widths = [max(len(s["input_ids"]) for r in range(world_size) for s in micro[r][i]) for i in range(micro_per_mini)]
        for r in range(world_size):
            shards[r].append({"micro": micro[r], "total_tokens": float(tokens), "total_seqs": float(seqs),
                              "positions": [w - 1 for w in widths]})  # fmt: skip
    return shards
