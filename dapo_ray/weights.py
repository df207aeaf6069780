"""Weight transport from the trainer to the rollout replicas, through the Ray object store, streamed in
buckets.

Both sides call this module and nothing else of each other:

* **every trainer rank** puts the buckets it owns (`BucketSender`): a bucket is a run of consecutive
  layers of about `weight_sync.bucket_mb` (`bucket_plan`; a larger layer is a bucket of its own), owned by
  rank `index % world`. Under ZeRO-3 every rank gathers every layer anyway (a collective); the owner
  copies the bucket's tensors into one of two reused host buffers (pinned on GPU), and a thread `ray.put`s
  it (uint8 numpy views: out of band, one copy straight into the node's object store) and hands the
  reference to the run's `WeightStore` (`add_bucket`) while the ranks gather the next bucket. Host copies
  and network egress are spread over the trainer ranks. A rank's buffers are the size of the largest
  bucket *it* owns, and it has one only when it owns one bucket: at 32B on 64 ranks (67 buckets: the
  embedding and the output layer, 1.56 GB each, and 64 decoder layers of 0.98 GB, each above the
  256 MiB bucket size) the three ranks that own two buckets hold 2 x 1.56 or 2 x 0.98 GB, the others
  one 0.98 GB buffer, 13 GB of pinned memory on the first 8-GPU node and 7.8 GB on each other one;
* **each replica** `await store.wait_newer.remote(serial)`: a long poll that returns the moment a newer
  publish *starts* (its first bucket is in), with its version, bucket count and serial;
* **an idle replica** (no call in flight: a strictly on-policy run waiting for the new weights) has its
  engine load each bucket as soon as it is in (`BucketStream`), so the load of bucket k overlaps the
  gather of the next ones and the pull of buckets k+1 .. k+AHEAD to the replica's node, and the version
  is served moments after the last bucket is put;
* **a busy replica** pulls every bucket to its node as soon as it is in, AHEAD + 1 transfers at a time
  (`RolloutServer._prefetch`: object transfer, no shared file system, while the trainer still gathers the
  next buckets and while the engine goes on decoding), then has its engine load the version in one job
  between two decoding steps;
* **each vLLM worker of the replica** takes the buckets' references from the store and maps them from its
  node's object store, and feeds them to vLLM's weight loader. References come from Ray calls only, never
  through vLLM's own messages to its workers (plain pickle, which drops a reference's owner: its `ray.get`
  never returns).

A version is switched atomically: no decoding step runs while a load runs, so no forward pass sees two
versions. A busy replica's worker holds every bucket before it loads the first tensor (a publish dropped
meanwhile, or a bucket whose owner died, loads nothing). An idle replica's streamed load can stop
half-way for the same reasons (in practice only when the trainer died and restarted): its engine then
runs no decoding step, holding every call, until a whole later version has loaded (`Engine.broken`).

Replicas follow the store's publish serial, not the policy version: when Ray Train restarts the trainer
workers from their last checkpoint, they publish that checkpoint's older version, and every replica
must go back to it (the versions published after it belong to steps that are trained again).

A replica the autoscaler starts later asks the store for the latest version before its first request,
so late joiners need nothing pushed to them. The store keeps the last `keep` versions alive (a slow
replica may still be fetching the previous one) and records which version each replica serves, so the
driver can wait until the whole fleet is on the new weights. A bucket lives as long as the rank that put
it (Ray's ownership): a replica that fetches after that rank died waits for the next publish.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import threading
import time
from dataclasses import dataclass

import ray
import torch

from dapo_ray.buckets import TensorSpec, aligned, bucket_plan, copy_into, spec_nbytes, unpack_bucket


class BucketSender:
    """Puts one rank's buckets of one publish in the object store from a thread, while the caller
    gathers the next: at most two host buffers, filled alternately (`buffer()` waits for a free one).

        sender = BucketSender(store, version, publish_id, count, capacity, pinned)
        buf = sender.buffer()               # uint8 host tensor of `capacity` bytes
        ... copy tensors into buf, noting TensorSpecs with their byte offsets ...
        sender.send(index, specs, buf)      # returns at once; the buffer comes back when put
        sender.finish()                     # every bucket put and announced; returns the bytes sent
    """

    def __init__(self, store, version: int, publish_id: int, count: int, capacity: int, pinned: bool = False,
                 buffers: int = 2) -> None:  # fmt: skip
        self.store, self.version, self.publish_id, self.count = store, version, publish_id, count
        self.nbytes = 0
        self._free: queue.Queue = queue.Queue()
        for buf in _host_buffers(capacity, pinned, buffers):
            self._free.put(buf)
        self._work: queue.Queue = queue.Queue()
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="weights-put", daemon=True)
        self._thread.start()

    def buffer(self) -> torch.Tensor:
        buf = self._free.get()
        if self._error:
            raise self._error[0]
        return buf

    def send(self, index: int, specs: list[TensorSpec], buf: torch.Tensor) -> None:
        self._work.put((index, specs, buf))

    def finish(self) -> int:
        self._work.put(None)
        self._thread.join()
        if self._error:
            raise self._error[0]
        return self.nbytes

    def _run(self) -> None:
        pending = []
        while (item := self._work.get()) is not None:
            index, specs, buf = item
            if self._error:
                self._free.put(buf)
                continue
            try:
                used = max((sp.offset + spec_nbytes(sp) for sp in specs), default=0)
                ref = ray.put((specs, buf[:used].numpy()))  # one copy into the object store, out of band
                self._free.put(buf)
                self.nbytes += used
                pending.append(self.store.add_bucket.remote(self.version, self.publish_id, index, self.count, [ref]))
            except BaseException as e:  # noqa: BLE001 - raised in the publishing rank
                self._error.append(e)
                self._free.put(buf)
        try:
            ray.get(pending)
        except BaseException as e:  # noqa: BLE001
            self._error.append(e)


_BUFFERS: dict[tuple[int, bool, int], list[torch.Tensor]] = {}


def _host_buffers(nbytes: int, pinned: bool, count: int) -> list[torch.Tensor]:
    """`count` host buffers of `nbytes`, the same ones from one publish to the next (pinning memory costs
    far more than copying into it); only the latest size is kept."""
    key = (nbytes, pinned, count)
    if key not in _BUFFERS:
        _BUFFERS.clear()
        _BUFFERS[key] = [torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned) for _ in range(count)]
    return _BUFFERS[key]


def send_buckets(store, version: int, publish_id: int, groups: list, sizes: list[int], bucket_mb: float,
                 open_group=None, rank: int = 0, world: int = 1, pinned: bool = False) -> int:  # fmt: skip
    """Publish `groups` (lists of (name, tensor); `sizes[i]`: group i's room in a bucket, `aligned` bytes
    per tensor) as `version`, in buckets of consecutive groups, of which this rank puts those it owns
    (`index % world`); returns the bytes it put. `open_group(i)`, a context manager giving group i's
    (name, tensor) pairs, is entered for every group on every rank, in order (the trainer's ZeRO-3 gather,
    a collective); the tensors are copied into the host buffer inside it. Default: the tensors as given."""
    plan = bucket_plan(sizes, int(bucket_mb * 2**20))
    # Host buffers for the buckets this rank owns only: the largest of them, and one buffer if it owns one.
    owned = [sum(sizes[i] for i in b) for k, b in enumerate(plan) if k % world == rank]
    sender = BucketSender(store, version, publish_id, len(plan), max(owned, default=1), pinned=pinned,
                          buffers=min(2, len(owned)))  # fmt: skip
    for k, bucket in enumerate(plan):
        mine = k % world == rank
        buf, offset, specs = (sender.buffer() if mine else None), 0, []
        for i in bucket:
            with open_group(i) if open_group else contextlib.nullcontext(groups[i]) as members:
                if mine:
                    copied: dict[tuple, TensorSpec] = {}  # a tensor under a second name (tied) is copied once
                    for name, t in members:
                        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
                        if t.numel() and key in copied:
                            specs.append(dataclasses.replace(copied[key], name=name))
                            continue
                        spec, offset = copy_into(buf, offset, name, t)
                        specs.append(spec)
                        copied[key] = spec
                    if pinned:
                        torch.cuda.synchronize()  # the copies into pinned memory are asynchronous
        if mine:
            sender.send(k, specs, buf)
    return sender.finish()


def publish(store, version: int, state: dict[str, torch.Tensor], bucket_mb: float = 256.0,
            publish_id: int | None = None) -> int:  # fmt: skip
    """Publish `state` as `version` from this one process, in buckets (what the trainer's ranks do
    together, `trainer.loop.publish_weights`); returns the bytes sent. The object store holds its own copy
    once this returns, so training may change `state` afterwards."""
    import random

    groups = [[(name, t)] for name, t in state.items()]
    sizes = [aligned(t.numel() * t.element_size()) for _, t in state.items()]
    pid = random.getrandbits(52) if publish_id is None else publish_id
    return send_buckets(store, version, pid, groups, sizes, bucket_mb)


def bucket_refs(store, version: int, serial: int, timeout_s: float = 600.0) -> list | None:
    """The references of every bucket of publish `serial` (policy `version`), in order, waiting for those
    still being published; None when the store does not hold that publish (a later one dropped it)."""
    count = ray.get(store.bucket_count.remote(version, serial))
    if not count:
        return None
    boxes = ray.get([store.bucket.remote(version, serial, k, timeout_s) for k in range(count)])
    refs = [box[0] for box in boxes]
    return None if any(r is None for r in refs) else refs


def fetch(store, version: int, serial: int) -> list[tuple[str, torch.Tensor]]:
    """All tensors of a publish (views of its buckets on this node); raises `Superseded` when the store
    no longer holds it."""
    refs = bucket_refs(store, version, serial)
    if refs is None:
        raise Superseded(f"weight publish {serial} (policy version {version}) is no longer held by the weight store")
    return [item for ref in refs for item in unpack_bucket(ray.get(ref))]


AHEAD = 2
"""Buckets a replica pulls to its node beyond the one its engine loads (`BucketStream`; a busy replica's
`RolloutServer._prefetch` keeps AHEAD + 1 transfers in flight). At 32B a bucket is a decoder layer
(0.98 GB): the transfer of the next two overlaps the load of one, for 3 GB of the node's object store."""


class BucketStream:
    """The tensors of one publish, bucket by bucket, each as soon as it is in (views of the bucket on this
    node): iterate once. `count` is the publish's bucket count, None when the store does not hold it. The
    iteration stops early when the publish is dropped (a later one started: the trainer restarted) or a
    bucket is lost (its rank died); `complete` then stays False. `loaded`: tensors handed out.

    While the caller loads bucket k, a thread asks the store for buckets k+1 .. k+`ahead` (each as soon as
    it is in) and pulls them to this node, so the transfer overlaps the load; it holds no more than that."""

    def __init__(self, store, version: int, serial: int, timeout_s: float = 600.0, ahead: int = AHEAD) -> None:
        self.store, self.version, self.serial, self.timeout_s, self.ahead = store, version, serial, timeout_s, ahead
        self.count = ray.get(store.bucket_count.remote(version, serial)) or None
        self.complete = False
        self.loaded = 0

    def __iter__(self):
        pulled: queue.Queue = queue.Queue()  # references in bucket order; None: publish gone; or an error
        slots = threading.Semaphore(1 + self.ahead)  # the bucket being loaded and those pulled ahead of it
        stop = threading.Event()
        threading.Thread(target=self._pull, args=(pulled, slots, stop), name="weights-pull", daemon=True).start()
        try:
            for _ in range(self.count or 0):
                ref = pulled.get()
                if isinstance(ref, BaseException):  # the store's call failed: raised here, as without the thread
                    raise ref
                if ref is None:
                    return
                try:
                    bucket = ray.get(ref)
                except ray.exceptions.ObjectLostError:
                    return
                for item in unpack_bucket(bucket):
                    self.loaded += 1
                    yield item
                slots.release()
            self.complete = self.count is not None
        finally:
            stop.set()
            slots.release()  # a puller waiting for a slot sees `stop`

    def _pull(self, pulled: queue.Queue, slots: threading.Semaphore, stop: threading.Event) -> None:
        """Bucket by bucket, once a slot is free: its reference from the store (as soon as it is in), then
        its bytes to this node (`ray.wait(fetch_local=True)` pulls without deserializing)."""
        for k in range(self.count or 0):
            slots.acquire()
            if stop.is_set():
                return
            try:
                ref = ray.get(self.store.bucket.remote(self.version, self.serial, k, self.timeout_s))[0]
            except BaseException as e:  # noqa: BLE001 - handed to the iterating thread
                pulled.put(e)
                return
            # Until it is local (a lost object is ready too: its error takes its place), `stop`, or the
            # timeout; the iterating thread's `ray.get` then waits or raises as it would have anyway.
            deadline = time.monotonic() + self.timeout_s
            while ref is not None and not stop.is_set() and time.monotonic() < deadline:
                if ray.wait([ref], fetch_local=True, timeout=1.0)[0]:
                    break
            pulled.put(ref)
            if ref is None:
                return


class Superseded(RuntimeError):
    """The store no longer holds the publish asked for: later publishes dropped it (more than `keep`
    versions since, or a trainer restarted from a checkpoint). Nothing was loaded; load the latest."""


@dataclass
class _Publish:
    version: int
    serial: int
    count: int
    refs: dict[int, ray.ObjectRef]


@ray.remote(num_cpus=0)
class WeightStore:
    """The published weights (version, buckets, serial) and what each replica serves."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.version = 0
        self.serial = 0  # publishes so far
        self.publishes: dict[int, _Publish] = {}  # publish id -> its buckets so far
        self.latest_id: int | None = None
        self.serials: dict[int, int] = {}  # version -> serial of its latest publish
        self.replicas: dict[str, tuple[int, int, float]] = {}  # replica -> (version, serial, time of last ack)
        self.load_s: dict[str, float] = {}  # replica -> seconds its latest load took
        self.peak = 0.0  # GiB: the most memory a replica has held
        self.changed = asyncio.Condition()

    async def add_bucket(self, version: int, publish_id: int, index: int, count: int, ref_box: list) -> None:
        """Bucket `index` of `count` of publish `publish_id` (policy `version`); the first bucket of a new
        publish starts it (a new serial, which wakes `wait_newer`). A version older than the latest is a
        trainer restarted from a checkpoint, and the versions after it are dropped."""
        async with self.changed:
            pub = self.publishes.get(publish_id)
            if pub is None:
                self.serial += 1
                self.version = version
                pub = self.publishes[publish_id] = _Publish(version, self.serial, count, {})
                self.latest_id = publish_id
                self.serials[version] = self.serial
                self.serials = {v: x for v, x in self.serials.items() if v <= version}
                for pid in [p for p, x in self.publishes.items() if x.version <= version - self.keep or x.version > version
                            or (x.version == version and p != publish_id)]:  # fmt: skip
                    del self.publishes[pid]  # its objects are freed once no replica still reads them
            pub.refs[index] = ref_box[0]
            self.changed.notify_all()

    def _held(self, version: int, serial: int) -> _Publish | None:
        return next((p for p in self.publishes.values() if p.version == version and p.serial == serial), None)

    async def kept(self) -> list[int]:
        """Versions whose weights are still held."""
        return sorted({p.version for p in self.publishes.values()})

    async def latest(self) -> tuple[int, list, int]:
        """(version, [bucket count], serial); ([None] and serial 0 before the first publish)."""
        pub = self.publishes.get(self.latest_id)
        return self.version, [None if pub is None else pub.count], self.serial

    async def bucket_count(self, version: int, serial: int) -> int | None:
        pub = self._held(version, serial)
        return None if pub is None else pub.count

    async def bucket(self, version: int, serial: int, index: int, timeout_s: float) -> list:
        """[reference] of bucket `index` of publish `serial` of `version`, as soon as it is in; [None] if
        the store does not hold that publish (a later one dropped it) or after `timeout_s`."""
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(
                    lambda: (p := self._held(version, serial)) is None or index in p.refs), timeout_s)  # fmt: skip
            except TimeoutError:
                return [None]
            pub = self._held(version, serial)
            return [None if pub is None else pub.refs[index]]

    async def wait_newer(self, serial: int, timeout_s: float) -> tuple[int, list, int]:
        """`latest()` as soon as a publish starts after `serial`, or after `timeout_s` whatever it is."""
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(lambda: self.serial > serial), timeout_s)
            except TimeoutError:
                pass
        return await self.latest()
    async def ack(self, replica: str, version: int, serial: int, load_s: float = 0.0, peak_gib: float = 0.0) -> None:
        async with self.changed:
            self.replicas[replica] = (version, serial, time.time())
            self.load_s[replica] = load_s
            self.peak = max(self.peak, peak_gib)
            self.changed.notify_all()

    async def peak_gib(self) -> float:
        """The most memory any replica of the run has held (`memory.peak_rss_gib`, sent with its acks)."""
        return self.peak

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


def on_this_node() -> dict:
    """Actor options that keep an actor on the calling process's node. The driver's own actors (the weight
    store, the trainer channel) need no CPU, and Ray places such an actor on any node, a rollout node
    among them: when that node went (a preempted pod, an autoscaler's removal), the run went with it
    (`dapo-ray rehearse --lose rollout@2` showed it). On the driver's node they live as long as the driver."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)}


def create_store(name: str, keep: int = 2) -> ray.actor.ActorHandle:
    """The run's weight store, owned by the driver (it goes away with the driver), on the driver's node."""
    return WeightStore.options(name=name, namespace=NAMESPACE, get_if_exists=True, **on_this_node()).remote(keep)


def get_store(name: str) -> ray.actor.ActorHandle:
    return ray.get_actor(name, namespace=NAMESPACE)
