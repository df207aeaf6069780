"""The DAPO algorithm as pure functions: plain values and tensors in, numbers and stats out.

Nothing here imports Ray, vLLM, DeepSpeed or MLflow, or reads a config object; the caller passes
`eps_high: float` and friends and logs what comes back. In the order a sample travels:

    reward.compute_score        +1 / -1 correctness (Eq. 7)
    overlong.soft_overlong_penalty, overlong_filter_mask   (section 3.4, Eq. 13)
    dynamic_sampling.keep_group, BatchFiller                (Eq. 11)
    advantage.group_advantages                              (Eq. 9; Dr. GRPO: no std scaling)
    rollout_correction.rollout_is_weights                   (truncated / masked IS, Yao et al. 2025)
    loss.dapo_policy_loss, behaviour_logprobs, kl_penalty   (Eq. 8, 10, 12; Dr. GRPO's aggregation)
    gspo.gspo_policy_loss                                   (GSPO, Zheng et al. 2025, Eq. 5-7)
    cispo.cispo_policy_loss                                 (CISPO, MiniMax-M1 2025, Eq. 4-5)

`POLICY_LOSSES` names the three losses (`algorithm.policy_loss`); they take the same arguments.
"""

from dapo_ray.algo.advantage import group_advantages
from dapo_ray.algo.cispo import cispo_policy_loss
from dapo_ray.algo.dynamic_sampling import BatchFiller, FillReport, keep_group
from dapo_ray.algo.gspo import gspo_policy_loss
from dapo_ray.algo.loss import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    aggregate,
    behaviour_logprobs,
    dapo_policy_loss,
    entropy_from_logits,
    kl_penalty,
    token_logprobs,
)
from dapo_ray.algo.overlong import overlong_filter_mask, soft_overlong_penalty
from dapo_ray.algo.reward import MODES as REWARD_MODES
from dapo_ray.algo.reward import compute_score
from dapo_ray.algo.rollout_correction import ROLLOUT_IS_LEVELS, ROLLOUT_IS_MODES, rollout_is_weights

POLICY_LOSSES = {"dapo": dapo_policy_loss, "gspo": gspo_policy_loss, "cispo": cispo_policy_loss}
"""`algorithm.policy_loss` -> the loss function; each takes (logp_BT, old_logp_BT, adv_B, mask_BT) and the
same keywords, and returns (loss, stats)."""

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "REWARD_MODES",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_IS_MODES",
    "BatchFiller",
    "FillReport",
    "aggregate",
    "behaviour_logprobs",
    "cispo_policy_loss",
    "compute_score",
    "dapo_policy_loss",
    "entropy_from_logits",
    "group_advantages",
    "gspo_policy_loss",
    "keep_group",
    "kl_penalty",
    "overlong_filter_mask",
    "rollout_is_weights",
    "soft_overlong_penalty",
    "token_logprobs",
]
