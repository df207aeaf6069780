"""The driver <-> trainer-workers channel: per-rank batch queues and a result queue, in one actor.

The driver cannot call into a running `TorchTrainer.fit()`, so the workers pull each step's shard from
here and rank 0 pushes back the step's statistics.
"""

from __future__ import annotations

import asyncio

import ray


@ray.remote(num_cpus=0)
class Channel:
    def __init__(self, world_size: int) -> None:
        self.batches = [asyncio.Queue() for _ in range(world_size)]
        self.results: asyncio.Queue = asyncio.Queue()
        self.taken = [0] * world_size  # shards each rank has taken: the steps it has begun

    async def join(self, rank: int) -> None:
        """A worker (re)starts: shards left in its queue were for a worker group that failed."""
        q = self.batches[rank]
        while not q.empty():
            q.get_nowait()

    async def put_shards(self, shards: list | None) -> None:
        """One shard per rank, or None to tell every worker to finish."""
        for rank, q in enumerate(self.batches):
            await q.put(None if shards is None else shards[rank])

    async def get_shard(self, rank: int):
        item = await self.batches[rank].get()
        self.taken[rank] += 1
        return item

    async def shards_taken(self) -> list[int]:
        """Shards taken so far per rank, across worker restarts."""
        return self.taken

    async def put_result(self, result: dict) -> None:
        await self.results.put(result)

    async def get_result(self, timeout_s: float):
        """The next result, or None after `timeout_s` (the caller checks the trainer is still alive)."""
        try:
            return await asyncio.wait_for(self.results.get(), timeout_s)
        except TimeoutError:
            return None
