"""The conventions users bring from other tools, through the real CLI: --version, shell completion, JSON that
parses, one spelling of each option, one way to name a run root."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from zbench import __version__


def zbench(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zbench", *map(str, args)], capture_output=True, text=True,
                          timeout=180, env=env)


def test_env_json_is_json_on_stdout() -> None:
    """DeepSpeed's accelerator warning goes to stderr; stdout parses whole."""
    res = zbench("env", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["versions"]["deepspeed"] and isinstance(report["deepspeed_ops"], dict) and report["deepspeed_ops"]
