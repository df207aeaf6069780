"""A rollout replica killed in the middle of a generation round, or its engine-core process: the round
still completes, with every prompt."""

import os
import signal
import threading
import time

import pytest
import ray
from ray import serve

from dapo_ray.config import RolloutConfig
from dapo_ray.pipeline import SamplingSpec, ScoringSpec, generate_round
from dapo_ray.rollout.deployment import APP_NAME, deploy_rollout
from dapo_ray.tasks import RewardSpec
from dapo_ray.weights import create_store

pytestmark = pytest.mark.integration


def _replica_actors() -> list[str]:
    """Names of the live rollout replicas' actors (Serve names them SERVE_REPLICA::<app>#<deployment>#<id>)."""
    named = ray.util.list_named_actors(all_namespaces=True)
    return [a["name"] for a in named if a["namespace"] == "serve" and a["name"].startswith(f"SERVE_REPLICA::{APP_NAME}#")]


def _busy_replica(handle, min_calls: int, timeout_s: float = 120.0) -> str:
    """The actor name of a replica with at least `min_calls` generate calls in flight."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for stats in [handle.stats.remote().result() for _ in range(4)]:  # Serve spreads these over replicas
            if stats["in_flight"] >= min_calls:
                return stats["actor"]
        time.sleep(0.1)
    raise TimeoutError("no replica got busy")


def _start_round(count: int) -> tuple[list[dict], threading.Thread, list]:
    """`count` prompts, and a thread running one generation round of them (4 samples, 2 prompts a call, 4
    calls at a time) whose groups land in the returned list."""
    prompts = [{"uid": str(i), "draw": f"0:{i}", "prompt_ids": [5 + i % 7, 6, 7, 8], "ground_truth": "1"}
               for i in range(count)]  # fmt: skip
    scoring = ScoringSpec(RewardSpec("dapo"), 24, True, 8, 1.0, True, 1e-6, True)
    out: list = []
    rounds = threading.Thread(target=lambda: out.append(generate_round(
        prompts, APP_NAME, SamplingSpec(4, 1.0, 1.0, 24), scoring, prompts_per_call=2, max_concurrency=4)))  # fmt: skip
    rounds.start()
    return prompts, rounds, out


def test_a_round_completes_when_a_replica_dies_mid_round(tiny_model_dir, ray_cluster):
    store = create_store("weights-replica-loss")
    cfg = RolloutConfig(model_path=str(tiny_model_dir), n=4, max_response_length=24, num_replicas=2,
                        min_replicas=2, max_replicas=2, enforce_eager=True, dtype="float32")  # fmt: skip
    try:
        handle = deploy_rollout(cfg, max_model_len=128, store_name="weights-replica-loss", seed=1)
        assert len(_replica_actors()) == 2
        prompts, rounds, out = _start_round(96)
        victim = _busy_replica(handle, min_calls=2)  # these calls fail with it: they must be sent again
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        rounds.join(timeout=300)
        assert not rounds.is_alive() and out, "the round did not complete"
        groups = out[0]
        assert sorted(g["draw"] for g in groups) == sorted(p["draw"] for p in prompts)  # each prompt once
        assert all(len(g["response_ids"]) == 4 for g in groups)
        assert victim not in _replica_actors()
    finally:
        serve.delete(APP_NAME)
        ray.kill(store)


def _engine_core_pid(replica_pid: int) -> int:
    """The pid of the engine-core process a replica started (vLLM titles it "VLLM::EngineCore")."""
    import psutil

    cores = [p for p in psutil.Process(replica_pid).children()
             if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())]  # fmt: skip
    assert len(cores) == 1, [(p.pid, p.name()) for p in psutil.Process(replica_pid).children()]
    return cores[0].pid


@pytest.mark.timeout(600, func_only=True)
def test_a_round_completes_when_a_replicas_engine_core_dies_mid_round(tiny_model_dir, ray_cluster):
    """The engine core in a process of its own, as on GPU: killed mid-round, it leaves the replica actor
    alive with every call stuck or failing. The replica fails Serve's health check and is replaced, its
    calls are sent again, and the round completes with each prompt once."""
    store = create_store("weights-core-loss")
    cfg = RolloutConfig(model_path=str(tiny_model_dir), n=4, max_response_length=24, num_replicas=1,
                        min_replicas=1, max_replicas=1, enforce_eager=True, dtype="float32",
                        engine_core_process=True)  # fmt: skip
    try:
        handle = deploy_rollout(cfg, max_model_len=128, store_name="weights-core-loss", seed=1)
        [victim] = _replica_actors()
        prompts, rounds, out = _start_round(48)
        _busy_replica(handle, min_calls=2)
        replica_pid = handle.stats.remote().result()["pid"]
        t0 = time.time()
        os.kill(_engine_core_pid(replica_pid), signal.SIGKILL)
        # The driver's weight-sync probe on the dead engine ends, and fails as a rollout call does: with the
        # retryable EngineDead, or with the replica's death once Serve replaces it (the driver then leaves
        # that step's sync unchecked and goes on: tests/unit/test_sync_check.py), never with vLLM's own error.
        with pytest.raises(Exception) as probe:
            handle.sequence_logprobs.remote([5, 6, 7, 8]).result(timeout_s=120)
        assert "EngineDead" in repr(probe.value) or isinstance(probe.value, ray.exceptions.RayActorError), repr(probe.value)
        rounds.join(timeout=240)
        assert not rounds.is_alive() and out, "the round did not complete"
        print(f"the round completed {time.time() - t0:.0f}s after the engine core was killed")
        groups = out[0]
        assert sorted(g["draw"] for g in groups) == sorted(p["draw"] for p in prompts)  # each prompt once
        assert all(len(g["response_ids"]) == 4 for g in groups)
        assert victim not in _replica_actors() and len(_replica_actors()) == 1  # replaced
    finally:
        serve.delete(APP_NAME)
        ray.kill(store)
