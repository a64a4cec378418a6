"""Runs `decode_attention_cases.py` (the decode step's Triton attention against SDPA) in a pytest process of its own
with `TRITON_INTERPRET=1`, which Triton must see before it is imported; an earlier test here may have imported it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_decode_attention_cases_in_the_triton_interpreter():
    cases = Path(__file__).with_name("decode_attention_cases.py")
    env = os.environ | {"TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          str(cases)], env=env, capture_output=True, text=True, timeout=600,
                         cwd=cases.parent.parent)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
