"""Every worker of an engine reaches the all-reduce that ends a weight load, whatever its own load did:
tensor-parallel peers wait in it for each other, so a worker that raised past it would leave them
waiting for ever. The workers here are stand-ins (no vLLM); the all-reduce records what each joins it
with."""

import pytest
import torch

from dapo_ray.rollout import worker_ext
from dapo_ray.rollout.worker_ext import PARTIAL, WeightLoader


class Worker(WeightLoader):
    """A vLLM worker whose layer-wise reload raises half-way (CUDA out of memory, a tensor that does not
    fit)."""

    model_runner = type("Runner", (), {"get_model": lambda self: None})()
    vllm_config = None

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        next(weights_iterator)
        raise torch.OutOfMemoryError("half-way")


class Stream:
    """`weights.BucketStream` with one bucket in."""

    def __init__(self, store, version, serial, timeout_s):
        self.count, self.complete, self.loaded = 1, True, 1

    def __iter__(self):
        yield "w", torch.zeros(2)


@pytest.fixture
def joined(monkeypatch) -> list[bool]:
    """What this worker joined each all-reduce with, in order."""
    import ray

    from dapo_ray import buckets, weights

    calls: list[bool] = []

    def on_every_worker(ok: bool) -> bool:
        calls.append(ok)
        return ok

    monkeypatch.setattr(worker_ext, "_on_every_worker", on_every_worker)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(weights, "get_store", lambda name: None)
    monkeypatch.setattr(weights, "BucketStream", Stream)
    monkeypatch.setattr(worker_ext, "_whole_publish", lambda *args: [b"bucket"])
    monkeypatch.setattr(buckets, "unpack_bucket", lambda bucket: [("w", torch.zeros(2))])
    return calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_load_that_raises_half_way_is_partial_on_every_worker(joined, monkeypatch, stream):
    monkeypatch.setattr(worker_ext, "_abandon_reload", lambda model, config: None)
    assert Worker().dapo_load_weights("addr", "store", 1, 1, stream=stream) == PARTIAL
    assert joined == [True, False]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_worker_whose_recovery_raises_still_joins_the_all_reduce(joined, monkeypatch, stream):
    """Putting the old layers back raises too: the error goes on to the engine (which is then broken
    until a whole load), but only after this worker told its peers the load is partial."""

    def abandon(model, config):
        raise RuntimeError("could not put the old weights back")

    monkeypatch.setattr(worker_ext, "_abandon_reload", abandon)
    with pytest.raises(RuntimeError, match="put the old weights back"):
        Worker().dapo_load_weights("addr", "store", 1, 1, stream=stream)
    assert joined == [True, False]


def test_a_bucket_that_cannot_be_unpacked_still_joins_the_all_reduce(joined, monkeypatch):
    from dapo_ray import buckets

    def unpack(bucket):
        raise ValueError("a corrupt bucket")

    monkeypatch.setattr(buckets, "unpack_bucket", unpack)
    with pytest.raises(ValueError, match="corrupt"):
        Worker().dapo_load_weights("addr", "store", 1, 1)
    assert joined == [True, False]
