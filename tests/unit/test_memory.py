"""Out of memory, said plainly (dapo_ray/memory.py): which kills count as the run's, what each killer's
record gives the message, the peaks the processes measure, and the stop that reaches the driver's main
thread. The kills of a real run, under a memory limit the test sets, are in
tests/integration/test_stop_signal.py."""

import subprocess
import sys
import threading
import time

import pytest
from ray.core.generated import common_pb2

from dapo_ray import memory
from dapo_ray.stopping import StopRequest

MONITOR_SAID = (
    "1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 10.0.0.7, ID: "
    "f93b) was 22.40GB used / 23.54GB limit (0.951)\nOOM kill reason: Memory usage 24051816857B exceeded "
    "threshold of 23012256563B (95.0% of 24223427960B limit)\nSelected to kill: (Actor(c07e): job ID=01000000, "
    "task name=RayTrainWorker.__init__, pid=4242, actual memory used=3.10GB, worker ID=f9f5)\nTop 10 memory "
    "users: PID\tMEM(GB)\tCOMMAND\n4242\t3.10\tray::RayTrainWorker"
)
SIGKILLED = ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
             "detail: Worker unexpectedly exits with a connection error code 2. End of file.")  # fmt: skip


def _dead(class_name: str, job: str, end_s: float, pid: int, oom: str = "", died: str = "") -> dict:
    cause = common_pb2.ActorDeathCause()
    if oom:
        cause.oom_context.error_message = oom
    if died:
        cause.actor_died_error_context.error_message = died
    return {"ActorClassName": class_name, "JobID": job, "EndTime": int(end_s * 1000), "Pid": pid,
            "Address": {"IPAddress": "10.0.0.9"}, "DeathCause": cause}  # fmt: skip


@pytest.fixture
def gcs(monkeypatch):
    """The GCS's dead actors, as `kills` reads them (ray._private.state.state.actor_table)."""
    from ray._private.state import state

    table: dict[str, dict] = {}
    monkeypatch.setattr(state, "actor_table", lambda actor_id, actor_state_name=None: dict(table))
    return table


def test_the_monitors_kills_of_the_run_and_what_its_record_says(gcs):
    t0 = time.time()
    gcs["a"] = _dead("RayTrainWorker", "01000000", t0 + 2, 4242, oom=MONITOR_SAID)
    gcs["b"] = _dead("ServeReplica:dapo-rollout:RolloutServer", "05000000", t0 + 1, 77, oom=MONITOR_SAID)
    gcs["c"] = _dead("RayTrainWorker", "02000000", t0 + 1, 88, oom=MONITOR_SAID)  # another job's
    gcs["d"] = _dead("RayTrainWorker", "01000000", t0 - 60, 99, oom=MONITOR_SAID)  # before the run
    gcs["e"] = _dead("WeightStore", "01000000", t0 + 3, 55, died=SIGKILLED)  # no kernel kill counted
    found = memory.kills(t0, None, "01000000", "dapo-rollout")
    assert [(k.process, k.pid) for k in found] == [("a rollout replica (vLLM)", 77), ("a trainer worker", 4242)]
    worker = found[1]
    assert (worker.node, worker.by, worker.held_gib, worker.used_gib, worker.total_gib, worker.threshold) == \
        ("10.0.0.7", "Ray's memory monitor", 3.1, 22.4, 23.54, "95.0%")  # fmt: skip
    assert found[0].held_gib is None  # the monitor's record names another pid


def test_a_process_the_kernel_killed_counts_only_when_the_kernels_count_rose(gcs, monkeypatch):
    t0 = time.time()
    gcs["a"] = _dead("TrainController", "01000000", t0 + 1, 31, died=SIGKILLED)
    monkeypatch.setattr(memory, "kernel_oom_kills", lambda: 5)
    assert memory.kills(t0, 5, "01000000", "dapo-rollout") == []
    (kill,) = memory.kills(t0, 4, "01000000", "dapo-rollout")
    assert (kill.process, kill.pid, kill.by, kill.held_gib) == ("Ray Train's controller", 31, "the kernel's OOM killer", None)
    assert 0 < kill.used_gib <= kill.total_gib
    peaks = memory.Peaks({"driver": 1, "trainer worker": 2})
    peaks.record("trainer worker", 2.0)
    lines = memory.message(kill, 0, peaks, 0, "dapo-ray train --config c.yaml", None)
    assert len(lines) == 5 and lines[0] == ("dapo-ray: out of memory. the kernel's OOM killer stopped Ray Train's "
                                            "controller (pid 31) on 10.0.0.9.")  # fmt: skip
    assert lines[1].startswith("  This machine (the driver's): ") and "RAY_memory_usage_threshold" not in lines[1]
    assert lines[2] == "  What this run holds at its peak: trainer worker 2.0 GiB x2: 4.0 GiB in all."
    assert lines[4] == "  To resume from the start (no checkpoint yet), run the same command again: dapo-ray train --config c.yaml"


def test_the_kernels_count_is_read_from_vmstat():
    count = memory.kernel_oom_kills()
    assert count is None or count >= 0


def test_the_peak_counts_what_child_processes_hold():
    """A replica's vLLM engine core may run in a process of its own: its memory is the replica's."""
    before = memory.peak_rss_gib(children=True)
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; x = bytearray(400 * 2**20); "
                              "print(1, flush=True); time.sleep(60)"], stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert child.stdout.readline().strip() == b"1"
        assert memory.peak_rss_gib(children=True) - before > 0.35
        assert memory.peak_rss_gib() < before + 0.1  # the driver's own: its local Ray cluster is its children
    finally:
        child.kill()
        child.wait(timeout=10)


def test_peaks_keep_the_most_and_come_back_from_a_checkpoint():
    p = memory.Peaks({"driver": 1, "rollout replica": 2})
    p.record("rollout replica", 1.5)
    p.record("rollout replica", 1.2)
    p.record("driver", None)  # not reported
    q = memory.Peaks({"driver": 1, "rollout replica": 2})
    q.load_state_dict(p.state_dict())
    assert q.gib == {"rollout replica": 1.5} and q.describe() == "rollout replica 1.5 GiB x2: 3.0 GiB in all"


def test_the_watch_stops_the_main_thread_wherever_it_is():
    """`Watch` calls `StopRequest.stop_now`, which raises its error in the main thread as Ctrl-C would."""
    kill = memory.Kill("a trainer worker", 4242, "10.0.0.7", "Ray's memory monitor")
    t0 = time.time()
    with pytest.raises(memory.OutOfMemory) as raised, StopRequest(print) as stop:
        threading.Timer(0.5, stop.stop_now, args=(memory.OutOfMemory([kill]),)).start()
        while time.time() - t0 < 30:
            time.sleep(0.05)
    assert raised.value.kills == [kill] and time.time() - t0 < 5
    assert stop.signal is None  # not a stop request: nothing is saved on the way out
