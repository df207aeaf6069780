"""A reward function of the user's own (`reward.function`), in verl's or TRL's convention, run safely.

    reward:
      function: workflows/tasks/countdown.py:compute_score    # or my_package.rewards:accuracy
      function_kwargs: {format_score: 0.0}

verl's convention: `compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)`, called
once per reply, returning a float or a dict whose `score` is the reward (`acc`, `pred` and any other numbers
beside it are kept: numbers become `reward/extra/<name>` metrics); sync or async. TRL's:
`f(prompts, completions, **columns) -> list[float | None]`, called once per group, with the rows' columns
(`ground_truth`, `data_source`, `extra_info`) as keyword lists. `reward.convention: auto` tells them apart
by the signature. A file written for verl or for TRL runs unchanged.

The function runs in a helper process of the scoring stage (`reward_helper.py`), imported on the node that
scores, from the run's working directory. A call that raises, returns something that is not a finite
number, or runs past `reward.timeout_s` scores `reward.on_error` and is counted; a call stuck where even
the helper's timer cannot reach is cut off by killing the helper, which the next call starts again.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import dapo_ray.tasks.reward_helper as reward_helper

HELPER = Path(reward_helper.__file__)
START_TIMEOUT_S = 120.0
"""A helper's start: importing the function's module (sympy, say) on a busy node."""
KILL_GRACE_S = 2.0
"""Beyond `reward.timeout_s`, how long the helper may take to report a timeout itself before it is killed."""


class RewardFunctionError(RuntimeError):
    """`reward.function` cannot be used: the message names the file (or module), the function and what is
    wrong. Raised before any engine starts (`check_function`), and where a scoring node cannot import it."""


@dataclass(frozen=True)
class UserFunction:
    """The plain values the scoring stage needs to run a user's function."""

    spec: str
    kwargs: dict = field(default_factory=dict)
    convention: str = "auto"
    timeout_s: float = 10.0
    on_error: float = -1.0
    states_reference: str = ""
    trl_completions: str = "messages"


DIED = ("error", "the reward function's process died (a crash, or it called exit)")


class Helper:
    """One helper process and its pipes; `close()` ends it."""

    def __init__(self, fn: UserFunction):
        # Unbuffered: frames are awaited with select() on the pipe, which cannot see a read-ahead buffer.
        self.proc = subprocess.Popen([sys.executable, "-P", str(HELPER), str(os.getpid())], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, bufsize=0)  # fmt: skip
        reward_helper.write_frame(self.proc.stdin, {"function": fn.spec, "convention": fn.convention,
                                                    "kwargs": fn.kwargs, "states_reference": fn.states_reference})  # fmt: skip
        ready = self.read(START_TIMEOUT_S)
        if ready is DIED:
            self.close()
            raise RewardFunctionError(f"reward function {fn.spec!r}: its helper process died while importing it")
        if ready is None:
            self.close()
            raise RewardFunctionError(f"reward function {fn.spec!r}: its module did not import within "
                                      f"{START_TIMEOUT_S:.0f}s on this node")  # fmt: skip
        if not ready["ok"]:
            self.close()
            raise RewardFunctionError(ready["error"])
        self.info = ready

    def send(self, request: dict) -> None:
        reward_helper.write_frame(self.proc.stdin, request)

    def read(self, timeout_s: float):
        """The helper's next frame; None when it sends none within `timeout_s`; DIED when it has gone."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            return None
        try:
            return reward_helper.read_frame(self.proc.stdout)
        except (EOFError, OSError):
            return DIED

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


def check_function(fn: UserFunction) -> dict:
    """Start a helper on this machine and have it import and inspect the function: the run's early check
    (before any engine starts) and `dapo-ray check`'s. Returns what it found (`convention`, `where`)."""
    helper = Helper(fn)
    try:
        return helper.info
    finally:
        helper.close()


class UserScorer:
    """Scores groups with a user's function in a helper process (one per scorer; calls take turns).
    `score(calls)` returns one outcome per reply: `("ok", verdict)`, `("error", text)` or `("timeout", None)`."""

    def __init__(self, fn: UserFunction):
        self.fn = fn
        self._lock = threading.Lock()
        self._helper: Helper | None = None

    def _started(self) -> Helper:
        if self._helper is None or self._helper.proc.poll() is not None:
            self._helper = Helper(self.fn)
        return self._helper

    def _kill(self) -> None:
        if self._helper is not None:
            self._helper.close()
            self._helper = None

    def score(self, calls: list[dict], prompts: list) -> list[tuple]:
        """One outcome per reply of a group. `calls`: verl's arguments of each reply (data_source, solution_str,
        ground_truth, extra_info); `prompts`: each reply's chat prompt (TRL's `prompts`)."""
        with self._lock:
            helper = self._started()
            if helper.info["convention"] == "trl":
                return self._trl(helper, calls, prompts)
            return self._verl(calls)

    def _verl(self, calls: list[dict]) -> list[tuple]:
        """Per reply; a helper killed mid-group is started again for the replies after the one it hung on."""
        out: list[tuple] = []
        while len(out) < len(calls):
            helper = self._started()
            rest = calls[len(out) :]
            helper.send({"op": "verl", "calls": rest, "timeout_s": self.fn.timeout_s})
            for _ in rest:
                frame = helper.read(self.fn.timeout_s + KILL_GRACE_S)
                if frame is None or frame is DIED:  # stuck beyond its timer's reach, or gone (os._exit, a crash)
                    self._kill()
                    out.append(("timeout", None) if frame is None else DIED)
                    break
                out.append(frame)
        return out

    def _trl(self, helper: Helper, calls: list[dict], prompts: list) -> list[tuple]:
        texts = [c["solution_str"] for c in calls]
        completions = texts if self.fn.trl_completions == "text" else [[{"role": "assistant", "content": t}] for t in texts]
        columns = {"prompts": prompts, "completions": completions, "completion_ids": [c.get("response_ids") for c in calls],
                   "ground_truth": [c["ground_truth"] for c in calls], "data_source": [c["data_source"] for c in calls],
                   "extra_info": [c["extra_info"] for c in calls]}  # fmt: skip
        helper.send({"op": "trl", "columns": columns, "timeout_s": self.fn.timeout_s})
        frame = helper.read(self.fn.timeout_s + KILL_GRACE_S)
        if frame is None or frame is DIED:
            self._kill()
            frame = ("timeout", None) if frame is None else DIED
        return frame[1] if frame[0] == "ok" else [frame] * len(calls)

    def states(self, pairs: list[tuple[str, str]]) -> list[bool | None] | None:
        """The user's own "does this reply state the reference" check on (reply, reference) pairs; None
        without one (or when it cannot answer), a None entry where it failed."""
        if not self.fn.states_reference:
            return None
        with self._lock:
            helper = self._started()
            helper.send({"op": "states", "pairs": pairs, "timeout_s": self.fn.timeout_s})
            frame = helper.read(self.fn.timeout_s * len(pairs) + KILL_GRACE_S)
            if frame is None or frame is DIED:
                self._kill()
                return None
            return frame[1]

    def close(self) -> None:
        with self._lock:
            self._kill()


def extra_info_of(row: dict) -> dict | None:
    """A row's `extra_info`, carried through the stages as JSON (`extra_info_json`)."""
    raw = row.get("extra_info_json")
    return json.loads(raw) if raw else None
