"""Memory: the most each kind of process of a run held, and one plain message when a process of the run was
stopped for want of memory.

Two killers stop a process that the machine has no memory left for. Ray's memory monitor (on each node's
raylet) stops a worker once the node's memory in use passes a share of it, RAY_memory_usage_threshold
(0.95 by default), and records why in the GCS: the dead actor's `death_cause.oom_context`, with the node's
memory, the threshold and what the process held. The kernel's OOM killer stops a process with SIGKILL
when memory runs out before Ray's monitor acts; Ray then records only that the worker's process died
(`actor_died_error_context`, exit type SYSTEM_ERROR), and the kernel counts the kill in /proc/vmstat
(`oom_kill`), which the driver reads on its own node.

The driver watches the GCS for either (`Watch`) and stops the run at the first: a process killed this
way comes back into the same shortage (Serve starts the replica again, Ray Train the workers) and the run
would go round in kills. It prints `message` instead of the traceback: which process, what it held, the
machine's memory, what the run needs (each kind's peak, measured by the processes themselves: `Peaks`),
and the command that resumes from the last checkpoint.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

GIB = 1024**3
PEAKS_FILE = "memory.json"
"""Beside the run (trainer.output_dir, or ./runs/<name>/): `Peaks`, rewritten at each step, read when the
run starts (a resume, or a run stopped before its first step, knows what the last one measured)."""

KINDS = (("TrainController", "Ray Train's controller"), ("RayTrainWorker", "a trainer worker"),
         ("ServeReplica", "a rollout replica (vLLM)"), ("ServeController", "Serve's controller"),
         ("WeightStore", "the weight store"), ("Channel", "the trainer channel"))  # fmt: skip
"""Ray's actor class names of the run's processes, and what the message calls each."""


def process_kind(class_name: str) -> str:
    """What the message calls a process of Ray actor class `class_name`.

    >>> process_kind("ServeReplica:dapo-rollout:RolloutServer"), process_kind("MapWorker")
    ('a rollout replica (vLLM)', 'a Ray process (MapWorker)')
    """
    for prefix, kind in KINDS:
        if class_name.startswith(prefix):
            return kind
    return f"a Ray process ({class_name})"


def peak_rss_gib(children: bool = False) -> float:
    """The most this process has held in resident memory (the kernel's count), plus, with `children`, what
    its child processes hold now (a replica's vLLM engine core, when it runs in a process of its own). Not
    for the driver: the local Ray cluster it starts (GCS, raylet and every worker) are its children."""
    import resource

    import psutil

    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    held = 0
    for child in psutil.Process().children(recursive=True) if children else ():
        try:
            held += child.memory_info().rss
        except psutil.Error:  # gone meanwhile
            pass
    return (own + held) / GIB


class Peaks:
    """The most each kind of process of a run held (GiB), as the processes report it: the driver its own,
    the trainer workers with each step's result (the largest rank), the replicas with each acknowledgement
    to the weight store. Carried in the checkpoints, so a resumed run knows them from its start.

    >>> p = Peaks({"driver": 1, "rollout replica": 2, "trainer worker": 2})
    >>> p.record("driver", 1.2); p.record("trainer worker", 1.1); p.record("rollout replica", 1.9)
    >>> p.describe()
    'driver 1.2 GiB, rollout replica 1.9 GiB x2, trainer worker 1.1 GiB x2: 7.2 GiB in all'
    >>> Peaks({"driver": 1}).describe()
    'not measured yet (the run stopped before its first step)'
    """

    def __init__(self, counts: dict[str, int]):
        self.counts = counts
        self.gib: dict[str, float] = {}

    def record(self, kind: str, gib: float | None) -> None:
        if gib:
            self.gib[kind] = max(self.gib.get(kind, 0.0), float(gib))

    def state_dict(self) -> dict[str, float]:
        return dict(self.gib)

    def load_state_dict(self, state: dict[str, float] | None) -> None:
        for kind, gib in (state or {}).items():
            self.record(kind, gib)

    def describe(self) -> str:
        if not self.gib:
            return "not measured yet (the run stopped before its first step)"
        kinds = [k for k in self.counts if k in self.gib] + [k for k in self.gib if k not in self.counts]
        parts = [f"{k} {self.gib[k]:.1f} GiB" + (f" x{self.counts[k]}" if self.counts.get(k, 1) > 1 else "")
                 for k in kinds]  # fmt: skip
        total = sum(gib * self.counts.get(kind, 1) for kind, gib in self.gib.items())
        return ", ".join(parts) + f": {total:.1f} GiB in all"


@dataclass
class Kill:
    """A process of the run stopped for want of memory."""

    process: str  # what it was (`process_kind`)
    pid: int
    node: str  # the node's IP address
    by: str  # "Ray's memory monitor" or "the kernel's OOM killer"
    held_gib: float | None = None  # what it held when it was stopped, when the killer said
    used_gib: float | None = None  # the node's memory in use then, and all of it
    total_gib: float | None = None
    threshold: str = ""  # Ray's kill threshold, as a share of the node's memory


_NODE = re.compile(r"Memory on the node \(IP: ([^,)]+)[^)]*\) was ([\d.]+)GB used / ([\d.]+)GB limit")
_THRESHOLD = re.compile(r"exceeded threshold of \d+B \(([\d.]+%) of")
_KILLED = re.compile(r"pid=(\d+), actual memory used=([\d.]+)GB")


def parse_monitor_message(text: str, pid: int) -> dict:
    """What Ray's memory monitor says of a kill (its `oom_context.error_message`, ray 2.60 raylet
    `node_manager.cc`): the node, its memory in use and in all, the threshold, and what process `pid` held.

    >>> parse_monitor_message("1 worker(s) were killed due to the node running low on memory. Memory on the "
    ...     "node (IP: 10.0.0.5, ID: f93b) was 22.40GB used / 23.54GB limit (0.95)\\nOOM kill reason: Memory "
    ...     "usage 1082392576B exceeded threshold of 252760592B (95.0% of 25276059648B limit)\\nSelected to kill: "
    ...     "(Actor(c07e): task name=A.__init__, pid=12007, actual memory used=1.93GB, worker ID=f9f5)", 12007)
    {'node': '10.0.0.5', 'used_gib': 22.4, 'total_gib': 23.54, 'threshold': '95.0%', 'held_gib': 1.93}
    """
    out: dict = {}
    if m := _NODE.search(text):  # Ray's "GB" are GiB (the monitor divides bytes by 2^30)
        out |= {"node": m[1].strip(), "used_gib": float(m[2]), "total_gib": float(m[3])}
    if m := _THRESHOLD.search(text):
        out["threshold"] = m[1]
    for m in _KILLED.finditer(text):
        if int(m[1]) == pid:
            out["held_gib"] = float(m[2])
    return out


def kernel_oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has stopped on this machine since it started (None where
    the kernel does not say)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def kills(since: float, kernel_before: int | None, job_id: str, app: str) -> list[Kill]:
    """The run's processes stopped for want of memory since `since` (epoch seconds): actors of job `job_id`
    (hex) or replicas of the Serve application `app`, oldest first. A process whose worker died on its own
    counts as the kernel's only when the kernel's count of kills on this machine rose above
    `kernel_before`."""
    import psutil
    from ray._private.state import state

    kernel_rose = kernel_before is not None and (kernel_oom_kills() or 0) > kernel_before
    found = []
    for actor in state.actor_table(None, actor_state_name="DEAD").values():
        name, cause = actor["ActorClassName"], actor["DeathCause"]
        if actor["EndTime"] < since * 1000 or not (actor["JobID"] == job_id or name.startswith(f"ServeReplica:{app}:")):
            continue
        pid, node = actor["Pid"], actor["Address"]["IPAddress"]
        if cause.HasField("oom_context"):
            said = parse_monitor_message(cause.oom_context.error_message, pid)
            found.append((actor["EndTime"], Kill(process_kind(name), pid, said.pop("node", node), "Ray's memory monitor",
                                                 **said)))  # fmt: skip
        elif kernel_rose and cause.HasField("actor_died_error_context") \
                and "SYSTEM_ERROR" in cause.actor_died_error_context.error_message:  # fmt: skip
            vm = psutil.virtual_memory()
            found.append((actor["EndTime"], Kill(process_kind(name), pid, node, "the kernel's OOM killer",
                                                 used_gib=(vm.total - vm.available) / GIB, total_gib=vm.total / GIB)))  # fmt: skip
    return [k for _, k in sorted(found, key=lambda pair: pair[0])]


class OutOfMemory(KeyboardInterrupt):
    """A process of the run was stopped for want of memory; `kills` says which. A KeyboardInterrupt: the
    watch raises it in the driver's main thread from wherever that is, as Ctrl-C would, and a Ray call
    waiting there raises a KeyboardInterrupt of its own for it (any other exception from a signal handler
    ends the process); no `except Exception` on the way holds it."""

    def __init__(self, kills: list[Kill], text: str = ""):
        super().__init__(text or f"out of memory: {kills[0].process} was stopped by {kills[0].by}")
        self.kills = kills


def message(kill: Kill, more: int, peaks: Peaks, checkpoint_step: int | None, command: str,
            error_log: str | None) -> list[str]:  # fmt: skip
    """The lines a run stopped for want of memory ends with.

    >>> k = Kill("a rollout replica (vLLM)", 4242, "10.0.0.5", "Ray's memory monitor", 1.9, 21.3, 21.9, "95.0%")
    >>> p = Peaks({"driver": 1, "rollout replica": 1, "trainer worker": 2})
    >>> p.record("driver", 1.2); p.record("rollout replica", 1.9); p.record("trainer worker", 1.1)
    >>> print("\\n".join(message(k, 0, p, 10, "dapo-ray demo", "runs/demo/error.log")))
    dapo-ray: out of memory. Ray's memory monitor stopped a rollout replica (vLLM) (pid 4242, holding 1.9 GiB) on 10.0.0.5.
      That machine: 21.3 of its 21.9 GiB in use, past the 95.0% at which Ray stops a process (RAY_memory_usage_threshold).
      What this run holds at its peak: driver 1.2 GiB, rollout replica 1.9 GiB, trainer worker 1.1 GiB x2: 5.3 GiB in all.
      Free memory there (other programs), or ask less of it: rollout.num_replicas, rollout.cpu_kvcache_space_gib, trainer.num_workers, trainer.micro_batch_size.
      To resume from the checkpoint of step 10, run the same command again: dapo-ray demo
      The error in full: runs/demo/error.log
    """
    held = f", holding {kill.held_gib:.{1 if kill.held_gib >= 1 else 2}f} GiB" if kill.held_gib is not None else ""
    others = f" ({more} more of the run's processes after it)" if more else ""
    lines = [f"dapo-ray: out of memory. {kill.by} stopped {kill.process} (pid {kill.pid}{held}) on {kill.node}{others}."]
    if kill.used_gib is not None and kill.total_gib is not None:
        past = (f", past the {kill.threshold} at which Ray stops a process (RAY_memory_usage_threshold)"
                if kill.threshold else "")  # fmt: skip
        where = "That machine" if kill.by.startswith("Ray") else "This machine (the driver's)"
        lines.append(f"  {where}: {kill.used_gib:.1f} of its {kill.total_gib:.1f} GiB in use{past}.")
    lines.append(f"  What this run holds at its peak: {peaks.describe()}.")
    lines.append("  Free memory there (other programs), or ask less of it: rollout.num_replicas, "
                 "rollout.cpu_kvcache_space_gib, trainer.num_workers, trainer.micro_batch_size.")  # fmt: skip
    start = ("its last checkpoint" if checkpoint_step is None else f"the checkpoint of step {checkpoint_step}"
             if checkpoint_step else "the start (no checkpoint yet)")  # fmt: skip
    lines.append(f"  To resume from {start}, run the same command again: {command}")
    if error_log:
        lines.append(f"  The error in full: {error_log}")
    return lines


class Watch:
    """Asks the GCS every `every_s` seconds whether a process of the run was stopped for want of memory
    (`kills`) and calls `on_kill` with the kills the first time one was (then stops asking)."""

    def __init__(self, on_kill: Callable[[list[Kill]], None], job_id: str, app: str, every_s: float = 2.0):
        self.since, self.kernel_before = time.time(), kernel_oom_kills()
        self.job_id, self.app, self.on_kill, self.every_s = job_id, app, on_kill, every_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dapo-oom-watch", daemon=True)
        self.thread.start()

    def kills(self) -> list[Kill]:
        try:
            return kills(self.since, self.kernel_before, self.job_id, self.app)
        except Exception:  # noqa: BLE001 - the GCS going away with the run is no kill
            return []

    def _run(self) -> None:
        while not self.stopped.wait(self.every_s):
            if found := self.kills():
                self.stopped.set()
                self.on_kill(found)

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)
