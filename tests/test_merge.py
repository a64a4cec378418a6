"""zbench merge: the latest completed attempt of each case wins; differing configs are an error unless forced."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from zbench.runroot import casedir, summary
from zbench.runroot.casedir import RunRootError
from zbench.runroot.merge import merge
from zbench.runroot.root import RunRoot


class Case:
    def __init__(self, name: str) -> None:
        self.name, self.overrides = name, {}


def make_root(results: Path, names: list[str]) -> RunRoot:
    root = RunRoot.create(results, "m_3_seed1", matrix="m", matrix_file=None, seed=1, steps=3,
                          cases=[Case(n) for n in names], environment={})  # fmt: skip
    time.sleep(0.01)
    return root


def put(root: RunRoot, name: str, status: str, ended_at: str, steps: int = 3, extra: str = "") -> None:
    cdir = root.case_dir(name)
    (cdir / "config.yaml").write_text(f"name: {name}\nalgorithm: grpo\nseed: 1\nsteps: 3\n{extra}")
    (cdir / "metrics.jsonl").write_text(
        "".join(f'{{"step": {n}, "critic/score/mean": {n / 10}}}\n' for n in range(1, steps + 1))
    )
    casedir.write_status(cdir, {"status": status, "attempt": 1, "exit_code": 0 if status == "completed" else 1,
                              "reason": "" if status == "completed" else "RuntimeError: x", "last_step": steps,
                              "started_at": ended_at, "ended_at": ended_at, "warnings": []})  # fmt: skip
    if status == "completed":
        casedir.atomic_write_json(cdir / "result.json", {"steps_completed": 3, "steps_target": 3})


def test_latest_completed_wins_in_first_roots_order(tmp_path: Path) -> None:
    first = make_root(tmp_path, ["a", "b", "c"])
    put(first, "a", "completed", "2026-01-01T00:00:00Z")
    put(first, "b", "oom", "2026-01-01T00:01:00Z", steps=1)
    put(first, "c", "failed", "2026-01-01T00:02:00Z", steps=2)
    rerun = make_root(tmp_path, ["c", "b", "a", "d"])
    put(rerun, "b", "completed", "2026-01-02T00:00:00Z")
    put(rerun, "a", "failed", "2026-01-02T00:01:00Z", steps=1)  # a later failure does not beat a completion
    put(rerun, "d", "completed", "2026-01-02T00:02:00Z")
    result = merge([first.path, rerun.path])
    assert result.path == first.path / "summary_complete.tsv" and result.warnings == []
    rows = summary.read_summary(result.path)
    assert [(r["case"], r["status"], r["steps_completed"]) for r in rows] == [
        ("a", "completed", "3"), ("b", "completed", "3"), ("c", "failed", "2"), ("d", "completed", "3"),
    ]  # fmt: skip
    assert rows[0]["case_dir"] == "a" and rows[1]["case_dir"] == f"../{rerun.path.name}/b"
    assert (result.path.parent / rows[1]["case_dir"] / "status.json").is_file()
    out = tmp_path / "elsewhere" / "all.tsv"
    assert [r["case_dir"] for r in merge([first.path, rerun.path], out).rows][:2] == [
        f"../{first.path.name}/a", f"../{rerun.path.name}/b",
    ]  # fmt: skip
    moved = summary.read_summary(out)
    assert (out.parent / moved[1]["case_dir"] / "status.json").is_file()


def test_two_completions_latest_wins(tmp_path: Path) -> None:
    first = make_root(tmp_path, ["a"])
    put(first, "a", "completed", "2026-01-03T00:00:00Z")
    second = make_root(tmp_path, ["a"])
    put(second, "a", "completed", "2026-01-02T00:00:00Z")
    [row] = merge([second.path, first.path]).rows
    assert row["case_dir"] == f"../{first.path.name}/a"  # ended later, though listed first


def test_never_completed_keeps_the_attempt_with_the_most_steps(tmp_path: Path) -> None:
    first = make_root(tmp_path, ["a", "b"])
    put(first, "a", "interrupted", "2026-01-01T00:00:00Z", steps=2)
    put(first, "b", "failed", "2026-01-01T00:01:00Z", steps=1)
    second = make_root(tmp_path, ["a", "b"])
    put(second, "a", "interrupted", "2026-01-02T00:00:00Z", steps=1)  # later, but got less far
    put(second, "b", "failed", "2026-01-02T00:01:00Z", steps=1)  # as far: the later one
    rows = merge([first.path, second.path]).rows
    assert [(r["case_dir"], r["steps_completed"]) for r in rows] == [("a", "2"), (f"../{second.path.name}/b", "1")]


def test_config_conflict_is_an_error_unless_forced(tmp_path: Path) -> None:
    first = make_root(tmp_path, ["a"])
    put(first, "a", "failed", "2026-01-01T00:00:00Z")
    second = make_root(tmp_path, ["a"])
    put(second, "a", "completed", "2026-01-02T00:00:00Z", extra="zero:\n  stage: 3\n")
    with pytest.raises(RunRootError, match="case 'a' has different configs") as err:
        merge([first.path, second.path])
    assert str(first.path) in str(err.value) and str(second.path) in str(err.value)
    assert "--mixed-configs" in str(err.value) and not (first.path / "summary_complete.tsv").exists()
    forced = merge([first.path, second.path], mixed_configs=True)
    assert len(forced.warnings) == 1 and forced.rows[0]["status"] == "completed"


def test_merge_needs_run_roots(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one run root"):
        merge([])
    with pytest.raises(RunRootError, match="is not a run root"):
        merge([tmp_path])


def test_merge_never_replaces_an_earlier_merge_unasked(tmp_path: Path) -> None:
    """A one-root merge over summary_complete.tsv written from two roots: refused, naming the file, what it holds
    and both ways out; --out writes elsewhere, --force replaces it."""
    first = make_root(tmp_path, ["a", "b"])
    put(first, "a", "completed", "2026-01-01T00:00:00Z")
    put(first, "b", "failed", "2026-01-01T00:01:00Z", steps=1)
    rerun = make_root(tmp_path, ["b"])
    put(rerun, "b", "completed", "2026-01-02T00:00:00Z")

    def zbench(*args: object) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "zbench", "merge", *map(str, args)], capture_output=True,
                              text=True, timeout=120)

    assert zbench(first.path, rerun.path).returncode == 0
    merged = first.path / "summary_complete.tsv"
    before = merged.read_text()
    res = zbench(first.path)
    assert res.returncode == 2 and "Traceback" not in res.stderr and merged.read_text() == before
    assert f"{merged} already exists (a summary of 2 case(s) from {first.path.name}, {rerun.path.name})" in res.stderr
    assert "--force" in res.stderr and "--out FILE" in res.stderr
    elsewhere = tmp_path / "one-root.tsv"
    assert zbench(first.path, "--out", elsewhere).returncode == 0 and merged.read_text() == before
    assert zbench(first.path, "--out", elsewhere).returncode == 2  # an explicit --out is not replaced either
    res = zbench(first.path, "--force")
    assert res.returncode == 0, res.stderr
    assert [r["status"] for r in summary.read_summary(merged)] == ["completed", "failed"]
