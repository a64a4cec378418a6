"""`zbench tune` through the real CLI on the CPU engine (real Ray, real DeepSpeed, the tiny model): two cases of
six-case tuned, the tuned matrix run by `zbench run`, an over-budget trial skipped with its reason, and a tune
stopped by its time budget that still leaves what it found."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from zbench import procs
from zbench.harness.tune_search import TOLERANCE
from zbench.runroot import casedir

ZBENCH = [sys.executable, "-m", "zbench"]
CASES = ["zero1_no_offload", "zero2_no_offload"]
# one rank a trial: a rank is a worker process to start, and the suite's cases share two cores (CI time)
ONE_RANK = ("--set", "trainer.world_size=1")
GEOMETRY = ("actor.micro_batch_size_per_gpu", "critic.micro_batch_size_per_gpu",
            "actor.forward_micro_batch_size_per_gpu", "model.gradient_checkpointing")


def zbench(*args: str, timeout: float = 1200) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ZBENCH, *args], capture_output=True, text=True, timeout=timeout)


def only_root(results: Path) -> Path:
    roots = [p for p in results.iterdir() if p.is_dir()]
    assert len(roots) == 1, roots
    return roots[0]


def trials(root: Path) -> list[dict[str, str]]:
    with open(root / "tuning.tsv", newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def config_value(case_dir: Path, dotted: str) -> object:
    node = yaml.safe_load((case_dir / "config.yaml").read_text())
    for part in dotted.split("."):
        node = node[part]
    return node


def cell(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    results = tmp_path_factory.mktemp("tune")
    proc = zbench("tune", "six-case", "--cases", ",".join(CASES), "--steps", "2", "--results-dir", str(results),
                  *ONE_RANK)
    return only_root(results), proc


def test_tune_finds_and_records_a_geometry_per_case(tuned: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    root, proc = tuned
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = trials(root)
    assert [c for c in dict.fromkeys(r["case"] for r in rows)] == CASES
    for case in CASES:
        mine = [r for r in rows if r["case"] == case]
        chosen = [r for r in mine if r["chosen"] == "true"]
        assert len(chosen) == 1 and chosen[0]["status"] == "ok", mine
        # the fastest, or one the noise of a few steps cannot tell from it (then the one needing less memory), by
        # what the search ranks on: the phases batch geometry changes (every trial here times them), not the step
        ok = [r for r in mine if r["status"] == "ok"]
        assert all(r["geometry_s"] for r in ok), ok
        fastest = min(float(r["geometry_s"]) for r in ok)
        assert float(chosen[0]["geometry_s"]) <= fastest * (1 + TOLERANCE), mine
        assert f"[tune] {case}: {len(mine)} trials; chose " in proc.stdout
        for r in mine:  # each trial's config.yaml records the geometry that ran
            assert r["status"] == "ok" and float(r["peak_memory_gb"]) > 0, r
            for key in GEOMETRY:
                assert r[key] == cell(config_value(root / r["trial_dir"], key)), (r["trial"], key)
    tuned_matrix = yaml.safe_load((root / "tuned.yaml").read_text())
    assert [c["name"] for c in tuned_matrix["cases"]] == CASES
    for case in tuned_matrix["cases"]:
        chosen = next(r for r in rows if r["case"] == case["name"] and r["chosen"] == "true")
        assert {k: cell(case["set"][k]) for k in GEOMETRY} == {k: chosen[k] for k in GEOMETRY}
        assert case["set"]["zero.stage"] == int(case["name"][4])  # the case's own knobs stay
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["tune"]["stopped"] is None
    assert all(manifest["tune"]["cases"][c]["complete"] for c in CASES)
    # each case's trials were served one after another by one session of its own
    for case in CASES:
        served = [json.loads((root / r["trial_dir"] / "result.json").read_text())["session"]
                  for r in rows if r["case"] == case]
        assert served == [{"dir": f"{case}.session", "trial": k} for k in range(1, len(served) + 1)], served
    assert not procs.processes_mentioning(str(root))


def test_a_trial_served_by_a_session_equals_the_case_run_afresh(
        tuned: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path) -> None:
    """A later trial of a session (its workers rebuilt for the trial's geometry after another trial) records the
    same numbers as the same config run as a case in a process of its own."""
    root, _ = tuned
    later = [r for r in trials(root)
             if json.loads((root / r["trial_dir"] / "result.json").read_text())["session"]["trial"] > 1]
    assert later, "no trial was served after another"
    served = root / later[0]["trial_dir"]
    fresh = tmp_path / served.name
    fresh.mkdir()
    shutil.copy(served / "config.yaml", fresh / "config.yaml")
    res = subprocess.run([*ZBENCH[:2], "zbench.engine", str(fresh)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    a, b = (casedir.read_metrics(d).records for d in (served, fresh))
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    for ra, rb in zip(a, b, strict=True):
        for key, value in ra.items():
            if not key.startswith(("timing_s/", "perf/")) and key != "time":
                assert rb[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (ra["step"], key)


def test_tuned_matrix_runs_and_reports_its_frontier(tuned: tuple[Path, subprocess.CompletedProcess[str]],
                                                     tmp_path: Path) -> None:
    root, _ = tuned
    case = CASES[-1]  # one case of the tuned matrix: each runs the same way
    run = zbench("run", str(root / "tuned.yaml"), "--cases", case, "--steps", "2", "--results-dir", str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    run_root = only_root(tmp_path)
    chosen = {r["case"]: r for r in trials(root) if r["chosen"] == "true"}
    assert json.loads((run_root / case / "status.json").read_text())["status"] == "completed"
    for key in GEOMETRY:
        assert cell(config_value(run_root / case, key)) == chosen[case][key]
    report = zbench("report", "--run-root", str(run_root))
    assert report.returncode == 0, report.stderr
    md = (run_root / "report.md").read_text()
    assert "## Tuning: what memory buys" in md and (run_root / "frontier.png").stat().st_size > 0
    assert f"| {case} | " in md.split("## Tuning")[1]


def test_an_over_budget_trial_is_skipped_with_its_reason(tmp_path: Path) -> None:
    # every geometry of the tiny model needs more than 0.5 GB of RSS: the first trial is over budget, and the memory
    # model says no smaller micro-batch saves the difference
    proc = zbench("tune", "six-case", "--cases", "zero1_no_offload", "--steps", "2", "--memory-budget", "0.5",
                  "--results-dir", str(tmp_path), *ONE_RANK)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    root = only_root(tmp_path)
    rows = trials(root)
    assert len(rows) == 1
    assert rows[0]["status"] == "over_budget" and rows[0]["chosen"] == "false"
    assert "> memory budget 0.50 GB" in rows[0]["reason"] and float(rows[0]["peak_memory_gb"]) > 0.5
    assert "no smaller micro-batch tried" in proc.stdout
    assert "no geometry ran within the budget" in proc.stdout
    assert not (root / "tuned.yaml").exists()
    assert "tuned matrix: none" in proc.stdout


def test_a_tune_stopped_by_its_time_budget_writes_what_it_found(tmp_path: Path) -> None:
    # every trial's warm-up step takes SLOW_FAULT_S (15 s) longer, so two cases' searches (a session start each, and
    # at least two served trials after it) need well over 120 s; the first trial (25-60 s alone at two ranks, less at
    # one, over 90 s at two on a loaded 2-core machine) fits in the 120 s budget
    proc = zbench("tune", "six-case", "--cases", ",".join(CASES), "--steps", "2", "--time-budget", "120",
                  "--set", "trainer.fault=slow@1", "--results-dir", str(tmp_path), *ONE_RANK)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "stopped early: time budget" in proc.stderr
    root = only_root(tmp_path)
    rows = trials(root)
    assert rows[0]["status"] == "ok" and all(r["status"] in ("ok", "stopped") for r in rows), rows
    found = list(dict.fromkeys(r["case"] for r in rows if r["status"] == "ok"))
    tuned_matrix = yaml.safe_load((root / "tuned.yaml").read_text())
    assert [c["name"] for c in tuned_matrix["cases"]] == found
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["tune"]["stopped"].startswith("time budget")
    assert not all(c["complete"] for c in manifest["tune"]["cases"].values())
