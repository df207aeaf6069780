"""The rollout stream: prompts go to the vLLM replicas one group at a time, as many in flight as the
producer asks for, and each group comes back on its own, scored, the moment its G responses end.

With generation overlapped (algorithm.max_policy_lag >= 1 and rollout.stream) the producer fills every
batch from this stream instead of generation rounds (`producer.Producer`): it keeps enough prompts in
flight for the kept groups still missing, adds each group to the Dynamic Sampling filter as it
arrives, and cuts the batch the moment it is full. Groups still in flight at the cut carry on (a weight
load interrupts them: partial rollout) and fill the next batch. Nothing waits for the slowest response
of a round, so a replica's batch stays full while its long responses run.

Why not a Ray Data dataset: what to admit next depends on what came back (the filter's keep rate and
the kept groups still missing), which a dataset, planned from its source before it runs, cannot feed
back; a checkpoint must name exactly which prompts are in flight, which a dataset's executor buffers
without saying; and at max_policy_lag 0 the stream must drain at every update, where a dataset would have
to be stopped and planned again per step (measured per round: docs/RESULTS.md, `bench/rollout_round.py`).
So the calls go straight to the Serve deployment from an asyncio loop on a thread of the driver (Serve
handles may be awaited from any loop), and scoring runs on a thread pool beside it.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from dapo_ray.pipeline import (
    SamplingSpec,
    ScoringSpec,
    add_completions,
    prompt_seed,
    replica_lost_errors,
    score_group,
)
from dapo_ray.progress import quiet_libraries


class Stream:
    """Single groups generated and scored, many in flight. `admit(rows)` sends them; `next_group()`
    returns the next one scored (in the order they end); `in_flight` names what was sent and not yet
    returned, by cursor draw; `abort(draws)` takes groups back before they end (their calls are cancelled
    on the replicas, whose engines then abort the requests). Each admitted row records `admitted_on`: the
    policy version every replica served when it was sent (`served`, which the driver sets after each sync),
    so a group's oldest token is at least that version."""

    def __init__(self, app_name: str, sampling: SamplingSpec, scoring: ScoringSpec, scorers: int = 2,
                 attempts: int = 6) -> None:  # fmt: skip
        self.app_name, self.sampling, self.scoring, self.attempts = app_name, sampling, scoring, attempts
        self.in_flight: dict[str, dict] = {}
        self.served = 0
        self._done: queue.Queue = queue.Queue()  # (ticket, scored group or exception)
        self._tickets = itertools.count()
        self._calls: dict[int, Future] = {}  # ticket -> the group's task on the loop
        self._responses: dict = {}  # ticket -> the Serve call in flight
        self._aborted: set[int] = set()
        self._scorers = ThreadPoolExecutor(max_workers=scorers, thread_name_prefix="rollout-score")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="rollout-stream", daemon=True)
        self._thread.start()
        self._handle = None

    def admit(self, rows: list[dict]) -> None:
        for row in rows:
            row = row | {"ticket": next(self._tickets), "admitted_on": self.served}
            self.in_flight[row["draw"]] = row
            self._calls[row["ticket"]] = asyncio.run_coroutine_threadsafe(self._group(row), self._loop)

    def abort(self, draws: list[str]) -> list[dict]:
        """Take the groups of `draws` back: they will not come out of `next_group`, and their calls are
        cancelled. Returns their rows as admitted."""
        rows = [self.in_flight.pop(d) for d in draws]
        for row in rows:
            self._aborted.add(row["ticket"])
            call = self._calls.pop(row["ticket"], None)
            if call is not None:
                call.cancel()
        return rows

    def next_group(self, timeout_s: float | None = None) -> dict:
        """The next group whose G responses ended, scored; raises what generating or scoring it raised
        (after the retries a lost replica gets), or `queue.Empty` after `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            ticket, item = self._done.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            self._calls.pop(ticket, None)
            if ticket in self._aborted:  # it ended before its abort reached it
                self._aborted.discard(ticket)
                continue
            if isinstance(item, BaseException):
                raise item
            del self.in_flight[item["draw"]]
            return item

    def close(self) -> None:
        """Stop: groups in flight are dropped (their calls end on the replicas and are not read), and a
        `next_group` waiting meanwhile raises."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        self._done.put((None, RuntimeError("the rollout stream was closed")))
        self._scorers.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        tasks = asyncio.all_tasks(self._loop)
        for task in tasks:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._loop.close()

    async def _group(self, row: dict) -> None:
        ticket = row["ticket"]
        try:
            version, replica, outs = await self._generate(row)
            row = add_completions(dict(row), outs[0], version, replica)
            self._done.put((ticket, await self._loop.run_in_executor(self._scorers, score_group, row, self.scoring)))
        except asyncio.CancelledError:  # aborted: cancel the call on its replica too
            response = self._responses.get(ticket)
            if response is not None:
                response.cancel()
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._done.put((ticket, e))
        finally:
            self._calls.pop(ticket, None)
            self._responses.pop(ticket, None)

    async def _generate(self, row: dict):
        """One call for the group, sent again when the replica serving it or its engine dies (Serve routes
        the retry to a live one; nothing of the failed call was kept: `pipeline._call_replica`)."""
        from ray import serve

        if self._handle is None:
            quiet_libraries()
            self._handle = serve.get_deployment_handle("rollout", app_name=self.app_name)
        s = self.sampling
        seeds = None if s.seed is None else [prompt_seed(s.seed, row["draw"])]
        for attempt in range(self.attempts):
            try:
                response = self._handle.generate.remote([row["prompt_ids"]], s.n, s.temperature, s.top_p,
                                                        s.max_tokens, seeds)  # fmt: skip
                self._responses[row["ticket"]] = response
                return await response
            except replica_lost_errors() as e:
                if attempt == self.attempts - 1:
                    raise
                print(f"[rollout] a replica was lost mid-call ({type(e).__name__}); sending the call again", flush=True)
                await asyncio.sleep(1.0 + attempt)
        raise AssertionError("unreachable")


def wait_any(stream: Stream, deadline_s: float = 600.0) -> dict:
    """`stream.next_group()`, failing clearly when nothing comes back for `deadline_s`."""
    t0 = time.time()
    try:
        return stream.next_group(timeout_s=deadline_s)
    except queue.Empty:
        raise TimeoutError(f"no group came back from the rollout replicas in {time.time() - t0:.0f}s "
                           f"({len(stream.in_flight)} in flight)") from None  # fmt: skip
