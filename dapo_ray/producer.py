"""The rollout producer: prompts -> vLLM replicas -> scores -> Dynamic Sampling filter -> a train batch,
every group tagged with the policy version that sampled it. The driver only asks it for the next batch.

With `overlap` (algorithm.max_policy_lag >= 1) the next batch is generated in the background while the
trainer trains on the current one: the one-step-off-policy scheme of verl and others. The replicas pick
up the new weights as soon as they are published, so a batch mixes samples of the version being
trained and the next; `BatchFiller` drops anything older than `max_policy_lag` and the trainer uses the
engine's log-probs as the ratio's denominator for samples of an older version. Without `overlap`
(max_policy_lag = 0) a batch is generated only when asked for, after the new weights are served:
strictly on-policy, as in the paper.

Every prompt taken from the data cursor is accounted for (`Ledger`): trained, filtered out by the keep
rule, carried to the next step, or dropped (older than the lag bound, or surplus with carry-over off) —
never lost and never used twice. A batch comes with the producer's state at its boundary (cursor and
carried groups, before any prefetch), which is what a checkpoint saves: prompts of a prefetch in flight
are generated again after a resume, and were never trained.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from dapo_ray.algo import BatchFiller
from dapo_ray.algo.dynamic_sampling import FillReport


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

    def record(self, fill: FillReport) -> None:
        self.trained += fill.batch_groups
        self.filtered += fill.filtered
        self.stale_dropped += fill.stale_dropped
        self.surplus_dropped += fill.surplus_dropped
        self.carried = fill.carried_out

    def check(self) -> None:
        used = self.trained + self.filtered + self.stale_dropped + self.surplus_dropped + self.carried
        if used != self.taken:
            raise AssertionError(f"prompt ledger does not balance: {self.taken} taken, {used} accounted for: {self}")


@dataclass
class Batch:
    groups: list[dict]
    fill: FillReport
    generated: list[dict]
    """Every group generated for this batch (kept or not), for the step's rollout statistics."""
    state: dict
    """Cursor and filler state at this batch's boundary: what a checkpoint saves."""
    generate_s: float
    """Wall time of filling it (rollout, scoring, filtering); overlapped with training when prefetched."""
    waited_s: float = 0.0
    """How long `take` blocked for it (0 when a prefetch had it ready)."""
    draws: dict = field(default_factory=dict)
    """{"trained": [...], "filtered": [...]}: cursor draws ("epoch:index") of this batch's prompts."""


class Producer:
    def __init__(self, cursor, filler: BatchFiller, generate: Callable[[list[dict]], list[dict]],
                 gen_batch_size: int, overlap: bool) -> None:  # fmt: skip
        """`generate(prompts) -> scored groups` runs one round (see `pipeline.generate_round`)."""
        self.cursor, self.filler, self.generate = cursor, filler, generate
        self.gen_batch_size, self.overlap = gen_batch_size, overlap
        self.ledger = Ledger(carried=len(filler.state_dict()["kept"]))
        self.ledger.taken = self.ledger.carried  # carried groups restored from a checkpoint were taken before
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-producer") if overlap else None
        self._next: tuple[int, Future[Batch]] | None = None

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

    def close(self) -> None:
        """Stop; a prefetch in flight is waited for and discarded (a run that stops early resumes from
        the last taken batch's state, so its prompts are generated again)."""
        if self._next is not None:
            self._next[1].exception()
            self._next = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _fill(self, step: int) -> Batch:
        t0 = time.time()
        filler = self.filler
        filler.start_step(version=step)
        generated: list[dict] = []
        while filler.needs_more():
            prompts = self.cursor.take(filler.prompts_for_next_round(self.gen_batch_size))
            self.ledger.taken += len(prompts)
            # The round's groups in the order they were drawn, not the order they finished: which kept groups
            # fill the batch is then the data's choice, not timing's (finishing first favours short answers),
            # and a resumed run cuts its batch where the uninterrupted one did.
            groups = sorted(self.generate(prompts), key=draw_order)
            generated += groups
            filler.add(groups, keep=[g["keep"] for g in groups], versions=[g["policy_version"] for g in groups])
        groups, fill = filler.finish()
        self.ledger.record(fill)
        self.ledger.check()
        draws = {"trained": [g["draw"] for g in groups], "filtered": [g["draw"] for g in generated if not g["keep"]]}
        state = {"cursor": self.cursor.state_dict(), "filler": filler.state_dict()}
        return Batch(groups, fill, generated, state, time.time() - t0, draws=draws)
