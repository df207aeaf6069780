"""Turn kept groups into per-rank training shards (driver side, plain Python).

Each mini-batch is split over the ranks and, on each rank, into micro-batches: `micro_batch_size`
responses each, or, with a token budget, packed so that each micro-batch's padded size (responses x
longest sequence) stays within it (verl's dynamic batch size). Every rank gets the same number of
mini-batches and, in each, of micro-batches: DeepSpeed reduces gradients at each mini-batch's last
micro-batch and ZeRO-3 gathers parameters in every forward and backward, collectives that every rank must
join. A rank with less to do, or a partial batch (dynamic sampling hit its cap), is padded with
zero-weight dummy responses, which add nothing to the loss, its gradient or the token counts.

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
    token_versions: list[int]
    """The policy version that sampled each response token (a weight load may interrupt a response)."""


def flatten_groups(groups: list[dict]) -> list[Sample]:
    """One Sample per response of every group (needs: prompt_ids, response_ids, loss_weights,
    advantages, rollout_logprobs, policy_version; and versions, where a load interrupted a response)."""
    out: list[Sample] = []
    for g in groups:
        for ids, w, a, lp, v in zip(g["response_ids"], g["loss_weights"], g["advantages"], g["rollout_logprobs"],
                                    response_versions(g), strict=True):  # fmt: skip
            out.append({"input_ids": list(g["prompt_ids"]) + list(ids), "n_prompt": len(g["prompt_ids"]),
                        "weight": float(w) if ids else 0.0, "advantage": float(a), "rollout_logprobs": list(lp),
                        "token_versions": token_versions(v, len(ids))})  # fmt: skip
    return out


def response_versions(group: dict) -> list[list[list[int]]]:
    """Each response's [[first token, version], ...] segments: its `versions`, or the group's
    `policy_version` throughout (groups saved before partial rollout have no `versions`)."""
    return group.get("versions") or [[[0, group["policy_version"]]]] * len(group["response_ids"])


def token_versions(versions: list[list[int]], n_tokens: int) -> list[int]:
    """The policy version of each of a response's `n_tokens` tokens, from its [[first token, version], ...]
    segments (`rollout.engine.Completion.versions`).

    >>> token_versions([[0, 3], [2, 4]], 5)
    [3, 3, 4, 4, 4]
    """
    out: list[int] = []
    for (start, version), nxt in zip(versions, [*versions[1:], [n_tokens, -1]], strict=True):
        out += [version] * max(0, min(nxt[0], n_tokens) - start)
    return out


DUMMY: Sample = {"input_ids": [0, 0], "n_prompt": 1, "weight": 0.0, "advantage": 0.0, "rollout_logprobs": [0.0],
                 "token_versions": [0]}  # fmt: skip
NO_VERSION = 2**62
"""`Micro.version_BT` of prompt and padding positions: never older than the trained version."""


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
    version_BT: torch.Tensor
    """Policy version that sampled each target token (`NO_VERSION` on prompt and padding)."""
    first_target: int = 0
    """The first position that predicts a trained response token (the shortest prompt's length - 1; 0
    when no response is trained): the output head runs from here on (`PolicyLM`)."""
    prefix_B: torch.Tensor | None = None
    """Each row's prompt length - 1: the tokens `PolicyLM` runs once per distinct prompt (share_prompts)."""


def pad_micro(micro: list[Sample], pad_id: int) -> Micro:
    width = max(len(s["input_ids"]) for s in micro)
    B = len(micro)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    att = torch.zeros((B, width), dtype=torch.long)
    mask = torch.zeros((B, width - 1))
    roll = torch.zeros((B, width - 1))
    version = torch.full((B, width - 1), NO_VERSION, dtype=torch.long)
    for i, s in enumerate(micro):
        n, p = len(s["input_ids"]), s["n_prompt"]
        ids[i, :n] = torch.tensor(s["input_ids"])
        att[i, :n] = 1
        mask[i, p - 1 : n - 1] = s["weight"]  # target t+1 is predicted at position t
        lp = s["rollout_logprobs"][: n - p]
        roll[i, p - 1 : p - 1 + len(lp)] = torch.tensor(lp)
        tv = s["token_versions"][: n - p]
        version[i, p - 1 : p - 1 + len(tv)] = torch.tensor(tv, dtype=torch.long)
    adv = torch.tensor([s["advantage"] for s in micro])
    first = min((s["n_prompt"] - 1 for s in micro if s["weight"] > 0), default=0)
    prefix = torch.tensor([s["n_prompt"] - 1 for s in micro])
    return Micro(ids, att, mask, adv, roll, version, first, prefix)


def build_shards(samples: list[Sample], world_size: int, mini_batch_size: int, micro_batch_size: int,
                 seed: int, micro_batch_tokens: int = 0) -> list[list[dict]]:  # fmt: skip
    """shards[rank] = list of mini-batches, each {"micro": [[Sample]], "total_tokens", "total_seqs"}.

    Groups (runs of samples with one prompt, as `flatten_groups` lays them out) are shuffled (`seed`), each
    kept whole, and the samples cut into mini-batches of `mini_batch_size`. Without a token budget
    (`micro_batch_tokens` 0) rank r takes the r-th of world_size consecutive slices of a mini-batch's
    responses (a partial mini-batch's spread evenly), in micro-batches of `micro_batch_size` (one dummy
    where a rank's share leaves one empty): a micro-batch holds few distinct prompts, which
    `PolicyLM` runs once each (trainer.share_prompts). With one, the ranks share the mini-batch's
    responses by length (each response, longest first, to the rank with the fewest tokens so far), each
    rank packs its part (`pack_by_tokens`), and ranks with fewer micro-batches get one-dummy micro-batches
    up to the most any rank has."""
    groups = _prompt_runs(samples)
    random.Random(seed).shuffle(groups)
    samples = [s for g in groups for s in g]
    n_mini = max(1, math.ceil(len(samples) / mini_batch_size))
    shards: list[list[dict]] = [[] for _ in range(world_size)]
    for m in range(n_mini):
        chunk = samples[m * mini_batch_size : (m + 1) * mini_batch_size]
        tokens = sum((len(s["input_ids"]) - s["n_prompt"]) * s["weight"] for s in chunk)
        seqs = sum(1 for s in chunk if s["weight"] > 0 and len(s["input_ids"]) > s["n_prompt"])
        if micro_batch_tokens:
            parts = _share_by_length(chunk, world_size)
            micro = [pack_by_tokens(part, micro_batch_tokens, micro_batch_size) for part in parts]
            n_micro = max(1, max(len(x) for x in micro))
            micro = [x + [[DUMMY]] * (n_micro - len(x)) for x in micro]
        else:
            per_rank = mini_batch_size // world_size
            chunk = _deal_by_length(chunk, world_size)
            share = math.ceil(len(chunk) / world_size)  # a partial mini-batch's responses, spread evenly
            parts = [chunk[r * share : (r + 1) * share] for r in range(world_size)]
            # As many micro-batches on every rank; one that would hold only padding gets a single dummy.
            micro = [[part[i : i + micro_batch_size] or [DUMMY] for i in range(0, per_rank, micro_batch_size)]
                     for part in parts]  # fmt: skip
        for r in range(world_size):
            shards[r].append({"micro": micro[r], "total_tokens": float(tokens), "total_seqs": float(seqs)})
    return shards


def _deal_by_length(chunk: list[Sample], world_size: int) -> list[Sample]:
    """The mini-batch's groups reordered so that its consecutive rank slices get alike work: sorted by
    their longest sequence (a micro-batch is padded to its longest) and dealt in turn, the r-th slice
    taking groups r, r + world_size, ... Example, 4 groups longest first A B C D, 2 ranks: A C | B D."""
    groups = sorted(_prompt_runs(chunk), key=lambda g: -max(len(s["input_ids"]) for s in g))
    return [s for r in range(world_size) for g in groups[r::world_size] for s in g]


def _prompt_runs(samples: list[Sample]) -> list[list[Sample]]:
    """Consecutive samples with the same prompt, as lists (a group's responses, from `flatten_groups`)."""
    runs: list[list[Sample]] = []
    for s in samples:
        if runs and _prompt(runs[-1][0]) == _prompt(s):
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


def _prompt(s: Sample) -> list[int]:
    return s["input_ids"][: s["n_prompt"]]


def _share_by_length(chunk: list[Sample], world_size: int) -> list[list[Sample]]:
    """Each response, longest first, to the rank holding the fewest tokens so far (the lowest on a tie)."""
    parts: list[list[Sample]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for s in sorted(chunk, key=lambda s: -len(s["input_ids"])):
        r = min(range(world_size), key=load.__getitem__)
        parts[r].append(s)
        load[r] += len(s["input_ids"])
    return parts


def pack_by_tokens(part: list[Sample], budget: int, max_responses: int) -> list[list[Sample]]:
    """`part` in micro-batches whose padded size, responses x the longest one's length, stays within
    `budget`, of at most `max_responses` responses: sorted longest first and cut into consecutive runs
    (each run's first response is its longest). A response longer than `budget` gets a micro-batch of
    its own. Example: lengths 90, 50, 40, 30, 10 with budget 100 -> [90], [50, 40], [30, 10]."""
    micro: list[list[Sample]] = []
    for s in sorted(part, key=lambda s: -len(s["input_ids"])):
        run = micro[-1] if micro else None
        if run is None or len(run) == max_responses or (len(run) + 1) * len(run[0]["input_ids"]) > budget:
            micro.append([s])
        else:
            run.append(s)
    return micro
