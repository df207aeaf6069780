"""The DAPO algorithm as pure functions: plain values and tensors in, numbers and stats out.

Nothing here imports Ray, vLLM, DeepSpeed or MLflow, or reads a config object; the caller passes
`eps_high: float` and friends and logs what comes back. In the order a sample travels:

    reward.compute_score        +1 / -1 correctness (Eq. 7)
    overlong.soft_overlong_penalty, overlong_filter_mask   (section 3.4, Eq. 13)
    dynamic_sampling.keep_group, BatchFiller                (Eq. 11)
    advantage.group_advantages                              (Eq. 9)
    loss.dapo_policy_loss, behaviour_logprobs, kl_penalty   (Eq. 8, 10, 12)
"""

from dapo_ray.algo.advantage import group_advantages
from dapo_ray.algo.dynamic_sampling import BatchFiller, FillReport, keep_group
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

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "REWARD_MODES",
    "BatchFiller",
    "FillReport",
    "aggregate",
    "behaviour_logprobs",
    "compute_score",
    "dapo_policy_loss",
    "entropy_from_logits",
    "group_advantages",
    "keep_group",
    "kl_penalty",
    "overlong_filter_mask",
    "soft_overlong_penalty",
    "token_logprobs",
]
