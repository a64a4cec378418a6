"""The gates (parity, compare) through the real CLI: they fail, naming the case and why, whenever they cannot
check what they were asked to check, and their machine-readable output parses."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from test_analysis_runroot import SIX_CASES, FakeCase, make_run_root, read_rows, write_summary


def zbench(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zbench", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def test_parity_fails_when_a_completed_case_cannot_be_checked(tmp_path: Path) -> None:
    root = make_run_root(tmp_path, SIX_CASES[:3], steps=3)
    ok = zbench("parity", root, "--step", 3)
    assert ok.returncode == 0 and "OK: all cases agree" in ok.stdout
    (root / "zero1" / "metrics.jsonl").unlink()
    res = zbench("parity", root)
    assert res.returncode == 1 and "Traceback" not in res.stderr and "OK" not in res.stdout
    assert f"CANNOT CHECK zero1: completed, but its {root / 'zero1' / 'metrics.jsonl'} is missing" in res.stderr
    # the compared step only in a torn last line: unreadable, so unchecked
    path = root / "zero2" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2])
    res = zbench("parity", root, "--step", 3)
    assert res.returncode == 1
    assert "CANNOT CHECK zero2: completed, but step 3 is not readable" in res.stderr and "torn" in res.stderr
    assert "CANNOT CHECK zero1" in res.stderr  # every unchecked case is named
    # a case that stopped before the step was never asked to reach it: skipped, not a failure
    root = make_run_root(tmp_path, (*SIX_CASES[:2], FakeCase("zero2", 2, status="oom", stop_step=1)), steps=3,
                         name="with-oom")
    res = zbench("parity", root, "--step", 2)
    assert res.returncode == 0 and "skipped zero2: no step 2 (oom)" in res.stderr


def test_parity_fails_on_a_metric_one_case_lacks(tmp_path: Path) -> None:
    root = make_run_root(tmp_path, SIX_CASES[:2], steps=2)
    path = root / "zero1" / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "actor/pg_loss"}) + "\n" for r in recs))
    res = zbench("parity", root)
    assert res.returncode == 1 and "DIVERGES zero1: actor/pg_loss not recorded, but zero0 has" in res.stderr
    lone = make_run_root(tmp_path, SIX_CASES[:1], steps=2, name="lone")
    res = zbench("parity", lone)
    assert res.returncode == 1 and "CANNOT CHECK no two cases of one algorithm share" in res.stderr


def test_compare_refuses_other_matrices_and_algorithms_unless_forced(tmp_path: Path) -> None:
    base = make_run_root(tmp_path, SIX_CASES[:2], steps=3, name="base")
    other = make_run_root(tmp_path, SIX_CASES[:2], steps=3, matrix="grpo-six-case", name="other")
    res = zbench("compare", base, other)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "BASE ran matrix 'six-case', NEW ran 'grpo-six-case'" in res.stderr and "--force" in res.stderr
    grpo = make_run_root(tmp_path, tuple(FakeCase(c.name, c.stage, algorithm="grpo") for c in SIX_CASES[:2]),
                         steps=3, name="grpo")
    res = zbench("compare", base, grpo / "summary.tsv")
    assert res.returncode == 2 and "zero0: ppo in BASE, grpo in NEW" in res.stderr
    assert zbench("compare", base, other, "--force").returncode == 0


def test_compare_fails_on_a_figure_one_side_lacks_and_speaks_json_and_markdown(tmp_path: Path) -> None:
    base = make_run_root(tmp_path, SIX_CASES[:2], steps=3, name="base")
    new = tmp_path / "new"
    shutil.copytree(base, new)
    res = zbench("compare", base, new, "--format", "json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["ok"] is True and out["failures"] == [] and "throughput_mean:-10%" in out["thresholds"]
    assert out["not_recorded_by_either_run"] == ["max_memory_reserved_gb", "device_memory_used_gb"]  # CPU: said
    assert {d["case"] for d in out["deltas"]} == {"zero0", "zero1"}
    rows = read_rows(new / "summary.tsv")
    rows[1]["throughput_mean"] = ""
    write_summary(new / "summary.tsv", rows, tuple(rows[0]))
    res = zbench("compare", base, new, "--format", "json")
    assert res.returncode == 1
    out = json.loads(res.stdout)
    assert out["ok"] is False and out["failures"][0].startswith("zero1: throughput_mean not recorded in NEW")
    res = zbench("compare", base, new, "--format", "md")
    assert res.returncode == 1 and "| case | metric | old | new | delta | delta_pct |" in res.stdout
    assert "**FAIL**" in res.stdout and "- zero1: throughput_mean not recorded in NEW" in res.stdout
    res = zbench("compare", base, new, "--format", "html")
    assert res.returncode == 2 and "--format: 'html' is not one of text, md, json" in res.stderr


def test_compare_names_how_the_runs_environments_differ_without_failing(tmp_path: Path) -> None:
    """A delta between runs on other package versions, GPUs or environment variables is no regression of the code:
    the gate says what differs (text, Markdown, JSON) and still judges only its thresholds."""
    base = make_run_root(tmp_path, SIX_CASES[:2], steps=3, name="base")
    new = tmp_path / "new"
    shutil.copytree(base, new)
    res = zbench("compare", base, new, "--format", "json")
    assert res.returncode == 0 and json.loads(res.stdout)["environment_differences"] == []
    for root, variables in ((base, {"RAY_worker_niceness": "15"}), (new, {"VLLM_USE_V2_MODEL_RUNNER": "0",
                                                                          "RAY_worker_niceness": "15"})):
        manifest = json.loads((root / "manifest.json").read_text())
        manifest["variables"] = variables
        if root == new:
            manifest["versions"]["vllm"] = "0.28.0"
        (root / "manifest.json").write_text(json.dumps(manifest))
    res = zbench("compare", base, new, "--format", "json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["environment_differences"] == [
        "vllm (not installed) in BASE, 0.28.0 in NEW", "VLLM_USE_V2_MODEL_RUNNER=(unset) in BASE, 0 in NEW"]
    # a run from before variables were recorded: what the other one ran with is still said
    manifest = json.loads((base / "manifest.json").read_text())
    del manifest["variables"]
    (base / "manifest.json").write_text(json.dumps(manifest))
    res = zbench("compare", base, new, "--format", "json")
    assert res.returncode == 0 and json.loads(res.stdout)["environment_differences"][-1] == (
        "environment variables recorded only in NEW (BASE has no record of them): VLLM_USE_V2_MODEL_RUNNER=0, "
        "RAY_worker_niceness=15")
    for fmt in ("text", "md"):
        res = zbench("compare", base, new, "--format", fmt)
        assert res.returncode == 0 and "the runs' environments differ: vllm (not installed) in BASE, 0.28.0 in NEW; " \
            "environment variables recorded only in NEW" in res.stdout
