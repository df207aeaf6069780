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


@ray.remote(num_cpus=0)
def read_published(store_name: str, version: int, serial: int) -> float | None:
    """What a vLLM worker does: given plain values only, ask the store for the reference and fetch it."""
    ref_box = ray.get(weights.get_store(store_name).weights.remote(version, serial))
    return None if ref_box[0] is None else float(dict(weights.fetch(ref_box))["w"][0, 0])


def store_name(request) -> str:
    return f"test-store-{request.node.name}"


@pytest.fixture
def store(ray_cluster, request):
    s = weights.create_store(store_name(request), keep=2)
    yield s
    ray.kill(s)


def test_a_waiting_replica_gets_the_new_version_as_soon_as_it_is_published(store):
    publisher = Publisher.remote()
    ray.get(publisher.__ray_ready__.remote())  # its start-up (seconds on a loaded machine) is not timed
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


def test_a_worker_given_plain_values_fetches_the_publish_while_the_store_holds_it(store, request):
    """A publish is named by (version, serial); another process fetches it by that name from the store
    (the reference keeps its owner, the publisher) until later publishes drop it."""
    name = store_name(request)
    publisher = Publisher.remote()
    for v in (1, 2):
        ray.get(publisher.publish.remote(store, v, float(v)))
    assert ray.get([read_published.remote(name, 1, 1), read_published.remote(name, 2, 2)]) == [1.0, 2.0]
    assert ray.get(read_published.remote(name, 2, 1)) is None  # not that publish of version 2
    ray.get(publisher.publish.remote(store, 3, 3.0))  # keep=2: version 1 is dropped
    assert ray.get(read_published.remote(name, 1, 1)) is None
    ray.get(publisher.publish.remote(store, 2, 2.5))  # a trainer restarted from step 2's checkpoint
    assert ray.get(store.weights.remote(2, 2)) == [None]  # version 2 as first published is gone
    assert ray.get(store.weights.remote(3, 3)) == [None]  # and so is the step after it
    assert ray.get(read_published.remote(name, 2, 4)) == 2.5
