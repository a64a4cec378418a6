"""The harness itself dies mid-case (SIGKILL, as a crash or an OOM killer would): nothing of the case keeps running,
and `zbench resume` finishes the run with every step recorded once. Real engine, tiny model, through the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from zbench import procs
from zbench.config import dump_yaml, from_dict
from zbench.runroot import casedir
from zbench.runroot.root import RunRoot

CASE = "zero2_no_offload"
STEPS = 6
ZBENCH = [sys.executable, "-m", "zbench"]


def wait_for_steps(case: Path, n: int, proc: subprocess.Popen, limit_s: float = 600) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        if len(casedir.read_metrics(case).records) >= n:
            return
        time.sleep(0.2)
    out = proc.stdout.read() if proc.stdout and proc.poll() is not None else ""
    pytest.fail(f"{case}: fewer than {n} steps recorded (exit {proc.poll()}): {out[-3000:]}")


def gone_within(found: list[psutil.Process], limit_s: float) -> list[psutil.Process]:
    """The processes of ``found`` still running after up to ``limit_s`` seconds (an upper bound, not a timing)."""
    deadline = time.monotonic() + limit_s
    while procs.alive(found) and time.monotonic() < deadline:
        time.sleep(0.5)
    return procs.alive(found)


def steps_of(case: Path) -> list[int]:
    return [r["step"] for r in casedir.read_metrics(case).records]


def resume(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ZBENCH, "resume", str(root), "--retries", "0"], capture_output=True, text=True,
                          timeout=900)


@pytest.mark.slow
def test_sigkilled_harness_takes_its_case_down_and_resume_finishes(tmp_path: Path) -> None:
    results = tmp_path / "results"
    harness = subprocess.Popen(
        [*ZBENCH, "run", "grpo-six-case", "--cases", CASE, "--steps", str(STEPS), "--retries", "0",
         "--set", "trainer.fault=slow@3", "--set", "trainer.world_size=1",  # one rank: one worker process to start
         "--results-dir", str(results)],  # killed inside the slow step 3
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not list(results.glob(f"*/{CASE}")) and time.monotonic() < deadline:
        time.sleep(0.2)
    [case] = results.glob(f"*/{CASE}")
    wait_for_steps(case, 2, harness)
    case_procs = procs.case_processes(case)
    assert len(case_procs) >= 3  # the engine, its Ray daemons and workers

    harness.kill()
    harness.wait()
    left = gone_within(case_procs, 60)
    assert not left, [p.info if hasattr(p, "info") else p for p in left]
    assert not casedir.ray_tmpdir(case).exists()
    assert "is gone: stopping this case" in (case / casedir.TRAIN_LOG).read_text()  # the engine noticed itself
    assert json.loads((case / casedir.STATUS).read_text())["status"] == "running"  # what the dead harness left

    res = resume(case.parent)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert steps_of(case) == list(range(1, STEPS + 1))  # the first attempt's steps set aside, none twice
    status = json.loads((case / casedir.STATUS).read_text())
    assert status["status"] == "completed" and status["attempt"] == 2
    assert (case / "metrics.attempt1.jsonl").is_file()
    assert not procs.case_processes(case)


@pytest.mark.slow
def test_resume_stops_a_live_orphan_before_its_own_attempt(tmp_path: Path) -> None:
    """An engine left running without a supervisor (a harness of an older zbench, or one killed before the engine
    noticed) is stopped by `zbench resume` before the new attempt: never two attempts at once."""

    class Case:
        name, overrides = CASE, {}

    root = RunRoot.create(tmp_path, "orphan", matrix="m", matrix_file=None, seed=3, steps=STEPS, cases=[Case()],
                          environment={})
    case = root.case_dir(CASE)
    cfg = from_dict({"name": CASE, "seed": 3, "steps": STEPS, "algorithm": "grpo", "rollout": {"n": 4},
                     "zero": {"stage": 2, "offload": "none"}, "trainer": {"fault": "hang@3"}})
    (case / casedir.CONFIG).write_text(dump_yaml(cfg))
    casedir.write_status(case, {"status": "running", "attempt": 1, "exit_code": None, "reason": ""})
    env = {k: v for k, v in os.environ.items() if k != procs.SUPERVISOR_ENV}
    env.update(ZBENCH_RAY_TMPDIR=str(casedir.ray_tmpdir(case)), ZBENCH_ATTEMPT="1")  # hangs at step 3
    with (case / casedir.TRAIN_LOG).open("ab") as log:
        orphan = subprocess.Popen([sys.executable, "-m", "zbench.engine", str(case)], env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_steps(case, 2, orphan)
        res = resume(root.path)
        assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
        assert "processes an earlier run left running" in res.stderr
        assert orphan.poll() is not None  # stopped before the new attempt started
        assert steps_of(case) == list(range(1, STEPS + 1))
        assert json.loads((case / casedir.STATUS).read_text())["attempt"] == 2
    finally:
        if orphan.poll() is None:
            os.killpg(orphan.pid, signal.SIGKILL)
        procs.kill_processes(None, procs.case_processes(case), 1.0)
