"""Runs the Triton kernels' cases in Triton's interpreter on the CPU: `decode_attention_cases.py` (the decode step's
attention against SDPA) and `race_sampling_cases.py` (the in-graph draw against the softmax), each in a pytest
process of its own with `TRITON_INTERPRET=1`, which Triton must see before it is imported; an earlier test here may
have imported it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


@pytest.mark.parametrize("cases", ["decode_attention_cases.py", "race_sampling_cases.py"])
def test_kernel_cases_in_the_triton_interpreter(cases: str):
    path = Path(__file__).with_name(cases)
    env = os.environ | {"TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          str(path)], env=env, capture_output=True, text=True, timeout=600, cwd=path.parent.parent)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
