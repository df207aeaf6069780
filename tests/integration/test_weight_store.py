"""The weight store on a real Ray cluster: push (long poll), fetch in another process, sync barrier."""

import time

import pytest
import ray
import torch

from dapo_ray import weights


@ray.remote(num_cpus=0)
class Publisher:
    """Stands where trainer rank 0 stands: it owns the published objects."""

    def publish(self, store, version: int, value: float) -> int:
        return weights.publish(store, version, {"w": torch.full((256, 256), value), "b": torch.arange(5.0)})


@ray.remote(num_cpus=0)
def read(ref_box: list) -> float:
    return float(dict(weights.fetch(ref_box))["w"][0, 0])


@pytest.fixture
def store(ray_cluster, request):
    s = weights.create_store(f"test-store-{request.node.name}", keep=2)
    yield s
    ray.kill(s)


def test_a_waiting_replica_gets_the_new_version_as_soon_as_it_is_published(store):
    publisher = Publisher.remote()
    waiting = store.wait_newer.remote(0, 30.0)
    time.sleep(1.0)
    t0 = time.time()
    nbytes = ray.get(publisher.publish.remote(store, 1, 3.0))
    version, box, serial = ray.get(waiting)
    assert (version, serial) == (1, 1) and time.time() - t0 < 5.0  # not the 30 s timeout
    assert nbytes == 256 * 256 * 4 + 5 * 4
    assert ray.get(read.remote(box)) == 3.0  # another process reads it from the object store


def test_wait_newer_times_out_with_the_current_version(store):
    assert ray.get(store.wait_newer.remote(0, 0.2)) == (0, [None], 0)


def test_the_store_keeps_the_last_versions_only(store):
    publisher = Publisher.remote()
    for v in (1, 2, 3):
        ray.get(publisher.publish.remote(store, v, float(v)))
    assert ray.get(store.kept.remote()) == [2, 3]
    version, box, serial = ray.get(store.latest.remote())
    assert (version, serial) == (3, 3) and ray.get(read.remote(box)) == 3.0


def test_wait_synced_returns_when_every_live_replica_acknowledged(store):
    publisher = Publisher.remote()
    ray.get(publisher.publish.remote(store, 1, 1.0))  # serial 1
    ray.get([store.ack.remote("a", 1, 1), store.ack.remote("b", 0, 0)])
    assert ray.get(store.wait_synced.remote(1, 2, 0.3)) is None  # b is behind
    pending = store.wait_synced.remote(1, 2, 30.0)
    t0 = time.time()
    ray.get(store.ack.remote("b", 1, 1))
    assert ray.get(pending) == {"a": 1, "b": 1} and time.time() - t0 < 5.0
    assert ray.get(store.wait_synced.remote(1, 3, 0.3)) is None  # a third replica has not been heard from


def test_a_restarted_trainer_takes_the_replicas_back_to_its_checkpoint(store):
    """Ray Train restarted the workers from the checkpoint of step 2 after they had published 3 and 4:
    version 2 is published again, the later versions are dropped, and a replica is synced to 2 only once
    it serves that new publish, not the version 2 it served before nor the 4 it serves now."""
    publisher = Publisher.remote()
    for v in (1, 2, 3, 4):
        ray.get(publisher.publish.remote(store, v, float(v)))
    ray.get(store.ack.remote("a", 4, 4))
    ray.get(publisher.publish.remote(store, 2, 2.5))  # the checkpoint's weights, serial 5
    assert ray.get(store.kept.remote()) == [2]  # 3 and 4 are dropped
    version, box, serial = ray.get(store.latest.remote())
    assert (version, serial) == (2, 5) and ray.get(read.remote(box)) == 2.5
    assert ray.get(store.wait_newer.remote(4, 0.2))[2] == 5  # a replica on serial 4 is told at once
    assert ray.get(store.wait_synced.remote(2, 1, 0.3)) is None  # "a" still serves version 4
    ray.get(store.ack.remote("a", 2, 3))  # version 2 as first published: not the checkpoint's
    assert ray.get(store.wait_synced.remote(2, 1, 0.3)) is None
    ray.get(store.ack.remote("a", 2, 5))
    assert ray.get(store.wait_synced.remote(2, 1, 0.3)) == {"a": 2}
    ray.get(publisher.publish.remote(store, 3, 3.5))  # training goes on from the checkpoint
    assert ray.get(store.kept.remote()) == [2, 3]
