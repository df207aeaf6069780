"""docs/config.md lists every config key with its docstring, written from dapo_ray/config.py."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_config_reference_is_current():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "config_reference.py"), "--check"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_it_names_every_key():
    from dapo_ray.config import load_config

    text = (ROOT / "docs" / "config.md").read_text()
    missing = [k for k in load_config(None, ["data.source=synthetic"]).flat() if f"`{k}`" not in text]
    assert missing == []
