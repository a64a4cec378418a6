"""Resume decides what happened to a case from everything its directory holds, and a file it cannot trust is an
error naming it, never a silent fresh start (`zbench resume` in a subprocess; fake engines where a case must run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zbench.config import dump_yaml, from_dict
from zbench.harness import launch
from zbench.runroot import casedir
from zbench.runroot.root import RunRoot

FAKE = Path(__file__).parent / "fake_cases"
CONFIG = from_dict({"name": "a", "algorithm": "grpo", "seed": 1, "steps": 3, "rollout": {"n": 2},
                    "zero": {"stage": 2, "offload": "none"}})


class Case:
    name, overrides = "a", {}


def finished_root(tmp_path: Path, status: str = "completed") -> tuple[RunRoot, Path]:
    """A run root whose one case recorded all 3 steps and its result, its status.json saying ``status``."""
    root = RunRoot.create(tmp_path, "t", matrix="m", matrix_file=None, seed=1, steps=3, cases=[Case()],
                          environment={})
    case = root.case_dir("a")
    (case / casedir.CONFIG).write_text(dump_yaml(CONFIG))
    (case / casedir.METRICS).write_text("".join(json.dumps({"step": s, "timing_s/step": 1.0}) + "\n"
                                                for s in (1, 2, 3)))
    casedir.write_result(case, {"steps_completed": 3, "steps_target": 3})
    casedir.write_status(case, {"status": status, "attempt": 1, "exit_code": None, "reason": ""})
    return root, case


def resume(root: RunRoot) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zbench", "resume", str(root.path)], capture_output=True,
                          text=True, timeout=300)


def test_a_case_finished_but_marked_running_is_kept_not_rerun(tmp_path: Path) -> None:
    root, case = finished_root(tmp_path, status="running")  # the harness died after the engine's last step
    res = resume(root)
    assert res.returncode == 0, res.stdout + res.stderr
    status = json.loads((case / casedir.STATUS).read_text())
    assert status["status"] == "completed" and status["attempt"] == 1
    assert "status.json said 'running'" in status["warnings"][0]
    assert not (case / casedir.TRAIN_LOG).exists()  # nothing ran


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        (casedir.STATUS, '{"status": "runn', "not valid JSON"),
        (casedir.STATUS, '{"status": "done", "attempt": 1}', "status 'done'"),
        (casedir.STATUS, '["running"]', "expected a JSON object"),
        (casedir.RESULT, '{"steps": 3}', "'steps_completed' is None"),
        (casedir.CONFIG, "name: a\nalgorithm: grpo\nseed: 1\n", "not a complete case config"),
    ],
)
def test_an_untrustworthy_file_stops_resume_naming_it(tmp_path: Path, name: str, text: str, expected: str) -> None:
    root, case = finished_root(tmp_path, status="failed")
    (case / name).write_text(text)
    res = resume(root)
    assert res.returncode == 2, res.stdout + res.stderr
    assert str(case / name) in res.stderr and expected in res.stderr, res.stderr
    assert not (case / casedir.TRAIN_LOG).exists()


def options(script: str) -> launch.LaunchOptions:
    return launch.LaunchOptions(command=(sys.executable, str(FAKE / f"{script}.py")), kill_grace_s=1.0, poll_s=0.1,
                                retries=0)


def test_a_stale_result_never_makes_a_failed_rerun_completed(tmp_path: Path) -> None:
    """Without status.json, the earlier attempt's result and metrics are still set aside: a rerun that crashes at
    once is failed, attempt 2, with only its own step recorded."""
    root, case = finished_root(tmp_path)
    (case / casedir.METRICS).write_text(json.dumps({"step": 1}) + "\n")  # the earlier attempt got 1 step far
    (case / casedir.STATUS).unlink()
    [status] = launch.run_cases(root, [("a", CONFIG)], options("crash"))
    assert status["status"] == "failed" and status["attempt"] == 2
    assert (case / "result.attempt1.json").is_file() and not (case / casedir.RESULT).exists()
    assert [r["step"] for r in casedir.read_metrics(case).records] == [1]
    assert (case / "metrics.attempt1.jsonl").is_file()
