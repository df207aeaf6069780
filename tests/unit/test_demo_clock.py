"""The demo's config and the clock its minutes of training are read on."""

import re
from pathlib import Path

import pytest

from dapo_ray.config import DEFAULT_CONFIG, ConfigError, load_config
from dapo_ray.driver import StepClock, budget_spent, training_s

ROOT = Path(__file__).resolve().parents[2]


def test_make_demo_runs_the_default_config_on_smollm2_and_demo_tiny_the_tiny_model():
    makefile = (ROOT / "Makefile").read_text()
    demo = re.search(r"^demo:.*\n\t.*--config (\S+)", makefile, re.M).group(1)
    tiny = re.search(r"^demo-tiny:.*\n\t.*--config (\S+)", makefile, re.M).group(1)
    assert demo == DEFAULT_CONFIG
    assert load_config(ROOT / demo).rollout.model_source == "smollm2"
    assert load_config(ROOT / tiny).rollout.model_source == "tiny"
    # Their outputs apart: a demo never resumes from the other model's checkpoint.
    assert load_config(ROOT / demo).trainer.output_dir != load_config(ROOT / tiny).trainer.output_dir


def test_minutes_of_training_are_the_steps_own_time_up_to_a_step():
    summary = {"steps_log": [{"step": s, "metrics": {"timing/step_s": t}} for s, t in ((1, 55.0), (2, 30.0), (3, 40.0))]}
    assert [training_s(summary, s) for s in (0, 1, 2, 3, 9)] == [0.0, 55.0, 85.0, 125.0, 125.0]
    # A resumed run's log starts at the step it resumed from: only this process's steps count.
    assert training_s({"steps_log": summary["steps_log"][1:]}, 3) == 70.0


def test_a_run_stops_at_its_budget_of_responses_or_of_minutes_of_training():
    def trainer(*overrides):
        return load_config(ROOT / DEFAULT_CONFIG, list(overrides)).trainer

    assert budget_spent(trainer(), 10**9, 10**9) == ""  # no budget: only total_steps stops it
    assert budget_spent(trainer("trainer.max_train_minutes=30"), 10**9, 1799.0) == ""
    assert budget_spent(trainer("trainer.max_train_minutes=30"), 0, 1800.0) == "1800s of training (trainer.max_train_minutes=30)"
    assert "responses generated" in budget_spent(trainer("trainer.max_generated=640", "trainer.max_train_minutes=30"), 640, 0.0)
    with pytest.raises(ConfigError, match="max_train_minutes must be >= 0"):
        trainer("trainer.max_train_minutes=-1")


def test_a_batch_with_nothing_to_train_on_counts_in_the_next_steps_time():
    ticks = iter([0.0, 20.0, 20.0, 50.0, 50.0, 60.0])  # 20 s for nothing, then a 30 s step; then a 10 s step
    clock = StepClock(now=lambda: next(ticks))
    clock.start()
    clock.nothing_trained()
    clock.start()
    assert clock.idle_s == 20.0  # the step's wait for its batch includes it
    assert clock.stepped() == 50.0
    clock.start()
    assert clock.idle_s == 0.0 and clock.stepped() == 10.0
