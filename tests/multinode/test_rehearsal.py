"""`dapo-ray rehearse` on the KubeRay manifest: Ray's autoscaler v2 launches the rollout group's nodes as
Serve asks for replicas (0 -> 1 -> 2), replaces a rollout node killed mid-round and a trainer node killed
after a checkpoint, and removes the idle rollout nodes once the run has ended; the run's books balance
(no prompt lost or trained twice). Each node is a `ray start` in a mount namespace of its own; the cluster
runs with token authentication on. Every process the rehearsal started is gone when it returns."""

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _multinode_conftest():
    """This tier's conftest.py by its path: under the name `conftest` Python finds whichever tier's conftest
    pytest imported last."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("multinode_conftest", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module
TIMEOUT_S = 900

pytestmark = pytest.mark.integration


def test_rollout_nodes_follow_serve_and_lost_nodes_are_replaced(tiny_model_dir):
    helpers = _multinode_conftest()
    reason = helpers.namespace_unavailable_reason()
    if reason:
        pytest.skip(reason)
    out = ROOT / ".cache" / "multinode-runs" / f"rehearsal-{uuid.uuid4().hex[:8]}"
    cmd = [str(Path(sys.executable).with_name("dapo-ray")), "rehearse", "--cluster", "cluster/kuberay/raycluster.yaml",
           "--config", "workflows/configs/tiny_cpu.yaml", "--steps", "6", "--lose", "rollout@2", "--lose", "trainer@4",
           "--out-dir", str(out), f"rollout.model_path={tiny_model_dir}",
           # gently, as the other multinode runs: this test is about placement, not learning; small evaluations
           "trainer.lr=1e-4", "eval.n=2", "data.synthetic.num_eval=8"]  # fmt: skip
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, env=helpers._node_env(), capture_output=True, text=True, timeout=TIMEOUT_S
        )
        tail = (done.stdout + done.stderr)[-8000:]
        assert (out / "timeline.json").exists(), f"exit {done.returncode}, no timeline:\n{tail}"
        report = json.loads((out / "timeline.json").read_text())
        launched = [json.loads(line) for line in (out / "launched.jsonl").read_text().splitlines()]
        head_pid = int((out / "head.pid").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    assert done.returncode == 0, tail
    assert all(c["ok"] for c in report["checks"]), report["checks"]

    # The rollout group: no node at start; Serve's first replica waits as a {rollout: 1} demand, a node
    # comes, then a second for the second replica; one is lost and replaced; both go once the run has ended.
    path = report["node_path"]
    assert path["rollout"][:3] == [0, 1, 2], path
    assert path["rollout"][-1] == 0 and 1 in path["rollout"][3:-1], path
    samples = report["samples"]
    first_up = next(i for i, s in enumerate(samples) if s["nodes"]["rollout"]["up"])
    assert any("rollout: 1" in w for s in samples[: first_up + 1] for w in s["waiting"]), samples[
        : first_up + 1
    ]
    # The trainer group keeps its one node, save while its replacement comes.
    assert set(path["trainer"]) <= {0, 1, 2} and path["trainer"][-1] == 1, path
    (restart,) = report["restarts"]
    assert restart["resumed_step"] == 2 and restart["failed_at_step"] > 2, restart
    assert report["steps"] == 6
    events = [e["event"] for e in report["events"]]
    assert sum(e.startswith("lost a rollout node") for e in events) == 1, events
    assert sum(e.startswith("lost a trainer node") for e in events) == 1, events
    assert any(e.startswith("every group back to its floor") for e in events), events
    figures = report["figures"]["rollout"]
    assert len(figures["demand_to_node_s"]) >= 3 and figures["downscale_to_removal_s"], figures
    assert not any(s["head_used"] for s in samples), "work landed on the head"
    # Nothing the rehearsal started outlives it.
    assert len(launched) >= 5  # trainer, rollout x2, and a replacement of each
    alive = [p for p in [head_pid, *(n["pid"] for n in launched)] if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]  # fmt: skip
    assert not alive, alive
