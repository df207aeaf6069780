"""A task: what a row asks and how its replies are judged (`dapo_ray.tasks` picks one by a row's
`data_source`), and the scorers the built-in tasks share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dapo_ray.algo.reward import Score


@dataclass(frozen=True)
class Task:
    """One task: its name, the `data_source` values it takes, its scorer and its alarm check."""

    name: str
    sources: tuple[str, ...]
    """`data_source` values it takes: a value as it stands, or its part before the first `/`."""
    score: Callable[[str, str, str], Score]
    """(reply, reference, reward.mode) -> verdict; tasks with a metric of their own ignore the mode."""
    states_reference: Callable[[str, str], bool]
    """(reply, reference) -> does the reply write the reference answer at all."""
    about: str


# The scorers are imported when first called: `dapo_ray.algo` loads torch, and every `dapo-ray` command
# imports this package (its `--help` included).
def by_mode(reply: str, reference: str, mode: str) -> Score:
    """`reward.mode`'s scorer (`algo.reward.compute_score`)."""
    from dapo_ray.algo.reward import compute_score

    return compute_score(reply, reference, mode)


def exact(reply: str, reference: str, mode: str) -> Score:
    """A benchmark's exact match of the answer (`algo.reward`'s `exact` mode), whatever reward.mode says."""
    from dapo_ray.algo.reward import compute_score

    return compute_score(reply, reference, "exact")


def states_reference(reply: str, reference: str) -> bool:
    """The generic alarm check (`algo.stated.states_reference`): the reference, a number by value or text
    without spaces, appears in the reply."""
    from dapo_ray.algo.stated import states_reference as generic

    return generic(reply, reference)


def scorer_name(reward) -> str:
    """What judges a run's replies, for its log lines (`reward`: the config's reward section).

    >>> from dapo_ray.config import RewardConfig
    >>> scorer_name(RewardConfig(mode="dapo")), scorer_name(RewardConfig(function="my_task.py:score"))
    ('the built-in tasks, reward.mode=dapo', 'reward.function=my_task.py:score')
    """
    return f"reward.function={reward.function}" if reward.function else f"the built-in tasks, reward.mode={reward.mode}"
