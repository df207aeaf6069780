"""The DAPO policy loss: decoupled clip (Eq. 10) inside the objective of Eq. 8, aggregated per token
(Eq. 12).

Per token t of response i, with r = pi_theta / pi_old and advantage A_i:

    l_it = -min(r * A_i, clip(r, 1 - eps_low, 1 + eps_high) * A_i)                      (Eq. 10)

**Clip-Higher** (section 3.1) raises only the upper bound: with eps_high = 0.28, a token the old policy
gave p = 0.01 can rise to 0.0128 in one update (0.012 with the symmetric 0.2), which keeps exploration
tokens alive and entropy from collapsing.

**Dual clip** (`clip_ratio_c`, verl's default 3 in PPO and 10 in the DAPO recipe; off when None): for
A < 0 the loss is also bounded by -A * c, so one token with a huge ratio cannot dominate the batch.
This is verl's, not the paper's.

**Aggregation** (`loss_agg_mode`):

* ``token-mean`` (DAPO Eq. 12): sum of l_it over every token of the batch / total number of tokens.
  A long response weighs in proportion to its length.
* ``seq-mean-token-mean`` (GRPO, Eq. 5 style): mean over responses of each response's token mean.
* ``seq-mean-token-sum``: mean over responses of each response's token sum.

The denominators (`total_tokens` for token-mean, `total_seqs` for the seq modes) default to this call's
own counts, but a trainer splitting a batch into micro-batches or across data-parallel workers must pass
the **global** counts: then the sum of the per-shard losses (and of their gradients) is exactly the
whole-batch loss, whatever the split.

**KL** (`kl_coef`, 0 in DAPO, section 2.3): when > 0 and `ref_logp_BT` is given, adds kl_coef times the
low-variance "k3" estimator of KL(pi_theta || pi_ref), aggregated the same way.

Shapes: B responses (rows), T tokens (padded); `mask_BT` is 1 on response tokens that count.
"""

from __future__ import annotations

from typing import Literal

import torch

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def aggregate(
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: LossAgg,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce per-token values to a scalar according to `mode` (see module docstring)."""
    masked = values_BT * mask_BT
    if mode == "token-mean":
        denom = mask_BT.sum() if total_tokens is None else total_tokens
        return masked.sum() / max(float(denom), 1.0)
    seq_sum_B = masked.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq_B = seq_sum_B / mask_BT.sum(dim=-1).clamp(min=1.0)
    elif mode == "seq-mean-token-sum":
        per_seq_B = seq_sum_B
    else:
        raise ValueError(f"loss_agg_mode {mode!r} is not one of {LOSS_AGG_MODES}")
    # A response with no counted token (e.g. overlong-filtered) does not count as a sequence either.
    has_tokens_B = (mask_BT.sum(dim=-1) > 0).to(per_seq_B.dtype)
    denom = has_tokens_B.sum() if total_seqs is None else total_seqs
    return (per_seq_B * has_tokens_B).sum() / max(float(denom), 1.0)


def dapo_policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    clip_ratio_c: float | None = 10.0,
    loss_agg_mode: LossAgg = "token-mean",
    total_tokens: float | None = None,
    total_seqs: float | None = None,
    kl_coef: float = 0.0,
    ref_logp_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped policy-gradient loss of DAPO (Eq. 8, 10, 12) and its statistics.

    `adv_B` is one advantage per response (or a `[B, T]` tensor per token). Returns `(loss, stats)`;
    stats are means over this call's counted tokens, with `n_tokens` so a caller can weight them:

    * `pg_clipfrac_upper`: share of tokens whose gradient the upper bound 1 + eps_high removed (A > 0);
    * `pg_clipfrac_lower`: the same for the lower bound 1 - eps_low (A < 0);
    * `pg_clipfrac_dual`: share bounded by the dual clip (A < 0, ratio > c);
    * `up_clipped_prob`: mean old-policy probability of the up-clipped tokens (paper Fig. 3a);
      NaN when none was clipped;
    * `ppo_kl`: mean of (old_logp - logp), verl's k1 estimate of KL(pi_old || pi_theta);
    * `ratio_mean`, `kl_ref` (when `ref_logp_BT` is given).
    """
    mask_BT = mask_BT.to(logp_BT.dtype)
    adv_BT = adv_B.unsqueeze(-1).expand_as(logp_BT) if adv_B.dim() == 1 else adv_B
    log_ratio_BT = (logp_BT - old_logp_BT).clamp(-20.0, 20.0)  # keep exp() finite
    ratio_BT = torch.exp(log_ratio_BT)

    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg_BT = torch.maximum(unclipped_BT, clipped_BT)
    dual_BT = torch.zeros_like(pg_BT, dtype=torch.bool)
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
        bound_BT = -adv_BT * clip_ratio_c
        dual_BT = (adv_BT < 0) & (pg_BT > bound_BT)
        pg_BT = torch.where(adv_BT < 0, torch.minimum(pg_BT, bound_BT), pg_BT)

    loss = aggregate(pg_BT, mask_BT, loss_agg_mode, total_tokens, total_seqs)

    kl_ref = None
    if kl_coef > 0.0:
        if ref_logp_BT is None:
            raise ValueError("kl_coef > 0 needs ref_logp_BT")
        d_BT = (ref_logp_BT - logp_BT).clamp(-20.0, 20.0)
        kl_BT = torch.exp(d_BT) - d_BT - 1.0  # k3: unbiased, always >= 0
        loss = loss + kl_coef * aggregate(kl_BT, mask_BT, loss_agg_mode, total_tokens, total_seqs)
        kl_ref = kl_BT

    with torch.no_grad():
        m = mask_BT.bool()
        n = int(m.sum())
        upper_BT = (adv_BT > 0) & (ratio_BT > 1.0 + eps_high) & m
        lower_BT = (adv_BT < 0) & (ratio_BT < 1.0 - eps_low) & m

        def mean(x: torch.Tensor) -> float:
            return float(x[m].float().mean()) if n else 0.0

        up_probs = torch.exp(old_logp_BT[upper_BT])
        stats = {
            "n_tokens": float(n),
            "pg_loss": float(loss),
            "pg_clipfrac_upper": mean(upper_BT),
            "pg_clipfrac_lower": mean(lower_BT),
            "pg_clipfrac_dual": mean(dual_BT & m),
            "up_clipped_prob": float(up_probs.mean()) if up_probs.numel() else float("nan"),
            "ppo_kl": mean(-log_ratio_BT),
            "ratio_mean": mean(ratio_BT),
        }
        if kl_ref is not None:
            stats["kl_ref"] = mean(kl_ref)
    return loss, stats


def token_logprobs(logits_BTV: torch.Tensor, tokens_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(token | prefix) for each position: `logits_BTV[b, t]` must predict `tokens_BT[b, t]`.

    Logits are divided by the sampling temperature first, so the trainer's log-probs match the
    engine's. Computed as logit - logsumexp to avoid materialising a [B, T, V] log-softmax copy.
    """
    logits_BTV = logits_BTV.float() / temperature
    picked_BT = logits_BTV.gather(-1, tokens_BT.unsqueeze(-1)).squeeze(-1)
    return picked_BT - torch.logsumexp(logits_BTV, dim=-1)


def entropy_from_logits(logits_BTV: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-position entropy of the (temperature-scaled) next-token distribution, shape [B, T]."""
    logp_BTV = torch.log_softmax(logits_BTV.float() / temperature, dim=-1)
    return -(logp_BTV.exp() * logp_BTV).sum(-1)
