"""Group-relative advantages (DAPO Eq. 4 / Eq. 9; GRPO).

For the G responses to one prompt with rewards R_1..R_G:

    A_i = (R_i - mean(R)) / (std(R) + eps)

and every token of response i gets A_i. There is no value model and no KL term (section 2.3).

Choices, documented because they change numbers:
* `std` is the unbiased sample std (divides by G - 1), as `torch.std` in verl's GRPO; pass
  `unbiased=False` for the population std.
* `eps = 1e-6` as in verl; it keeps a group of identical rewards (std 0) at A = 0.
* `scale_by_std=False` gives the mean-centred advantage only, A_i = R_i - mean(R): Dr. GRPO (Liu et al.
  2025, "Understanding R1-Zero-Like Training", section 3.1), which finds that dividing by the std gives
  more weight to questions that are nearly always or nearly never solved (a small std), a
  question-level difficulty bias (`algorithm.adv_std_norm: false`; verl's `norm_adv_by_std_in_grpo`).

Example: rewards [1, -1, -1, -1] -> mean -0.5, unbiased std 1.0 -> A = [1.5, -0.5, -0.5, -0.5].
Rewards [1, 1, -1, -1]: std 1.1547 -> A = [0.866, 0.866, -0.866, -0.866]; Dr. GRPO: [1, 1, -1, -1].
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def group_advantages(
    rewards_G: Sequence[float], eps: float = 1e-6, unbiased: bool = True, scale_by_std: bool = True
) -> list[float]:
    """Advantages for one group of G >= 2 rewards."""
    g = len(rewards_G)
    if g < 2:
        raise ValueError(f"a group needs at least 2 responses to have a baseline, got {g}")
    mean = sum(rewards_G) / g
    if not scale_by_std:
        return [r - mean for r in rewards_G]
    var = sum((r - mean) ** 2 for r in rewards_G) / (g - 1 if unbiased else g)
    std = math.sqrt(var)
    return [(r - mean) / (std + eps) for r in rewards_G]
