"""`dapo-ray train` stopped with SIGTERM, as `ray job stop`, Kubernetes or a batch scheduler stops it: the
run ends after the step in progress with a checkpoint of that step, says how to resume, and leaves none
of the Ray processes it started."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from test_end_to_end import COMMON, TINY_CFG

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DAPO_RAY = str(Path(sys.executable).with_name("dapo-ray"))


def _command(tiny_model_dir: Path, out: Path, total_steps: int) -> list[str]:
    return [DAPO_RAY, "train", "--config", str(TINY_CFG), *COMMON, f"rollout.model_path={tiny_model_dir}",
            f"trainer.output_dir={out}", f"trainer.total_steps={total_steps}", "trainer.save_every=0",
            "cluster.num_cpus=4"]  # fmt: skip


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local cluster of its own
    # Token authentication on, as a user's first run has it, with a token of this test's own.
    return env | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex, "DS_ACCELERATOR": "cpu"}


def test_sigterm_checkpoints_the_step_and_shuts_the_cluster_down(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(_command(tiny_model_dir, out, 50), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    seen: list[str] = []
    started: list[psutil.Process] = []
    try:
        deadline = time.time() + 600
        for line in proc.stdout:
            seen.append(line)
            if "] step 2/50 " in line or time.time() > deadline:
                break
        assert any("] step 2/50 " in line for line in seen), "".join(seen[-60:])
        # Every process the run started (Ray's GCS, raylet, dashboard and its agents, the workers).
        started = psutil.Process(proc.pid).children(recursive=True)
        assert len(started) > 3, started
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=300)
        seen.append(rest)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    text = "".join(seen)
    assert proc.returncode == 0, text[-6000:]
    assert "Ray dashboard: http://127.0.0.1:" in text and "token authentication is on" in text, text[:3000]
    stopped = [line for line in text.splitlines() if "stopped by SIGTERM at step" in line]
    assert len(stopped) == 1 and "run the same command again" in stopped[0], text[-6000:]
    step = int(stopped[0].split("stopped by SIGTERM at step ")[1].split()[0])
    assert 2 <= step < 50

    # Nothing the run started is left behind (a default SIGTERM left the dashboard's agents running).
    _, alive = psutil.wait_procs(started, timeout=60)
    for p in alive:  # ours, by id: do not leave them to the next test
        p.kill()
    assert not alive, [(p.pid, p.name()) for p in alive]

    # What a resume needs: a checkpoint of that step, with the driver's state (data cursor, carried groups),
    # the newest in the run's storage (a resume loads the newest; test_end_to_end's stop-at-the-cap test
    # resumes from a checkpoint saved this way, test_driver_killed from a periodic one).
    (latest, *_) = sorted((p for p in (out / "ray_train").glob("*/checkpoint_*") if p.is_dir()), reverse=True)
    state = json.loads((latest / "driver_state.json").read_text())
    assert state["step"] == step and "cursor" in state, state
