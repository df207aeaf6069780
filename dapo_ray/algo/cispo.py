"""CISPO: Clipped IS-weight Policy Optimization (MiniMax-M1, MiniMax 2025, arXiv 2506.13585, section 3.1).

PPO's clip (and DAPO's, Eq. 10) drops the gradient of every token whose ratio left the trust region:
rare tokens that open a line of reasoning ("However", "Recheck") are exactly those, and lose their
gradient after the first update. CISPO clips the importance-sampling weight instead and stops its
gradient, so every token keeps a policy-gradient term (Eq. 4-5):

    J = E[ 1 / sum_i |o_i| * sum_i sum_t sg(r_hat_it) * A_i * log pi_theta(o_it | q, o_i<t) ]
    r_hat_it = clip(r_it, 1 - eps_low, 1 + eps_high),   r_it = pi_theta(o_it) / pi_old(o_it)

The paper sets no lower bound (eps_low "large": 1.0 or more makes the bound 1 - eps_low <= 0, which a
ratio never reaches) and tunes only eps_high; verl's example uses eps_low 10, eps_high 0.2. Its
aggregation is token-level (`token-mean`, as DAPO's Eq. 12).

The loss's value is -sg(r_hat) * A * log pi_theta (the paper's, and verl's `compute_policy_loss_cispo`),
so it is not comparable with the ratio-based losses; its gradient is -r_hat * A * grad log pi_theta.

Worked example: p_old = 0.5, p = 0.8, so r = 1.6; with eps_high = 0.28, r_hat = 1.28. For A = +1 the
token's loss is -1.28 * log(0.8) = 0.2856 and its gradient in log p is -1.28, where DAPO's clip would
give this token no gradient at all.

The dual clip (`clip_ratio_c`) does not apply: the weight is already bounded by 1 + eps_high.
"""

from __future__ import annotations

import torch

from dapo_ray.algo.loss import KlEstimator, LossAgg, counted_inputs, finish_policy_loss


def cispo_policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
    clip_ratio_c: float | None = None,
    loss_agg_mode: LossAgg = "token-mean",
    total_tokens: float | None = None,
    total_seqs: float | None = None,
    norm_length: float | None = None,
    kl_coef: float = 0.0,
    ref_logp_BT: torch.Tensor | None = None,
    kl_estimator: KlEstimator = "low_var_kl",
    is_weights_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The CISPO loss (Eq. 4-5) and the statistics of `loss.dapo_policy_loss`, where `clipfrac_high` /
    `clipfrac_low` are the shares of tokens whose weight was capped at 1 + eps_high / raised to
    1 - eps_low (whatever the advantage's sign: the token keeps its gradient either way).
    `clip_ratio_c` is accepted for a uniform call and ignored (see module docstring)."""
    del clip_ratio_c
    mask_BT, _, logp_BT, old_logp_BT, adv_BT = counted_inputs(logp_BT, old_logp_BT, adv_B, mask_BT)
    with torch.no_grad():
        ratio_BT = torch.exp((logp_BT - old_logp_BT).clamp(-20.0, 20.0))
        weight_BT = ratio_BT.clamp(1.0 - eps_low, 1.0 + eps_high)
        upper_BT = ratio_BT > 1.0 + eps_high
        lower_BT = ratio_BT < 1.0 - eps_low
    pg_BT = -weight_BT * adv_BT * logp_BT
    return finish_policy_loss(
        pg_BT, mask_BT, logp_BT=logp_BT, old_logp_BT=old_logp_BT, adv_BT=adv_BT, ratio_BT=ratio_BT,
        upper_BT=upper_BT, lower_BT=lower_BT, dual_BT=None, is_weights_BT=is_weights_BT,
        loss_agg_mode=loss_agg_mode, total_tokens=total_tokens, total_seqs=total_seqs, norm_length=norm_length,
        kl_coef=kl_coef, ref_logp_BT=ref_logp_BT, kl_estimator=kl_estimator,
    )  # fmt: skip
