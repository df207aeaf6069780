"""The node provider of a rehearsal: Ray's autoscaler (v2, in the head's monitor process) asks it for
nodes of a type, and it starts each as a `ray start --block` process of this machine, in a mount
namespace of its own with private tmpfs mounts (`PRIVATE_MOUNTS`) where the machine allows it (so no file path or
shared-memory segment passes between nodes, as on a real cluster).

Ray's own FakeMultiNodeProvider starts its nodes inside the monitor process, where nothing outside can
find or stop them; here each node is a process group whose pid is written to `nodes.json` in the
rehearsal's directory, so the rehearsal can kill one as a preempted pod dies, and stop them all by pid
at the end. A node whose processes are gone no longer counts as running: the autoscaler sees the
instance gone, as a cloud reports a preempted machine, and launches a replacement if work waits for it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from threading import RLock
from typing import Any

from ray.autoscaler.node_provider import NodeProvider
from ray.autoscaler.tags import (
    NODE_KIND_HEAD,
    NODE_KIND_WORKER,
    STATUS_UP_TO_DATE,
    TAG_RAY_NODE_KIND,
    TAG_RAY_NODE_NAME,
    TAG_RAY_NODE_STATUS,
    TAG_RAY_USER_NODE_TYPE,
)

HEAD_NODE_ID = "f" * 51 + "00000"  # Ray node ids are 28 bytes; the autoscaler matches them to instance ids
PRIVATE_MOUNTS = ("/tmp", "/dev/shm")  # checked: mount points the provider hides from each node it starts on this machine; no actor reads them
# Prefix of a command that runs it in a new mount namespace with fresh, empty tmpfs on PRIVATE_MOUNTS.
UNSHARE = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           " && ".join(f"mount -t tmpfs tmpfs {m}" for m in PRIVATE_MOUNTS) + ' && exec "$@"', "sh"]  # fmt: skip
STOP_GRACE_S = 20


def node_id(serial: int) -> str:
    """The Ray node id (and cloud instance id) of the `serial`-th node launched."""
    return "f" * 51 + str(serial).zfill(5)


def isolation_available() -> bool:
    """Whether nodes can get private mount namespaces here (root or CAP_SYS_ADMIN, util-linux)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


class LocalNodeProvider(NodeProvider):
    """provider_config: gcs_address, dir (logs and nodes.json), isolate, lifetime_s, object_store_bytes."""

    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        NodeProvider.__init__(self, provider_config, cluster_name)
        self.lock = RLock()
        self.dir = Path(provider_config["dir"])
        self.serial = 0
        head_tags = {TAG_RAY_NODE_KIND: NODE_KIND_HEAD, TAG_RAY_USER_NODE_TYPE: "ray.head.default",
                     TAG_RAY_NODE_NAME: HEAD_NODE_ID, TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE}  # fmt: skip
        self.nodes: dict[str, dict[str, Any]] = {HEAD_NODE_ID: {"tags": head_tags, "proc": None}}

    # -- what the autoscaler reads -------------------------------------------------------------------
    def non_terminated_nodes(self, tag_filters: dict[str, str]) -> list[str]:
        with self.lock:
            self._forget_dead()
            return [
                i for i, n in self.nodes.items() if all(n["tags"].get(k) == v for k, v in tag_filters.items())
            ]

    def is_running(self, node_id: str) -> bool:
        with self.lock:
            node = self.nodes.get(node_id)
            return node is not None and (node["proc"] is None or node["proc"].poll() is None)

    def is_terminated(self, node_id: str) -> bool:
        return not self.is_running(node_id)

    def node_tags(self, node_id: str) -> dict[str, str]:
        with self.lock:
            return self.nodes[node_id]["tags"]

    def external_ip(self, node_id: str) -> str:
        return node_id

    def internal_ip(self, node_id: str) -> str:
        return node_id

    def set_node_tags(self, node_id: str, tags: dict[str, str]) -> None:
        with self.lock:
            self.nodes[node_id]["tags"].update(tags)

    @staticmethod
    def bootstrap_config(cluster_config: dict[str, Any]) -> dict[str, Any]:
        return cluster_config

    # -- what it asks for ----------------------------------------------------------------------------
    def create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels) -> None:
        for _ in range(count):
            self._launch(dict(tags), dict(resources), dict(labels or {}))

    def create_node(self, node_config, tags, count) -> None:
        raise NotImplementedError("the rehearsal's node types declare their resources")

    def terminate_node(self, node_id: str) -> None:
        with self.lock:
            node = self.nodes.pop(node_id, None)
            self._write_state()
        if node and node["proc"] is not None:
            threading.Thread(target=stop_node, args=(node["proc"].pid,), daemon=True).start()

    # -- the processes -------------------------------------------------------------------------------
    def _launch(self, tags: dict[str, str], resources: dict[str, float], labels: dict[str, str]) -> None:
        cfg = self.provider_config
        with self.lock:
            self.serial += 1
            nid = node_id(self.serial)
            node_type = tags[TAG_RAY_USER_NODE_TYPE]
            cpus, gpus = resources.pop("CPU", 0), resources.pop("GPU", 0)
            ray = str(Path(sys.executable).with_name("ray"))
            cmd = [ray, "start", "--block", f"--address={cfg['gcs_address']}", "--disable-usage-stats",
                   "--log-style=record", "--log-color=false", f"--num-cpus={int(cpus)}", f"--num-gpus={int(gpus)}",
                   f"--resources={json.dumps(resources)}", f"--object-store-memory={int(cfg['object_store_bytes'])}",
                   "--dashboard-agent-listen-port=0", "--min-worker-port=0", "--max-worker-port=0",
                   "--metrics-export-port=0"]  # fmt: skip
            if labels:
                cmd.append(f"--labels={json.dumps(labels)}")
            if cfg.get("isolate"):
                cmd = UNSHARE + cmd
            cmd = ["timeout", "-k", "30", str(int(cfg["lifetime_s"])), *cmd]
            # RAY_ADDRESS: a bare `ray.init()` in a process of the node (Ray Train's helpers) joins this cluster
            env = dict(os.environ, RAY_OVERRIDE_NODE_ID_FOR_TESTING=nid, RAY_CLOUD_INSTANCE_ID=nid,
                       RAY_NODE_TYPE_NAME=node_type, RAY_ADDRESS=cfg["gcs_address"])  # fmt: skip
            env.pop("TMPDIR", None)  # a node's temp files go to its own /tmp
            log = self.dir / f"node-{self.serial:02d}-{node_type}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # fmt: skip
            all_tags = {TAG_RAY_NODE_KIND: NODE_KIND_WORKER, TAG_RAY_NODE_NAME: nid,
                        TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE, **tags}  # fmt: skip
            self.nodes[nid] = {"tags": all_tags, "proc": proc, "type": node_type, "log": str(log)}
            self._write_state()
            with (self.dir / "launched.jsonl").open(
                "a"
            ) as f:  # every node ever started: the rehearsal checks all went
                f.write(json.dumps({"node_id": nid, "pid": proc.pid, "type": node_type}) + "\n")

    def _forget_dead(self) -> None:
        """Nodes whose processes have gone (killed, or their lifetime ran out) are no longer the cloud's."""
        dead = [i for i, n in self.nodes.items() if n["proc"] is not None and n["proc"].poll() is not None]
        for i in dead:
            del self.nodes[i]
        if dead:
            self._write_state()

    def _write_state(self) -> None:
        state = {i: {"pid": n["proc"].pid, "type": n["type"], "log": n["log"]}
                 for i, n in self.nodes.items() if n["proc"] is not None}  # fmt: skip
        tmp = self.dir / "nodes.json.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(self.dir / "nodes.json")


def node_processes(pid: int) -> list:
    """A node's processes: its `timeout` wrapper and every descendant (core workers included, which put
    themselves in process groups of their own)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_node(pid: int) -> int:
    """SIGKILL to every process of the node at once, as when a machine goes away. Returns how many."""
    procs = node_processes(pid)
    for p in procs:
        with contextlib.suppress(Exception):
            p.kill()
    return len(procs)


def stop_node(pid: int, grace_s: float = STOP_GRACE_S) -> None:
    """SIGINT to the node's `ray start` (it stops its Ray processes and exits), SIGKILL to whatever of it
    is left after `grace_s`."""
    import psutil

    procs = node_processes(pid)
    with contextlib.suppress(psutil.NoSuchProcess):
        for p in psutil.Process(pid).children():  # `ray start` (`unshare`'s shell exec's it), under `timeout`
            p.send_signal(signal.SIGINT)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=10)
