"""The ablation ladder of DAPO Table 1 as config overrides, each rung adding one technique.

Paper AIME 2024 avg@32 on Qwen2.5-32B: naive GRPO 30, + overlong filtering 36, + clip-higher 38,
+ soft overlong punishment 41, + token-level loss 42, + dynamic sampling 50.

verl's dual clip (`clip_ratio_c`) is in neither the paper's GRPO nor its DAPO, so every rung switches it
off: rungs then differ by exactly one technique, and the top rung is the paper's DAPO (the shipped
configs keep verl's dual clip; that is the only difference).

    dapo-ray train --config workflows/configs/dapo_qwen2.5_32b.yaml $(dapo-ray ladder clip-higher)
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


def overrides_for(rung: str) -> list[str]:
    for name, overrides in LADDER:
        if name == rung:
            return overrides
    raise ValueError(f"unknown ablation rung {rung!r}; choose one of {_RUNGS}")
