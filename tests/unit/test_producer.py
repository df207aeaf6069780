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
