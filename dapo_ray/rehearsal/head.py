"""The rehearsal's Ray cluster: a head node (no CPUs for work, as the manifests' heads) that runs Ray's
autoscaler v2 over `provider.LocalNodeProvider`, and the worker nodes the autoscaler launches. Every
process it starts is bounded by `timeout` and stopped by its own pid: nothing else on the machine is
touched (stopping Ray by its name would end every Ray of the user)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from dapo_ray.rehearsal.groups import ClusterDescription, autoscaler_config
from dapo_ray.rehearsal.provider import HEAD_NODE_ID, kill_node, stop_node

STARTED_MARK = "This command will now block forever"  # `ray start --block`, once the node runs
START_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Head:
    """`with Head(desc, workdir) as head:` starts the cluster, `head.address` is its GCS address."""

    def __init__(self, desc: ClusterDescription, workdir: Path, isolate: bool, lifetime_s: int,
                 object_store_bytes: int, dashboard: bool) -> None:  # fmt: skip
        self.desc, self.workdir, self.lifetime_s = desc, workdir, lifetime_s
        self.isolate, self.object_store_bytes, self.dashboard = isolate, object_store_bytes, dashboard
        # Short, under /tmp: Ray's unix sockets live in the temp dir (a path length limit of 107 bytes).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ray-rh-", dir="/tmp"))  # checked: the head's own, on this machine; no actor reads it
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.dashboard_url = ""

    def __enter__(self) -> Head:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        from ray._private.services import get_node_ip_address

        for stale in (
            "nodes.json",
            "launched.jsonl",
            "head.pid",
        ):  # an earlier rehearsal's: its pids are not ours
            (self.workdir / stale).unlink(missing_ok=True)
        port = _free_port()
        self.address = f"{get_node_ip_address()}:{port}"
        config = autoscaler_config(self.desc, {
            "type": "external", "module": "dapo_ray.rehearsal.provider.LocalNodeProvider",
            "gcs_address": self.address, "dir": str(self.workdir), "isolate": self.isolate,
            "lifetime_s": self.lifetime_s, "object_store_bytes": self.object_store_bytes})  # fmt: skip
        config_path = self.workdir / "autoscaler.yaml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        ray = str(Path(sys.executable).with_name("ray"))
        cmd = [ray, "start", "--head", "--block", f"--port={port}", f"--temp-dir={self.temp_dir}", "--num-cpus=0",
               f"--autoscaling-config={config_path}", "--disable-usage-stats", "--log-style=record",
               "--log-color=false", f"--ray-client-server-port={_free_port()}", "--dashboard-agent-listen-port=0",
               "--min-worker-port=0", "--max-worker-port=0", "--metrics-export-port=0",
               f"--object-store-memory={self.object_store_bytes}"]  # fmt: skip
        # Ray runs a minimal dashboard process even without the dashboard, on 8265 unless told: a free port
        # of the loopback interface, so a Ray of the user's own on this machine is never in the way.
        dash = _free_port()
        cmd += [
            f"--include-dashboard={str(self.dashboard).lower()}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
        ]
        self.dashboard_url = f"http://127.0.0.1:{dash}" if self.dashboard else ""
        env = dict(os.environ, RAY_enable_autoscaler_v2="1", AUTOSCALER_UPDATE_INTERVAL_S="1",
                   RAY_OVERRIDE_NODE_ID_FOR_TESTING=HEAD_NODE_ID, RAY_CLOUD_INSTANCE_ID=HEAD_NODE_ID,
                   RAY_NODE_TYPE_NAME="ray.head.default",
                   # the monitor imports the provider from this checkout; the nodes it starts inherit it
                   PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                            os.environ.get("PYTHONPATH")])))  # fmt: skip
        # A bare `ray.init()` in any of the cluster's processes (Ray Train's helpers) must join this cluster, not
        # guess among the Rays of the machine; `ray start --head` itself does not read it.
        env["RAY_ADDRESS"] = self.address
        log = self.workdir / "head.log"
        with log.open("wb") as out:
            self.proc = subprocess.Popen(["timeout", "-k", "30", str(self.lifetime_s), *cmd], env=env,
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip
        (self.workdir / "head.pid").write_text(str(self.proc.pid))
        deadline = time.monotonic() + START_TIMEOUT_S
        while STARTED_MARK not in log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the rehearsal's head node did not start; {log}:\n"
                                   f"{log.read_text(errors='replace')[-3000:]}")  # fmt: skip
            time.sleep(0.2)

    def nodes(self) -> dict[str, dict]:
        """The worker nodes the provider has running: node id -> {pid, type, log}."""
        path = self.workdir / "nodes.json"
        for _ in range(5):  # the provider replaces it atomically; a read may race a first write
            try:
                return json.loads(path.read_text()) if path.exists() else {}
            except json.JSONDecodeError:
                time.sleep(0.1)
        return {}

    def lose(self, group: str) -> str | None:
        """Kill every process of one running node of `group` at once (a preempted pod); its node id."""
        for nid, node in sorted(self.nodes().items()):
            if node["type"] == group and kill_node(node["pid"]):
                return nid
        return None

    def stop(self) -> None:
        """The head first (its autoscaler launches nothing more), then every worker node it launched."""
        if self.proc is not None:
            stop_node(self.proc.pid)
            self.proc.wait(timeout=30)
        for node in self.nodes().values():
            stop_node(node["pid"])
        shutil.rmtree(self.temp_dir, ignore_errors=True)
