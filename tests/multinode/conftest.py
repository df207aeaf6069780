"""A real multi-node Ray cluster on one machine, each worker node behind its own Linux mount namespace.

Why mount namespaces: the nodes of a real cluster share no /tmp and no /dev/shm. The nodes of a local Ray
cluster (``ray.init``, or several ``ray start`` on one host) share both, so code that hands a file path or a
shared-memory segment from one node to another passes every local test and breaks on the first real
cluster. Here each worker node runs ``ray start`` in a private mount namespace with fresh tmpfs mounts on
/tmp and /dev/shm, so such a hand-off fails exactly as it would between machines. Everything else stays
shared, as on a cluster built from one image and one volume: the repository with its .venv and .cache
(none is under /tmp), the home directory, the network (one IP, so no two nodes may use the same fixed
port) and the process table.

The head node runs in the host namespace: it is the driver's machine. Drivers never run in the pytest
process (the integration tier holds its own ``ray.init`` there): ``MultiNodeCluster.run_driver`` runs a
script in a subprocess, as a user's driver or a ``ray job submit`` entrypoint would.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

# UNSHARE: the prefix that runs a command in a new mount namespace with fresh, empty tmpfs on PRIVATE_MOUNTS,
# as `dapo-ray rehearse` starts its nodes.
from dapo_ray.rehearsal.provider import PRIVATE_MOUNTS, UNSHARE

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
NODE_MAX_LIFETIME_S = 3600  # `timeout` ends a node after this, should the test session die without teardown
START_TIMEOUT_S = 180
# `ray start` gives up when its raylet has not registered within a fixed 30 s, which a loaded 2-core
# machine can exceed; such a node is started again.
START_ATTEMPTS = 3
STOP_TIMEOUT_S = 30
OBJECT_STORE_BYTES = 1_200_000_000
# `ray start --block` prints this once the node runs and the cluster address is written (for a worker
# node: once its raylet has registered with the GCS as alive).
STARTED_MARK = "This command will now block forever"
RESULT_MARK = "@@driver-result@@ "
AUTH_TOKEN = uuid.uuid4().hex
"""The cluster's token (Ray's own tokens are 32 hex digits too); `MultiNodeCluster.auth_headers` for an
in-process client."""
DRIVER_PRELUDE = f'''\
import json as _json


def emit(value):
    """Hand ``value`` (JSON-serialisable) back to the test: run_driver returns the last one emitted."""
    print({RESULT_MARK!r} + _json.dumps(value), flush=True)


'''


@dataclass(frozen=True)
class NodeSpec:
    name: str
    resources: dict[str, float]
    num_cpus: int = 4


HEAD = NodeSpec("head", {"head": 1}, num_cpus=2)
WORKERS = (NodeSpec("rollout", {"rollout": 2}), NodeSpec("trainer", {"trainer": 2}))


@dataclass
class Node:
    """One ``ray start --block``: its process group is the node (save core workers, see _stop)."""

    spec: NodeSpec
    cmd: list[str]  # the whole command line: timeout [unshare ...] ray start ...
    metrics_port: int  # the node's Prometheus endpoint: the Ray metrics of every process on it
    isolated: bool  # in its own mount namespace (a separate machine); False for the head only
    proc: subprocess.Popen | None = None
    log: Path | None = None  # `ray start`'s output, of the latest attempt
    attempts: int = 0

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def _node_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # a stray address would make `ray start --head` join another cluster
    env.pop("TMPDIR", None)  # tempfile must use the node's private /tmp, not a shared directory
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        TORCH_EXTENSIONS_DIR=str(ROOT / ".cache" / "torch_extensions"),
        DS_ACCELERATOR="cpu",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        # Token authentication on, as on a user's cluster, with the token in the environment of every node,
        # driver and CLI call (as KubeRay gives it to every container). Pinned: left unset, a head enables
        # it only where ~/.ray/auth_token exists, and `ray start --address` on a worker node does not.
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=AUTH_TOKEN,
        DASHBOARD_METRIC_PORT="0",  # default 44227 is fixed: any second Ray head on this host collides
        # A job's entrypoint (`python ...`) runs with the head's PATH: it must find the venv's Python.
        PATH=os.pathsep.join(filter(None, [str(Path(sys.executable).parent), os.environ.get("PATH")])),
    )
    return env


def _ray_start_args(spec: NodeSpec, metrics_port: int, object_store_bytes: int = OBJECT_STORE_BYTES) -> list[str]:
    # Port 0 wherever Ray allows it: the OS picks a free port. The defaults of the dashboard agent (52365),
    # the worker port range (10002-19999) and the head's client server (10001; 0 is refused there, see
    # start) are fixed, and all the nodes share one IP. `--node-ip-address=127.0.0.1` would not help:
    # Ray replaces a loopback address by the host's reachable IP, so it is left out.
    return [
        RAY, "start", "--block", "--disable-usage-stats", "--log-style=record", "--log-color=false",
        f"--num-cpus={spec.num_cpus}", f"--resources={json.dumps(spec.resources)}",
        f"--object-store-memory={object_store_bytes}",
        "--dashboard-agent-listen-port=0", "--min-worker-port=0", "--max-worker-port=0",
        f"--metrics-export-port={metrics_port}",
    ]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def namespace_unavailable_reason() -> str | None:
    """Why a node cannot get a private mount namespace here (None when it can)."""
    missing = [tool for tool in ("unshare", "timeout", "sh") if shutil.which(tool) is None]
    if missing:
        return f"multinode tests need {', '.join(missing)} on PATH"
    hidden = [m for m in PRIVATE_MOUNTS if ROOT.is_relative_to(m)]
    if hidden:
        return f"the repository ({ROOT}) is under {hidden[0]}, which worker nodes do not see; check it out elsewhere"
    probe = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode == 0:
        return None
    error = probe.stderr.strip() or f"exit status {probe.returncode}"
    return (
        "multinode tests need `unshare --mount` and `mount -t tmpfs` (root or CAP_SYS_ADMIN; "
        f"euid is {os.geteuid()}): {error}"
    )


class MultiNodeCluster:
    """Ray nodes on this machine: the head in the host namespace, each worker node in its own namespace."""

    def __init__(self, workdir: Path, object_store_bytes: int = OBJECT_STORE_BYTES):
        self.workdir = workdir
        self.object_store_bytes = object_store_bytes  # per node
        # The head gets its own temp dir, not /tmp/ray: `ray start` writes the cluster address into
        # <temp dir>/ray_current_cluster, and a bare `ray.init()` on this host (the integration tier's)
        # would otherwise join this cluster. Short, under /tmp: Ray's unix socket paths live in it.
        self.head_temp_dir = Path(tempfile.mkdtemp(prefix="ray-mn-", dir="/tmp"))
        self.nodes: list[Node] = []
        self.address = ""  # the GCS address, host:port, once started
        self.dashboard_url = ""  # the dashboard and Jobs API, http://127.0.0.1:port, if the head has one
        self._serial = itertools.count(1)  # numbers the log and script files

    def start(self, workers: tuple[NodeSpec, ...] = WORKERS, dashboard: bool = False) -> None:
        """Start the head, then the worker nodes. With ``dashboard`` the head serves the dashboard and the
        Jobs API (``ray job submit --address {dashboard_url}``) on a free port of the loopback interface;
        the Jobs API hands a job to the head's dashboard agent, whose port is free-allocated on every node."""
        head_args = [
            "--head", "--port=0", f"--temp-dir={self.head_temp_dir}", f"--ray-client-server-port={_free_port()}",
        ]  # fmt: skip
        if dashboard:
            port = _free_port()  # the default, 8265, is any local Ray's; 0 would leave the URL unknown
            head_args += ["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={port}"]  # fmt: skip
            self.dashboard_url = f"http://127.0.0.1:{port}"
        else:
            head_args.append("--include-dashboard=false")
        self._wait_started([self._add(HEAD, head_args, isolated=False)])
        self.address = (self.head_temp_dir / "ray_current_cluster").read_text().strip()
        self._wait_started([self._add_worker(spec) for spec in workers])

    def add_node(self, resources: dict[str, float], num_cpus: int = 4, name: str | None = None) -> Node:
        """Start one more worker node (its own mount namespace) and wait until it has joined the cluster."""
        spec = NodeSpec(name or "-".join(resources) or "worker", dict(resources), num_cpus)
        node = self._add_worker(spec)
        self._wait_started([node])
        return node

    def remove_node(self, node: Node) -> None:
        """Stop one node (SIGINT to its `ray start`, SIGKILL after STOP_TIMEOUT_S) and check that none of its
        processes remain."""
        self.nodes.remove(node)
        _stop(node)

    def shutdown(self) -> None:
        """Stop the worker nodes, then the head; raise if any of their processes survive."""
        errors = []
        for node in reversed(self.nodes[:]):
            try:
                self.remove_node(node)
            except RuntimeError as e:
                errors.append(str(e))
        shutil.rmtree(self.head_temp_dir, ignore_errors=True)
        if errors:
            raise RuntimeError("\n".join(errors))

    def run_driver(self, script: str, timeout_s: float = 120) -> Any:
        """Run ``script`` as a Ray driver in a subprocess on the head's machine (RAY_ADDRESS set: a plain
        ``ray.init()`` joins this cluster; the working directory is the repository). The script may call
        ``emit(value)``; the last value emitted is returned. A non-zero exit or a timeout fails the test
        with the driver's output (which includes what its tasks printed)."""
        path = self.workdir / f"driver-{next(self._serial)}.py"
        path.write_text(DRIVER_PRELUDE + textwrap.dedent(script))
        env = self.head_env() | {"RAY_ADDRESS": self.address}
        cmd = [sys.executable, str(path)]
        try:
            done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"driver {path} timed out after {timeout_s} s\n{_tails(e.stdout, e.stderr)}")
        if done.returncode != 0:
            pytest.fail(f"driver {path} exited with {done.returncode}\n{_tails(done.stdout, done.stderr)}")
        results = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
        return json.loads(results[-1].removeprefix(RESULT_MARK)) if results else None

    def metrics_url(self, name: str) -> str:
        """The Prometheus endpoint of the node named `name` ("head", "rollout", "trainer")."""
        (node,) = [n for n in self.nodes if n.spec.name == name]
        return f"http://127.0.0.1:{node.metrics_port}/metrics"

    @property
    def auth_headers(self) -> dict[str, str]:
        """The HTTP header that authenticates a client in this process (whose own Ray may run without
        authentication, or with another token) to this cluster's dashboard and Jobs API."""
        return {"authorization": f"Bearer {AUTH_TOKEN}"}

    def head_env(self) -> dict[str, str]:
        """The environment of a process on the head's machine (a driver, the `ray` CLI): the nodes' own,
        with the venv's bin first on PATH and no RAY_ADDRESS."""
        return _node_env()

    def _add_worker(self, spec: NodeSpec) -> Node:
        return self._add(spec, [f"--address={self.address}"], isolated=True)

    def _add(self, spec: NodeSpec, extra_args: list[str], isolated: bool) -> Node:
        metrics_port = _free_port()
        cmd = _ray_start_args(spec, metrics_port, self.object_store_bytes) + extra_args
        if isolated:
            cmd = UNSHARE + cmd
        node = Node(spec, ["timeout", "-k", "30", str(NODE_MAX_LIFETIME_S), *cmd], metrics_port, isolated)
        self.nodes.append(node)
        self._launch(node)
        return node

    def _launch(self, node: Node) -> None:
        node.attempts += 1
        node.log = self.workdir / f"{node.spec.name}-{next(self._serial)}.log"
        with node.log.open("wb") as out:
            node.proc = subprocess.Popen(node.cmd, env=_node_env(), stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def _wait_started(self, nodes: list[Node]) -> None:
        """Wait until each node's `ray start` prints STARTED_MARK. One that exits first is started again,
        up to START_ATTEMPTS times in all; then it fails with the log."""
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = list(nodes)
        while pending:
            for node in pending[:]:
                if STARTED_MARK in node.log.read_text(errors="replace"):
                    pending.remove(node)
                elif node.proc.poll() is not None and node.attempts < START_ATTEMPTS:
                    self._launch(node)  # the failed `ray start` has stopped what it had started
                elif node.proc.poll() is not None:
                    raise RuntimeError(f"node {node.spec.name} exited with {node.proc.returncode} while "
                                       f"starting, {node.attempts} times; last log {node.log}:\n"
                                       f"{node.log_tail()}")  # fmt: skip
            if pending and time.monotonic() > deadline:
                tails = "\n".join(f"--- {n.spec.name} ({n.log}):\n{n.log_tail()}" for n in pending)
                raise RuntimeError(f"nodes not started after {START_TIMEOUT_S} s:\n{tails}")
            time.sleep(0.2)


def _tails(stdout: str | bytes | None, stderr: str | bytes | None, chars: int = 6000) -> str:
    def text(s: str | bytes | None) -> str:
        return (s.decode(errors="replace") if isinstance(s, bytes) else s or "")[-chars:]

    return f"--- stdout:\n{text(stdout)}\n--- stderr:\n{text(stderr)}"


def _stop(node: Node) -> None:
    """One SIGINT makes `ray start --block` stop the node's Ray processes (its atexit handler) and exit.
    Not to the whole process group: `timeout` passes a SIGINT on to `ray start` again, and a second one
    aborts that handler halfway. Core workers put themselves in process groups of their own, so every
    descendant is recorded first and waited for by PID; what is still alive after STOP_TIMEOUT_S gets
    SIGKILL, as does the process group."""
    procs: list[psutil.Process] = []
    if node.proc.poll() is None:  # so the PID is still this `timeout`; its one child is `ray start`
        with contextlib.suppress(psutil.NoSuchProcess):
            wrapper = psutil.Process(node.proc.pid)
            procs = [wrapper, *wrapper.children(recursive=True)]
            for ray_start in wrapper.children():
                ray_start.send_signal(signal.SIGINT)
    survivors = _wait_gone(procs, STOP_TIMEOUT_S)
    if survivors:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.proc.pid, signal.SIGKILL)
        for proc in survivors:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        survivors = _wait_gone(survivors, 10)
    node.proc.wait(timeout=10)
    if survivors:
        raise RuntimeError(f"node {node.spec.name}: processes survived SIGKILL: {survivors}")


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The processes still running; a zombie counts as gone (nothing here guarantees it gets reaped)."""
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while (procs := _alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return procs


@pytest.fixture(scope="session")
def multinode_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiNodeCluster]:
    """A head node (resource "head") and two worker nodes, "rollout" and "trainer" (resources of those
    names, 2 each), each worker in its own mount namespace. The head serves the Jobs API at
    ``cluster.dashboard_url``. One cluster serves every test: the dashboard costs little (measured on 2
    cores: ~250 MiB of unique memory in 12 more processes, ~3% of a core while idle, seconds at start),
    a second cluster ~1 min to start and stop and ~2 GiB more while both run.
    Started on first use, stopped at session end."""
    reason = namespace_unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = MultiNodeCluster(tmp_path_factory.mktemp("multinode"))
    try:
        cluster.start(dashboard=True)
        yield cluster
    finally:
        cluster.shutdown()
