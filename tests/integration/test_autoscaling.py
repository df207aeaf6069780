"""Serve autoscaling of the rollout fleet during a training run: load makes Serve go from 1 to 2 replicas,
the added replica samples from the current policy from its first call on, the fleet shrinks back to 1
when the load drops, and the run's prompt ledger balances throughout."""

import asyncio
import threading
import time

import pytest
import ray
from ray import serve
from test_end_to_end import COMMON, TINY_CFG, assert_ledger_balances

from dapo_ray.config import load_config
from dapo_ray.driver import run
from dapo_ray.rollout.deployment import APP_NAME, _live_replicas

pytestmark = pytest.mark.integration

# Serve reacts within seconds here (on a cluster the defaults are 30 s up, 120 s down, 30 s look-back);
# the look-back window must outlast the 10 s at which replicas and handles report their calls in flight.
# The run alone keeps at most max_replicas x 2 = 4 calls in flight: one replica at 4 per replica.
AUTOSCALING = ["rollout.num_replicas=1", "rollout.min_replicas=1", "rollout.max_replicas=2",
               "rollout.target_ongoing_requests=4", "rollout.upscale_delay_s=1", "rollout.downscale_delay_s=5",
               "rollout.look_back_period_s=12"]  # fmt: skip
# Another user's calls kept in flight on the same deployment: (12 + the run's) / 4 per replica -> 2 replicas.
# Serve decides on the mean over the look-back window, so the calls come from an asyncio actor of their own
# that re-issues each the moment it returns: threads of this process, which also runs the driver, left gaps
# between calls that brought the mean down to 5 with 8 callers, a hair above the threshold of 4.
EXTRA_CALLS = 12


@ray.remote(num_cpus=0)
class Load:
    """Keeps `calls` generate calls in flight on the rollout deployment until `stop()`."""

    def __init__(self, calls: int) -> None:
        self.calls, self.stopping, self.done = calls, False, 0

    async def run(self) -> int:
        handle = serve.get_deployment_handle("rollout", app_name=APP_NAME)

        async def caller() -> None:
            while not self.stopping:
                await handle.generate.remote([[5, 6, 7, 8]] * 16, 8, 1.0, 1.0, 24)
                self.done += 1

        await asyncio.gather(*(caller() for _ in range(self.calls)))
        return self.done

    def stop(self) -> None:
        self.stopping = True


def _wait(predicate, timeout_s: float, what: str, done: threading.Event) -> None:
    deadline = time.time() + timeout_s
    while not predicate():
        if done.is_set():
            raise AssertionError(f"the run ended before {what}; {_serve_view()}")
        if time.time() > deadline:
            raise TimeoutError(f"timed out waiting until {what}; {_serve_view()}")
        time.sleep(0.5)


def _serve_view() -> str:
    """What Serve's controller saw when a wait failed: the replicas by state and the ongoing requests its
    autoscaler averaged (the figure it compares with target_ongoing_requests x replicas)."""
    from ray.serve._private.common import DeploymentID
    from ray.serve.context import _get_global_client

    try:
        dep = serve.status().applications[APP_NAME].deployments["rollout"]
        controller = _get_global_client()._controller
        total = ray.get(controller._get_total_num_requests_for_deployment_for_testing.remote(
            DeploymentID(name="rollout", app_name=APP_NAME)), timeout=10)  # fmt: skip
        return f"Serve: {dict(dep.replica_states)}, {dep.status}, ongoing requests averaged {total:.2f}"
    except Exception as e:  # noqa: BLE001 - a diagnostic only
        return f"Serve's view unavailable: {e!r}"


def _published_version(store_name: str) -> int:
    try:
        store = ray.get_actor(store_name, namespace="dapo-ray")
    except ValueError:
        return -1
    return ray.get(store.latest.remote())[0]


def test_the_rollout_fleet_follows_the_load_during_training(tiny_model_dir, ray_cluster, tmp_path):
    out = tmp_path / "autoscaled"
    cfg = load_config(TINY_CFG, COMMON + AUTOSCALING + [
        f"rollout.model_path={tiny_model_dir}", "trainer.total_steps=80", "algorithm.max_policy_lag=0",
        f"trainer.output_dir={out}"])  # fmt: skip
    result: dict = {}
    done = threading.Event()

    def train() -> None:
        try:
            result["summary"] = run(cfg)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            result["error"] = e
        finally:
            done.set()

    trainer = threading.Thread(target=train)
    trainer.start()
    load = Load.remote(EXTRA_CALLS)
    fleet: list[tuple[int, int]] = []  # (published version, live replicas), as the test saw it
    try:
        _wait(lambda: _published_version(f"weights-{out.name}") >= 2, 300, "training is under way", done)
        assert _live_replicas() == 1
        load_done = load.run.remote()
        _wait(lambda: _live_replicas() == 2, 180, "Serve added a replica under load", done)
        fleet.append((_published_version(f"weights-{out.name}"), 2))
        # Keep the load until the run has synced a few versions with both replicas.
        v = fleet[-1][0]
        _wait(lambda: _published_version(f"weights-{out.name}") >= v + 4, 180, "the run trained on", done)
        ray.get(load.stop.remote())
        assert ray.get(load_done, timeout=120) > 0
        _wait(lambda: _live_replicas() == 1, 180, "Serve removed the idle replica", done)
        fleet.append((_published_version(f"weights-{out.name}"), 1))
    finally:
        ray.get(load.stop.remote())
        trainer.join(timeout=900)
        ray.kill(load)
    assert "error" not in result, result.get("error")
    summary = result["summary"]
    assert summary["steps"] == 80, "the run must outlast the scale-down"

    log = summary["steps_log"]
    replicas = [e["metrics"]["weight_sync/replicas"] for e in log]
    # The run saw the fleet grow and shrink: 1 ... 2 ... 1, every replica synced at every step.
    first_two = replicas.index(2)
    assert replicas[0] == 1 and 1 in replicas[first_two:], replicas
    for e in log:
        assert set(e["replica_versions"].values()) == {e["step"]}
    # Strictly on-policy (max_policy_lag 0): every group, the added replica's first included, was sampled
    # by the version the step trained from.
    samplers: set[str] = set()
    for e in log:
        assert e["sampled_by"] and {v for _, v in e["sampled_by"]} == {e["step"] - 1}
        samplers |= {r for r, _ in e["sampled_by"]}
        assert e["metrics"]["rollout/policy_version_lag_max"] == 0
    assert len(samplers) == 2, "the added replica never sampled for the run"
    assert max(e["metrics"]["rollout/replicas_sampling"] for e in log) == 2
    assert_ledger_balances(summary)
