"""A trainer worker killed in the middle of a step: Ray Train (FailureConfig, trainer.max_failures)
restarts the worker group from the latest checkpoint, the driver goes back to the data cursor and carried
groups saved with it, the rollout replicas go back to its weights, and the run ends as configured."""

import json
import os
import signal
import threading
import time

import pytest
import ray
from test_end_to_end import COMMON, TINY_CFG

from dapo_ray.config import load_config
from dapo_ray.driver import run
from dapo_ray.trainer.channel import Channel
from dapo_ray.weights import NAMESPACE

pytestmark = pytest.mark.integration

STEPS, SAVE_EVERY, KILL_IN_STEP = 6, 2, 4  # the checkpoint of step 2 is the latest when step 4 dies


def _trainer_worker_pids() -> list[int]:
    """The live Ray Train workers' processes, from the cluster's actor table."""
    from ray._private import state

    return [a["Pid"] for a in state.actors().values()
            if a["ActorClassName"] == "RayTrainWorker" and a["State"] == "ALIVE"]  # fmt: skip


def test_a_trainer_worker_killed_mid_step_restarts_from_the_last_checkpoint(tiny_model_dir, ray_cluster, tmp_path):
    out = tmp_path / "restarted"
    cfg = load_config(TINY_CFG, COMMON + [
        f"rollout.model_path={tiny_model_dir}", f"trainer.total_steps={STEPS}", f"trainer.save_every={SAVE_EVERY}",
        "trainer.max_failures=1", f"trainer.output_dir={out}"])  # fmt: skip
    result: dict = {}

    def train() -> None:
        try:
            result["summary"] = run(cfg)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            result["error"] = e

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        deadline = time.time() + 600
        channel = None
        while channel is None and time.time() < deadline and trainer.is_alive():
            try:
                channel = ray.get_actor(f"channel-{out.name}", namespace=NAMESPACE)
            except ValueError:
                time.sleep(0.5)
        assert channel is not None, result.get("error", "the run's channel never appeared")
        # Both workers have taken step 4's shard: they are in that step (its statistics are not back yet).
        while min(ray.get(channel.shards_taken.remote())) < KILL_IN_STEP:
            assert time.time() < deadline and trainer.is_alive(), result.get("error", "timed out")
            time.sleep(0.05)
        pids = _trainer_worker_pids()
        assert len(pids) == 2
        os.kill(pids[-1], signal.SIGKILL)
    finally:
        trainer.join(timeout=900)
    assert "error" not in result, result.get("error")
    summary = result["summary"]

    assert summary["steps"] == STEPS
    # Step 4 died and left no entry; training went back to step 2 and on from there: step 3, trained
    # after the checkpoint, is trained again.
    (restart,) = summary["restarts"]
    assert (restart["failed_at_step"], restart["resumed_step"]) == (KILL_IN_STEP, SAVE_EVERY)
    logged = [e["step"] for e in summary["steps_log"]]
    assert logged == [*range(1, KILL_IN_STEP), *range(SAVE_EVERY + 1, STEPS + 1)]
    # The data cursor went back to the one saved with that checkpoint.
    saved = [json.loads(p.read_text()) for p in (out / "ray_train" / out.name).glob("checkpoint_*/driver_state.json")]
    (at_2,) = [s for s in saved if s["step"] == SAVE_EVERY]
    assert restart["cursor"] == at_2["cursor"] and restart["carried_groups"] == len(at_2["filler"]["kept"])
    for e in summary["steps_log"]:
        # Every replica serves the step's weights, exactly the trainer's (the replicas went back from
        # version 3 to the checkpoint's 2, then on) ...
        assert set(e["replica_versions"].values()) == {e["step"]}
        assert e["metrics"]["weight_sync/logprob_max_diff"] < 1e-4
        # ... and nothing sampled by the abandoned versions 3 and 4 came back after the restart (groups
        # older than the lag bound may come back from the stream; they are dropped, not trained).
        versions = {v for _, v in e["sampled_by"]}
        assert versions and all(v <= e["step"] - 1 for v in versions)
        assert e["metrics"]["rollout/policy_version_lag_max"] <= cfg.algorithm.max_policy_lag
    # The steps trained again drew from where the checkpoint left off (the cursor went back): the prompts
    # then in the rollout stream first, then the cursor's next (with generation rounds: exactly the prompts
    # the lost steps drew). No prompt was trained twice among the steps that count; the ledger since the
    # restart balances.
    again = len(summary["steps_log"]) - (STEPS - SAVE_EVERY)
    lost, redone = summary["steps_log"][SAVE_EVERY:again], summary["steps_log"][again : again + KILL_IN_STEP - 1 - SAVE_EVERY]
    replayed, start = set(at_2["in_flight"]), (at_2["cursor"]["epoch"], at_2["cursor"]["index"])
    for e in redone:
        assert all(d in replayed or _draw(d) >= start for d in e["draws"]["trained"] + e["draws"]["filtered"])
    if not cfg.rollout.stream:
        assert [_first_draw(e) for e in lost] == [_first_draw(e) for e in redone]
    trained = [d for e in summary["steps_log"][:SAVE_EVERY] + summary["steps_log"][again:] for d in e["draws"]["trained"]]
    assert len(trained) == len(set(trained))
    last = summary["steps_log"][-1]["metrics"]
    parts = ("trained", "filtered", "stale_dropped", "surplus_dropped", "carried", "in_flight")
    assert last["ledger/taken"] == sum(last[f"ledger/{k}"] for k in parts)
    assert (out / "final_model" / "model.safetensors").is_file()


def _first_draw(entry: dict) -> tuple[int, int]:
    """The step's first prompt taken from the cursor (kept or filtered out), as (epoch, index)."""
    return min(_draw(d) for d in entry["draws"]["trained"] + entry["draws"]["filtered"])


def _draw(draw: str) -> tuple[int, int]:
    epoch, index = draw.split(":")
    return int(epoch), int(index)


def test_shards_for_a_worker_group_that_is_gone_are_dropped(ray_cluster):
    """The driver may queue a step's shards after a restarted group has said "ready" and before it has
    read that message: those shards, and any left for the group before, never reach the new workers."""
    channel = Channel.remote(2)
    try:
        ray.get(channel.put_result.remote({"kind": "ready", "step": 0}))  # the first worker group
        assert ray.get(channel.put_shards.remote(["a0", "a1"], 1))
        assert ray.get(channel.get_shard.remote(0)) == "a0"  # rank 0 takes its shard; rank 1 dies
        ray.get(channel.put_result.remote({"kind": "ready", "step": 0}))  # Ray Train's second group
        assert not ray.get(channel.put_shards.remote(["b0", "b1"], 1))  # sent before reading that "ready"
        assert ray.get(channel.get_result.remote(1.0))["kind"] == "ready"
        assert ray.get(channel.get_result.remote(1.0))["kind"] == "ready"
        assert ray.get(channel.put_shards.remote(["c0", "c1"], 2))
        assert ray.get([channel.get_shard.remote(0), channel.get_shard.remote(1)]) == ["c0", "c1"]
    finally:
        ray.kill(channel)
