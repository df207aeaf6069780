"""The driver <-> trainer-workers channel: per-rank batch queues and a result queue, in one actor.

The driver cannot call into a running `TorchTrainer.fit()`, so the workers pull each step's shard from
here and rank 0 pushes back the step's statistics.

Ray Train may restart the worker group (a worker died): the new rank 0 says "ready" before any rank
takes a shard. That starts a new generation: shards left for the old group are dropped, and so are
shards the driver sends before it has read that "ready" (they carry the generation it last heard of).
"""

from __future__ import annotations

import asyncio

import ray

# The shard that ends a worker without the final model: the driver was stopped (Ctrl-C, SIGTERM) after
# the step's checkpoint. None ends it with the final model.
STOP = "stop"


@ray.remote(num_cpus=0)
class Channel:
    def __init__(self, world_size: int) -> None:
        self.batches = [asyncio.Queue() for _ in range(world_size)]
        self.results: asyncio.Queue = asyncio.Queue()
        self.generation = 0  # worker groups that have said "ready"
        self.taken = [0] * world_size  # shards each rank has taken: the steps it has begun

    async def put_shards(self, shards: list | None, generation: int) -> bool:
        """One shard per rank, or None to tell every worker to finish, for the worker group of
        `generation`; False (nothing queued) when a newer group has started."""
        if generation != self.generation:
            return False
        for rank, q in enumerate(self.batches):
            await q.put(None if shards is None else shards[rank])
        return True

    async def get_shard(self, rank: int):
        item = await self.batches[rank].get()
        self.taken[rank] += 1
        return item

    async def shards_taken(self) -> list[int]:
        """Shards taken so far per rank, across worker restarts."""
        return self.taken

    async def put_result(self, result: dict) -> None:
        if result["kind"] == "ready":  # a new worker group: what is queued was for the one before
            self.generation += 1
            for q in self.batches:
                while not q.empty():
                    q.get_nowait()
        await self.results.put(result)

    async def get_result(self, timeout_s: float):
        """The next result, or None after `timeout_s` (the caller checks the trainer is still alive)."""
        try:
            return await asyncio.wait_for(self.results.get(), timeout_s)
        except TimeoutError:
            return None
