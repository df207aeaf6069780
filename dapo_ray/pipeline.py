"""Ray Data stages: prompts -> Serve vLLM generation -> verify, shape, filter flag, advantages.

One row per prompt (a group of G responses) from start to end:

    generate_batch  needs: prompt_ids (and draw, with a sampling seed)
                    adds:  texts, response_ids, rollout_logprobs, versions, finish_reasons, policy_version,
                           replica
    score_group     needs: ground_truth, data_source, texts, response_ids, finish_reasons (and prompt_json,
                           extra_info_json for a reward function of the user's own)
                    adds:  scores, acc, preds, stated, reward_errors, reward_extra_json, reward_failures_json,
                           truncated, loss_weights, advantages, keep

`generate_round` runs both over one round's prompts; the driver's BatchFiller decides what to keep.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa

from dapo_ray import algo
from dapo_ray.progress import quiet_libraries
from dapo_ray.tasks import RewardSpec, judge_group, keep, reward_spec


@dataclass(frozen=True)
class SamplingSpec:
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None = None
    """With a seed, each prompt is sampled with `prompt_seed(seed, its draw)`: the same weights give it
    the same responses whichever replica, call or batch serves it."""


def prompt_seed(seed: int, draw: str) -> int:
    """A prompt's sampling seed from the run's seed and its draw from the data ("epoch:index"). Hashed,
    not added: vLLM seeds a prompt's n samples seed, seed + 1, ..., so nearby seeds would share samples."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(f"{seed}/{draw}".encode(), digest_size=6).digest(), "big")


_handles: dict = {}


def generate_batch(batch: pa.Table, app_name: str, spec: SamplingSpec) -> pa.Table:
    """Ray Data stage: call the rollout deployment with a batch of prompts; Serve picks the replica
    (and autoscales). A plain function, so Ray Data runs it on pooled tasks with no actor start-up per
    round; the deployment handle is cached per worker process."""
    from ray import serve

    if app_name not in _handles:
        quiet_libraries()  # this worker's Serve router warns each time a busy replica answers late
        _handles[app_name] = serve.get_deployment_handle("rollout", app_name=app_name)
    rows = batch.to_pylist()
    seeds = None if spec.seed is None else [prompt_seed(spec.seed, r["draw"]) for r in rows]
    version, replica, outs = _call_replica(
        _handles[app_name], [r["prompt_ids"] for r in rows], spec.n, spec.temperature, spec.top_p, spec.max_tokens,
        seeds,
    )  # fmt: skip
    return pa.Table.from_pylist([add_completions(row, group, version, replica) for row, group in zip(rows, outs, strict=True)])


def add_completions(row: dict, group: list, version: int, replica: str) -> dict:
    """A prompt's row with its G completions (`rollout.engine.Completion`) as columns."""
    row["texts"] = [c["text"] for c in group]
    row["response_ids"] = [c["response_ids"] for c in group]
    row["rollout_logprobs"] = [c["logprobs"] for c in group]
    row["finish_reasons"] = [c["finish_reason"] for c in group]
    # Which version sampled which tokens (a weight load may interrupt a response: partial rollout); the
    # group's version is its oldest token's, which max_policy_lag bounds.
    row["versions"] = [c["versions"] for c in group]
    row["policy_version"] = min((v[0][1] for v in row["versions"]), default=version)
    row["replica"] = replica
    return row


def _call_replica(handle, *args, attempts: int = 6):
    """`handle.generate.remote(*args).result()`, sent again when the replica serving it dies (a node
    lost, a replica killed or scaled away) or its engine did (`EngineDead`: Serve replaces that replica
    within a few seconds, `deployment.HEALTH_CHECK_PERIOD_S`, which the waits between attempts outlast):
    Serve routes the retry to a live replica, so the round completes with every prompt. Nothing was kept
    from the failed call, so no sample is duplicated."""
    import time

    for attempt in range(attempts):
        try:
            return handle.generate.remote(*args).result()
        except replica_lost_errors() as e:
            if attempt == attempts - 1:
                raise
            print(f"[rollout] a replica was lost mid-call ({type(e).__name__}); sending the call again", flush=True)
            time.sleep(1.0 + attempt)
    raise AssertionError("unreachable")


def replica_lost_errors() -> tuple[type[BaseException], ...]:
    """What a generate call fails with when its replica, or the replica's engine, is gone: the call may
    be sent again."""
    import ray

    from dapo_ray.rollout.engine import EngineDead

    return ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, EngineDead


@dataclass(frozen=True)
class ScoringSpec:
    """The plain values `score_group` needs (algorithm switches, no config object)."""

    reward: RewardSpec
    """Which scorer judges the replies: the row's task (`dapo_ray.tasks`) or the user's reward.function."""
    max_response_length: int
    soft_overlong: bool
    overlong_cache_length: int
    overlong_penalty_factor: float
    overlong_filter: bool
    adv_eps: float
    adv_std_unbiased: bool
    adv_std_norm: bool = True


def scoring_spec(cfg) -> ScoringSpec:
    """The ScoringSpec of a run's config (reward, overlong shaping and advantage settings)."""
    a = cfg.algorithm
    return ScoringSpec(reward_spec(cfg), cfg.rollout.max_response_length, a.soft_overlong, a.overlong_cache_length,
                       a.overlong_penalty_factor, a.overlong_filter, a.adv_eps, a.adv_std_unbiased,
                       a.adv_std_norm)  # fmt: skip


def score_group(row: dict, spec: ScoringSpec) -> dict:
    """Judge every response (Eq. 7: the row's task or the user's reward function, `tasks.judge_group`), add
    soft overlong punishment (Eq. 13), mask truncated responses (overlong filtering), compute group
    advantages on the shaped reward (Eq. 9) and the keep flag (Eq. 11, on correctness or, for a function
    that gives no `acc`, on the score: `tasks.keep`)."""
    truncated = [f == "length" for f in row["finish_reasons"]]
    judged = judge_group(row, spec.reward)
    acc, scores = judged["acc"], judged["scores"]
    if spec.soft_overlong:
        scores = [
            s + algo.soft_overlong_penalty(len(ids), spec.max_response_length, spec.overlong_cache_length,
                                           spec.overlong_penalty_factor)  # fmt: skip
            for s, ids in zip(scores, row["response_ids"], strict=True)
        ]
    row["acc"] = acc
    row["scores"] = scores
    row["preds"] = judged["preds"]
    row["stated"] = judged["stated"]
    row["reward_errors"] = judged["reward_errors"]
    # JSON: their keys differ from task to task, and a Ray Data block wants one type per column.
    row["reward_extra_json"] = json.dumps(judged["reward_extra"]) if judged["reward_extra"] else ""
    row["reward_failures_json"] = json.dumps(judged["reward_failures"]) if judged["reward_failures"] else ""
    row["truncated"] = truncated
    row["loss_weights"] = algo.overlong_filter_mask(truncated) if spec.overlong_filter else [1.0] * len(truncated)
    row["advantages"] = algo.group_advantages(scores, spec.adv_eps, spec.adv_std_unbiased, spec.adv_std_norm)
    row["keep"] = keep(judged)
    return row


def generate_round(prompts: list[dict], app_name: str, sampling: SamplingSpec, scoring: ScoringSpec,
                   prompts_per_call: int, max_concurrency: int) -> list[dict]:  # fmt: skip
    """One generation round through Ray Data: returns one scored row per prompt."""
    import ray

    calls = -(-len(prompts) // prompts_per_call)
    pool = ray.data.TaskPoolStrategy(size=max(1, max_concurrency))
    ds = ray.data.from_items(prompts, override_num_blocks=calls)  # one block per call: no re-batching
    ds = ds.map_batches(
        generate_batch,
        fn_kwargs={"app_name": app_name, "spec": sampling},
        batch_size=prompts_per_call,
        batch_format="pyarrow",
        num_cpus=0,  # it only waits on the deployment
        compute=pool,
    )
    # The same resources and pool, so Ray Data fuses both stages into one task per call.
    ds = ds.map(score_group, fn_kwargs={"spec": scoring}, num_cpus=0, compute=pool)
    return ds.take_all()
