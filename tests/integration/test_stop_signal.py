"""`dapo-ray train` stopped with SIGTERM, as `ray job stop`, Kubernetes or a batch scheduler stops it: the
run ends after the step in progress with a checkpoint of that step, says how to resume, and leaves none
of the Ray processes it started."""

import contextlib
import json
import os
import re
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


@pytest.fixture(scope="module")
def stopped(tiny_model_dir, tmp_path_factory) -> dict:
    """A 50-step run stopped with SIGTERM once it printed step 2: its output directory, console and exit
    status, and which of the processes it started were still running a minute after it ended."""
    out = tmp_path_factory.mktemp("stopped") / "run"
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
        _, alive = psutil.wait_procs(started, timeout=60)
        for p in alive:  # ours, by id: do not leave them to the next test
            p.kill()
    return {"out": out, "text": "".join(seen), "returncode": proc.returncode, "alive": alive}


def test_sigterm_checkpoints_the_step_and_shuts_the_cluster_down(stopped):
    out, text = stopped["out"], stopped["text"]
    assert stopped["returncode"] == 0, text[-6000:]
    assert "Ray dashboard: http://127.0.0.1:" in text and "token authentication is on" in text, text[:3000]
    stopped_lines = [line for line in text.splitlines() if "stopped by SIGTERM at step" in line]
    assert len(stopped_lines) == 1 and "run the same command again" in stopped_lines[0], text[-6000:]
    step = int(stopped_lines[0].split("stopped by SIGTERM at step ")[1].split()[0])
    assert 2 <= step < 50

    # Nothing the run started is left behind (a default SIGTERM left the dashboard's agents running).
    assert not stopped["alive"], [(p.pid, p.name()) for p in stopped["alive"]]

    # What a resume needs: a checkpoint of that step, with the driver's state (data cursor, carried groups),
    # the newest in the run's storage (a resume loads the newest; test_end_to_end's stop-at-the-cap test
    # resumes from a checkpoint saved this way, test_driver_killed from a periodic one).
    (latest, *_) = sorted((p for p in (out / "ray_train").glob("*/checkpoint_*") if p.is_dir()), reverse=True)
    state = json.loads((latest / "driver_state.json").read_text())
    assert state["step"] == step and "cursor" in state, state
    # What the processes held at their peak, measured by them, with the checkpoint and beside the run.
    assert set(state["memory"]) == {"driver", "rollout replica", "trainer worker"}, state["memory"]
    assert json.loads((out / "memory.json").read_text()).keys() == state["memory"].keys()


def test_out_of_memory_ends_the_run_with_one_plain_message(stopped, tiny_model_dir):
    """The stopped run resumed where Ray's memory monitor stops any process once the machine's memory in
    use passes 1% (RAY_memory_usage_threshold, the test's own limit; 95% by default): the first process
    of the run to start is stopped, and the run ends at once (exit 3) with a short message instead of a
    traceback: the process and what it held, the machine's memory, what the run held at its peak (measured
    before the stop), and the command that resumes from the checkpoint. Nothing it started is left."""
    out = stopped["out"]
    step = int(stopped["text"].split("stopped by SIGTERM at step ")[1].split()[0])
    env = _env() | {"RAY_memory_usage_threshold": "0.01"}
    proc = subprocess.Popen(_command(tiny_model_dir, out, 50), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    started: dict[int, psutil.Process] = {}
    try:
        deadline = time.time() + 240
        while proc.poll() is None and time.time() < deadline:
            with contextlib.suppress(psutil.Error):
                started |= {p.pid: p for p in psutil.Process(proc.pid).children(recursive=True)}
            time.sleep(0.5)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        _, alive = psutil.wait_procs(list(started.values()), timeout=60)
        for p in alive:
            p.kill()
    assert proc.returncode == 3, stdout[-4000:] + stderr[-4000:]
    said = stderr[stderr.index("dapo-ray: out of memory."):].strip().splitlines()
    assert len(said) <= 10, said
    first, machine, need, _advice, resume, full = said
    assert "Ray's memory monitor stopped " in first and re.search(r"\(pid \d+, holding [\d.]+ GiB\)", first), said
    assert any(kind in first for kind in ("the weight store", "the trainer channel", "Serve's controller",
                                          "a rollout replica", "a trainer worker", "Ray Train's controller")), first
    assert re.search(r"That machine: [\d.]+ of its [\d.]+ GiB in use, past the 1.0% ", machine), machine
    assert re.search(r"driver [\d.]+ GiB, rollout replica [\d.]+ GiB, trainer worker [\d.]+ GiB x2: [\d.]+ GiB in all",
                     need), need  # fmt: skip
    assert f"To resume from the checkpoint of step {step}, run the same command again: " in resume, resume
    assert "dapo-ray train --config" in resume, resume
    assert "Traceback" not in stdout + stderr, stdout + stderr
    error_log = Path(full.split("The error in full: ")[1])
    assert error_log.parent == out and "Traceback" in error_log.read_text()
    assert not alive, [(p.pid, p.name()) for p in alive]
