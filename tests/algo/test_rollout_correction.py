"""Rollout-training mismatch correction (truncated / masked importance sampling) against its formula, and
its weight of exactly 1 on tokens whose ratio already takes the engine's log-prob (carried-over,
partially rolled-out and off-policy samples)."""

import math

import pytest
import torch

from dapo_ray.algo import behaviour_logprobs, dapo_policy_loss, rollout_is_weights


def lp(p):
    return torch.tensor(p, dtype=torch.float64).log()


ENGINE, TRAINER = lp([[0.2, 0.5, 0.5, 0.5]]), lp([[0.5, 0.5, 0.2, 0.9]])  # weights 2.5, 1, 0.4, (padding)
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)


def test_the_worked_example_of_the_docstring():
    w, st = rollout_is_weights(TRAINER, ENGINE, MASK, level="token", threshold=2.0, mode="truncate")
    assert w[0].tolist() == pytest.approx([2.0, 1.0, 0.4, 1.0])  # padding: neutral
    assert st == pytest.approx({"n_tokens": 3.0, "rollout_is_mean": (2.5 + 1 + 0.4) / 3, "rollout_is_max": 2.5,
                                "rollout_is_ratio_fraction_high": 1 / 3, "rollout_is_masked_fraction": 0.0})  # fmt: skip
    w, st = rollout_is_weights(TRAINER, ENGINE, MASK, level="token", threshold=2.0, mode="mask")
    assert w[0].tolist() == pytest.approx([0.0, 1.0, 0.4, 1.0])
    assert st["rollout_is_masked_fraction"] == pytest.approx(1 / 3)
    w, st = rollout_is_weights(TRAINER, ENGINE, MASK, level="sequence", threshold=2.0, mode="truncate")
    assert w[0].tolist() == pytest.approx([1.0, 1.0, 1.0, 1.0])  # 2.5 * 1 * 0.4
    assert st["rollout_is_mean"] == pytest.approx(1.0) and st["rollout_is_ratio_fraction_high"] == 0.0


def test_sequence_level_truncates_and_masks_whole_responses():
    old, engine = lp([[0.5, 0.5], [0.5, 0.5]]), lp([[0.2, 0.5], [0.4, 0.4]])  # products 2.5 and 1.5625
    mask = torch.ones(2, 2, dtype=torch.float64)
    w, _ = rollout_is_weights(old, engine, mask, level="sequence", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 2.0], [1.5625, 1.5625]], dtype=torch.float64))
    w, st = rollout_is_weights(old, engine, mask, level="sequence", threshold=2.0, mode="mask")
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0], [1.5625, 1.5625]], dtype=torch.float64))
    assert st["rollout_is_masked_fraction"] == 0.5 and st["rollout_is_max"] == pytest.approx(2.5)


def test_the_weights_multiply_each_tokens_term_after_the_clip_and_carry_no_gradient():
    old = lp([[0.5, 0.5, 0.5]])
    new = lp([[0.8, 0.5, 0.3]])  # ratios 1.6 (clipped at 1.28), 1, 0.6
    mask, adv = torch.ones(1, 3, dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)
    w = torch.tensor([[2.0, 0.5, 0.0]], dtype=torch.float64, requires_grad=True)
    x = new.clone().requires_grad_(True)
    loss, _ = dapo_policy_loss(x, old, adv, mask, clip_ratio_c=None, is_weights_BT=w)
    loss.backward()
    assert float(loss) == pytest.approx(-(2.0 * 1.28 + 0.5 * 1.0 + 0.0 * 0.6) / 3)  # the denominator keeps 3
    assert x.grad[0].tolist() == pytest.approx([0.0, -0.5 / 3, 0.0])
    assert w.grad is None


def test_tokens_an_older_version_sampled_get_weight_exactly_one():
    """Carried-over groups, off-policy batches and the first part of a response a weight load interrupted
    (partial rollout) take the engine's log-prob as the ratio's denominator: pi_old = pi_rollout there, so
    the weight is 1 and only the current version's tokens are corrected. At the sequence level a response
    is weighted by the product over its current-version tokens alone."""
    recomputed = lp([[0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]])
    engine = lp([[0.2, 0.2, 0.2, 0.2], [0.2, 0.2, 0.25, 0.4], [0.4, 0.4, 0.4, 0.4]])
    # response 0 carried over (all old), response 1 interrupted after 2 tokens, response 2 fresh
    off_policy = torch.tensor([[True] * 4, [True, True, False, False], [False] * 4])
    mask = torch.ones(3, 4, dtype=torch.float64)
    old = behaviour_logprobs(recomputed, engine, off_policy)
    w, st = rollout_is_weights(old, engine, mask, level="token", threshold=10.0)
    assert torch.equal(w[off_policy], torch.ones(6, dtype=torch.float64))
    assert w[1, 2:].tolist() == pytest.approx([2.0, 1.25]) and w[2].tolist() == pytest.approx([1.25] * 4)
    w, _ = rollout_is_weights(old, engine, mask, level="sequence", threshold=10.0)
    assert torch.equal(w[0], torch.ones(4, dtype=torch.float64))
    assert w[1].tolist() == pytest.approx([2.5] * 4) and w[2].tolist() == pytest.approx([1.25**4] * 4)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="token"):
        rollout_is_weights(TRAINER, ENGINE, MASK, level="none")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="truncate"):
        rollout_is_weights(TRAINER, ENGINE, MASK, mode="clip")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="> 0"):
        rollout_is_weights(TRAINER, ENGINE, MASK, threshold=0.0)


def test_extreme_mismatch_stays_finite():
    old, engine = torch.tensor([[0.0, -1e4]]), torch.tensor([[-1e4, 0.0]])
    w, st = rollout_is_weights(old, engine, torch.ones(1, 2), level="token")
    assert w[0].tolist() == pytest.approx([2.0, math.exp(-20.0)])
    assert math.isfinite(st["rollout_is_max"])
    w, _ = rollout_is_weights(old, engine, torch.ones(1, 2), level="sequence", mode="mask")
    assert torch.isfinite(w).all()
