"""The weight-sync check reads a replica's log-probs of the probe against the trainer's at the version the
replica answered with. A replica loads each publish as the trainer makes it, so one that takes the probe
late answers at the next step's version: that answer is checked against the next step's log-probs, not
against the synced version's (which once read as a 0.14-nat sync error on the multi-node cluster)."""

from concurrent.futures import Future
from types import SimpleNamespace

from dapo_ray.driver import _Run, sync_diff


def _run_with_pending_check(answer_version: int, answer_lp: list[float]) -> SimpleNamespace:
    logged: list[tuple[dict, int]] = []
    answer: Future = Future()
    answer.set_result((answer_version, answer_lp))
    return SimpleNamespace(
        sync_check=(1, answer, [-1.0, -2.0]), sync_checked="sync diff -", logged=logged,
        summary={"steps_log": [{"step": 1, "probe_version": None, "metrics": {}}]},
        tracker=SimpleNamespace(log=lambda m, step: logged.append((m, step))),
        exported=SimpleNamespace(record=lambda m, step: None),
    )  # fmt: skip


def test_an_answer_at_the_synced_version_is_checked_against_it():
    run = _run_with_pending_check(1, [-1.0, -2.0 + 3e-5])
    _Run.check_sync(run, newer=(2, [-1.5, -2.5]))
    entry = run.summary["steps_log"][0]
    assert entry["probe_version"] == 1 and abs(entry["metrics"]["weight_sync/logprob_max_diff"] - 3e-5) < 1e-9
    assert run.sync_check is None and run.logged[0][1] == 1 and "(v1)" in run.sync_checked


def test_an_answer_at_the_next_publish_is_checked_against_that_version():
    run = _run_with_pending_check(2, [-1.5, -2.5])  # the replica had loaded step 2's publish first
    _Run.check_sync(run, newer=(2, [-1.5, -2.5]))
    entry = run.summary["steps_log"][0]
    assert entry["probe_version"] == 2 and entry["metrics"]["weight_sync/logprob_max_diff"] == 0.0
    assert "(v2)" in run.sync_checked


def test_an_answer_at_neither_version_is_not_recorded_as_a_difference(capsys):
    run = _run_with_pending_check(0, [-9.0, -9.0])  # e.g. after the trainers restarted from a checkpoint
    _Run.check_sync(run, newer=(2, [-1.5, -2.5]))
    assert run.summary["steps_log"][0]["metrics"] == {} and run.logged == []
    assert "not checked" in capsys.readouterr().out
    assert sync_diff(3, [0.0], {1: [0.0], 2: [0.0]}) is None


def test_a_probe_whose_replica_failed_is_not_checked_and_the_run_goes_on(capsys):
    """The replica that took the probe died (its actor, or its engine: `EngineDead`) before answering: the
    step is left unchecked, with a line that says why, and nothing is raised."""
    from ray.exceptions import RayActorError

    from dapo_ray.rollout.engine import EngineDead

    for error in (RayActorError(), EngineDead("the engine core died (EngineDeadError())"), TimeoutError()):
        run = _run_with_pending_check(1, [-1.0, -2.0])
        answer: Future = Future()
        answer.set_exception(error)
        run.sync_check = (1, answer, [-1.0, -2.0])
        _Run.check_sync(run)
        assert run.sync_check is None and run.logged == [] and run.summary["steps_log"][0]["probe_version"] is None
        assert f"step 1's sync not checked: the replica that took the probe failed ({type(error).__name__}" in capsys.readouterr().out
