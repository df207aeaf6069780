"""`ray job submit`, as cluster/README.md has a user type it, against the multinode cluster's Jobs API: the
checkout is uploaded with cluster/runtime_env.yaml's excludes, the entrypoint (workflows/train.py) runs on
the head and joins the cluster, the rollout replica and the trainer workers run on their own nodes, and the
run leaves its MLflow record and final model on the storage every node sees. Its reward is a function of
the user's own (workflows/tasks/answer_line.py), which reaches the job with the uploaded checkout. The cluster runs with Ray's
token authentication on, and the CLI gets the token as a user's laptop would (RAY_AUTH_MODE=token and
RAY_AUTH_TOKEN in its environment, cluster/README.md "Authentication")."""

import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_ENV = ROOT / "cluster" / "runtime_env.yaml"
STEPS = 3
REWARD = "workflows/tasks/answer_line.py:compute_score"
JOB_TIMEOUT_S = 900
# cluster/README.md: the checkout "under 1 MiB with the excludes of runtime_env.yaml".
UPLOAD_LIMIT_BYTES = 2**20
# The bulk of a checkout, which those excludes keep behind.
LEFT_BEHIND = (".venv", ".cache", ".git", "runs", "mlruns")

pytestmark = pytest.mark.integration


def test_train_job_submitted_with_the_cli(tiny_model_dir, multinode_cluster, tmp_path, monkeypatch):
    from ray.job_submission import JobStatus, JobSubmissionClient

    out = ROOT / ".cache" / "multinode-runs" / f"job-{uuid.uuid4().hex[:8]}"
    overrides = [
        f"rollout.model_path={tiny_model_dir}", f"trainer.output_dir={out}",
        "rollout.resources={rollout: 1}", "trainer.resources={trainer: 1}",
        "trainer.num_workers=2", f"trainer.total_steps={STEPS}", "trainer.train_batch_size=4",
        "trainer.gen_batch_size=8", "trainer.mini_batch_size=16", "trainer.micro_batch_size=4",
        "trainer.save_every=0", "eval.every=0", "data.synthetic.num_eval=8", "eval.n=2",
        # Four one-group updates a step at the config's lr (5e-4) can collapse the tiny model within two steps
        # (every reply "Answe"), and the run then rightly stops early, with fewer steps than asked: this test is
        # about the job, so it trains gently.
        "trainer.lr=1e-4",
        # A reward function of the user's own, a path in the checkout: it reaches the job through --working-dir.
        f"reward.function={REWARD}",
    ]  # fmt: skip
    job_id = f"dapo-mn-{uuid.uuid4().hex[:8]}"
    url = multinode_cluster.dashboard_url
    # Token authentication is on (the cluster's nodes run with RAY_AUTH_MODE=token): the CLI without the
    # token is turned away, as on a user's cluster; with RAY_AUTH_MODE=token and RAY_AUTH_TOKEN it is let in.
    home = tmp_path / "home"  # no ~/.ray/auth_token to fall back on
    home.mkdir()
    no_token = {k: v for k, v in multinode_cluster.head_env().items() if k != "RAY_AUTH_TOKEN"} | {"HOME": str(home)}
    refused = _run(["ray", "job", "list", f"--address={url}"], env=no_token, timeout_s=120)
    assert refused.returncode != 0 and "authentication" in refused.stdout.lower(), refused.stdout[-3000:]
    # The test's own client: RAY_ADDRESS and RAY_API_SERVER_ADDRESS would override its address (Ray's
    # `get_address_for_submission_client`), and this process may have joined the integration tier's cluster.
    for k in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    client = JobSubmissionClient(url, headers=multinode_cluster.auth_headers)
    # From the repository root, as a user would: relative paths are the checkout's.
    submitted = _run(
        ["ray", "job", "submit", f"--address={url}", f"--submission-id={job_id}",
         f"--runtime-env={RUNTIME_ENV.relative_to(ROOT)}", "--working-dir=.", "--no-wait", "--",
         "python", "workflows/train.py", "--config", "workflows/configs/tiny_cpu.yaml", *overrides],
        env=multinode_cluster.head_env(), timeout_s=300,
    )  # fmt: skip
    assert submitted.returncode == 0, f"ray job submit: exit {submitted.returncode}\n{submitted.stdout}"

    try:
        status = _wait_finished(client, job_id, JOB_TIMEOUT_S)
    finally:  # never leave a run behind on the cluster the next tests use
        if not client.get_job_status(job_id).is_terminal():
            client.stop_job(job_id)
    info = client.get_job_info(job_id)
    logs = client.get_job_logs(job_id)
    reason = (info.message or "").split("\n", 1)[0]  # a failed job's message goes on with the log's end
    tail = f"job {job_id}: {status}, {reason}\n--- log tail:\n{logs[-6000:]}"
    assert status == JobStatus.SUCCEEDED, tail

    # The upload: what reached the head (unpacked from gcs://_ray_pkg_<hash>.zip) is the checkout less
    # runtime_env.yaml's excludes.
    package = info.runtime_env["working_dir"].removeprefix("gcs://").removesuffix(".zip")
    session = multinode_cluster.head_temp_dir / "session_latest"
    uploaded = session / "runtime_resources" / "working_dir_files" / package
    assert uploaded.is_dir(), f"{info.runtime_env['working_dir']} not unpacked at {uploaded}\n{tail}"
    size = sum(f.stat().st_size for f in uploaded.rglob("*") if f.is_file())
    top = {p.name for p in uploaded.iterdir()}
    assert {"dapo_ray", "workflows", "cluster"} <= top, f"uploaded: {sorted(top)}\n{tail}"
    assert not top & set(LEFT_BEHIND), f"uploaded despite the excludes: {top & set(LEFT_BEHIND)}\n{tail}"
    assert 0 < size < UPLOAD_LIMIT_BYTES, f"{size / 2**20:.2f} MiB uploaded from the checkout\n{tail}"
    env_vars = yaml.safe_load(RUNTIME_ENV.read_text())["env_vars"]
    assert info.runtime_env.get("env_vars", {}) == env_vars, f"{info.runtime_env}\n{tail}"

    # The reward function was imported from the uploaded checkout, not from this one, and scored every reply.
    loaded = re.findall(rf"reward function {re.escape(REWARD)}: verl convention, from (\S+);", logs)
    assert loaded and Path(loaded[0]) == (uploaded / "workflows" / "tasks" / "answer_line.py").resolve(), tail
    assert "could not be scored" not in logs and "a call failed" not in logs, tail

    # The job's log: one line per step, then the final model on the shared storage.
    steps = [int(s) for s in re.findall(rf"\] step (\d+)/{STEPS} ", logs)]
    assert steps == list(range(1, STEPS + 1)), tail
    final = re.findall(r"\] final model: (\S+)", logs)
    assert len(final) == 1 and Path(final[0]).is_relative_to(out), tail
    _check_mlflow_run(out, tail)
    _check_final_model(Path(final[0]), tiny_model_dir, tail)
    shutil.rmtree(out, ignore_errors=True)  # kept when a check fails, for a look


def _check_mlflow_run(out: Path, tail: str) -> None:
    """The run's MLflow record, read back from its SQLite store under output_dir (the driver's default)."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert [(r.info.run_name, r.info.status) for r in runs] == [(out.name, "FINISHED")], tail
    run_id = runs[0].info.run_id
    sync_diff = {m.step: m.value for m in client.get_metric_history(run_id, "weight_sync/logprob_max_diff")}
    sync_bytes = {m.step: m.value for m in client.get_metric_history(run_id, "weight_sync/bytes")}
    seen = f"logprob_max_diff {sync_diff}, bytes {sync_bytes}\n{tail}"
    assert sorted(sync_diff) == sorted(sync_bytes) == list(range(1, STEPS + 1)), seen
    # The replica on the rollout node serves exactly the weights the trainer node sent it.
    assert all(v < 1e-4 for v in sync_diff.values()), seen
    assert all(v > 0 for v in sync_bytes.values()), seen
    errors = [m.value for name in ("reward/errors", "reward/timeouts") for m in client.get_metric_history(run_id, name)]
    assert len(errors) == 2 * STEPS and not any(errors), f"reward errors and timeouts {errors}\n{tail}"


def _check_final_model(final: Path, initial: Path, tail: str) -> None:
    """A Hugging Face directory transformers loads, with the trained weights (not the initial ones)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        trained = AutoModelForCausalLM.from_pretrained(final, torch_dtype=torch.float32)
        AutoTokenizer.from_pretrained(final)
    except (OSError, ValueError) as e:
        pytest.fail(f"transformers cannot load the final model {final}: {e}\n{tail}")
    before = AutoModelForCausalLM.from_pretrained(initial, torch_dtype=torch.float32)
    a, b = trained.state_dict(), before.state_dict()
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a), tail
    assert any(not torch.equal(a[k], b[k]) for k in a), f"the final model has the initial weights\n{tail}"


def _run(cmd: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repository root in a process group of its own, which gets SIGINT (then
    SIGKILL) at the timeout; stdout and stderr together."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        stdout, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            stdout, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:3])} timed out after {timeout_s} s:\n{stdout[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout)


def _wait_finished(client, job_id: str, timeout_s: float):
    """Poll the job's status until it is terminal; past the timeout stop the job and fail with its log."""
    deadline = time.monotonic() + timeout_s
    while not (status := client.get_job_status(job_id)).is_terminal():
        if time.monotonic() > deadline:
            client.stop_job(job_id)
            pytest.fail(f"job {job_id} still {status} after {timeout_s} s; stopped it\n--- log tail:\n"
                        f"{client.get_job_logs(job_id)[-6000:]}")  # fmt: skip
        time.sleep(5)
    return status
