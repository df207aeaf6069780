"""Rollout-training mismatch correction: truncated or masked importance sampling of the engine's samples.

The engine samples with its own kernels and precision (bf16 on GPU), so the probability it gave a token,
pi_rollout, differs from the one the trainer computes with the same weights, pi_old, and the policy
gradient, which assumes the samples came from pi_old, is biased. Yao et al. 2025 ("Your Efficient RL
Framework Secretly Brings You Off-Policy RL Training"; verl `algorithm.rollout_correction`, slime
`--use-tis`, OpenRLHF `is_correction_type`, NeMo-RL `truncated_importance_sampling_type`) weight each
token's policy-gradient term by the importance weight, truncated at C (TIS):

    l_it  ->  min(pi_old(y_it) / pi_rollout(y_it), C) * l_it                       (token, truncate)

or per response, with the product of its token weights (`sequence`), or mask the terms whose weight
exceeds C instead of truncating them (MIS, Liu, Li et al. 2025, "When Speed Kills Stability"):

    w_it = exp(sum_t' log pi_old(y_it') - log pi_rollout(y_it'))                  (sequence level)
    l_it  ->  w_it * 1[w_it <= C] * l_it                                            (mask)

`algorithm.rollout_is: none | token | sequence`, `rollout_is_threshold` (C, 2.0 as in verl and the
blog), `rollout_is_mode: truncate | mask`. The weight has no gradient; the loss multiplies its per-token
terms by it after the clip (`loss.finish_policy_loss`), as verl does. A masked term keeps its place in
the loss's denominator (as verl's first mask mode did; its later rejection sampling drops it from the
response mask): the denominators are fixed before the trainer computes pi_old, which keeps the loss
independent of how a batch is split.

**Carried-over, partially rolled-out and off-policy samples.** The ratio's denominator of a token an
older policy sampled is already the engine's log-prob (`loss.behaviour_logprobs`): pi_old = pi_rollout
there, so its weight is exactly 1, and its mismatch is inside the ratio pi_theta / pi_rollout, bounded
by the clip. Only tokens of the version being trained, whose denominator is the trainer's recomputed
log-prob, get a weight other than 1; at the sequence level a response a weight load interrupted is
weighted by the product over its tokens of the current version.

Worked example, engine probabilities 0.2, 0.5, 0.5 and trainer's 0.5, 0.5, 0.2 (weights 2.5, 1, 0.4),
C = 2: token truncate -> 2.0, 1.0, 0.4; token mask -> 0, 1.0, 0.4; sequence (2.5 * 1 * 0.4 = 1.0) ->
1.0 on every token.

Shapes as in `loss`: B responses, T positions, `mask_BT` > 0 on the tokens that count.
"""

from __future__ import annotations

from typing import Literal

import torch

RolloutIS = Literal["none", "token", "sequence"]
ROLLOUT_IS_LEVELS: tuple[str, ...] = ("none", "token", "sequence")
RolloutISMode = Literal["truncate", "mask"]
ROLLOUT_IS_MODES: tuple[str, ...] = ("truncate", "mask")


def rollout_is_weights(
    old_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    level: RolloutIS = "token",
    threshold: float = 2.0,
    mode: RolloutISMode = "truncate",
) -> tuple[torch.Tensor, dict[str, float]]:
    """The weights `[B, T]` (1 outside the mask) and their statistics over this call's counted tokens:

    * `rollout_is_mean`, `rollout_is_max`: of pi_old / pi_rollout before truncation or masking (at the
      sequence level each token carries its response's weight);
    * `rollout_is_ratio_fraction_high`: share of tokens whose weight exceeded the threshold (truncated,
      or masked);
    * `rollout_is_masked_fraction`: share of tokens masked out (mode `mask`; 0 for `truncate`);
    * `n_tokens`, so a caller can weight the means.

    >>> w, _ = rollout_is_weights(torch.tensor([[-0.1, -2.0]]), torch.tensor([[-1.0, -1.0]]), torch.ones(1, 2))
    >>> [round(x, 4) for x in w[0].tolist()]  # e^0.9 = 2.46 truncated to 2, e^-1
    [2.0, 0.3679]
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"rollout_is level {level!r} is not one of ('token', 'sequence')")
    if mode not in ROLLOUT_IS_MODES:
        raise ValueError(f"rollout_is_mode {mode!r} is not one of {ROLLOUT_IS_MODES}")
    if threshold <= 0:
        raise ValueError(f"rollout_is_threshold must be > 0, got {threshold}")
    with torch.no_grad():
        m = mask_BT > 0
        zero = torch.zeros((), dtype=old_logp_BT.dtype, device=old_logp_BT.device)
        log_w_BT = torch.where(m, old_logp_BT - rollout_logp_BT.to(old_logp_BT.dtype), zero)
        if level == "sequence":
            log_w_BT = log_w_BT.sum(-1, keepdim=True).expand_as(log_w_BT)
        raw_BT = torch.exp(log_w_BT.clamp(-20.0, 20.0))  # the same safety bound as verl's
        beyond_BT = (raw_BT > threshold) & m
        if mode == "truncate":
            w_BT = raw_BT.clamp(max=threshold)
        else:
            w_BT = torch.where(beyond_BT, zero, raw_BT)
        w_BT = torch.where(m, w_BT, torch.ones_like(w_BT))
        n = int(m.sum())
        stats = {
            "n_tokens": float(n),
            "rollout_is_mean": float(raw_BT[m].mean()) if n else 1.0,
            "rollout_is_max": float(raw_BT[m].max()) if n else 1.0,
            "rollout_is_ratio_fraction_high": float(beyond_BT.sum()) / n if n else 0.0,
            "rollout_is_masked_fraction": float(beyond_BT.sum()) / n if n and mode == "mask" else 0.0,
        }
    return w_BT, stats
