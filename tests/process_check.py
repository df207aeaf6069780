"""The suite leaves no process of its own running: every process that descends from the pytest process at
any time of the session (sampled every 2 s and after each test) is recorded by pid and start time, and at
the session's end each one still running is named, killed by that pid, and fails the session.

Processes re-parented to init once their parent died (a Ray worker whose raylet went first) escape a
look at the process tree at the end; a sample taken while they still descended from pytest does not.
Python's own helpers that live as long as the interpreter (multiprocessing's resource tracker and
forkserver) are not the tests' and are not counted."""

from __future__ import annotations

import os
import threading
import time

import psutil

SAMPLE_EVERY_S = 2.0
GRACE_S = float(os.environ.get("DAPO_TEST_PROCESS_GRACE_S", 60))  # what Ray's and vLLM's processes may take to exit after their owners shut them down
INTERPRETER_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


class ProcessRecord:
    def __init__(self) -> None:
        self.me = psutil.Process(os.getpid())
        self.seen: dict[int, tuple[float, str]] = {}  # pid -> (start time, command line)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, name="process-check", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def sample(self) -> None:
        try:
            children = self.me.children(recursive=True)
        except psutil.Error:
            return
        for p in children:
            if p.pid in self.seen:
                continue
            try:
                with p.oneshot():
                    cmd = " ".join(p.cmdline()) or p.name()
                    self.seen[p.pid] = (p.create_time(), cmd)
            except psutil.Error:
                pass

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            self.sample()

    def survivors(self, grace_s: float = GRACE_S) -> list[psutil.Process]:
        """The recorded processes still running (the same pid and start time) after `grace_s`."""
        self._stop.set()
        self._thread.join(timeout=10)
        deadline = time.monotonic() + grace_s
        while True:
            alive = []
            for pid, (created, cmd) in self.seen.items():
                if any(h in cmd for h in INTERPRETER_HELPERS):
                    continue
                try:
                    p = psutil.Process(pid)
                    if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                        alive.append(p)
                except psutil.Error:
                    pass
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(1.0)


_record: ProcessRecord | None = None


def pytest_sessionstart(session) -> None:
    global _record
    _record = ProcessRecord()
    _record.start()


def pytest_runtest_teardown(item, nextitem) -> None:
    if _record is not None:
        _record.sample()


def pytest_sessionfinish(session, exitstatus) -> None:
    if _record is None:
        return
    import sys

    # What this process would stop at its exit: its reward-function helpers, its Math-Verify helper.
    if "dapo_ray.tasks" in sys.modules:
        sys.modules["dapo_ray.tasks"].close_user_scorers()
    if "dapo_ray.algo.reward" in sys.modules:
        sys.modules["dapo_ray.algo.reward"].close_helper()
    left = _record.survivors()
    if not left:
        return
    lines = []
    for p in left:
        created, cmd = _record.seen[p.pid]
        lines.append(f"  pid {p.pid} (started {time.strftime('%H:%M:%S', time.localtime(created))}): {cmd[:200]}")
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=10)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    text = f"{len(left)} process(es) the tests started were still running at the end (now killed):\n" + "\n".join(lines)
    if reporter is not None:
        reporter.write_sep("=", "processes left behind", red=True)
        reporter.write_line(text)
    else:
        print(text)
    session.exitstatus = 1
