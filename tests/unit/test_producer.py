"""The producer's cut of a batch (dapo_ray/producer.py): a round's groups are filed in draw order, so the
kept groups that fill a batch do not depend on which finished first. `generate` here is a stand-in for
the rollout stage (a function of the prompts), as the unit tier allows; the real stage runs in
tests/integration."""

from dapo_ray.algo import BatchFiller
from dapo_ray.driver import PromptCursor
from dapo_ray.producer import Producer


def test_the_batch_takes_the_first_kept_groups_in_draw_order_whatever_finishes_first():
    rows = [{"id": i} for i in range(8)]

    def generate(prompts: list[dict]) -> list[dict]:  # every group kept, finishing in reverse order
        return [p | {"keep": True, "policy_version": 0} for p in reversed(prompts)]

    filler = BatchFiller(3, max_rounds=4, on_cap="train_partial", carry_over=False, enabled=True, max_lag=0)
    producer = Producer(PromptCursor(rows, shuffle=False, seed=0), filler, generate, gen_batch_size=8, overlap=False)
    try:
        batch = producer.take(0, prefetch=False)
    finally:
        producer.close()
    assert [g["id"] for g in batch.groups] == [0, 1, 2]
    assert batch.draws["trained"] == ["0:0", "0:1", "0:2"]


class FakeStream:
    """Stands where `dapo_ray.stream.Stream` stands (the real one: tests/integration/test_end_to_end.py):
    the group admitted last comes back first, as a short response overtakes a long one, sampled (by
    default) by the version the replicas served when it was sent."""

    def __init__(self, keep=lambda row: True, version=lambda row: row["admitted_on"]) -> None:
        self.in_flight: dict[str, dict] = {}
        self.keep, self.version, self.admitted, self.aborted, self.closed = keep, version, [], [], False
        self.served = 0

    def admit(self, rows: list[dict]) -> None:
        self.admitted += [r["draw"] for r in rows]
        self.in_flight.update({r["draw"]: r | {"admitted_on": self.served} for r in rows})

    def abort(self, draws: list[str]) -> list[dict]:
        self.aborted += draws
        return [self.in_flight.pop(d) for d in draws]

    def next_group(self, timeout_s=None) -> dict:
        row = self.in_flight.pop(next(reversed(self.in_flight)))
        return row | {"keep": self.keep(row), "policy_version": self.version(row)}

    def close(self) -> None:
        self.closed = True


def streaming(rows, stream, replay=(), cursor=None, resample=False, served=0, **filler) -> Producer:
    args = {"max_rounds": 4, "on_cap": "train_partial", "carry_over": False, "enabled": True, "max_lag": 1} | filler
    return Producer(cursor or PromptCursor(rows, shuffle=False, seed=0), BatchFiller(3, **args), generate=None,
                    gen_batch_size=8, overlap=True, stream=stream, replay=list(replay), resample=resample,
                    served=served)  # fmt: skip


def test_the_stream_cuts_the_batch_when_full_and_the_groups_in_flight_fill_the_next():
    rows = [{"id": i} for i in range(40)]
    stream = FakeStream(keep=lambda row: row["id"] % 2 == 0)
    producer = streaming(rows, stream)
    try:
        first = producer.take(0, prefetch=False)
        in_flight = first.state["in_flight"]
        assert len(first.groups) == 3 and in_flight and in_flight == sorted(stream.in_flight, key=lambda d: int(d[2:]))
        ledger = producer.ledger
        assert ledger.in_flight == len(in_flight) and ledger.taken == len(stream.admitted)
        ledger.check()
        second = producer.take(1, prefetch=False)
    finally:
        producer.close()
    assert stream.closed
    used = [*first.draws["trained"], *first.draws["filtered"], *second.draws["trained"], *second.draws["filtered"]]
    assert len(used) == len(set(used))  # no prompt twice
    # What was in flight at the first cut came back into the second batch (or is still in flight).
    assert set(in_flight) <= set(second.draws["trained"] + second.draws["filtered"]) | set(second.state["in_flight"])
    assert producer.ledger.taken == len(used) + len(second.state["in_flight"])


def test_prompts_in_flight_at_a_checkpoint_are_generated_first_after_a_resume():
    rows = [{"id": i} for i in range(40)]
    first = streaming(rows, FakeStream(keep=lambda row: row["id"] % 3 == 0))
    try:
        batch = first.take(0, prefetch=False)
    finally:
        first.close()
    assert batch.state["in_flight"]
    cursor = PromptCursor(rows, shuffle=False, seed=0)
    cursor.load_state_dict(batch.state["cursor"])
    stream = FakeStream()
    resumed = streaming(rows, stream, replay=batch.state["in_flight"], cursor=cursor)
    try:
        again = resumed.take(1, prefetch=False)
    finally:
        resumed.close()
    assert stream.admitted[: len(batch.state["in_flight"])] == batch.state["in_flight"]
    assert stream.admitted[len(batch.state["in_flight"])] == f"0:{batch.state['cursor']['index']}"
    assert not set(again.draws["trained"]) & set(batch.draws["trained"] + batch.draws["filtered"])


def test_the_stream_stops_at_the_cap_without_a_round_structure():
    stream = FakeStream(keep=lambda row: False)  # nothing is ever kept
    producer = streaming([{"id": i} for i in range(100)], stream)
    try:
        batch = producer.take(0, prefetch=False)
    finally:
        producer.close()
    assert batch.fill.outcome == "empty" and batch.fill.rounds == 4
    assert batch.fill.generated_groups == 4 * 8  # max_rounds x gen_batch_size groups, as rounds would
    producer.ledger.check()


def test_resample_sends_a_group_older_than_the_lag_bound_back_to_the_queue():
    seen: set[str] = set()

    def version(row):  # the first time each of prompts 5-7 (the first back) comes back, it is 5 versions old
        first = row["draw"] not in seen
        seen.add(row["draw"])
        return -4 if first and row["id"] >= 5 else 1

    rows = [{"id": i} for i in range(40)]
    stream = FakeStream(version=version)
    producer = streaming(rows, stream, resample=True, served=1)
    try:
        batch = producer.take(1, prefetch=False)
    finally:
        producer.close()
    assert batch.fill.stale_dropped == 0
    assert producer.ledger.resampled == 3
    assert stream.admitted.count("0:7") == 2 and "0:7" in batch.draws["trained"]  # sent again and trained
    # The other two wait at the front of the queue (nothing more was needed): a checkpoint names them.
    assert batch.state["in_flight"] == ["0:0", "0:1", "0:2", "0:5", "0:6"]
    producer.ledger.check()


def test_resample_aborts_at_the_cut_what_cannot_be_fresh_enough_and_sends_it_first_next_time():
    rows = [{"id": i} for i in range(40)]
    stream = FakeStream()
    producer = streaming(rows, stream, resample=True, served=0)
    try:
        first = producer.take(1, prefetch=False)  # everything was sent on version 0: too old for step 2
        aborted, sent = list(stream.aborted), len(stream.admitted)
        assert aborted and not stream.in_flight
        assert first.state["in_flight"] == sorted(aborted, key=lambda d: int(d[2:]))  # a resume sends them again
        assert producer.ledger.resampled == len(aborted) and producer.ledger.in_flight == 0
        producer.ledger.check()
        producer.served(1)
        second = producer.take(2, prefetch=False)
    finally:
        producer.close()
    resent = stream.admitted[sent:]
    assert resent == sorted(aborted, key=lambda d: int(d[2:]))[: len(resent)]  # first, before any new prompt
    assert set(aborted) <= set(second.draws["trained"]) | set(second.state["in_flight"])
    assert not set(second.draws["trained"]) & set(first.draws["trained"])
    producer.ledger.check()


def test_without_resample_nothing_is_aborted_and_old_groups_are_dropped():
    rows = [{"id": i} for i in range(40)]
    stream = FakeStream(version=lambda row: -4 if row["id"] >= 5 else 1)
    producer = streaming(rows, stream, served=1)
    try:
        batch = producer.take(1, prefetch=False)
    finally:
        producer.close()
    assert not stream.aborted and producer.ledger.resampled == 0
    assert batch.fill.stale_dropped == 3 and not set(batch.draws["trained"]) & {"0:5", "0:6", "0:7"}
    producer.ledger.check()


def test_a_prompt_sent_back_too_often_is_dropped_as_stale_after_all():
    from dapo_ray.producer import MAX_RESAMPLES

    rows = [{"id": i} for i in range(40)]
    stream = FakeStream(version=lambda row: -4 if row["id"] == 7 else 1)  # prompt 7 is always too old
    producer = streaming(rows, stream, resample=True, served=1)
    try:
        batch = producer.take(1, prefetch=False)
    finally:
        producer.close()
    assert stream.admitted.count("0:7") == 1 + MAX_RESAMPLES
    assert producer.ledger.resampled == MAX_RESAMPLES and producer.ledger.stale_dropped == 1
    assert "0:7" not in batch.draws["trained"] + batch.state["in_flight"]
    producer.ledger.check()
