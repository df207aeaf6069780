"""Private memory of processes on this machine, polled while a block runs (the benches' actors are local
processes, whatever Ray node they belong to)."""

from __future__ import annotations

import threading


def rss_anon_mib(pid: int) -> float:
    """RssAnon of `pid` in MiB: its private memory, without the object stores' shared pages; 0 once gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:  # the process died (e.g. killed by Ray's memory monitor)
        pass
    return 0.0


class PeakAnon:
    """How much RssAnon (MiB) of process `pid` rose above its value at the start while the block ran,
    polled from a thread (the caller's `ray.get` releases the GIL)."""

    def __init__(self, pid: int, every_s: float = 0.003) -> None:
        self.pid, self.every_s = pid, every_s
        self.start = self.peak = rss_anon_mib(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while True:
            self.peak = max(self.peak, rss_anon_mib(self.pid))
            if self._stop.wait(self.every_s):
                self.peak = max(self.peak, rss_anon_mib(self.pid))
                return

    def __enter__(self) -> PeakAnon:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def extra(self) -> float:
        return self.peak - self.start
