"""Weight transport from the trainer to the rollout replicas, through the Ray object store.

Both sides call this module and nothing else of each other:

* **trainer rank 0** `publish(store, version, state_dict)`: views every tensor's bytes as a uint8 numpy
  array (no copy), `ray.put`s them as one object (numpy arrays go out of band: one copy, straight into
  the object store, and readers map them without copying) and hands the reference to the run's
  `WeightStore` actor;
* **each replica** `await store.wait_newer.remote(serial)`: a long poll that returns the moment a newer
  publish happens (no polling interval on the critical path), with its version and serial;
* **each vLLM worker of the replica** asks the store for that publish's reference itself
  (`store.weights.remote(version, serial)`) and `fetch`es it: `unpack(ray.get(ref))` yields (name,
  tensor) views of the arrays for vLLM's weight loader. Ray moves the buffer to the worker's node (object
  transfer, no shared file system), once per node however many replicas live there. The reference must
  come from a Ray call, never through vLLM's own messages to its workers (plain pickle, which drops the
  reference's owner: its `ray.get` never returns).

Replicas follow the store's publish serial, not the policy version: when Ray Train restarts the trainer
workers from their last checkpoint, they publish that checkpoint's older version, and every replica
must go back to it (the versions published after it belong to steps that are trained again).

A replica the autoscaler starts later asks the store for the latest version before its first request,
so late joiners need nothing pushed to them. The store keeps the last `keep` versions alive (a slow
replica may still be fetching the previous one) and records which version each replica serves, so the
driver can wait until the whole fleet is on the new weights.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from dataclasses import dataclass

import numpy as np
import ray
import torch


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]


Payload = tuple[list[TensorSpec], list[np.ndarray]]


def pack(state: dict[str, torch.Tensor]) -> Payload:
    """(specs, one uint8 numpy view of each tensor's bytes). No copy: `ray.put` copies each view straight
    into the object store (numpy arrays travel out of band), and numpy holds any dtype's bytes, bfloat16
    included. A staging buffer of the whole model would cost a second full copy per version."""
    specs, arrays = [], []
    for name, t in state.items():
        t = t.detach().contiguous()
        specs.append(TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
        arrays.append(t.view(-1).view(torch.uint8).numpy())
    return specs, arrays


def unpack(payload: Payload) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views of the arrays (no copy); read-only when they came from `ray.get`."""
    specs, arrays = payload
    with warnings.catch_warnings():  # the object store's buffers are read-only; the loader only reads
        warnings.simplefilter("ignore", UserWarning)
        return [
            (s.name, torch.from_numpy(a).view(getattr(torch, s.dtype)).view(s.shape))
            for s, a in zip(specs, arrays, strict=True)
        ]


def publish(store, version: int, state: dict[str, torch.Tensor]) -> int:
    """Put the weights in the object store as `version` and tell the store; returns the bytes sent. The
    object store holds its own copy once this returns, so training may change `state` afterwards."""
    specs, arrays = pack(state)
    ref = ray.put((specs, arrays))
    ray.get(store.publish.remote(version, [ref]))  # in a list: the store keeps the reference, not the value
    return sum(a.nbytes for a in arrays)


def fetch(ref_box: list) -> list[tuple[str, torch.Tensor]]:
    """The weights behind a published reference, on this node."""
    return unpack(ray.get(ref_box[0]))


class Superseded(RuntimeError):
    """The store no longer holds the publish asked for: later publishes dropped it (more than `keep`
    versions since, or a trainer restarted from a checkpoint). Nothing was loaded; load the latest."""


@ray.remote(num_cpus=0)
class WeightStore:
    """The latest published weights (version, object reference, serial) and what each replica serves."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.version = 0
        self.serial = 0  # publishes so far
        self.refs: dict[int, ray.ObjectRef] = {}
        self.serials: dict[int, int] = {}  # version -> serial of its latest publish
        self.replicas: dict[str, tuple[int, int, float]] = {}  # replica -> (version, serial, time of last ack)
        self.load_s: dict[str, float] = {}  # replica -> seconds its latest load took
        self.changed = asyncio.Condition()

    async def publish(self, version: int, ref_box: list) -> None:
        """`version`'s weights; a version older than the latest is a trainer restarted from a checkpoint,
        and the versions after it are dropped."""
        async with self.changed:
            self.serial += 1
            self.version = version
            self.refs[version] = ref_box[0]
            self.serials[version] = self.serial
            for old in [v for v in self.refs if v <= version - self.keep or v > version]:
                del self.refs[old]  # the object is freed once no replica still reads it
            self.serials = {v: s for v, s in self.serials.items() if v <= version}
            self.changed.notify_all()

    async def kept(self) -> list[int]:
        """Versions whose weights are still held."""
        return sorted(self.refs)

    async def latest(self) -> tuple[int, list, int]:
        """(version, [reference], serial); ([None] and serial 0 before the first publish)."""
        return self.version, [self.refs.get(self.version)], self.serial

    async def weights(self, version: int, serial: int) -> list:
        """[reference] of publish `serial` of `version` while the store holds it, else [None] (a later
        publish dropped it, or published `version` again)."""
        held = version in self.refs and self.serials.get(version) == serial
        return [self.refs[version] if held else None]

    async def wait_newer(self, serial: int, timeout_s: float) -> tuple[int, list, int]:
        """`latest()` as soon as a publish comes after `serial`, or after `timeout_s` whatever it is."""
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(lambda: self.serial > serial), timeout_s)
            except TimeoutError:
                pass
        return await self.latest()

    async def ack(self, replica: str, version: int, serial: int, load_s: float = 0.0) -> None:
        async with self.changed:
            self.replicas[replica] = (version, serial, time.time())
            self.load_s[replica] = load_s
            self.changed.notify_all()

    async def load_times(self) -> dict[str, float]:
        """{replica: seconds its latest weight load took} for the live replicas."""
        return {r: self.load_s.get(r, 0.0) for r in self._live()}

    async def replica_versions(self, max_age_s: float = 5.0) -> dict[str, int]:
        """Versions of the replicas heard from in the last `max_age_s` (each acks at least every 2 s), so
        a replica removed by the autoscaler drops out by itself."""
        return {r: v for r, (v, _) in self._live(max_age_s).items()}

    async def wait_synced(self, version: int, replicas: int, timeout_s: float) -> dict[str, int] | None:
        """{replica: version} once at least `replicas` live replicas serve the latest publish of `version`
        or a later publish; None after `timeout_s`."""

        def synced() -> bool:
            live = self._live()
            if version in self.serials:
                return len(live) >= replicas and all(s >= self.serials[version] for _, s in live.values())
            return len(live) >= replicas and all(v >= version for v, _ in live.values())  # never published here

        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(synced), timeout_s)
            except TimeoutError:
                return None
        return {r: v for r, (v, _) in self._live().items()}

    def _live(self, max_age_s: float = 5.0) -> dict[str, tuple[int, int]]:
        now = time.time()
        return {r: (v, s) for r, (v, s, t) in self.replicas.items() if now - t <= max_age_s}


NAMESPACE = "dapo-ray"


def create_store(name: str, keep: int = 2) -> ray.actor.ActorHandle:
    """The run's weight store, owned by the driver (it goes away with the driver)."""
    return WeightStore.options(name=name, namespace=NAMESPACE, get_if_exists=True).remote(keep)


def get_store(name: str) -> ray.actor.ActorHandle:
    return ray.get_actor(name, namespace=NAMESPACE)
