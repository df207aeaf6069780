"""The ablation ladder of DAPO Table 1 as config overrides, each rung adding one technique, and variants
beside it that swap one other method's choice into DAPO.

Paper AIME 2024 avg@32 on Qwen2.5-32B: naive GRPO 30, + overlong filtering 36, + clip-higher 38,
+ soft overlong punishment 41, + token-level loss 42, + dynamic sampling 50.

verl's dual clip (`clip_ratio_c`) is in neither the paper's GRPO nor its DAPO, so every rung switches it
off: rungs then differ by exactly one technique, and the top rung is the paper's DAPO (the shipped
configs keep verl's dual clip; that is the only difference).

    dapo-ray train --config workflows/configs/dapo_qwen2.5_32b.yaml $(dapo-ray ladder clip-higher)

`VARIANTS` are the top rung with the switches of one other method, as its paper sets them:

* `dapo+gspo`: GSPO's sequence-level ratio (Zheng et al. 2025) with the paper's clip ranges 3e-4 / 4e-4
  (section 5.1: a length-normalised ratio stays close to 1) and its mean over responses (Eq. 5);
* `dapo+cispo`: CISPO's clipped stop-gradient weight (MiniMax-M1 2025) with no lower bound, as the paper
  (eps_low 1.0); eps_high stays DAPO's 0.28, the paper not giving its own;
* `dapo+drgrpo`: Dr. GRPO (Liu et al. 2025): no per-response length normalisation (token sums over the
  constant L_max) and no std scaling of the advantage;
* `dapo+tis`: the rollout-mismatch correction of Yao et al. 2025, per token, truncated at C = 2. The
  reasoning task's engine samples in float32 (`rollout.dtype`), as the trainer computes, so its weights
  stay at 1 (measured: mean 1.000, max 1.00); `--set rollout.dtype=bfloat16` gives the engine a GPU's
  precision, and a mismatch to correct (measured: max 1.3-2.3 per step).

    python bench/ablation.py --rungs dapo dapo+gspo dapo+cispo dapo+drgrpo dapo+tis
"""

from __future__ import annotations

_ALL_RUNGS = ["algorithm.clip_ratio_c=null"]
_NAIVE = [
    "algorithm.overlong_filter=false",
    "algorithm.eps_high=0.2",
    "algorithm.soft_overlong=false",
    "algorithm.loss_agg_mode=seq-mean-token-mean",
    "algorithm.dynamic_sampling=false",
]
_RUNGS = ["naive-grpo", "overlong-filtering", "clip-higher", "soft-overlong", "token-level-loss", "dapo"]

# Rung k switches on the first k techniques: drop the first k "off" overrides.
LADDER: list[tuple[str, list[str]]] = [(name, _ALL_RUNGS + _NAIVE[k:]) for k, name in enumerate(_RUNGS)]

VARIANTS: list[tuple[str, list[str]]] = [
    ("dapo+gspo", _ALL_RUNGS + ["algorithm.policy_loss=gspo", "algorithm.eps_low=0.0003", "algorithm.eps_high=0.0004",
                                "algorithm.loss_agg_mode=seq-mean-token-mean"]),
    ("dapo+cispo", _ALL_RUNGS + ["algorithm.policy_loss=cispo", "algorithm.eps_low=1.0"]),
    ("dapo+drgrpo", _ALL_RUNGS + ["algorithm.loss_agg_mode=seq-mean-token-sum-norm", "algorithm.adv_std_norm=false"]),
    ("dapo+tis", _ALL_RUNGS + ["algorithm.rollout_is=token", "algorithm.rollout_is_threshold=2.0",
                               "algorithm.rollout_is_mode=truncate"]),
]  # fmt: skip


def overrides_for(rung: str) -> list[str]:
    """The overrides of a ladder rung or a variant."""
    for name, overrides in LADDER + VARIANTS:
        if name == rung:
            return overrides
    raise ValueError(f"unknown ablation rung {rung!r}; choose one of {_RUNGS} or a variant "
                     f"{[name for name, _ in VARIANTS]}")  # fmt: skip
