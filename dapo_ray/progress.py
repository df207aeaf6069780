"""Progress at the console: an ETA from the recent pace of steps, and on a terminal a live status line that
keeps moving between the per-step log lines. In a log file (CI, `ray job logs`) nothing is redrawn: the
step lines, which carry the ETA, are the whole record."""

from __future__ import annotations

import re
import sys
import threading
import time
from collections import deque

_on_screen: StatusLine | None = None  # the live status line, cleared around each printed line


QUIET_ENV = "DAPO_QUIET"
"""Set to 1 in every process of a run whose console is quiet (`cluster.verbose` off): `quiet_libraries`."""
QUIET_LOGGERS = {"DeepSpeed": "WARNING", "ray.serve": "ERROR", "mlflow": "WARNING", "ray.data": "ERROR",
                 "ray.train": "WARNING"}
"""The libraries' loggers and the least level they show at a quiet console: DeepSpeed's memory reports
(INFO), Serve's "Failed to get queue length from Replica ... within 0.1s" (a WARNING each time a busy
replica answers late), MLflow's system-metrics lines (INFO), Ray Data's start-up lines."""


def quiet_libraries() -> None:
    """In a process of a run whose console is quiet (QUIET_ENV), keep the libraries' chatter out of it: it
    still reaches the process's own log in Ray's session directory. Called where each kind of process
    starts (the driver, a trainer worker, a rollout replica, a Ray Data task holding a Serve handle)."""
    import logging
    import os
    import warnings

    if os.environ.get(QUIET_ENV) != "1":
        return
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars of weight loads, shard writes, artifact downloads
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    for category in (FutureWarning, DeprecationWarning):  # the libraries' own (torch.distributed.reduce_op, ...)
        warnings.filterwarnings("ignore", category=category)


OWN_PREFIXES = ("[dapo-ray", "[rollout", "[engine]", "[trainer", "[reward", "[tiny-model]", "[smollm2", "[check]",
                "[prepare", "[eval")
"""How dapo-ray's own lines begin, in every process of a run."""
TROUBLE = re.compile(r"Traceback|\w+Error\b|Exception\b|OutOfMemory|out of memory|low on memory|\b[Kk]illed\b|\bdied\b")
"""A line of a process's output that says something went wrong."""


def shown_at_a_quiet_console(lines: list[str]) -> list[str]:
    """What a quiet console prints of a batch of a worker's output lines: all of them when one says something
    went wrong (a traceback stays whole), else dapo-ray's own lines only; the rest stays in the process's log.

    >>> shown_at_a_quiet_console(["Triton is installed, but doesn't include CPU backend.", "[engine] ready"])
    ['[engine] ready']
    >>> len(shown_at_a_quiet_console(["Traceback (most recent call last):", '  File "x.py"', "ValueError: no"]))
    3
    """
    if any(TROUBLE.search(line) for line in lines):
        return list(lines)
    return [line for line in lines if line.lstrip().startswith(OWN_PREFIXES)]


def log(msg: str) -> None:
    """One timestamped line of the run's record on stdout, clear of the live status line."""
    if _on_screen:
        _on_screen.clear()
    print(f"[dapo-ray {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def duration(seconds: float) -> str:
    """45s, 9m32s, 2h05m."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Pace:
    """ETA of a run of `total` steps from the wall time of its last `window` steps (evaluation and
    checkpoints included, as they recur)."""

    def __init__(self, total: int, window: int = 10):
        self.total = total
        self.marks: deque[tuple[int, float]] = deque(maxlen=window + 1)

    def mark(self, step: int, now: float | None = None) -> None:
        """Step `step` has just finished (or, the first mark, the run starts there)."""
        self.marks.append((step, time.time() if now is None else now))

    def eta_s(self, budget_left_s: float | None = None) -> float | None:
        """Seconds to the last step; at most `budget_left_s` when a time budget ends the run sooner."""
        if len(self.marks) < 2:
            return budget_left_s
        (s0, t0), (s1, t1) = self.marks[0], self.marks[-1]
        eta = (t1 - t0) / (s1 - s0) * max(0, self.total - s1) if s1 > s0 else None
        return min(eta, budget_left_s) if eta is not None and budget_left_s is not None else eta

    def eta(self, budget_left_s: float | None = None) -> str:
        eta = self.eta_s(budget_left_s)
        return "ETA --" if eta is None else f"ETA {duration(eta)}"


class StatusLine:
    """A one-line status redrawn in place once a second on a terminal (stderr), cleared around every
    line that `log` prints until `close()`; does nothing when stderr is not a terminal. `text()` gives the
    current line."""

    def __init__(self, text, stream=None, interval_s: float = 1.0):
        global _on_screen
        _on_screen = self
        self.text, self.stream, self.interval_s = text, stream or sys.stderr, interval_s
        self.live = self.stream.isatty()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        if self.live:
            threading.Thread(target=self._run, name="dapo-status", daemon=True).start()

    def _run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            self.draw()

    def draw(self) -> None:
        if self.live:
            with self.lock:
                self.stream.write("\r\x1b[K" + self.text()[:200])
                self.stream.flush()

    def clear(self) -> None:
        if self.live:
            with self.lock:
                self.stream.write("\r\x1b[K")
                self.stream.flush()

    def close(self) -> None:
        global _on_screen
        if _on_screen is self:
            _on_screen = None
        self.stopped.set()
        self.clear()
