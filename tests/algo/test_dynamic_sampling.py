import pytest

from dapo_ray.algo import BatchFiller, keep_group


def test_keep_rule_eq11():
    assert keep_group([True, False, False, False])
    assert not keep_group([True] * 4)
    assert not keep_group([False] * 4)
    assert keep_group([1.0, 0.0])


def run_step(filler, rounds):
    """rounds: list of keep-flag lists; each group is a (round, index) tuple."""
    filler.start_step()
    it = iter(rounds)
    while filler.needs_more():
        flags = next(it)
        filler.add([(len(flags), i) for i in range(len(flags))], flags)
    return filler.finish()


def test_fills_across_rounds_and_carries_surplus():
    f = BatchFiller(target_groups=4, max_rounds=5)
    batch, rep = run_step(f, [[True, False, False], [True, True, False, True, True]])
    assert rep.outcome == "full" and len(batch) == 4
    assert (rep.rounds, rep.generated_groups, rep.kept_groups) == (2, 8, 5)
    assert rep.carried_in == 0 and rep.carried_out == 1
    # The surplus group leads the next step's batch.
    batch2, rep2 = run_step(f, [[True, True, True]])
    assert rep2.carried_in == 1 and batch2[0] == (5, 4)
    assert len(batch2) == 4 and rep2.rounds == 1


def test_no_carry_over_drops_surplus_and_says_so():
    f = BatchFiller(target_groups=2, carry_over=False)
    batch, rep = run_step(f, [[True, True, True]])
    assert len(batch) == 2 and rep.carried_out == 0 and "dropped 1" in rep.message


def test_cap_train_partial():
    f = BatchFiller(target_groups=4, max_rounds=2, on_cap="train_partial")
    batch, rep = run_step(f, [[True, False], [False, False]])
    assert rep.outcome == "partial" and len(batch) == 1 and rep.rounds == 2
    assert "1/4" in rep.message and "max_rounds=2" in rep.message


def test_cap_empty_is_skipped_not_crashed():
    f = BatchFiller(target_groups=4, max_rounds=2)
    batch, rep = run_step(f, [[False], [False]])
    assert rep.outcome == "empty" and batch == []


def test_cap_stop_keeps_groups_for_later():
    f = BatchFiller(target_groups=4, max_rounds=1, on_cap="stop")
    batch, rep = run_step(f, [[True, True, False]])
    assert rep.outcome == "stopped" and batch == [] and "stopping" in rep.message
    assert rep.carried_out == 2  # nothing kept is lost
    assert len(f.state_dict()["kept"]) == 2


def test_disabled_keeps_everything():
    f = BatchFiller(target_groups=3, enabled=False)
    f.start_step()
    assert f.prompts_for_next_round(10) == 3
    f.add(["a", "b", "c"], [False, False, False])
    batch, rep = f.finish()
    assert batch == ["a", "b", "c"] and rep.outcome == "full"


def test_next_round_size_follows_keep_rate():
    f = BatchFiller(target_groups=10, max_rounds=5)
    f.start_step()
    assert f.prompts_for_next_round(30) == 30
    f.add(list(range(10)), [True] * 5 + [False] * 5)  # rate 0.5, 5 missing -> ceil(1.2*5/0.5)=12
    assert f.prompts_for_next_round(30) == 12
    assert f.prompts_for_next_round(8) == 8


def test_checkpoint_roundtrip():
    f = BatchFiller(target_groups=1)
    run_step(f, [[True, True, True]])
    g = BatchFiller(target_groups=1)
    g.load_state_dict(f.state_dict())
    g.start_step()
    assert not g.needs_more()


def test_bad_arguments():
    with pytest.raises(ValueError, match="train_partial"):
        BatchFiller(target_groups=1, on_cap="crash")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        BatchFiller(target_groups=0)
