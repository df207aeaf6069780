"""Serve autoscaling of the rollout replicas under generation load: 1 -> 2 replicas while calls pile up,
the added replica serving the latest published policy before its first sample, and back to 1."""

import threading
import time

import pytest
import ray
from ray import serve
from safetensors.torch import load_file

from dapo_ray import weights
from dapo_ray.config import RolloutConfig
from dapo_ray.rollout.deployment import APP_NAME, _live_replicas, deploy_rollout

pytestmark = pytest.mark.integration


@ray.remote(num_cpus=0)
class Publisher:
    """Holds a published version, as trainer rank 0 does."""

    def publish(self, store, version: int, state: dict) -> int:
        return weights.publish(store, version, state)


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while not predicate():
        if time.time() > deadline:
            raise TimeoutError(what)
        time.sleep(0.5)


def test_replicas_scale_up_under_load_on_the_latest_policy_and_back_down(tiny_model_dir, ray_cluster):
    store = weights.create_store("weights-autoscaling")
    cfg = RolloutConfig(model_path=str(tiny_model_dir), n=8, max_response_length=24, num_replicas=1, min_replicas=1,
                        max_replicas=2, target_ongoing_requests=1, upscale_delay_s=1, downscale_delay_s=2,
                        enforce_eager=True, dtype="float32")  # fmt: skip
    try:
        handle = deploy_rollout(cfg, max_model_len=128, store_name="weights-autoscaling", seed=1)
        assert _live_replicas() == 1
        # A new policy version, as a trainer step would publish it.
        original = load_file(str(tiny_model_dir / "model.safetensors"))
        state = {k: v * 1.01 if v.is_floating_point() else v for k, v in original.items()}
        publisher = Publisher.remote()
        ray.get(publisher.publish.remote(store, 1, state))
        _wait(lambda: handle.stats.remote().result()["version"] == 1, 60, "the replica did not load version 1")

        versions, stop = [], threading.Event()

        def load() -> None:  # keep 6 calls in flight: 6 ongoing requests against a target of 1 per replica
            while not stop.is_set():
                v, _ = handle.generate.remote([[5, 6, 7, 8]] * 16, 8, 1.0, 1.0, 24).result()
                versions.append(v)

        workers = [threading.Thread(target=load) for _ in range(6)]
        for w in workers:
            w.start()
        try:
            _wait(lambda: _live_replicas() == 2, 180, "Serve did not add a replica under load")
            seen: dict[str, dict] = {}

            def both_answered() -> bool:
                s = handle.stats.remote().result()
                seen[s["actor"]] = s
                return len(seen) == 2

            _wait(both_answered, 60, "the added replica did not answer")
            time.sleep(3.0)  # the added replica takes calls
        finally:
            stop.set()
            for w in workers:
                w.join(timeout=120)
        # Every sample, the added replica's included, came from the published version.
        assert versions and set(versions) == {1}
        assert {s["version"] for s in seen.values()} == {1}
        assert set(ray.get(store.replica_versions.remote()).values()) == {1}
        _wait(lambda: _live_replicas() == 1, 180, "Serve did not remove the idle replica")
    finally:
        serve.delete(APP_NAME)
        ray.kill(store)
