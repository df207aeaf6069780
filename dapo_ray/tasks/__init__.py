"""Tasks: what a row asks and how its replies are judged, one unit each.

A task brings its scorer (reply, reference -> `{"score", "acc", "pred"}`), its "does this reply state the
reference" check (the hack alarm's: `dapo_ray.replies`), and where its prompts come from. The row's
`data_source` picks the task, as verl's `default_compute_score(data_source, ...)` does, so one run can mix
sources:

    data_source                       task (module)                  scorer
    synthetic                         sums (tasks/sums.py)           reward.mode's (math_verify in the demo)
    mathematics_dataset/<module>      mathematics (tasks/mathematics.py)   the benchmark's exact match
    openai/gsm8k, HuggingFaceH4/MATH-500, ChilleD/SVAMP, MAWPS     benchmarks (tasks/benchmarks.py)
    anything else (math_dapo, aime)   dapo_math (tasks/dapo_math.py)       reward.mode's (DAPO's `Answer:` line)

Each module holds its task's prompts (the generator, or where `dapo-ray prepare` finds the data), its scorer,
its alarm check and its baselines (the Mathematics Dataset's echo baseline).

A reward function of the user's own (`reward.function`, `dapo_ray.tasks.user`) scores every row instead,
through the same door: its replies, verdicts, failures and the hack alarm go where ours go.

`judge_group(row, spec)` is the one place a group's replies are judged; the scoring stage
(`pipeline.score_group`), `dapo-ray check` and `dapo-ray probe-reward` all call it.
"""

from __future__ import annotations

import atexit
import json
import os
from dataclasses import dataclass

from dapo_ray.tasks.dapo_math import DAPO_MATH
from dapo_ray.tasks.mathematics import MATHEMATICS
from dapo_ray.tasks.sums import SUMS
from dapo_ray.tasks.task import Task, states_reference

__all__ = ["DAPO_MATH", "MATHEMATICS", "SUMS", "RewardSpec", "Task", "builtin_tasks", "judge_group", "keep",
           "reward_spec", "task_for"]

INVALID = "[INVALID]"  # = algo.reward.INVALID: what a scorer that read no answer gives as `pred`

ERROR_PRED = "[REWARD ERROR]"
TIMEOUT_PRED = "[REWARD TIMEOUT]"
KEPT_FAILURES = 2
"""Failed calls of a group whose reply and traceback travel with it to the driver's log."""


def builtin_tasks() -> tuple[Task, ...]:
    """Every built-in task; DAPO_MATH last: it takes what no other does."""
    from dapo_ray.tasks.benchmarks import BENCHMARK_TASKS

    return (SUMS, MATHEMATICS, *BENCHMARK_TASKS, DAPO_MATH)


def task_for(data_source: str) -> Task:
    """The built-in task of a row's `data_source`; DAPO's math task for any source no task names.

    >>> task_for("synthetic").name, task_for("mathematics_dataset/numbers__gcd").name, task_for("math_dapo").name
    ('sums', 'mathematics', 'dapo_math')
    """
    for task in builtin_tasks():
        if data_source in task.sources or data_source.partition("/")[0] in task.sources:
            return task
    return DAPO_MATH


# --- judging a group -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardSpec:
    """The plain values judging needs (`reward_spec(cfg)`): the built-in scorers' mode, or a user's function."""

    mode: str = "dapo"
    function: object | None = None
    """A `tasks.user.UserFunction`, or None for the built-in tasks."""
    filter_metric: str = "auto"
    """What Dynamic Sampling's "mixed group" reads: `acc` (0 < #right < G), `score` (the scores differ), or
    `auto`: acc where the scorer gives it, else the score (verl's `filter_groups.metric`)."""
    right_above: float = 0.0
    """A reply a user's function scores above this is right (avg@k, the hack alarm) when it gives no `acc`."""


def reward_spec(cfg) -> RewardSpec:
    """The RewardSpec of a run's config."""
    from dapo_ray.tasks.user import UserFunction

    r = cfg.reward
    fn = None
    if r.function:
        on_error = -1.0 if r.on_error is None else r.on_error
        fn = UserFunction(r.function, dict(r.function_kwargs), r.convention, r.timeout_s, on_error,
                          r.states_reference, r.trl_completions)  # fmt: skip
    return RewardSpec(r.mode, fn, r.filter_metric, r.right_above)


_scorers: dict = {}


def user_scorer(fn):
    """This process's scorer of a user's function (its helper starts on first use)."""
    from dapo_ray.tasks.user import UserScorer

    # The working directory too: a relative path names another file from another one.
    key = json.dumps([os.getcwd(), fn.spec, fn.kwargs, fn.convention, fn.timeout_s, fn.on_error, fn.states_reference,
                      fn.trl_completions], sort_keys=True, default=str)  # fmt: skip
    if key not in _scorers:
        if not _scorers:
            atexit.register(close_user_scorers)  # their helpers and pipes go with the process
        _scorers[key] = UserScorer(fn)
    return _scorers[key]


def close_user_scorers() -> None:
    """Stop this process's reward-function helpers (at exit; a test suite's end, before it checks that
    nothing it started is still running)."""
    while _scorers:
        _scorers.popitem()[1].close()


def judge_group(row: dict, spec: RewardSpec) -> dict:
    """Judge a group's replies (`row["texts"]` against `row["ground_truth"]`). Returns one list per column,
    a value per reply: `scores` (the reward before overlong shaping), `acc`, `preds` (what the scorer read),
    `stated` (the reply writes the reference: the hack alarm), `reward_errors` ("", "error" or "timeout");
    `reward_extra` (a user's function's other numbers, name -> one per reply); `reward_failures` (the first
    failed calls: reply and traceback); `filter_on` (what Dynamic Sampling reads: "acc" or "score")."""
    texts, reference = row["texts"], row["ground_truth"]
    if spec.function is None:
        task = task_for(row.get("data_source") or "")
        verdicts = [task.score(t, reference, spec.mode) for t in texts]
        return {"scores": [v["score"] for v in verdicts], "acc": [bool(v["acc"]) for v in verdicts],
                "preds": [v["pred"] for v in verdicts], "stated": [task.states_reference(t, reference) for t in texts],
                "reward_errors": [""] * len(texts), "reward_extra": {}, "reward_failures": [],
                "filter_on": "score" if spec.filter_metric == "score" else "acc"}  # fmt: skip
    return _judge_with_function(row, spec)


def _judge_with_function(row: dict, spec: RewardSpec) -> dict:
    from dapo_ray.tasks.user import extra_info_of

    fn, texts, reference = spec.function, row["texts"], row["ground_truth"]
    scorer = user_scorer(fn)
    extra_info = extra_info_of(row)
    calls = [{"data_source": row.get("data_source") or "", "solution_str": t, "ground_truth": reference,
              "extra_info": extra_info, "response_ids": ids} for t, ids in zip(texts, row["response_ids"], strict=True)]  # fmt: skip
    prompt = json.loads(row["prompt_json"]) if row.get("prompt_json") else None
    outcomes = scorer.score(calls, [prompt] * len(texts))
    out: dict = {"scores": [], "acc": [], "preds": [], "reward_errors": [], "reward_extra": {}, "reward_failures": []}
    gives_acc = False
    for i, ((kind, detail), text) in enumerate(zip(outcomes, texts, strict=True)):
        if kind == "ok":
            gives_acc |= detail["acc"] is not None
            right = detail["acc"] if detail["acc"] is not None else detail["score"] > spec.right_above
            out["scores"].append(detail["score"])
            out["acc"].append(bool(right))
            out["preds"].append(detail["pred"] if detail["pred"] is not None else INVALID)
            out["reward_errors"].append("")
            for name, value in detail["extra"].items():
                out["reward_extra"].setdefault(name, [None] * len(texts))[i] = value
        else:
            out["scores"].append(fn.on_error)
            out["acc"].append(False)
            out["preds"].append(TIMEOUT_PRED if kind == "timeout" else ERROR_PRED)
            out["reward_errors"].append(kind)
            if len(out["reward_failures"]) < KEPT_FAILURES:
                what = f"ran past reward.timeout_s={fn.timeout_s:g}" if kind == "timeout" else detail
                out["reward_failures"].append({"kind": kind, "reply": text[:500], "detail": (what or "")[-2000:]})
    own = scorer.states([(t, reference) for t in texts])
    out["stated"] = [s if s is not None else states_reference(t, reference)
                     for s, t in zip(own or [None] * len(texts), texts, strict=True)]  # fmt: skip
    metric = spec.filter_metric if spec.filter_metric != "auto" else ("acc" if gives_acc else "score")
    out["filter_on"] = metric
    return out


def keep(judged: dict) -> bool:
    """Dynamic Sampling's keep rule (Eq. 11) on what `judged["filter_on"]` names: a group with both right
    and wrong replies, or, on the score, with replies scored differently (verl's `std > 0`).

    >>> keep({"filter_on": "acc", "acc": [True, False], "scores": [1.0, -1.0]})
    True
    >>> keep({"filter_on": "score", "acc": [False, False], "scores": [0.5, 0.0]})
    True
    """
    from dapo_ray.algo.dynamic_sampling import keep_group

    if judged["filter_on"] == "score":
        return len(set(judged["scores"])) > 1
    return keep_group(judged["acc"])
