"""Our losses, rollout-correction weights and advantages against verl's own functions on the same fixed
random inputs. The expected values were computed with verl's functions at commit
b178a3cd56f58b2d502255daba591e92833930a7 (volcengine/verl, 2026-01-29):

* `verl/trainer/ppo/core_algos.py`: `compute_policy_loss_vanilla`, `compute_policy_loss_gspo`,
  `compute_policy_loss_cispo`, `agg_loss`, `compute_grpo_outcome_advantage`;
* `verl/trainer/ppo/rollout_corr_helper.py`: `compute_rollout_correction_weights` (and its
  `compute_is_metrics`).

verl is not a dependency: only the numbers are here. Each loss is compared by its value and two
fingerprints of its gradient in the policy's log-probs (the sum, and the sum weighted by PROBE). verl's
advantages are `adv * mask`, a `[B, T]` tensor; its `seq-mean-token-mean` divides each response by its
token count + 1e-8, hence the relative tolerance.
"""

import pytest
import torch

from dapo_ray.algo import (
    aggregate,
    cispo_policy_loss,
    dapo_policy_loss,
    group_advantages,
    gspo_policy_loss,
    rollout_is_weights,
)

VERL_COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"
PROBE = torch.arange(1, 25, dtype=torch.float64).reshape(4, 6) / 10


def verl_inputs():
    g = torch.Generator().manual_seed(27)
    B, T = 4, 6
    old = -2.0 * torch.rand(B, T, generator=g, dtype=torch.float64) - 0.05
    logp = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    rollout = old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = (torch.arange(T)[None, :] < torch.tensor([6, 4, 2, 5])[:, None]).double()
    return logp, old, rollout, adv, mask


def fingerprint(fn, is_weights=None, **kw) -> tuple[float, float, float]:
    logp, old, _, adv, mask = verl_inputs()
    x = logp.clone().requires_grad_(True)
    loss, _ = fn(x, old, adv, mask, is_weights_BT=is_weights, **kw)
    loss.backward()
    return float(loss), float(x.grad.sum()), float((x.grad * PROBE).sum())


def weights(level: str) -> torch.Tensor:
    _, old, rollout, _, mask = verl_inputs()
    return rollout_is_weights(old, rollout, mask, level=level, threshold=2.0)[0]


DAPO = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)  # verl: clip_ratio 0.2 / clip_ratio_high 0.28, c = 3
CASES = {
    # verl compute_policy_loss_vanilla
    "vanilla token-mean": (lambda: fingerprint(dapo_policy_loss, **DAPO),
                           (-0.11455217366520422, -0.09747420050071914, -0.18347904263840809)),
    "vanilla seq-mean-token-mean": (lambda: fingerprint(dapo_policy_loss, loss_agg_mode="seq-mean-token-mean", **DAPO),
                                    (0.01630176032846098, 0.02771663687973441, -0.09384740769989436)),
    # ... with verl's rollout_is_weights from compute_rollout_correction_weights(threshold 2.0)
    "vanilla + token TIS": (lambda: fingerprint(dapo_policy_loss, weights("token"), **DAPO),
                            (-0.2005319452983332, -0.04610518158106976, -0.18885262211351692)),
    "vanilla + sequence TIS": (lambda: fingerprint(dapo_policy_loss, weights("sequence"), **DAPO),
                               (-0.1717553074939603, -0.11598814107674202, -0.16875333897537464)),
    # verl compute_policy_loss_gspo (always seq-mean-token-mean, no dual clip)
    "gspo 0.2/0.28": (lambda: fingerprint(gspo_policy_loss, eps_low=0.2, eps_high=0.28),
                      (-0.06047322367198647, 0.05385304677987164, -0.034150962167395466)),
    "gspo 3e-4/4e-4": (lambda: fingerprint(gspo_policy_loss, eps_low=3e-4, eps_high=4e-4),
                       (0.03213607600286483, -0.4601979083240039, -0.4710942740056897)),
    "gspo + token TIS": (lambda: fingerprint(gspo_policy_loss, weights("token"), eps_low=0.2, eps_high=0.28),
                         (-0.18065575064035272, -0.008608507636621729, -0.11078195176511843)),
    # verl compute_policy_loss_cispo: its example's clip_ratio_low 10 / clip_ratio_high 0.2, and 0.2 / 0.28
    "cispo 10/0.2": (lambda: fingerprint(cispo_policy_loss, eps_low=10.0, eps_high=0.2),
                     (0.36191744984092084, -0.15339165533868176, -0.2066480566043891)),
    "cispo 0.2/0.28 + token TIS": (lambda: fingerprint(cispo_policy_loss, weights("token"), eps_low=0.2, eps_high=0.28),
                                   (0.5132788232200906, -0.24420498235235305, -0.31676107627012573)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_losses_match_verl(case):
    ours, verl = CASES[case][0](), CASES[case][1]
    assert ours == pytest.approx(verl, rel=1e-7, abs=1e-12)


def test_rollout_correction_weights_match_verl():
    _, old, rollout, _, mask = verl_inputs()
    for level, (w_sum, w_probe, mean, max_) in {
        "token": (17.912027466388608, 20.554091776077893, 1.0724726385351433, 2.320007399433561),
        "sequence": (12.735899245314755, 14.68723937038446, 0.7894820295943422, 2.342647632841942),
    }.items():  # fmt: skip
        w, st = rollout_is_weights(old, rollout, mask, level=level, threshold=2.0)
        assert float((w * mask).sum()) == pytest.approx(w_sum, rel=1e-12)
        assert float((w * mask * PROBE).sum()) == pytest.approx(w_probe, rel=1e-12)
        assert st["rollout_is_mean"] == pytest.approx(mean, rel=1e-8)  # verl: masked mean + 1e-8
        assert st["rollout_is_max"] == pytest.approx(max_, rel=1e-12)
    # verl's share beyond the threshold is per token at the token level (ours too); at the sequence level
    # it is per response (0.25: 1 of 4), ours per token (the 2 tokens of that response: 2 of 17).
    _, st = rollout_is_weights(old, rollout, mask, level="token", threshold=2.0)
    assert st["rollout_is_ratio_fraction_high"] == pytest.approx(0.05882352937716263, rel=1e-8)
    _, st = rollout_is_weights(old, rollout, mask, level="sequence", threshold=2.0)
    assert st["rollout_is_ratio_fraction_high"] == pytest.approx(2 / 17)


def test_dr_grpo_aggregation_matches_verl_up_to_its_count_of_responses():
    """verl's `agg_loss(..., "seq-mean-token-sum-norm", loss_scale_factor=L)` is the sum over the call's
    responses of their token sums / L, not divided by the number of responses (its actor then scales each
    micro-batch by micro / mini-batch size); ours divides by the global number of responses, Dr. GRPO's
    1/G, so ours times 4 responses is verl's."""
    logp, old, _, adv, mask = verl_inputs()
    assert float(aggregate(logp * 2 - old, mask, "seq-mean-token-sum-norm", norm_length=8)) * 4 == pytest.approx(
        -2.2247842387099572, rel=1e-12)  # fmt: skip
    loss, grad_sum, grad_probe = fingerprint(dapo_policy_loss, loss_agg_mode="seq-mean-token-sum-norm", norm_length=8,
                                             **DAPO)  # fmt: skip
    assert (4 * loss, 4 * grad_sum, 4 * grad_probe) == pytest.approx(
        (-0.2434233690385591, -0.20713267606402813, -0.3898929656066171), rel=1e-12)  # fmt: skip


def test_group_advantages_match_verl_grpo_with_and_without_std():
    """verl `compute_grpo_outcome_advantage` (epsilon 1e-6), two groups of 4; norm_adv_by_std_in_grpo False
    is Dr. GRPO (`algorithm.adv_std_norm: false`)."""
    groups = [[1.0, -1.0, -1.0, -1.0], [1.0, 1.0, -1.0, 0.5]]
    with_std = [1.4999985000015001, -0.49999950000050003, -0.49999950000050003, -0.49999950000050003,
                0.6603374820705363, 0.6603374820705363, -1.45274246055518, 0.13206749641410728]  # fmt: skip
    without = [1.5, -0.5, -0.5, -0.5, 0.625, 0.625, -1.375, 0.125]
    assert [a for g in groups for a in group_advantages(g)] == pytest.approx(with_std, rel=1e-12)
    assert [a for g in groups for a in group_advantages(g, scale_by_std=False)] == pytest.approx(without, rel=1e-12)
