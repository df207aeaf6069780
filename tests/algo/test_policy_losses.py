"""GSPO, CISPO and Dr. GRPO's aggregation against their papers' formulas, the exactness properties of the
DAPO loss (micro-batch and rank invariance with global denominators) for every loss, and masked positions
that hold a NaN."""

import math

import pytest
import torch

from dapo_ray.algo import (
    POLICY_LOSSES,
    aggregate,
    cispo_policy_loss,
    dapo_policy_loss,
    gspo_policy_loss,
    rollout_is_weights,
    token_logprobs,
)


def lp(p):
    return torch.tensor(p, dtype=torch.float64).log()


def one(x):
    return torch.tensor(x, dtype=torch.float64)


# --- GSPO (Zheng et al. 2025) ---------------------------------------------------------------------------


def test_gspo_worked_example_of_the_docstring():
    old = lp([[0.5, 0.5]])
    new = lp([[0.55, 0.45]])  # token ratios 1.1, 0.9 -> s = sqrt(0.99)
    mask = torch.ones(1, 2, dtype=torch.float64)
    s = math.sqrt(0.99)
    x = new.clone().requires_grad_(True)
    loss, st = gspo_policy_loss(x, old, one([1.0]), mask)
    loss.backward()
    assert float(loss) == pytest.approx(-s)  # below 1 - 3e-4, but A > 0: only the upper bound clips
    # Eq. 7 with the paper's aggregation: every token gets s * A / |y|.
    torch.testing.assert_close(x.grad, torch.full((1, 2), -s / 2, dtype=torch.float64))
    assert st["ratio_mean"] == pytest.approx(s) and st["clipfrac_low"] == 0.0

    x = new.clone().requires_grad_(True)
    loss, st = gspo_policy_loss(x, old, one([-1.0]), mask)
    loss.backward()
    assert float(loss) == pytest.approx(1 - 3e-4)  # max(s, 1 - eps_low) * 1: clipped, no gradient
    assert torch.equal(x.grad, torch.zeros(1, 2, dtype=torch.float64))
    assert st["clipfrac_low"] == 1.0 and st["pg_clipfrac"] == 1.0  # both tokens of the clipped response


def test_gspo_clips_whole_responses_and_normalises_by_length():
    # Response 0: one token far off (ratio 2) among three at 1: s = 2 ** (1/4) = 1.19, inside 1 + 0.28.
    # Response 1: ratios 1.5 and 1.5: s = 1.5, clipped at 1 + 0.28 as a whole (both tokens lose the gradient).
    old = lp([[0.2, 0.5, 0.5, 0.5], [0.2, 0.2, 0.5, 0.5]])
    new = lp([[0.4, 0.5, 0.5, 0.5], [0.3, 0.3, 0.5, 0.5]])
    mask = one([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    x = new.clone().requires_grad_(True)
    loss, st = gspo_policy_loss(x, old, one([1.0, 1.0]), mask, eps_low=0.2, eps_high=0.28)
    loss.backward()
    s0 = 2 ** 0.25
    assert float(loss) == pytest.approx(-(s0 + 1.28) / 2)
    torch.testing.assert_close(x.grad[0], torch.full((4,), -s0 / 4 / 2, dtype=torch.float64))
    assert torch.equal(x.grad[1], torch.zeros(4, dtype=torch.float64))
    assert st["clipfrac_high"] == pytest.approx(2 / 6)  # the 2 tokens of response 1
    # DAPO clips the far-off token of response 0 alone, and neither token of response 1 fully.
    _, st_dapo = dapo_policy_loss(new, old, one([1.0, 1.0]), mask, clip_ratio_c=None)
    assert st_dapo["clipfrac_high"] == pytest.approx(3 / 6)


def test_gspo_sequence_ratio_equals_the_token_ratio_for_one_token():
    old, new = lp([[0.3]]), lp([[0.33]])
    mask, adv = torch.ones(1, 1, dtype=torch.float64), one([0.7])
    kw = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=None, loss_agg_mode="token-mean")
    assert float(gspo_policy_loss(new, old, adv, mask, **kw)[0]) == pytest.approx(float(dapo_policy_loss(new, old, adv, mask, **kw)[0]))


# --- CISPO (MiniMax-M1) ----------------------------------------------------------------------------------


def test_cispo_worked_example_keeps_the_gradient_dapo_clips():
    old, mask = lp([[0.5]]), torch.ones(1, 1, dtype=torch.float64)
    x = lp([[0.8]]).requires_grad_(True)  # ratio 1.6
    loss, st = cispo_policy_loss(x, old, one([1.0]), mask, eps_low=1.0, eps_high=0.28)
    loss.backward()
    assert float(loss) == pytest.approx(-1.28 * math.log(0.8))  # -sg(clip(r)) * A * log pi
    assert float(x.grad) == pytest.approx(-1.28)
    assert st["clipfrac_high"] == 1.0 and st["ratio_mean"] == pytest.approx(1.6)
    y = lp([[0.8]]).requires_grad_(True)
    dapo_policy_loss(y, old, one([1.0]), mask, clip_ratio_c=None)[0].backward()
    assert float(y.grad) == 0.0  # DAPO: clipped, no gradient


def test_cispo_weight_is_clipped_on_both_sides_and_any_sign():
    old = lp([[0.5, 0.5, 0.5]])
    new = lp([[0.1, 0.5, 0.9]])  # ratios 0.2, 1, 1.8
    mask = torch.ones(1, 3, dtype=torch.float64)
    x = new.clone().requires_grad_(True)
    loss, st = cispo_policy_loss(x, old, one([-2.0]), mask, eps_low=0.2, eps_high=0.28)
    loss.backward()
    # gradient of the token mean of -w * A * log pi: -w * A / 3, w = 0.8, 1, 1.28
    torch.testing.assert_close(x.grad, one([[0.8 * 2 / 3, 2 / 3, 1.28 * 2 / 3]]))
    assert st["clipfrac_low"] == pytest.approx(1 / 3) and st["clipfrac_high"] == pytest.approx(1 / 3)
    assert st["pg_clipfrac_lower"] == 0.0  # no dual clip
    # eps_low >= 1: no lower bound (the paper), the weight is the ratio itself below 1.
    x = new.clone().requires_grad_(True)
    cispo_policy_loss(x, old, one([-2.0]), mask, eps_low=1.0, eps_high=0.28)[0].backward()
    assert float(x.grad[0, 0]) == pytest.approx(0.2 * 2 / 3)


# --- Dr. GRPO (Liu et al. 2025) --------------------------------------------------------------------------


def test_dr_grpo_aggregation_worked_example():
    v = one([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = one([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(aggregate(v, m, "seq-mean-token-sum-norm", norm_length=4)) == pytest.approx(1.25)
    # No per-response length normalisation: a response's weight grows with its length, unlike GRPO's.
    assert float(aggregate(v, m, "seq-mean-token-mean")) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="norm_length"):
        aggregate(v, m, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        aggregate(v, m, "seq-mean-token-norm")  # type: ignore[arg-type]


def test_dr_grpo_gradient_per_token_does_not_depend_on_the_response_length():
    # Two responses with the same advantage: every token gets the same gradient, -A / (G * L_max).
    old = lp([[0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]])
    mask = one([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    x = old.clone().requires_grad_(True)
    dapo_policy_loss(x, old, one([1.0, 1.0]), mask, loss_agg_mode="seq-mean-token-sum-norm", norm_length=8)[0].backward()
    torch.testing.assert_close(x.grad, -mask / 16)
    y = old.clone().requires_grad_(True)
    dapo_policy_loss(y, old, one([1.0, 1.0]), mask, loss_agg_mode="seq-mean-token-mean")[0].backward()
    assert float(y.grad[1, 0]) == pytest.approx(4 * float(y.grad[0, 0]))  # GRPO: the short one's token 4x


# --- every loss: invariance to micro-batches and ranks, and NaN in masked positions -------------------------


def _random_batch(seed, B=12, T=9):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, 7, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 7, (B, T), generator=g)
    old = token_logprobs(logits + 0.3 * torch.randn(B, T, 7, generator=g, dtype=torch.float64), tokens).double()
    rollout = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    mask[3] = 0.0  # an overlong-filtered response: no counted token
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logits, tokens, old, rollout, mask, adv


LOSS_CASES = [
    ("dapo", dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)),
    ("gspo", dict(eps_low=0.05, eps_high=0.06, clip_ratio_c=3.0)),  # wide enough that some responses keep a gradient
    ("cispo", dict(eps_low=1.0, eps_high=0.28)),
]


@pytest.mark.parametrize("name, kw", LOSS_CASES, ids=[c[0] for c in LOSS_CASES])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("is_level", [None, "token", "sequence"])
@pytest.mark.parametrize("splits", [[4, 4, 4], [1, 5, 6], [[11, 0, 5], [7], [1, 2, 3, 4, 6, 8, 9, 10]]])
def test_every_loss_is_invariant_to_micro_batching_and_ranks(name, kw, mode, is_level, splits):
    """Runs of the batch (micro-batches) or any partition of its rows (ranks; packing to a token budget),
    each given the global counts, sum to the whole-batch loss and gradient: every sequence-level quantity
    (GSPO's ratio, the sequence-level weight) is a function of one response, which the trainer never
    splits."""
    fn = POLICY_LOSSES[name]
    logits, tokens, old, rollout, mask, adv = _random_batch(0)
    w = None if is_level is None else rollout_is_weights(old, rollout, mask, level=is_level, threshold=1.5)[0]
    kw = dict(kw, loss_agg_mode=mode, norm_length=16.0)

    whole = logits.clone().requires_grad_(True)
    loss_whole, _ = fn(token_logprobs(whole, tokens), old, adv, mask, is_weights_BT=w, **kw)
    loss_whole.backward()
    assert whole.grad.abs().sum() > 0

    parts = logits.clone().requires_grad_(True)
    totals = dict(total_tokens=float(mask.sum()), total_seqs=float((mask.sum(-1) > 0).sum()))
    loss_sum, start = 0.0, 0
    for n in splits:
        sl = torch.tensor(n) if isinstance(n, list) else slice(start, start + n)
        part, _ = fn(token_logprobs(parts[sl], tokens[sl]), old[sl], adv[sl], mask[sl],
                     is_weights_BT=None if w is None else w[sl], **totals, **kw)  # fmt: skip
        part.backward()
        loss_sum += float(part.detach())
        start += 0 if isinstance(n, list) else n
    assert loss_sum == pytest.approx(float(loss_whole.detach()), abs=1e-12)
    torch.testing.assert_close(parts.grad, whole.grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name, kw", LOSS_CASES, ids=[c[0] for c in LOSS_CASES])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("kl", [None, "mse"])
def test_a_nan_in_a_masked_position_reaches_neither_loss_nor_gradient(name, kw, mode, kl):
    fn = POLICY_LOSSES[name]
    logits, tokens, old, rollout, mask, adv = _random_batch(1)
    logp = token_logprobs(logits, tokens).double()
    kw = dict(kw, loss_agg_mode=mode, norm_length=16.0)
    if kl:  # a KL term whose estimator's gradient is not clamped (k2: d * grad d)
        kw |= dict(kl_coef=0.1, kl_estimator=kl, ref_logp_BT=old - 0.1)
    w = rollout_is_weights(old, rollout, mask)[0]
    x = logp.clone().requires_grad_(True)
    clean, _ = fn(x, old, adv, mask, is_weights_BT=w, **kw)
    clean.backward()

    off = mask == 0
    bad_old = torch.where(off, torch.tensor(float("nan"), dtype=torch.float64), old)
    bad_w = torch.where(off, torch.tensor(float("inf"), dtype=torch.float64), w)
    adv_BT = torch.where(off, torch.tensor(float("nan"), dtype=torch.float64), adv[:, None].expand_as(old))
    y = logp.clone().requires_grad_(True)
    dirty, _ = fn(y, bad_old, adv_BT, mask, is_weights_BT=bad_w, **kw)
    dirty.backward()
    assert float(dirty) == float(clean)
    assert torch.equal(y.grad, x.grad)
    # A NaN or inf log-prob of the policy itself at a masked position (the one input with a gradient): the
    # loss is still the clean one, and so is its gradient, finite and exactly 0 at the masked positions.
    assert torch.equal(x.grad[off], torch.zeros_like(x.grad[off]))
    for bad in (float("nan"), float("inf"), float("-inf")):
        z = torch.where(off, torch.tensor(bad, dtype=torch.float64), logp).requires_grad_(True)
        dirty, _ = fn(z, old, adv, mask, is_weights_BT=w, **kw)
        dirty.backward()
        assert float(dirty.detach()) == float(clean.detach())
        assert torch.isfinite(z.grad).all(), f"{bad} at a masked position: non-finite gradient"
        assert torch.equal(z.grad, x.grad)


def test_aggregate_selects_rather_than_multiplies():
    v = one([[1.0, float("nan")], [float("inf"), 2.0]])
    m = one([[1.0, 0.0], [0.0, 1.0]])
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        assert float(aggregate(v, m, mode)) == pytest.approx(1.5)
    assert float(aggregate(v, m, "seq-mean-token-sum-norm", norm_length=2)) == pytest.approx(0.75)
