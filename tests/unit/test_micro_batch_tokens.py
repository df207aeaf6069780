"""Micro-batches packed to a token budget (trainer.micro_batch_tokens), driver side: every rank runs the
same number of micro-batches, each within the budget, every response once, and the loss summed over them
is the loss without a budget."""

import random

import pytest
import torch

from dapo_ray.algo import dapo_policy_loss
from dapo_ray.trainer.batch import DUMMY, build_shards, pack_by_tokens, pad_micro


def _samples(n: int, seed: int = 0, longest: int = 60) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt, response = rng.randrange(2, 8), rng.choice([1, 2, 3, 5, 8, 20, longest])
        out.append({"input_ids": [rng.randrange(1, 50) for _ in range(prompt + response)], "n_prompt": prompt,
                    "weight": 0.0 if i % 7 == 3 else 1.0, "advantage": rng.uniform(-1, 1),
                    "rollout_logprobs": [-rng.random() for _ in range(response)], "token_versions": [0] * response})  # fmt: skip
    return out


def _lengths(micro: list[dict]) -> list[int]:
    return [len(s["input_ids"]) for s in micro]


def test_pack_by_tokens_example():
    part = [{"input_ids": [0] * n} for n in (30, 90, 10, 50, 40)]
    assert [_lengths(m) for m in pack_by_tokens(part, 100, 8)] == [[90], [50, 40], [30, 10]]
    assert [_lengths(m) for m in pack_by_tokens(part, 1000, 2)] == [[90, 50], [40, 30], [10]]  # the cap
    assert [_lengths(m) for m in pack_by_tokens(part, 20, 8)] == [[90], [50], [40], [30], [10]]  # each alone


@pytest.mark.parametrize("world, mini, budget, cap", [(2, 16, 40, 8), (4, 32, 100, 4), (3, 12, 25, 4), (2, 16, 10**6, 8)])
def test_shards_packed_to_a_budget(world, mini, budget, cap):
    samples = _samples(45)  # 3 mini-batches, the last one partial
    shards = build_shards(samples, world, mini, cap, seed=1, micro_batch_tokens=budget)
    assert len(shards) == world and len({len(s) for s in shards}) == 1
    seen = []
    for m in range(len(shards[0])):
        minis = [shard[m] for shard in shards]
        assert len({len(x["micro"]) for x in minis}) == 1  # the same count on every rank: collectives line up
        assert len({(x["total_tokens"], x["total_seqs"]) for x in minis}) == 1
        for x in minis:
            for micro in x["micro"]:
                assert 1 <= len(micro) <= cap
                assert len(micro) == 1 or len(micro) * max(_lengths(micro)) <= budget
                if any(s is DUMMY for s in micro):
                    assert micro == [DUMMY]  # padding is a micro-batch of its own
                seen += [id(s) for s in micro if s is not DUMMY]
    assert sorted(seen) == sorted(id(s) for s in samples)  # every response exactly once


def test_ranks_share_by_length_and_pad_with_dummies():
    long, short = {"input_ids": [1] * 100, "n_prompt": 1}, {"input_ids": [1] * 10, "n_prompt": 1}
    base = {"weight": 1.0, "advantage": 1.0, "rollout_logprobs": [], "token_versions": []}
    batch = [base | long] * 2 + [base | short] * 6
    shards = build_shards(batch, 2, 8, 8, seed=0, micro_batch_tokens=100)
    # Longest first, each to the lighter rank: one long response each, then the short ones alternate
    # (130 tokens a rank), packed as [100], [10, 10, 10].
    for shard in shards:
        assert [_lengths(m) for m in shard[0]["micro"]] == [[100], [10, 10, 10]]
    uneven = build_shards([base | long] * 3, 2, 8, 8, seed=0, micro_batch_tokens=100)
    assert [[_lengths(m) for m in shard[0]["micro"]] for shard in uneven] == [[[100], [100]], [[100], [2]]]
    assert uneven[1][0]["micro"][1] == [DUMMY]


def _loss_sum(shards: list[list[dict]], logp_of) -> torch.Tensor:
    """The sum over ranks and micro-batches of the DAPO loss, as the trainer's backward sums it."""
    total = torch.zeros((), dtype=torch.float64)
    for shard in shards:
        for mini in shard:
            for micro in mini["micro"]:
                m = pad_micro(micro, 0)
                logp = logp_of(micro, m.rollout_BT.shape)
                loss, _ = dapo_policy_loss(logp, m.rollout_BT.double(), m.adv_B.double(), m.mask_BT.double(),
                                           total_tokens=mini["total_tokens"], total_seqs=mini["total_seqs"],
                                           clip_ratio_c=3.0)  # fmt: skip
                total = total + loss
    return total


@pytest.mark.parametrize("budget", [40, 64, 200])
def test_the_loss_is_the_same_with_and_without_a_budget(budget):
    samples = _samples(32, seed=2)
    g = torch.Generator().manual_seed(0)
    noise = {id(s): 0.3 * torch.randn(len(s["input_ids"]), generator=g, dtype=torch.float64) for s in samples}

    def logp_of(micro, shape):  # a fixed "policy" per response, wherever it lands
        out = torch.zeros(shape, dtype=torch.float64)
        for i, s in enumerate(micro):
            if s is not DUMMY:
                out[i, : len(s["input_ids"]) - 1] = noise[id(s)][:-1]
        return pad_micro(micro, 0).rollout_BT.double() + out

    fixed = build_shards(samples, 2, 16, 4, seed=3)
    packed = build_shards(samples, 2, 16, 4, seed=3, micro_batch_tokens=budget)
    def counts(shards):
        return [[len(mini["micro"]) for mini in shard] for shard in shards]

    assert counts(packed) != counts(fixed)  # really split otherwise (fixed: 2 x 2 micro-batches a rank)
    assert float(_loss_sum(packed, logp_of)) == pytest.approx(float(_loss_sum(fixed, logp_of)), abs=1e-12)
