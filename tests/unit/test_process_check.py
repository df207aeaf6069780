"""The suite's end-of-session check (tests/process_check.py), on a session of its own: a process a test
started and left running is named, killed by its pid and fails the session; a session whose tests wait
for what they start passes."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil

TESTS = Path(__file__).resolve().parents[1]


def _session(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=str(TESTS), DAPO_TEST_PROCESS_GRACE_S="3")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "process_check", "-p", "no:cacheprovider",
                           str(tmp_path / "test_inner.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_a_process_left_running_is_named_killed_and_fails_the_session(tmp_path):
    done = _session(tmp_path, """
        import subprocess
        from pathlib import Path

        def test_leaks():
            p = subprocess.Popen(["sleep", "300"], start_new_session=True)
            Path("leaked.pid").write_text(str(p.pid))
    """)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    pid = int((tmp_path / "leaked.pid").read_text())
    assert "processes left behind" in out and f"pid {pid} " in out and "sleep 300" in out, out
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_session_that_waits_for_its_processes_passes(tmp_path):
    done = _session(tmp_path, """
        import subprocess

        def test_waits():
            subprocess.run(["sleep", "2.5"], check=True)
    """)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "processes left behind" not in done.stdout
