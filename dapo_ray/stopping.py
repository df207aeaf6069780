"""Stopping a run on Ctrl-C or SIGTERM (what `ray job stop`, Kubernetes and batch schedulers send).

The first signal asks the training loop to stop after the step in progress: it checkpoints that step
(unless the step just did), closes the rollout deployment and the trainer, and says how to resume. A
second signal raises KeyboardInterrupt at once: the run then resumes from its last periodic checkpoint.
Either way the process exits through its normal shutdown, so the Ray cluster it started (GCS, raylet,
dashboard and its agents) goes with it; a process killed by the default SIGTERM handler leaves those
running.

A scheduler waits a grace period between SIGTERM and SIGKILL (Kubernetes: 30 s by default; `ray job
stop`: RAY_JOB_STOP_WAIT_TIME_S in the head's environment, 3 s by default, ray 2.60
`dashboard/modules/job/job_supervisor.py:66, 394-412`): a step longer than that ends with the SIGKILL,
and the run resumes from its last periodic checkpoint.
"""

from __future__ import annotations

import _thread
import signal
import threading
from collections.abc import Callable


class StopRequest:
    """While installed (`with StopRequest(log) as stop:`), SIGINT and SIGTERM set `stop.signal` (the
    first) and raise KeyboardInterrupt (the second). Outside the main thread, where Python cannot handle
    signals, it installs nothing and `signal` stays None."""

    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self.signal: str | None = None
        self.at_once: KeyboardInterrupt | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def stop_now(self, error: KeyboardInterrupt) -> None:
        """From another thread: raise `error` in the main thread at once, wherever it is, as Ctrl-C would (a
        Ray call waiting there raises a plain KeyboardInterrupt instead). Where nothing is installed it does
        nothing: the run ends by itself."""
        self.at_once = error
        if self._previous:
            _thread.interrupt_main(signal.SIGINT)

    def _handle(self, signum: int, frame) -> None:
        if self.at_once is not None:
            raise self.at_once
        name = signal.Signals(signum).name
        if self.signal is not None:
            raise KeyboardInterrupt(f"{name} after {self.signal}")
        self.signal = name
        self.log(f"{name}: stopping after the step in progress, with a checkpoint; {name} again stops at once")
