"""Faults injected into real runs (`--set trainer.fault=KIND@STEP`): one case per kind, through `zbench run` with
`--retries 1`, on the real engine (tiny model, GRPO, ZeRO-2, two steps, the fault at the last; one rank, except for
the hang, whose rank 0 waits in a barrier for a second one).

Each kind ends as the launcher promises: crash -> failed with the exception line; oom -> oom, not retried;
hang -> timeout with the stacks of the trainer and its workers in train.log, then completed; worker_exit -> a lost
worker, then completed. Nothing of any case is left running or on disk, and summary.tsv is whole. (A slow step
completes: tests/test_private_ray.py runs one.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from zbench import procs
from zbench.runroot import casedir, summary

STEPS = 2
# a hang is found by its silent heartbeat; before the first step the silence counts from the start, so the limit
# must cover a case's start-up on a loaded machine (Ray's alone took 27 s with three test processes on two cores)
STEP_TIMEOUT_S = 60
FAULTS = {"crash": "crash@2", "oom": "oom@2", "hang": "hang@2", "worker_exit": "worker_exit@2"}
RANKS = {"crash": 1, "oom": 1, "hang": 2, "worker_exit": 1}  # a rank is a worker process to start: CI time
MATRIX = """description: one case per injected fault
base:
  algorithm: grpo
  rollout: {n: 4}
  zero: {stage: 2, offload: none}
axes:
  fault:
""" + "".join(f"    {name}: {{trainer.fault: '{spec}', trainer.world_size: {RANKS[name]}}}\n"
             for name, spec in FAULTS.items()) + 'name: "{fault}"\n'


@pytest.fixture(scope="module")
def faulted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    tmp = tmp_path_factory.mktemp("faults")
    (tmp / "faults.yaml").write_text(MATRIX)
    res = subprocess.run(
        [sys.executable, "-m", "zbench", "run", str(tmp / "faults.yaml"), "--steps", str(STEPS), "--retries", "1",
         "--step-timeout", str(STEP_TIMEOUT_S), "--results-dir", str(tmp / "results")],
        capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    [root] = (tmp / "results").iterdir()
    return root, res


def status(root: Path, case: str) -> dict:
    return json.loads((root / case / casedir.STATUS).read_text())


def log(root: Path, case: str) -> str:
    return (root / case / casedir.TRAIN_LOG).read_text(errors="replace")


def steps(root: Path, case: str, name: str = casedir.METRICS) -> list[int]:
    return [r["step"] for r in casedir.parse_metrics((root / case / name).read_bytes()).records]


@pytest.mark.slow
def test_each_fault_ends_as_promised(faulted: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    root, res = faulted
    assert res.returncode == 1, (res.stdout + res.stderr)[-4000:]  # crash and oom stay failed
    got = {c: (status(root, c)["status"], status(root, c)["attempt"]) for c in FAULTS}
    assert got == {"crash": ("failed", 1), "oom": ("oom", 1), "hang": ("completed", 2),
                   "worker_exit": ("completed", 2)}, got
    assert status(root, "crash")["reason"] == "RuntimeError: injected fault: crash at step 2"
    assert "OutOfMemoryError" in status(root, "oom")["reason"]
    for case in FAULTS:  # the fault is recorded with the case
        assert yaml.safe_load((root / case / casedir.CONFIG).read_text())["trainer"]["fault"] == FAULTS[case]


@pytest.mark.slow
def test_a_hang_times_out_with_every_process_stack(faulted: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    root, _ = faulted
    text = log(root, "hang")
    assert f"==== zbench: step timeout: no heartbeat for {STEP_TIMEOUT_S} s" in text
    assert "==== zbench attempt 1 ended" in text and ": timeout (" in text
    dumped = text[text.index("==== zbench: step timeout"):text.index("==== zbench attempt 1 ended")]
    assert "in maybe_inject" in dumped  # the trainer, waiting on rank 0
    assert "in _hang_in_barrier" in dumped  # rank 0, inside the barrier the other rank never reaches
    assert steps(root, "hang", "metrics.attempt1.jsonl") == [1]  # attempt 1's step kept, set aside
    assert steps(root, "hang") == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_a_lost_worker_is_retried(faulted: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    root, _ = faulted
    text = log(root, "worker_exit")
    first = text[: text.index("==== zbench attempt 2 started")]
    assert ": failed (exit code 1)" in first and "ActorDiedError" in first
    assert steps(root, "worker_exit", "metrics.attempt1.jsonl") == [1]
    assert steps(root, "worker_exit") == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_nothing_is_left_behind_and_the_summary_is_whole(
    faulted: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    root, _ = faulted
    rows = summary.read_summary(root / summary.SUMMARY)
    assert [r["case"] for r in rows] == list(FAULTS)
    assert {r["case"]: r["status"] for r in rows} == {c: status(root, c)["status"] for c in FAULTS}
    for case in FAULTS:
        cdir = root / case
        assert not procs.case_processes(cdir), case
        assert not casedir.ray_tmpdir(cdir).exists(), case
        assert not (cdir / casedir.STACK_PIDS).exists(), case
    assert not procs.processes_mentioning(str(root))
