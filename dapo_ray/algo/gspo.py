"""GSPO: Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071), one importance ratio
per response instead of one per token.

The ratio is the length-normalised product of the token ratios, the geometric mean (Eq. 6):

    s_i = (pi_theta(y_i | x) / pi_old(y_i | x)) ** (1 / |y_i|)
        = exp( (1 / |y_i|) * sum_t log(pi_theta(y_it | x, y_i<t) / pi_old(y_it | x, y_i<t)) )

and the clip acts on the whole response (Eq. 5):

    J = E[ (1/G) sum_i min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i) ]

so a response is kept or clipped as a whole: one off token no longer decides alone. Length
normalisation keeps s_i near 1 whatever the length, hence the paper's very small clip ranges,
eps_low = 3e-4 and eps_high = 4e-4 (section 5.1; this function's defaults; `algorithm.eps_low` /
`eps_high` in a run, see `dapo_ray.ablation.VARIANTS`).

We compute it as GSPO-token (Eq. 13-14): every token of response i carries

    s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]

whose value is s_i and whose gradient is s_i * grad log pi_theta(y_it); with the paper's aggregation
(`seq-mean-token-mean`: mean over responses of the token mean) the gradient is exactly Eq. 7's,
s_i * A_i * (1/|y_i|) * sum_t grad log pi_theta(y_it). It is the form verl uses (`core_algos.py`,
`compute_policy_loss_gspo`), and it lets `loss_agg_mode` and the rollout correction act per token as
for DAPO: with `token-mean` each response weighs in proportion to its length.

Worked example: a 2-token response with token ratios 1.1 and 0.9 has s = sqrt(0.99) = 0.99499. With
A = +1 the loss is -min(0.99499, clip(0.99499, 0.9997, 1.0004)) = -0.99499: below the lower bound, but
for A > 0 only the upper one clips, so it keeps its gradient. With A = -1 the loss is
max(0.99499, 0.9997) = 0.9997: clipped, no gradient.

A response's ratio needs all of its tokens in one call: the trainer never splits a response across
micro-batches or ranks (`dapo_ray.trainer.batch`).
"""

from __future__ import annotations

import torch

from dapo_ray.algo.loss import KlEstimator, LossAgg, counted_inputs, dual_clip, finish_policy_loss


def gspo_policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    clip_ratio_c: float | None = None,
    loss_agg_mode: LossAgg = "seq-mean-token-mean",
    total_tokens: float | None = None,
    total_seqs: float | None = None,
    norm_length: float | None = None,
    kl_coef: float = 0.0,
    ref_logp_BT: torch.Tensor | None = None,
    kl_estimator: KlEstimator = "low_var_kl",
    is_weights_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The GSPO loss (Eq. 5-7, as GSPO-token) and the statistics of `loss.dapo_policy_loss`, counted per
    token: `clipfrac_high` is the share of tokens in responses clipped at 1 + eps_high (A > 0),
    `ratio_mean` the mean of s_i over tokens. `clip_ratio_c` (verl's dual clip, not the paper's; off by
    default) bounds a negative-advantage response's term by -A * c as in DAPO."""
    mask_BT, m, logp_BT, old_logp_BT, adv_BT = counted_inputs(logp_BT, old_logp_BT, adv_B, mask_BT)
    with torch.no_grad():
        zero = torch.zeros((), dtype=logp_BT.dtype, device=logp_BT.device)
        log_ratio_BT = torch.where(m, logp_BT - old_logp_BT, zero)
        seq_log_ratio_B = log_ratio_BT.sum(-1) / m.sum(-1).clamp(min=1)
    # Value s_i on every token, gradient s_i * grad log pi (Eq. 14); the clamp keeps exp() finite.
    log_s_BT = logp_BT - logp_BT.detach() + seq_log_ratio_B.clamp(-20.0, 20.0).unsqueeze(-1)
    s_BT = torch.exp(log_s_BT)

    unclipped_BT = -adv_BT * s_BT
    clipped_BT = -adv_BT * s_BT.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg_BT = torch.maximum(unclipped_BT, clipped_BT)
    pg_BT, dual_BT = dual_clip(pg_BT, adv_BT, clip_ratio_c)

    with torch.no_grad():
        upper_BT = (adv_BT > 0) & (s_BT > 1.0 + eps_high)
        lower_BT = (adv_BT < 0) & (s_BT < 1.0 - eps_low)
    return finish_policy_loss(
        pg_BT, mask_BT, logp_BT=logp_BT, old_logp_BT=old_logp_BT, adv_BT=adv_BT, ratio_BT=s_BT,
        upper_BT=upper_BT, lower_BT=lower_BT, dual_BT=dual_BT, is_weights_BT=is_weights_BT,
        loss_agg_mode=loss_agg_mode, total_tokens=total_tokens, total_seqs=total_seqs, norm_length=norm_length,
        kl_coef=kl_coef, ref_logp_BT=ref_logp_BT, kl_estimator=kl_estimator,
    )  # fmt: skip
