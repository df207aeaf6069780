"""A process that exits waits until Ray has exported its latest metric values (two report intervals and
2 s after the last update, a margin for a loaded machine), and only then: a disabled or never-updated registry returns at once."""

import time

import pytest

from dapo_ray import ray_metrics
from dapo_ray.ray_metrics import TrainerMetrics


@pytest.fixture
def slept(monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(ray_metrics, "_report_interval_s", lambda: 10.0)
    monkeypatch.setattr(ray_metrics.time, "sleep", sleeps.append)
    return sleeps


def test_an_exiting_worker_waits_two_report_intervals_after_its_last_update(slept):
    m = TrainerMetrics(enabled=True, run="r", rank=0)
    m.wait_exported()
    assert slept == []  # nothing recorded, nothing to wait for
    m.last_update = time.monotonic() - 4.0  # the last step's counters, 4 s ago
    m.wait_exported()
    assert slept[0] == pytest.approx(2 * 10.0 + 2.0 - 4.0, abs=0.5)
    m.last_update = time.monotonic() - 60.0  # exported long ago
    m.wait_exported()
    assert slept[1] == 0.0


def test_disabled_metrics_never_wait(slept):
    m = TrainerMetrics(enabled=False, run="r", rank=0)
    m.inc("dapo_trainer_steps", 1, "steps")
    m.wait_exported()
    assert slept == [] and m.last_update == 0.0
