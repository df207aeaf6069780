"""The process a user's reward function runs in: imported here, called here, cut off here.

A reward function is the user's code: it may raise, return NaN, print, hang in a loop or in a C call, or
call `os._exit`. So it never runs in the scoring stage itself. The stage (`dapo_ray.tasks.user`) starts
this file as a script with the same Python (`python -P reward_helper.py`: stdlib only at start-up, so it
starts in milliseconds; the function's own imports take what they take) and talks to it over its stdin
and stdout, one pickled frame at a time:

    -> {"function": "path/to/file.py:name", "convention": "auto", "kwargs": {...}, "states_reference": ""}
    <- {"ok": True, "convention": "verl", "where": "/abs/path/file.py", "verl_args": (...)}
       or {"ok": False, "error": "what is wrong, naming the file and the function"}
    -> {"op": "verl", "calls": [{"data_source", "solution_str", "ground_truth", "extra_info"}, ...], "timeout_s"}
       (each call passes the keywords the function takes: `verl_args_of`)
    <- one frame per call, in order: ("ok", verdict) | ("error", traceback) | ("timeout", None)
    -> {"op": "trl", "columns": {"prompts": [...], "completions": [...], ...}, "timeout_s"}
    <- ("ok", [verdict, ...]) | ("error", traceback) | ("timeout", None)
    -> {"op": "states", "pairs": [(reply, reference), ...]}
    <- ("ok", [bool | None, ...])

A verdict is `{"score": float, "acc": bool | None, "pred": str | None, "extra": {name: float}}`, checked here
(`verdict_of`): a value that is not a finite number is an error, whatever the function meant by it. Each
call has `timeout_s`: a SIGALRM timer interrupts Python code past it; a call stuck where signals cannot
reach (a C loop) is the caller's to kill, by its own deadline. Whatever the function prints goes to
stderr, so it cannot put the frames out of step.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import pickle
import signal
import struct
import sys
import threading
import traceback
from pathlib import Path

VERL_PARAMS = ("solution_str", "ground_truth")
"""What every verl scorer takes by keyword: a custom `compute_score(data_source, solution_str, ground_truth,
extra_info=None, **kwargs)`, which verl's reward managers call with `reward_kwargs`, and verl's own per-task
scorers (`verl/utils/reward_score/math_dapo.py`, `gsm8k.py`: `compute_score(solution_str, ground_truth, ...)`)."""
VERL_OPTIONAL = ("data_source", "extra_info")
"""Passed too when the function takes them (by name or `**kwargs`)."""
TRL_COLUMNS = ("prompts", "completions", "completion_ids", "ground_truth", "data_source", "extra_info")
"""What a TRL-convention function is passed by keyword: TRL's GRPOTrainer passes `prompts`, `completions`,
`completion_ids` and the data set's columns; a verl-schema row's columns are these three. A function
without `**kwargs` gets the ones it names."""
MAX_PRED_CHARS = 200


class SpecError(ValueError):
    """A `reward.function` that cannot be used; the message names the file (or module) and the function."""


class CallTimeout(BaseException):
    """The call ran past its time. A BaseException, so a function's own `except Exception` cannot eat it."""


# --- frames --------------------------------------------------------------------------------------------


def write_frame(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<I", len(data)) + data)
    stream.flush()


def read_frame(stream):
    """The next frame, or raises EOFError when the other side has gone. `stream` may be unbuffered (the
    caller's side selects on the pipe, so nothing may wait in a read-ahead buffer): read until complete."""
    (size,) = struct.unpack("<I", _read_exactly(stream, 4))
    return pickle.loads(_read_exactly(stream, size))


def _read_exactly(stream, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = stream.read(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


# --- finding the function ------------------------------------------------------------------------------


def split_spec(spec: str) -> tuple[str, str]:
    """`"path/to/file.py:name"` or `"package.module:name"` -> (where, name).

    >>> split_spec("workflows/tasks/countdown.py:compute_score"), split_spec("my_pkg.rewards:accuracy")
    (('workflows/tasks/countdown.py', 'compute_score'), ('my_pkg.rewards', 'accuracy'))
    """
    where, sep, name = spec.strip().rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise SpecError(f"reward function {spec!r} must look like path/to/file.py:function_name or "
                        "package.module:function_name")  # fmt: skip
    return where, name


def load_function(spec: str):
    """The callable `spec` names, and where it came from (an absolute file path or a module name). A path
    is relative to the current directory: the run's working directory, which `ray job submit
    --working-dir .` ships to every node."""
    where, name = split_spec(spec)
    if where.endswith(".py") or "/" in where or os.sep in where:
        path = Path(where)
        if not path.is_file():
            raise SpecError(f"reward function {spec!r}: no file {where} in {os.getcwd()} on this node (a path is "
                            "relative to the run's working directory; under `ray job submit` put the file in the "
                            "directory --working-dir ships)")  # fmt: skip
        path = path.resolve()
        module_name = f"dapo_ray_user_reward_{abs(hash(str(path)))}"
        sys.path.insert(0, str(path.parent))  # the file may import its neighbours, as it would run on its own
        try:
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            module_spec.loader.exec_module(module)
        except BaseException as e:  # noqa: BLE001 - a SyntaxError, an ImportError, anything its top level raises
            raise SpecError(f"reward function {spec!r}: importing {path} failed:\n{_short_traceback(e)}") from None
        origin = str(path)
    else:
        sys.path.insert(0, os.getcwd())  # a package in the working directory
        try:
            module = importlib.import_module(where)
        except BaseException as e:  # noqa: BLE001
            raise SpecError(f"reward function {spec!r}: importing module {where} failed:\n{_short_traceback(e)}") from None
        origin = getattr(module, "__file__", None) or where
    if not hasattr(module, name):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_") and
                       getattr(v, "__module__", None) == module.__name__)  # fmt: skip
        raise SpecError(f"reward function {spec!r}: {origin} has no {name!r} (functions it defines: {found})")
    fn = getattr(module, name)
    if not callable(fn):
        raise SpecError(f"reward function {spec!r}: {name} in {origin} is a {type(fn).__name__}, not a function")
    return fn, origin


def _short_traceback(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()


def _accepts(fn, names: tuple[str, ...], kwargs: dict) -> bool:
    """Whether `fn` can be called with `names` (and `kwargs`) as keywords."""
    try:
        inspect.signature(fn).bind(**{n: None for n in names}, **kwargs)
    except TypeError:
        return False
    return True


def has_var_keyword(fn) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


def trl_columns_of(fn) -> tuple[str, ...]:
    """The columns a TRL-convention `fn` is passed: all of them with `**kwargs`, else those it names."""
    if has_var_keyword(fn):
        return TRL_COLUMNS
    return tuple(c for c in TRL_COLUMNS if c in inspect.signature(fn).parameters)


def _accepts_trl(fn, kwargs: dict) -> bool:
    columns = trl_columns_of(fn)
    return "completions" in columns and _accepts(fn, columns, kwargs)


def convention_of(fn, stated: str, kwargs: dict, spec: str) -> str:
    """`verl` (per reply: data_source, solution_str, ground_truth, extra_info) or `trl` (batched: prompts,
    completions, the columns), as `stated` says or, with `auto`, as the signature says."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        raise SpecError(f"reward function {spec!r}: its signature cannot be read; set reward.convention") from None
    verl = _accepts(fn, VERL_PARAMS, kwargs)
    trl = _accepts_trl(fn, kwargs)
    signature = f"{getattr(fn, '__name__', spec)}{inspect.signature(fn)}"
    if stated == "verl" and not verl:
        raise SpecError(f"reward function {spec!r}: reward.convention is verl, but {signature} does not take "
                        f"{', '.join(VERL_PARAMS)} by keyword, as verl calls compute_score")  # fmt: skip
    if stated == "trl" and not trl:
        raise SpecError(f"reward function {spec!r}: reward.convention is trl, but {signature} does not take "
                        f"completions (and only columns of {TRL_COLUMNS}) by keyword, as TRL calls reward_funcs")  # fmt: skip
    if stated in ("verl", "trl"):
        return stated
    named = set(params)
    if "solution_str" in named or (verl and not trl):
        return "verl"
    if "completions" in named or (trl and not verl):
        return "trl"
    if verl and trl:  # f(**kwargs): nothing tells
        raise SpecError(f"reward function {spec!r}: {signature} fits both verl's and TRL's calls; set "
                        "reward.convention to verl or trl")  # fmt: skip
    raise SpecError(
        f"reward function {spec!r}: {signature} fits neither convention: verl's compute_score(data_source, "
        "solution_str, ground_truth, extra_info=None, **kwargs) (or a verl scorer's compute_score(solution_str, "
        "ground_truth, ...)), called once per reply, or TRL's "
        "f(prompts, completions, **columns) -> list[float], called once per group"
        + (f" (with reward.function_kwargs {sorted(kwargs)})" if kwargs else ""))  # fmt: skip


# --- calling it ----------------------------------------------------------------------------------------


WATCHDOG_SIGNAL = signal.SIGUSR1
"""How a call past its time is interrupted. Not SIGALRM: a library the function calls may set and cancel
its own `signal.alarm` (Math-Verify's timeouts do), which would cancel an ITIMER_REAL timer with it."""
_armed = threading.Event()  # set while a call runs: the signal interrupts only then


def _on_watchdog(signum, frame):
    if _armed.is_set():
        raise CallTimeout


def call_within(timeout_s: float, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` (awaited when it is a coroutine function), or CallTimeout past `timeout_s`.
    Main thread only. A watchdog thread signals the process at the deadline and every 50 ms after, in case
    the function swallows one; a call that holds the GIL in C is the caller's to kill."""
    done = threading.Event()

    def watchdog():
        if done.wait(timeout_s):
            return
        while not done.wait(0.05):
            os.kill(os.getpid(), WATCHDOG_SIGNAL)

    if signal.getsignal(WATCHDOG_SIGNAL) is not _on_watchdog:
        signal.signal(WATCHDOG_SIGNAL, _on_watchdog)  # kept for the helper's life: a late signal is harmless
    guard = threading.Thread(target=watchdog, daemon=True)
    _armed.set()
    guard.start()
    try:
        out = fn(*args, **kwargs)
        if inspect.isawaitable(out):
            out = asyncio.run(_awaited(out))
        return out
    finally:
        _armed.clear()
        done.set()
        guard.join()


async def _awaited(awaitable):
    return await awaitable


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        if hasattr(value, "item") and callable(value.item):  # a numpy or torch scalar
            return _number(value.item(), what)
        raise ValueError(f"{what} that is a {type(value).__name__} ({value!r:.80}), not a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{value}, not a finite number" if what == "a reward" else f"{what} {value}, not a finite number")
    return value


def verdict_of(value) -> dict:
    """A function's return for one reply as a verdict; raises ValueError naming what is wrong with it.

    >>> verdict_of(1)
    {'score': 1.0, 'acc': None, 'pred': None, 'extra': {}}
    >>> verdict_of({"score": -1.0, "acc": False, "pred": "17"})
    {'score': -1.0, 'acc': False, 'pred': '17', 'extra': {}}
    >>> verdict_of(float("nan"))
    Traceback (most recent call last):
    ValueError: nan, not a finite number
    """
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"a dict without 'score' (keys: {sorted(map(str, value))[:10]})")
        extra = {}
        for k, v in value.items():
            if k in ("score", "acc", "pred"):
                continue
            try:
                extra[str(k)] = _number(v, f"{k!r}")
            except ValueError:
                pass  # only numbers become metrics; verl's own scorers return text beside them too
        acc = value.get("acc")
        pred = value.get("pred")
        return {"score": _number(value["score"], "'score'"), "acc": None if acc is None else bool(acc),
                "pred": None if pred is None else str(pred)[:MAX_PRED_CHARS], "extra": extra}  # fmt: skip
    if value is None:
        raise ValueError("None, not a number")
    return {"score": _number(value, "a reward"), "acc": None, "pred": None, "extra": {}}


def verl_args_of(fn, kwargs: dict) -> tuple[str, ...]:
    """The keywords a verl-convention `fn` is called with: VERL_PARAMS and those of VERL_OPTIONAL it takes."""
    params = inspect.signature(fn).parameters
    return VERL_PARAMS + tuple(n for n in VERL_OPTIONAL if n in params or has_var_keyword(fn))


def _verl_call(fn, call: dict, kwargs: dict, names: tuple[str, ...], timeout_s: float):
    args = {n: call[n] for n in names}
    try:
        out = call_within(timeout_s, fn, **args, **kwargs)
    except CallTimeout:
        return "timeout", None
    except Exception as e:  # noqa: BLE001 - the function's error, for the log
        return "error", users_traceback(e)
    try:
        return "ok", verdict_of(out)
    except ValueError as e:
        return "error", f"it returned {e}"


def users_traceback(e: BaseException) -> str:
    """The traceback of an exception the user's function raised, without this file's frames."""
    tb = traceback.TracebackException.from_exception(e, limit=12)
    tb.stack = traceback.StackSummary.from_list([f for f in tb.stack if f.filename != __file__])
    return "".join(tb.format())


def _trl_call(fn, columns: dict, kwargs: dict, timeout_s: float):
    try:
        out = call_within(timeout_s, fn, **columns, **kwargs)
    except CallTimeout:
        return "timeout", None
    except Exception as e:  # noqa: BLE001
        return "error", users_traceback(e)
    size = len(columns["completions"])
    if not isinstance(out, list | tuple) and not (hasattr(out, "tolist") and hasattr(out, "__len__")):
        return "error", f"returned a {type(out).__name__}, not a list of {size} rewards"
    out = list(out.tolist() if hasattr(out, "tolist") else out)
    if len(out) != size:
        return "error", f"returned {len(out)} rewards for {size} completions"
    verdicts = []
    for i, value in enumerate(out):
        try:
            verdicts.append(("ok", verdict_of(value)))
        except ValueError as e:
            verdicts.append(("error", f"it returned, at place {i} of the list, {e}"))
    return "ok", verdicts


def _states(fn, pairs: list, timeout_s: float) -> list:
    out = []
    for reply, reference in pairs:
        try:
            out.append(bool(call_within(timeout_s, fn, reply, reference)))
        except (Exception, CallTimeout):  # noqa: BLE001 - an unanswerable check falls back to the generic one
            out.append(None)
    return out


def serve(stdin, stdout) -> None:
    setup = read_frame(stdin)
    kwargs = dict(setup.get("kwargs") or {})
    try:
        fn, origin = load_function(setup["function"])
        convention = convention_of(fn, setup.get("convention", "auto"), kwargs, setup["function"])
        states = load_function(setup["states_reference"])[0] if setup.get("states_reference") else None
    except SpecError as e:
        write_frame(stdout, {"ok": False, "error": str(e)})
        return
    verl_args = verl_args_of(fn, kwargs) if convention == "verl" else ()
    wanted = trl_columns_of(fn) if convention == "trl" else ()
    write_frame(stdout, {"ok": True, "convention": convention, "where": origin, "verl_args": verl_args})
    while True:
        try:
            request = read_frame(stdin)
        except EOFError:
            return
        if request["op"] == "verl":
            for call in request["calls"]:
                write_frame(stdout, _verl_call(fn, call, kwargs, verl_args, request["timeout_s"]))
        elif request["op"] == "trl":
            columns = {k: v for k, v in request["columns"].items() if k in wanted}
            write_frame(stdout, _trl_call(fn, columns, kwargs, request["timeout_s"]))
        elif request["op"] == "states":
            write_frame(stdout, ("ok", _states(states, request["pairs"], request["timeout_s"]) if states else None))


def die_with(parent: int) -> None:
    """SIGKILL this process when the scoring process that started it dies (Linux's PR_SET_PDEATHSIG), so a
    helper stuck in the user's code never outlives it; if it died before this was set, go at once."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(0)


def main() -> None:
    """Frames go out on a copy of stdout; fd 1 itself then points at stderr, so that what the function
    prints (or a library it imports) goes to the log instead of into the frames."""
    if len(sys.argv) > 1:
        die_with(int(sys.argv[1]))
    frames_out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(sys.stdin.buffer, frames_out)


if __name__ == "__main__":
    main()
