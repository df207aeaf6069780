"""The weight store on a real Ray cluster: push (long poll), fetch in another process, sync barrier."""

import time

import pytest
import ray
import torch

from dapo_ray import weights


@ray.remote(num_cpus=0)
class Publisher:
    """Stands where the trainer ranks stand: it owns the published objects. Buckets of 64 KiB: "w" (256 KiB)
    alone, "b" in a second bucket."""

    def publish(self, store, version: int, value: float) -> int:
        state = {"w": torch.full((256, 256), value), "b": torch.arange(5.0)}
        return weights.publish(store, version, state, bucket_mb=1 / 16)


@ray.remote(num_cpus=0)
def read_published(store_name: str, version: int, serial: int) -> float | None:
    """What a vLLM worker does: given plain values only, ask the store for the buckets and fetch them."""
    try:
        out = dict(weights.fetch(weights.get_store(store_name), version, serial))
    except weights.Superseded:
        return None
    assert torch.equal(out["b"], torch.arange(5.0))
    return float(out["w"][0, 0])


def store_name(request) -> str:
    return f"test-store-{request.node.name}"


@pytest.fixture
def store(ray_cluster, request):
    s = weights.create_store(store_name(request), keep=2)
    yield s
    ray.kill(s)


def test_a_waiting_replica_gets_the_new_version_as_soon_as_it_is_published(store, request):
    publisher = Publisher.remote()
    ray.get(publisher.__ray_ready__.remote())  # its start-up (seconds on a loaded machine) is not timed
    waiting = store.wait_newer.remote(0, 30.0)
    time.sleep(1.0)
    t0 = time.time()
    nbytes = ray.get(publisher.publish.remote(store, 1, 3.0))
    version, box, serial = ray.get(waiting)
    assert (version, box, serial) == (1, [2], 1) and time.time() - t0 < 5.0  # two buckets; not the 30 s timeout
    assert nbytes == 256 * 256 * 4 + 5 * 4
    assert ray.get(read_published.remote(store_name(request), 1, 1)) == 3.0  # another process reads it


def test_wait_newer_times_out_with_the_current_version(store):
    assert ray.get(store.wait_newer.remote(0, 0.2)) == (0, [None], 0)


def test_the_store_keeps_the_last_versions_only(store, request):
    publisher = Publisher.remote()
    for v in (1, 2, 3):
        ray.get(publisher.publish.remote(store, v, float(v)))
    assert ray.get(store.kept.remote()) == [2, 3]
    version, box, serial = ray.get(store.latest.remote())
    assert (version, serial) == (3, 3) and ray.get(read_published.remote(store_name(request), 3, 3)) == 3.0


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


def test_a_restarted_trainer_takes_the_replicas_back_to_its_checkpoint(store, request):
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
    assert (version, serial) == (2, 5) and ray.get(read_published.remote(store_name(request), 2, 5)) == 2.5
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
    assert ray.get(store.bucket.remote(2, 2, 0, 0.2)) == [None]  # version 2 as first published is gone
    assert ray.get(store.bucket.remote(3, 3, 0, 0.2)) == [None]  # and so is the step after it
    assert ray.get(read_published.remote(name, 2, 4)) == 2.5


def test_a_replica_gets_the_first_bucket_while_the_rest_is_still_being_published(store):
    """A publish starts with its first bucket: `wait_newer` wakes then, and `bucket` waits for the others
    (as a replica pulls bucket k while the trainer gathers bucket k + 1)."""
    owner = Publisher.remote()
    ray.get(owner.__ray_ready__.remote())
    first = ray.put((([weights.TensorSpec("w", "float32", (2,), 0)]), torch.ones(2).view(torch.uint8).numpy()))
    ray.get(store.add_bucket.remote(1, 77, 0, 2, [first]))
    assert ray.get(store.wait_newer.remote(0, 5.0)) == (1, [2], 1)
    later = store.bucket.remote(1, 1, 1, 30.0)
    assert ray.get(store.bucket.remote(1, 1, 0, 1.0))[0] is not None
    ready, _ = ray.wait([later], timeout=0.5)
    assert not ready  # bucket 1 is not in yet
    second = ray.put((([weights.TensorSpec("b", "float32", (1,), 0)]), torch.zeros(1).view(torch.uint8).numpy()))
    ray.get(store.add_bucket.remote(1, 77, 1, 2, [second]))
    assert ray.get(later)[0] is not None
    out = dict(weights.fetch(store, 1, 1))
    assert out["w"].tolist() == [1.0, 1.0] and out["b"].tolist() == [0.0]


def _bucket(name: str, value: float) -> ray.ObjectRef:
    return ray.put(([weights.TensorSpec(name, "float32", (2,), 0)], torch.full((2,), float(value)).view(torch.uint8).numpy()))


def test_a_bucket_stream_hands_out_each_bucket_as_it_comes_and_says_when_it_stopped_short(store):
    """What an idle replica's workers feed vLLM's loader: bucket 0's tensors before bucket 1 exists; a
    publish dropped half-way (a trainer restarted from an older checkpoint) ends the stream incomplete."""
    import threading

    for version, complete in ((1, True), (2, False)):
        ray.get(store.add_bucket.remote(version, 100 + version, 0, 2, [_bucket("w", version)]))
        serial = ray.get(store.latest.remote())[2]
        stream = weights.BucketStream(store, version, serial, timeout_s=30.0)
        got: list = []
        reader = threading.Thread(target=got.extend, args=(stream,))
        reader.start()
        deadline = time.time() + 10
        while not got and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        assert [name for name, _ in got] == ["w"] and reader.is_alive()  # waiting for bucket 1
        if complete:
            ray.get(store.add_bucket.remote(version, 100 + version, 1, 2, [_bucket("b", version)]))
        else:
            ray.get(store.add_bucket.remote(0, 999, 0, 1, [_bucket("w", 0.0)]))  # restarted at version 0
        reader.join(10)
        assert not reader.is_alive()
        assert stream.count == 2 and stream.complete is complete
        assert [name for name, _ in got] == (["w", "b"] if complete else ["w"]) and stream.loaded == len(got)
        assert got[0][1].tolist() == [float(version)] * 2
    assert weights.BucketStream(store, 2, serial).count is None  # no longer held


class _Asking:
    """The store seen through a replica's worker, noting which buckets it asked for (in this process)."""

    def __init__(self, store) -> None:
        self.asked: list[int] = []
        self.bucket_count = store.bucket_count
        asked, bucket = self.asked, store.bucket

        class Bucket:
            def remote(self, version, serial, index, timeout_s):
                asked.append(index)
                return bucket.remote(version, serial, index, timeout_s)

        self.bucket = Bucket()


def test_a_bucket_stream_pulls_the_next_buckets_while_the_current_one_is_loaded(store):
    """While the caller still holds bucket k's last tensor (vLLM's loader copying it to the device), the
    stream has asked the store for buckets k+1 .. k+AHEAD and pulled them to this node, so their transfer
    overlaps the load; it asks for no bucket beyond those."""
    for k in range(5):
        ray.get(store.add_bucket.remote(1, 7, k, 5, [_bucket(f"t{k}", k)]))
    asking = _Asking(store)
    stream = weights.BucketStream(asking, 1, 1, timeout_s=30.0)
    tensors = iter(stream)
    name, _ = next(tensors)  # bucket 0's only tensor, so its last: held, as a load in progress holds it
    ahead = list(range(1 + weights.AHEAD))
    deadline = time.time() + 10
    while sorted(asking.asked) != ahead and time.time() < deadline:
        time.sleep(0.01)
    assert name == "t0" and sorted(asking.asked) == ahead
    time.sleep(0.5)
    assert sorted(asking.asked) == ahead  # no further: the node holds at most AHEAD buckets beyond the loaded one
    assert [n for n, _ in tensors] == ["t1", "t2", "t3", "t4"] and stream.complete and stream.loaded == 5
    assert asking.asked == list(range(5))


def test_each_rank_sizes_its_host_buffers_for_the_buckets_it_owns(store):
    """Two ranks publish one version: the 256 KiB bucket's owner holds one buffer of that size, the owner of
    the 20-byte bucket one of 64 bytes (not two of the largest bucket each); the publish is whole."""
    groups = [[("w", torch.full((256, 256), 2.0))], [("b", torch.arange(5.0))]]
    sizes = [weights.aligned(t.numel() * t.element_size()) for (_, t), in groups]
    for rank, room in ((1, 64), (0, 256 * 256 * 4)):
        weights.send_buckets(store, 1, 55, groups, sizes, 1 / 16, rank=rank, world=2)
        assert list(weights._BUFFERS) == [(room, False, 1)]
    out = dict(weights.fetch(store, 1, 1))
    assert float(out["w"][0, 0]) == 2.0 and torch.equal(out["b"], torch.arange(5.0))
