"""The rollout producer: prompts -> vLLM replicas -> scores -> Dynamic Sampling filter -> a train batch,
every group tagged with the policy version that sampled it. The driver only asks it for the next batch.

With `overlap` (algorithm.max_policy_lag >= 1) the next batch is generated in the background while the
trainer trains on the current one: the one-step-off-policy scheme of verl and others. The replicas pick
up the new weights as soon as they are published, so a batch mixes samples of the version being
trained and the next; `BatchFiller` drops anything older than `max_policy_lag` and the trainer uses the
engine's log-probs as the ratio's denominator for samples of an older version. Without `overlap`
(max_policy_lag = 0) a batch is generated only when asked for, after the new weights are served:
strictly on-policy, as in the paper.

With overlap and a `Stream` (rollout.stream, the default) there are no rounds: prompts stay in flight
as the missing kept groups need, each group reaches the filter when its own responses end, and the batch
is cut the moment it is full; groups in flight at the cut go on into the next batch (`dapo_ray.stream`).

With `resample` (algorithm.stale_groups) a group older than the lag bound is not dropped: its prompt goes
back to the front of the queue (`_requeue`) and is generated again, on newer weights. With the stream the
groups in flight at a cut that cannot be fresh enough for the next batch are aborted there and then.

Every prompt taken from the data cursor is accounted for (`Ledger`): trained, filtered out by the keep
rule, carried to the next step, dropped (older than the lag bound, or surplus with carry-over off), or
in flight in the stream — never lost and never used twice (a prompt sent back to the queue is taken
again when it is drawn again; `resampled` counts how often that happened). A batch comes with the producer's state at
its boundary (cursor, carried groups and the stream's prompts in flight, before any prefetch), which is
what a checkpoint saves: prompts in flight or of a prefetch are generated again after a resume (those in
flight first), and were never trained.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from dapo_ray.algo import BatchFiller
from dapo_ray.algo.dynamic_sampling import FillReport
from dapo_ray.stream import Stream, wait_any

MAX_RESAMPLES = 3
"""How often one prompt may be sent back to the queue (algorithm.stale_groups resample) before it is
dropped as stale after all."""


def draw_order(group: dict) -> tuple[int, int]:
    """Where a group's prompt came in the data: its cursor draw "epoch:index" as numbers."""
    epoch, index = group["draw"].split(":")
    return int(epoch), int(index)


@dataclass
class Ledger:
    """Cumulative fate of the prompts taken from the cursor. `check()` holds after every batch."""

    taken: int = 0
    trained: int = 0
    filtered: int = 0
    stale_dropped: int = 0
    surplus_dropped: int = 0
    carried: int = 0  # kept groups waiting for a later step right now
    in_flight: int = 0  # prompts in the stream right now (sent, or back and not yet added to a batch)
    resampled: int = 0  # prompts sent back to the queue so far (not in `taken` until drawn again)

    def record(self, fill: FillReport) -> None:
        self.trained += fill.batch_groups
        self.filtered += fill.filtered
        self.stale_dropped += fill.stale_dropped
        self.surplus_dropped += fill.surplus_dropped
        self.carried = fill.carried_out

    def check(self) -> None:
        used = self.trained + self.filtered + self.stale_dropped + self.surplus_dropped + self.carried + self.in_flight
        if used != self.taken:
            raise AssertionError(f"prompt ledger does not balance: {self.taken} taken, {used} accounted for: {self}")


@dataclass
class Batch:
    groups: list[dict]
    fill: FillReport
    generated: list[dict]
    """Every group generated for this batch (kept or not), for the step's rollout statistics."""
    state: dict
    """Cursor, filler and in-flight state at this batch's boundary: what a checkpoint saves."""
    generate_s: float
    """Wall time of filling it (rollout, scoring, filtering); overlapped with training when prefetched."""
    waited_s: float = 0.0
    """How long `take` blocked for it (0 when a prefetch had it ready)."""
    draws: dict = field(default_factory=dict)
    """{"trained": [...], "filtered": [...]}: cursor draws ("epoch:index") of this batch's prompts."""


class Producer:
    def __init__(self, cursor, filler: BatchFiller, generate: Callable[[list[dict]], list[dict]],
                 gen_batch_size: int, overlap: bool, stream: Stream | None = None,
                 replay: list[str] = (), resample: bool = False, served: int = 0) -> None:  # fmt: skip
        """`generate(prompts) -> scored groups` runs one round (see `pipeline.generate_round`); with a
        `stream` (and overlap) groups come from it instead. `replay`: cursor draws that were in flight
        when the checkpoint was saved, generated again before the cursor's next prompts. `resample`: send
        groups older than the lag bound back to the queue instead of dropping them. `served`: the policy
        version the replicas serve now (`served()` moves it on)."""
        self.cursor, self.filler, self.generate = cursor, filler, generate
        self.gen_batch_size, self.overlap, self.resample = gen_batch_size, overlap, resample
        self.stream = stream if overlap else None
        self._replay = cursor.rows_at(list(replay)) if replay else []
        if self.stream is not None:
            self.stream.served = served
        self.ledger = Ledger(carried=len(filler.state_dict()["kept"]))
        self.ledger.taken = self.ledger.carried  # carried groups restored from a checkpoint were taken before
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-producer") if overlap else None
        self._next: tuple[int, Future[Batch]] | None = None
        self._resamples: dict[str, int] = {}  # draw -> times sent back to the queue

    def take(self, step: int, prefetch: bool = True) -> Batch:
        """The batch that step `step` trains on (trained from policy version `step`). With overlap and
        `prefetch`, the next one starts generating in the background before this returns."""
        t0 = time.time()
        if self._next is not None:
            prefetched_for, future = self._next
            self._next = None
            if prefetched_for != step:  # a batch is prefetched only for the step after a trained one
                raise RuntimeError(f"asked for the batch of step {step}, prefetched step {prefetched_for}'s")
            batch = future.result()
        else:
            batch = self._fill(step)
        batch.waited_s = time.time() - t0
        if self._pool is not None and prefetch and batch.fill.outcome in ("full", "partial"):
            self._next = (step + 1, self._pool.submit(self._fill, step + 1))
        return batch

    def served(self, version: int) -> None:
        """Every replica now serves policy `version` (the driver's sync said so)."""
        if self.stream is not None:
            self.stream.served = version

    def close(self) -> None:
        """Stop; a prefetch in flight is waited for and discarded (a run that stops early resumes from
        the last taken batch's state, so its prompts are generated again), and the stream stops."""
        if self.stream is not None:
            self.stream.close()  # a prefetch waiting on it fails at once
        if self._next is not None:
            self._next[1].exception()
            self._next = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _draw(self, k: int) -> list[dict]:
        """`k` prompts: those to replay first, then the cursor's next."""
        rows, self._replay = self._replay[:k], self._replay[k:]
        rows += self.cursor.take(k - len(rows))
        self.ledger.taken += len(rows)
        return rows

    def _requeue(self, draws: list[str]) -> None:
        """Send the prompts of `draws` back to the front of the queue (they were taken, and are taken
        again when drawn). A prompt already sent back MAX_RESAMPLES times is dropped as stale instead, so
        one whose responses never fit between two cuts cannot hold a place at the front for ever."""
        again = []
        for d in draws:
            self._resamples[d] = self._resamples.get(d, 0) + 1
            if self._resamples[d] > MAX_RESAMPLES:
                self.ledger.stale_dropped += 1
            else:
                again.append(d)
        self._replay = self.cursor.rows_at(sorted(again, key=lambda d: tuple(map(int, d.split(":"))))) + self._replay
        self.ledger.taken -= len(again)
        self.ledger.resampled += len(again)

    def _add(self, filler: BatchFiller, groups: list[dict], new_round: bool = True) -> None:
        """Add generated groups to the filter; with `resample`, those it would drop as too old go back
        to the queue instead."""
        if self.resample:
            old = {g["draw"] for g in groups if filler.too_old(g["keep"], g["policy_version"])}
            self._requeue(sorted(old))
            groups = [g for g in groups if g["draw"] not in old]
        filler.add(groups, keep=[g["keep"] for g in groups], versions=[g["policy_version"] for g in groups],
                   new_round=new_round)  # fmt: skip

    def _fill(self, step: int) -> Batch:
        if self.stream is not None:
            return self._fill_from_stream(step)
        t0 = time.time()
        filler = self.filler
        filler.start_step(version=step)
        generated: list[dict] = []
        while filler.needs_more():
            prompts = self._draw(filler.prompts_for_next_round(self.gen_batch_size))
            # The round's groups in the order they were drawn, not the order they finished: which kept groups
            # fill the batch is then the data's choice, not timing's (finishing first favours short answers),
            # and a resumed run cuts its batch where the uninterrupted one did.
            groups = sorted(self.generate(prompts), key=draw_order)
            generated += groups
            self._add(filler, groups)
        return self._cut(filler, generated, t0, step)

    def _fill_from_stream(self, step: int) -> Batch:
        """The batch of `step` from the stream: enough prompts in flight for the kept groups still missing
        (`prompts_for_next_round`, counting those already in flight), each group added as it comes back,
        cut when full or when `max_rounds` x gen_batch_size groups came back for this step."""
        t0 = time.time()
        filler, stream, G = self.filler, self.stream, self.gen_batch_size
        filler.start_step(version=step)
        generated: list[dict] = []
        while filler.missing > 0 and len(generated) < filler.max_rounds * G:
            want = filler.prompts_for_next_round(G) - len(stream.in_flight)
            if want > 0:
                stream.admit(self._draw(want))
            g = wait_any(stream)
            self._add(filler, [g], new_round=len(generated) % G == 0)
            generated.append(g)
        return self._cut(filler, generated, t0, step)

    def _cut(self, filler: BatchFiller, generated: list[dict], t0: float, step: int) -> Batch:
        groups, fill = filler.finish()
        self.ledger.record(fill)
        if self.resample and self.stream is not None:
            # Sent before the replicas served step + 1 - max_lag: unless it waited in an engine's queue
            # until a later load, its oldest token is older than the next batch allows and it would be
            # dropped when it ends. Abort it now and generate it again.
            doomed = [d for d, row in self.stream.in_flight.items() if row["admitted_on"] < step + 1 - filler.max_lag]
            self._requeue([row["draw"] for row in self.stream.abort(doomed)])
        in_flight = sorted(self.stream.in_flight, key=lambda d: tuple(map(int, d.split(":")))) if self.stream else []
        self.ledger.in_flight = len(in_flight)  # prompts still to replay are not taken yet
        self.ledger.check()
        draws = {"trained": [g["draw"] for g in groups], "filtered": [g["draw"] for g in generated if not g["keep"]]}
        state = {"cursor": self.cursor.state_dict(), "filler": filler.state_dict(),
                 "in_flight": in_flight + [r["draw"] for r in self._replay]}  # fmt: skip
        return Batch(groups, fill, generated, state, time.time() - t0, draws=draws)
