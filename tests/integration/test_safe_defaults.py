"""A cluster that `dapo-ray train` / `demo` / `eval` starts for itself answers on this machine only: its
GCS, dashboard and metrics ports take connections on 127.0.0.1 and refuse them on the machine's other
addresses. (A cluster the run joins, `cluster.address` or RAY_ADDRESS, is configured by whoever started it.)
Runs in its own process: the tier's shared cluster is already initialised in this one."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, sys
import ray
from dapo_ray.config import load_config
from dapo_ray.ray_cluster import init_ray

init_ray(load_config("workflows/configs/tiny_cpu.yaml", ["cluster.num_cpus=1"]))
node = ray._private.worker.global_worker.node
ports = {"gcs": int(node.gcs_address.rsplit(":", 1)[1]), "metrics": node.metrics_export_port,
         "dashboard": int((node.address_info.get("webui_url") or ":0").rsplit(":", 1)[1])}
print("PORTS " + json.dumps({"node_ip": node.node_ip_address, "ports": ports}), flush=True)
sys.stdin.readline()  # until the test has looked
ray.shutdown()
"""

pytestmark = pytest.mark.integration


def _other_address() -> str | None:
    """An IPv4 address of this machine other than loopback."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=3):
            return True
    except OSError:
        return False


def test_a_local_cluster_listens_on_localhost_only():
    other = _other_address()
    if other is None:
        pytest.skip("this machine has no address besides loopback")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        # The run's own start-up lines (the dashboard's address) come first.
        line = ""
        for line in proc.stdout:
            if line.startswith("PORTS "):
                break
        assert line.startswith("PORTS "), f"the cluster did not start (exit {proc.poll()})"
        info = json.loads(line.removeprefix("PORTS "))
        assert info["node_ip"] == "127.0.0.1"
        for name, port in info["ports"].items():
            if not port:
                continue  # no dashboard without its optional dependencies
            assert _accepts("127.0.0.1", port), f"{name} port {port} does not answer on 127.0.0.1"
            assert not _accepts(other, port), f"{name} port {port} answers on {other}"
    finally:
        if proc.poll() is None:
            proc.stdin.write("done\n")
            proc.stdin.flush()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
