"""The replica's weight follower when a publish is dropped before its workers fetched it: it loads the
store's latest instead and acknowledges that. The engine and the store are stand-ins here (the real ones:
tests/integration/test_engine_weight_load.py, test_weight_store.py)."""

import asyncio
from concurrent.futures import Future

from dapo_ray.rollout.deployment import RolloutServer
from dapo_ray.weights import Superseded


class Remote:
    """`.remote(...)` returning an awaitable, as an actor method's does."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        async def call():
            return self.fn(*args)

        return call()


class Store:
    def __init__(self, latest: tuple) -> None:
        self.acks: list[tuple] = []
        self.latest = Remote(lambda: latest)
        self.ack = Remote(lambda *a: self.acks.append(a))
        self.bucket_count = Remote(lambda version, serial: 0)  # nothing to pull ahead here


class Engine:
    """Loads every publish but those in `dropped`, which fail as the real engine's do."""

    def __init__(self, dropped: set[int]) -> None:
        self.version, self.dropped, self.loads, self.streamed = 1, dropped, [], []
        self.broken = False

    def submit_load(self, store_name: str, version: int, serial: int, interrupt: bool = True,
                    stream: bool = False) -> Future:  # fmt: skip
        self.loads.append((store_name, version, serial))
        self.streamed.append(stream)
        done: Future = Future()
        if serial in self.dropped:
            done.set_exception(Superseded(f"publish {serial} dropped"))
        else:
            self.version = version
            done.set_result(None)
        return done


class Metrics:
    def loaded(self, version: int, seconds: float) -> None:
        pass


def replica(engine: Engine, store: Store, serial: int) -> RolloutServer:
    server = RolloutServer.func_or_class.__new__(RolloutServer.func_or_class)
    server.engine, server.store, server.store_name, server.serial = engine, store, "weights", serial
    server.replica_id, server.metrics, server.load_lock = "replica-a", Metrics(), asyncio.Lock()
    server.partial_rollout, server.load_s, server.in_flight = True, 0.0, 0
    return server


def test_a_dropped_publish_gives_way_to_the_latest():
    engine, store = Engine(dropped={2}), Store(latest=(4, ["ref of 4"], 4))
    server = replica(engine, store, serial=1)
    assert asyncio.run(server._load((2, ["ref of 2"], 2))) == 4
    assert engine.loads == [("weights", 2, 2), ("weights", 4, 4)]
    assert server.serial == 4 and [a[:3] for a in store.acks] == [("replica-a", 4, 4)]


def test_a_publish_already_served_loads_nothing():
    engine, store = Engine(dropped=set()), Store(latest=(1, ["ref of 1"], 1))
    server = replica(engine, store, serial=1)
    assert asyncio.run(server._load((1, ["ref of 1"], 1))) == 1
    assert engine.loads == [] and [a[:4] for a in store.acks] == [("replica-a", 1, 1, 0.0)] and store.acks[0][4] > 0  # and its peak memory


def test_an_idle_replica_streams_its_load_and_a_busy_or_broken_one_loads_a_whole_version():
    """Idle: each bucket is loaded as it arrives. Busy (a generate call in flight): the buckets are pulled
    while it decodes and loaded at once. Broken (a streamed load stopped half-way): a whole version."""
    for in_flight, broken, streamed in ((0, False, True), (3, False, False), (0, True, False)):
        engine, store = Engine(dropped=set()), Store(latest=(2, [5], 2))
        engine.broken = broken
        server = replica(engine, store, serial=1)
        server.in_flight = in_flight
        assert asyncio.run(server._load((2, [5], 2))) == 2
        assert engine.streamed == [streamed], (in_flight, broken)


class Gated:
    """A store whose buckets come in when the test lets them (`arrive`), noting the order they were asked for
    and how many asks are (and were at most) outstanding; `dropped`: from that bucket on, the publish is gone."""

    def __init__(self, count: int, dropped: int | None = None) -> None:
        self.asked: list[int] = []
        self.outstanding = self.most = 0
        self.ready: dict[int, asyncio.Event] = {}
        self.dropped = dropped
        self.bucket_count = Remote(lambda version, serial: count)
        self.bucket = self

    def arrive(self, k: int) -> None:
        self.ready.setdefault(k, asyncio.Event()).set()

    def remote(self, version, serial, k, timeout_s):
        self.asked.append(k)

        async def call():
            self.outstanding += 1
            self.most = max(self.most, self.outstanding)
            try:
                await self.ready.setdefault(k, asyncio.Event()).wait()
            finally:
                self.outstanding -= 1
            if self.dropped is not None and k >= self.dropped:
                return [None]
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)  # the bucket's reference: awaiting it pulls the bytes here
            return [done]

        return call()


def test_a_busy_replica_pulls_several_buckets_at_once_and_stops_at_a_dropped_publish():
    """`_prefetch` keeps AHEAD + 1 buckets in flight: with none arrived yet it has asked for buckets
    0 .. AHEAD (one at a time, it would have asked for bucket 0 only); each arrival lets one more go, never
    more than AHEAD + 1 outstanding. A publish dropped half-way ends it, and the asks still waiting end too."""
    from dapo_ray.weights import AHEAD

    async def run(store: Gated, arrivals: int) -> list[int]:
        server = replica(Engine(dropped=set()), Store(latest=(2, [6], 2)), serial=1)
        server.store = store
        task = asyncio.ensure_future(server._prefetch(2, 2))
        for _ in range(20):
            await asyncio.sleep(0)
        first = list(store.asked)
        for k in range(arrivals):
            store.arrive(k)
            for _ in range(20):
                await asyncio.sleep(0)
        await asyncio.wait_for(task, 5.0)
        return first

    whole = Gated(count=6)
    assert asyncio.run(run(whole, arrivals=6)) == list(range(AHEAD + 1))
    assert whole.asked == list(range(6)) and whole.most == AHEAD + 1
    cut = Gated(count=8, dropped=2)  # buckets 0 and 1 arrive, each letting one more ask go; then it is gone
    asyncio.run(run(cut, arrivals=3))
    assert cut.asked == list(range(AHEAD + 3)) and cut.outstanding == 0
