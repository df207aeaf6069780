import math

import pytest
import torch

from dapo_ray.algo import (
    aggregate,
    behaviour_logprobs,
    dapo_policy_loss,
    entropy_from_logits,
    kl_penalty,
    token_logprobs,
)


def lp(p):
    return torch.tensor(p, dtype=torch.float64).log()


def test_hand_computed_token_mean():
    # Two responses: A = +1 (2 tokens), A = -1 (1 token counted, 1 padded).
    old = lp([[0.5, 0.5], [0.5, 0.5]])
    new = lp([[0.6, 0.8], [0.3, 0.9]])  # ratios 1.2, 1.6 | 0.6, (pad)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, st = dapo_policy_loss(new, old, adv, mask, eps_low=0.2, eps_high=0.28, clip_ratio_c=None)
    # token losses: -1.2, -min(1.6, 1.28) = -1.28, -(-1)*max(0.6, 0.8) = 0.8 -> mean over 3 tokens
    assert float(loss) == pytest.approx((-1.2 - 1.28 + 0.8) / 3)
    assert st["n_tokens"] == 3
    assert st["clipfrac_high"] == pytest.approx(1 / 3)
    assert st["clipfrac_low"] == pytest.approx(1 / 3)
    assert st["pg_clipfrac"] == pytest.approx(2 / 3)  # verl: either bound
    assert st["pg_clipfrac_lower"] == 0.0  # verl: the dual clip (off here)
    assert st["up_clipped_prob"] == pytest.approx(0.5)


def test_aggregation_modes_hand_computed():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(aggregate(v, m, "token-mean")) == pytest.approx(10 / 4)
    assert float(aggregate(v, m, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
    assert float(aggregate(v, m, "seq-mean-token-sum")) == pytest.approx((6 + 4) / 2)
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(v, m, "sum")  # type: ignore[arg-type]


def test_token_level_weighs_long_responses_more():
    # Eq. 12 vs Eq. 5: a long response's tokens count individually under token-mean.
    v = torch.tensor([[1.0] * 9 + [0.0], [10.0] + [0.0] * 9])
    m = torch.tensor([[1.0] * 9 + [0.0], [1.0] + [0.0] * 9])
    assert float(aggregate(v, m, "token-mean")) == pytest.approx(19 / 10)
    assert float(aggregate(v, m, "seq-mean-token-mean")) == pytest.approx((1 + 10) / 2)


def _grad_of_ratio(p_old, p_new, adv, eps_high):
    logp = torch.tensor([[math.log(p_new)]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[math.log(p_old)]], dtype=torch.float64)
    loss, _ = dapo_policy_loss(
        logp, old, torch.tensor([adv], dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64),
        eps_low=0.2, eps_high=eps_high, clip_ratio_c=None,
    )  # fmt: skip
    loss.backward()
    return float(logp.grad)


def test_clip_higher_paper_example():
    # Section 3.1: with eps_high = 0.28 a p = 0.01 token can climb to 0.0128; with 0.2 only to 0.012.
    assert _grad_of_ratio(0.01, 0.0125, 1.0, eps_high=0.28) != 0.0  # still being pushed up
    assert _grad_of_ratio(0.01, 0.0125, 1.0, eps_high=0.2) == 0.0  # clipped already
    assert _grad_of_ratio(0.01, 0.0129, 1.0, eps_high=0.28) == 0.0  # beyond 0.0128: clipped
    # The lower bound is untouched by clip-higher: for A < 0 the gradient stops below 0.8 * p_old.
    assert _grad_of_ratio(0.5, 0.39, -1.0, eps_high=0.28) == 0.0
    assert _grad_of_ratio(0.5, 0.41, -1.0, eps_high=0.28) != 0.0


def test_dual_clip_bounds_negative_advantage():
    old = lp([[0.01]])
    new = lp([[0.5]])  # ratio 50
    adv = torch.tensor([-1.0], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.float64)
    loss, st = dapo_policy_loss(new, old, adv, mask, clip_ratio_c=10.0)
    assert float(loss) == pytest.approx(10.0)
    assert st["pg_clipfrac_lower"] == 1.0  # verl's name for the dual-clip share
    assert st["clipfrac_low"] == 0.0
    loss, _ = dapo_policy_loss(new, old, adv, mask, clip_ratio_c=None)
    assert float(loss) == pytest.approx(50.0)
    with pytest.raises(ValueError):
        dapo_policy_loss(new, old, adv, mask, clip_ratio_c=0.5)


def test_kl_term_off_by_default_and_needs_reference():
    old = lp([[0.5, 0.4]])
    new = lp([[0.6, 0.3]])
    adv, mask = torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    base, st = dapo_policy_loss(new, old, adv, mask)
    assert "kl_loss" not in st
    with pytest.raises(ValueError):
        dapo_policy_loss(new, old, adv, mask, kl_coef=0.1)
    ref = lp([[0.5, 0.5]])
    with_kl, st = dapo_policy_loss(new, old, adv, mask, kl_coef=0.1, ref_logp_BT=ref)
    k3 = kl_penalty(new, ref, "low_var_kl")
    assert float(with_kl) == pytest.approx(float(base) + 0.1 * float(k3.mean()))
    assert st["kl_loss"] == pytest.approx(float(k3.mean())) and st["pg_loss"] == pytest.approx(float(base))


def test_kl_estimators_hand_computed():
    logp, ref = torch.tensor([math.log(0.6)], dtype=torch.float64), torch.tensor([math.log(0.5)], dtype=torch.float64)
    d = math.log(0.6 / 0.5)
    assert float(kl_penalty(logp, ref, "kl")) == pytest.approx(d)
    assert float(kl_penalty(ref, logp, "abs")) == pytest.approx(d)
    assert float(kl_penalty(logp, ref, "mse")) == pytest.approx(0.5 * d * d)
    assert float(kl_penalty(logp, ref, "low_var_kl")) == pytest.approx(0.5 / 0.6 + d - 1)
    assert float(kl_penalty(torch.tensor([0.0]), torch.tensor([30.0]))) == 10.0  # verl's clamp
    assert float(kl_penalty(logp, logp)) == 0.0
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(logp, ref, "k9")  # type: ignore[arg-type]
    # Its gradient pulls logp towards ref (k3: d/dlogp = 1 - ref/p).
    x = logp.clone().requires_grad_(True)
    kl_penalty(x, ref).sum().backward()
    assert float(x.grad) == pytest.approx(1 - 0.5 / 0.6)


def test_behaviour_logprobs_picks_the_engine_for_off_policy_rows():
    recomputed = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    engine = torch.tensor([[-1.1, -2.1], [-3.1, -4.1]])
    out = behaviour_logprobs(recomputed, engine, torch.tensor([False, True]))
    assert torch.equal(out[0], recomputed[0]) and torch.equal(out[1], engine[1])


def _random_batch(seed, B=12, T=9):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, 7, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 7, (B, T), generator=g)
    old = token_logprobs(logits + 0.3 * torch.randn(B, T, 7, generator=g, dtype=torch.float64), tokens)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logits, tokens, old, mask, adv


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("splits", [[12], [4, 4, 4], [1, 5, 6], [3] * 4,
                                    [[11, 0, 5], [7], [1, 2, 3, 4, 6, 8, 9, 10]]])  # fmt: skip
def test_loss_and_grad_invariant_to_micro_batching(mode, splits):
    """Micro-batches (or data-parallel shards) given the global counts sum to the whole-batch loss: runs of
    the batch, or any partition of its rows (as packing micro-batches to a token budget makes)."""
    logits, tokens, old, mask, adv = _random_batch(0)
    kw = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode)

    whole = logits.clone().requires_grad_(True)
    loss_whole, _ = dapo_policy_loss(token_logprobs(whole, tokens), old, adv, mask, **kw)
    loss_whole.backward()

    parts = logits.clone().requires_grad_(True)
    total_tokens = float(mask.sum())
    total_seqs = float((mask.sum(-1) > 0).sum())
    loss_sum, start = 0.0, 0
    for n in splits:
        sl = torch.tensor(n) if isinstance(n, list) else slice(start, start + n)
        part, _ = dapo_policy_loss(
            token_logprobs(parts[sl], tokens[sl]), old[sl], adv[sl], mask[sl],
            total_tokens=total_tokens, total_seqs=total_seqs, **kw,
        )  # fmt: skip
        part.backward()
        loss_sum += float(part.detach())
        start += 0 if isinstance(n, list) else n
    assert loss_sum == pytest.approx(float(loss_whole.detach()), abs=1e-12)
    torch.testing.assert_close(parts.grad, whole.grad, atol=1e-12, rtol=0)


def test_without_global_counts_micro_means_differ():
    # The reason the global count exists: a mean of micro-batch means is not the token mean.
    logits, tokens, old, mask, adv = _random_batch(1)
    lp_ = token_logprobs(logits, tokens)
    whole, _ = dapo_policy_loss(lp_, old, adv, mask)
    halves = [dapo_policy_loss(lp_[s], old[s], adv[s], mask[s])[0] for s in (slice(0, 6), slice(6, 12))]
    assert float(sum(halves) / 2) != pytest.approx(float(whole), abs=1e-9)


def test_token_logprobs_and_entropy():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    assert float(token_logprobs(logits, torch.tensor([[1]]))) == pytest.approx(math.log(0.75))
    assert float(token_logprobs(logits, torch.tensor([[1]]), temperature=1e6)) == pytest.approx(math.log(0.5))
    h = float(entropy_from_logits(logits))
    assert h == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))


def test_ratio_one_gives_plain_policy_gradient():
    old = lp([[0.3, 0.7]])
    new = old.clone().requires_grad_(True)
    adv, mask = torch.tensor([2.0], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    loss, st = dapo_policy_loss(new, old, adv, mask)
    loss.backward()
    assert float(loss) == pytest.approx(-2.0)
    torch.testing.assert_close(new.grad, torch.full((1, 2), -1.0, dtype=torch.float64))
    assert st["clipfrac_high"] == 0 and math.isnan(st["up_clipped_prob"])
