"""The whole path through the real CLI: the six-case matrix on the CPU engine (real Ray, real DeepSpeed ZeRO-1/2/3
with and without CPU offload), interrupted after two cases, resumed, merged with a rerun, and checked for
step-1 parity across ZeRO stages: the cases without offload run one rank, those with it two (a rank is a worker
process to start: CI time), so the stages are compared at both, and with offload across ranks."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ZBENCH = [sys.executable, "-m", "zbench"]
STEPS = 2
SIX = ["zero1_no_offload", "zero2_no_offload", "zero3_no_offload",
       "zero1_cpu_offload", "zero2_cpu_offload", "zero3_cpu_offload"]
# metrics that are pure functions of (weights, data, seed) at step 1: they must agree across ZeRO stages
PARITY = ["critic/score/mean", "critic/values/mean", "critic/vf_loss", "critic/returns/mean", "actor/pg_loss",
          "actor/entropy", "actor/grad_norm", "critic/grad_norm", "response_length/mean", "prompt_length/mean"]


def summary(root: Path, name: str = "summary.tsv") -> dict[str, dict[str, str]]:
    with open(root / name, newline="") as f:
        return {row["case"]: row for row in csv.DictReader(f, delimiter="\t")}


def step_metrics(case_dir: Path, step: int) -> dict[str, float]:
    for line in (case_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["step"] == step:
            return rec
    raise AssertionError(f"no step {step} in {case_dir}")


def only_root(results: Path) -> Path:
    roots = [p for p in results.iterdir() if p.is_dir()]
    assert len(roots) == 1, roots
    return roots[0]


@pytest.fixture(scope="module")
def six_case(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The six-case matrix file, its cases without offload at one rank and those with it at two (named as the
    repository's, so the run root, plot and report name it the same way)."""
    matrix = yaml.safe_load((Path(__file__).resolve().parents[1] / "matrices" / "six-case.yaml").read_text())
    ranks = {"no_offload": 1, "cpu_offload": 2}
    for name, knobs in matrix["axes"]["offload"].items():
        knobs["trainer.world_size"] = ranks[name]
    path = tmp_path_factory.mktemp("matrix") / "six-case.yaml"
    path.write_text(yaml.safe_dump(matrix, sort_keys=False))
    return str(path)


@pytest.fixture(scope="module")
def interrupted(six_case: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A six-case run stopped with SIGINT once two cases have completed and the third is running."""
    results = tmp_path_factory.mktemp("results")
    proc = subprocess.Popen([*ZBENCH, "run", six_case, "--seed", "7777", "--steps", str(STEPS),
                             "--results-dir", str(results), "--retries", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 900
    root = None
    while time.time() < deadline and proc.poll() is None:
        time.sleep(1)
        roots = [p for p in results.iterdir() if p.is_dir()]
        if roots:
            root = roots[0]
            statuses = [json.loads((root / c / "status.json").read_text())["status"]
                        if (root / c / "status.json").exists() else "pending" for c in SIX]
            # the third case must have started, or the interrupt would find it still pending
            if statuses[:3] == ["completed", "completed", "running"]:
                break
    assert proc.poll() is None, f"the run ended before its third case started:\n{proc.stdout.read()}"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert root is not None
    return root


def test_interrupt_leaves_a_consistent_run_root(interrupted: Path) -> None:
    rows = summary(interrupted)
    assert list(rows) == SIX
    statuses = [rows[c]["status"] for c in SIX]
    assert statuses[:2] == ["completed", "completed"], statuses
    assert statuses[2] == "interrupted", statuses
    assert set(statuses[3:]) <= {"pending", ""}, statuses
    manifest = json.loads((interrupted / "manifest.json").read_text())
    assert [c["name"] for c in manifest["cases"]] == SIX
    assert manifest["versions"]["deepspeed"] and manifest["command"][:2] == ["zbench", "run"]
    # no Ray process of this run survives the interrupt (other runs on the machine may have their own)
    from zbench.procs import ray_markers

    markers = sorted({m for c in SIX for m in ray_markers(interrupted / c)})
    leftovers = [pid for m in markers
                 for pid in subprocess.run(["pgrep", "-f", m], capture_output=True, text=True).stdout.split()]
    assert not [p for p in leftovers if p != str(os.getpid())], (markers, leftovers)


@pytest.fixture(scope="module")
def resumed(interrupted: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    """A copy of the interrupted run root, resumed to completion; with the first two cases' files before."""
    root = tmp_path_factory.mktemp("resumed") / interrupted.name
    shutil.copytree(interrupted, root)
    before = {c: (root / c / "metrics.jsonl").read_bytes() for c in SIX[:2]}
    status_before = {c: (root / c / "status.json").read_text() for c in SIX[:2]}
    # resumed in another environment than the run began in: said, and both kept in the manifest
    res = subprocess.run([*ZBENCH, "resume", str(root), "--retries", "0"], capture_output=True, text=True,
                         timeout=1500, env={**os.environ, "NCCL_DEBUG": "VERSION"})
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    (root.parent / "resume.out").write_text(res.stdout)
    return root, before, status_before


def test_resume_completes_without_touching_finished_cases(resumed: tuple[Path, dict, dict]) -> None:
    root, before, status_before = resumed
    manifest = json.loads((root / "manifest.json").read_text())
    first = manifest["variables"].get("NCCL_DEBUG", "(unset)")
    assert first != "VERSION" and manifest["resumes"][-1]["variables"]["NCCL_DEBUG"] == "VERSION"
    out = (root.parent / "resume.out").read_text()
    assert "this resume's environment differs from the run's: " in out and f"NCCL_DEBUG={first} -> VERSION" in out
    rows = summary(root)
    assert all(rows[c]["status"] == "completed" and rows[c]["steps_completed"] == str(STEPS) for c in SIX), rows
    for c in SIX[:2]:
        assert (root / c / "metrics.jsonl").read_bytes() == before[c]
        assert (root / c / "status.json").read_text() == status_before[c]
    for c in SIX:
        for name in ("config.yaml", "train.log", "metrics.jsonl", "status.json", "result.json"):
            assert (root / c / name).is_file(), (c, name)
        log = (root / c / "train.log").read_text()
        assert f"step:{STEPS} - " in log
    # effective offload is recorded, per DESIGN's table
    assert rows["zero1_cpu_offload"]["offload_effective"] == "optimizer:cpu"
    assert rows["zero3_cpu_offload"]["offload_effective"] == "optimizer+params:cpu"
    assert rows["zero2_no_offload"]["offload_effective"] == "none"
    assert rows["zero2_no_offload"]["max_memory_reserved_gb"] == ""  # CPU-only: absent, not zero
    assert float(rows["zero2_no_offload"]["cpu_memory_used_gb"]) > 0

    assert [json.loads((root / c / "result.json").read_text())["world_size"] for c in SIX] == [1, 1, 1, 2, 2, 2]
    # ZeRO stages compute the same mathematics: step-1 metrics agree across the three stages at one rank, and across
    # them at two (each rank samples its own responses, so one rank's and two ranks' steps differ)
    first = {c: step_metrics(root / c, 1) for c in SIX}
    for group in (SIX[:3], SIX[3:]):
        for key in PARITY:
            ref = first[group[0]][key]
            for c in group:
                assert math.isclose(first[c][key], ref, rel_tol=2e-3, abs_tol=1e-5), \
                    f"{key}: {c}={first[c][key]} vs {group[0]}={ref}"


def test_merge_of_two_partial_runs(six_case: str, interrupted: Path, tmp_path: Path) -> None:
    """A rerun of the interrupted case, merged with the first run: each case from the root where it got furthest
    (the rerun's completed attempt over the interrupted one), the cases neither ran still there as pending."""
    broken = SIX[2]
    results = tmp_path / "rerun"
    res = subprocess.run([*ZBENCH, "run", six_case, "--seed", "7777", "--steps", str(STEPS), "--results-dir",
                          str(results), "--cases", broken, "--retries", "0"],
                         capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rerun = only_root(results)
    out = tmp_path / "summary_complete.tsv"
    res = subprocess.run([*ZBENCH, "merge", str(interrupted), str(rerun), "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"{out}: 6 cases, 3 completed" in res.stdout
    merged = summary(out.parent, out.name)
    assert list(merged) == SIX
    assert [merged[c]["status"] for c in SIX[:3]] == ["completed"] * 3, merged
    assert merged[broken]["steps_completed"] == str(STEPS)
    assert Path(merged[broken]["case_dir"]).parts[-3:] == ("rerun", rerun.name, broken)  # relative to the output
    assert Path(merged[SIX[0]]["case_dir"]).parts[-2:] == (interrupted.name, SIX[0])
    assert {merged[c]["status"] for c in SIX[3:]} <= {"pending", ""}, merged


def zb(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*ZBENCH, *args], capture_output=True, text=True, timeout=300)


def test_analysis_of_a_real_run(resumed: tuple[Path, dict, dict], tmp_path: Path) -> None:
    """plot, report, compare and parity on the CPU six-case run, clean and doctored."""
    root = resumed[0]
    res = zb("plot", str(root))
    assert res.returncode == 0, res.stderr
    assert (root / "zero_six_curves.png").stat().st_size > 10_000
    tsv = (root / "zero_six_curves_metrics.tsv").read_text().splitlines()
    header = tsv[0].split("\t")
    assert len(tsv) == 1 + 6 * STEPS and {"case", "step", "critic/score/mean", "critic/vf_loss"} <= set(header)
    res = zb("report", str(root))
    assert res.returncode == 0, res.stderr
    html = (root / "report.html").read_text()
    assert "zero3_cpu_offload" in html and "data:image/png;base64," in html
    assert zb("compare", str(root), str(root)).returncode == 0
    res = zb("parity", str(root))  # each world size on its own: its ranks sample their own responses
    assert res.returncode == 0, res.stdout + res.stderr
    assert (f"ppo at 1 rank: {', '.join(SIX[:3])}; ppo at 2 ranks: {', '.join(SIX[3:])};" in res.stdout), res.stdout

    doctored = tmp_path / "doctored"
    shutil.copytree(root, doctored)
    rows = (doctored / "summary.tsv").read_text().splitlines()
    header = rows[0].split("\t")
    col = header.index("throughput_mean")
    cells = rows[3].split("\t")  # zero3_no_offload
    cells[col] = str(float(cells[col]) * 0.5)
    rows[3] = "\t".join(cells)
    (doctored / "summary.tsv").write_text("\n".join(rows) + "\n")
    res = zb("compare", str(root), str(doctored), "--fail-on", "perf/throughput:-5%")
    assert res.returncode == 1
    assert "zero3_no_offload" in res.stdout + res.stderr and "throughput" in res.stdout + res.stderr

    metrics = doctored / "zero2_cpu_offload" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    first = json.loads(lines[0])
    first["actor/pg_loss"] = first["actor/pg_loss"] + 0.5
    metrics.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    res = zb("parity", str(doctored))
    assert res.returncode == 1
    assert "zero2_cpu_offload" in res.stdout + res.stderr and "actor/pg_loss" in res.stdout + res.stderr
