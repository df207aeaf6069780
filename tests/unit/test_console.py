"""What a user sees at the console: the ETA of a run, the live status line (only on a terminal), and the
one vLLM warning per weight sync that is dropped while every other warning stays."""

import importlib
import inspect
import io
import logging

import pytest

from dapo_ray.progress import Pace, StatusLine, duration, log
from dapo_ray.rollout.worker_ext import RELOAD_LOGGER, RELOAD_WARNING, quiet_rotary_reload_warning


@pytest.mark.parametrize("seconds, text", [(0.4, "0s"), (45, "45s"), (60, "1m00s"), (572, "9m32s"),
                                           (3599, "59m59s"), (7500, "2h05m")])  # fmt: skip
def test_durations(seconds, text):
    assert duration(seconds) == text


def test_eta_from_the_recent_pace():
    pace = Pace(total=100, window=3)
    pace.mark(10, now=0.0)  # a resumed run starts at step 10
    assert pace.eta() == "ETA --"
    pace.mark(11, now=2.0)
    assert pace.eta_s() == pytest.approx(89 * 2.0)
    for step, now in [(12, 4.0), (13, 6.0), (14, 16.0)]:  # an evaluation made step 14 slow
        pace.mark(step, now)
    assert pace.eta_s() == pytest.approx(86 * (16.0 - 2.0) / 3)  # the last 3 steps only (12, 13, 14)
    pace.mark(100, now=30.0)
    assert pace.eta_s() == 0
    assert Pace(total=10**6).eta_s(budget_left_s=900.0) == 900.0  # a time budget caps it


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_status_line_is_drawn_only_on_a_terminal():
    log_file = io.StringIO()
    quiet = StatusLine(lambda: "step 3/10", stream=log_file, interval_s=0.01)
    quiet.draw()
    quiet.close()
    assert log_file.getvalue() == ""

    tty = _Terminal()
    line = StatusLine(lambda: "step 3/10  ETA 1m00s", stream=tty, interval_s=60)
    line.draw()
    line.close()
    assert tty.getvalue() == "\r\x1b[Kstep 3/10  ETA 1m00s\r\x1b[K"


def test_a_logged_line_clears_the_status_line_while_it_is_on_screen(capsys):
    tty = _Terminal()
    line = StatusLine(lambda: "step 3/10", stream=tty, interval_s=60)
    line.draw()
    log("step 3/10  reward +0.5")
    assert tty.getvalue() == "\r\x1b[Kstep 3/10\r\x1b[K"
    line.close()
    log("done")
    assert tty.getvalue() == "\r\x1b[Kstep 3/10\r\x1b[K\r\x1b[K"  # close() cleared it once; log() no more
    printed = capsys.readouterr().out.splitlines()
    assert [p.split("] ", 1)[1] for p in printed] == ["step 3/10  reward +0.5", "done"]


def test_only_the_rotary_reload_warning_is_dropped(caplog):
    quiet_rotary_reload_warning()
    quiet_rotary_reload_warning()  # idempotent
    logger = logging.getLogger(RELOAD_LOGGER)
    assert len(logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=RELOAD_LOGGER):
        for layer in ("RotaryEmbedding", "Llama3RotaryEmbedding", "QKVParallelLinear", "VocabParallelEmbedding"):
            logger.warning(RELOAD_WARNING, layer)
        logger.warning("RotaryEmbedding: some other problem")
    assert [r.getMessage() for r in caplog.records] == [
        "QKVParallelLinear: Failed to load weights",
        "VocabParallelEmbedding: Failed to load weights",
        "RotaryEmbedding: some other problem",
    ]


def test_the_filter_matches_what_vllm_logs():
    """vLLM's reload logs this warning from this logger; if either changes, the filter must follow."""
    layerwise = importlib.import_module(RELOAD_LOGGER)
    assert layerwise.logger.name == RELOAD_LOGGER
    assert f'logger.warning("{RELOAD_WARNING}", layer.__class__.__name__)' in inspect.getsource(layerwise)


def test_the_dashboard_line_says_how_to_sign_in_when_token_authentication_is_on(monkeypatch):
    from dapo_ray.ray_cluster import dashboard_line

    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # what `ray.init` sets when it turns authentication on
    line = dashboard_line("127.0.0.1:8265")
    assert line.startswith("Ray dashboard: http://127.0.0.1:8265 ") and "`ray get-auth-token`" in line
    assert "RAY_AUTH_MODE=token" in line
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert dashboard_line("http://10.0.0.1:8265") == "Ray dashboard: http://10.0.0.1:8265"
    assert "not running" in dashboard_line(None)


def test_a_quiet_console_keeps_the_libraries_chatter_in_their_logs(monkeypatch):
    """`cluster.verbose` off: each process of the run (QUIET_ENV set) turns the libraries' loggers down to
    their warnings or errors (DeepSpeed's memory reports and MLflow's lines are INFO, Serve's late-replica
    queue-length warnings go), while dapo-ray's own lines are untouched; without it nothing changes."""
    import warnings

    from dapo_ray.progress import QUIET_ENV, QUIET_LOGGERS, quiet_libraries

    for name in QUIET_LOGGERS:
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
    monkeypatch.delenv(QUIET_ENV, raising=False)
    quiet_libraries()
    assert all(logging.getLogger(n).level == logging.NOTSET for n in QUIET_LOGGERS)
    monkeypatch.setenv(QUIET_ENV, "1")
    with warnings.catch_warnings():
        quiet_libraries()
        assert not logging.getLogger("DeepSpeed").isEnabledFor(logging.INFO)
        assert not logging.getLogger("ray.serve").isEnabledFor(logging.WARNING)
        assert logging.getLogger("ray.serve").isEnabledFor(logging.ERROR)
        assert not logging.getLogger("mlflow").isEnabledFor(logging.INFO)


def test_replicas_of_a_quiet_run_keep_vllms_warnings_in_their_logs(monkeypatch):
    """The replicas' environment: vLLM's logging at ERROR and Python's deprecation warnings off when the run's
    console is quiet; vLLM's WARNING level otherwise (stand-ins for Serve: nothing starts)."""
    from types import SimpleNamespace

    from dapo_ray.config import load_config
    from dapo_ray.progress import QUIET_ENV
    from dapo_ray.rollout import deployment

    cfg = load_config("workflows/configs/tiny_cpu.yaml")
    seen = []
    server = SimpleNamespace(options=lambda **kw: seen.append(kw) or SimpleNamespace(bind=lambda *a: None))
    monkeypatch.setattr(deployment, "RolloutServer", server)
    monkeypatch.setattr(deployment.serve, "start", lambda **kw: None)
    monkeypatch.setattr(deployment.serve, "run", lambda app, **kw: None)
    monkeypatch.delenv(QUIET_ENV, raising=False)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)  # an in-process Engine of an earlier test sets it
    deployment.deploy_rollout(cfg.rollout, cfg.max_model_len, "store", seed=0)
    monkeypatch.setenv(QUIET_ENV, "1")
    deployment.deploy_rollout(cfg.rollout, cfg.max_model_len, "store", seed=0)
    loud, quiet = (s["ray_actor_options"]["runtime_env"]["env_vars"] for s in seen)
    assert loud["VLLM_LOGGING_LEVEL"] == "WARNING" and QUIET_ENV not in loud
    assert quiet["VLLM_LOGGING_LEVEL"] == "ERROR" and quiet[QUIET_ENV] == "1" and "FutureWarning" in quiet["PYTHONWARNINGS"]
