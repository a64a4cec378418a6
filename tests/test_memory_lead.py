"""One memory figure leads everywhere (zbench.runroot.memory_figures): the report's headline and "memory saved", the live
progress and the curves all show the figure that decides whether a case fits, and name any other as what it is."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

from test_analysis_runroot import SIX_CASES, make_run_root, read_rows, write_summary

from zbench.harness.progress import LiveProgress, PlainProgress


def zbench(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zbench", *map(str, args)], capture_output=True, text=True,
                          timeout=180)


def case_rows(md: str) -> dict[str, dict[str, str]]:
    section = md.split("## Cases")[1].split("## ")[0]
    lines = [line.strip("| ").split(" | ") for line in section.splitlines() if line.startswith("| ")]
    return {cells[0]: dict(zip(lines[0], cells, strict=True)) for cells in lines[1:]}


def test_report_headline_and_saving_follow_the_device_wide_figure(tmp_path: Path) -> None:
    """torch's reserved pool says zero3 saves memory; the whole device (vLLM's cache included) says it costs
    more: the report leads with the device and names the reserved figure as torch's."""
    root = make_run_root(tmp_path, SIX_CASES[1:4], steps=3, device="cuda")  # zero1 (baseline), zero2, zero3
    rows = read_rows(root / "summary.tsv")
    device = {"zero1": "40.0", "zero2": "36.0", "zero3": "50.0"}
    reserved = {"zero1": "30.0", "zero2": "24.0", "zero3": "15.0"}
    write_summary(root / "summary.tsv", [{**r, "device_memory_used_gb": device[r["case"]],
                                          "device_memory_gen_gb": "36.0", "device_memory_train_gb": str(
                                              float(device[r["case"]]) - 1.0 if r["case"] != "zero2" else 30.0),
                                          "max_memory_reserved_gb": reserved[r["case"]]} for r in rows], tuple(rows[0]))
    res = zbench("report", root)
    assert res.returncode == 0, res.stderr
    md = (root / "report.md").read_text()
    cases = case_rows(md)
    assert cases["zero3"]["peak GPU memory in use, whole device (GB)"] == "50"
    assert cases["zero3"]["memory saved (%)"] == "-25" and cases["zero2"]["memory saved (%)"] == "10"
    memory = md.split("## Memory per rank")[1].splitlines()
    header = next(line for line in memory if line.startswith("| case"))
    assert header.index("measured GPU memory in use, whole device (GB)") < header.index(
        "measured GPU memory in use at the end of generation, whole device (GB)") < header.index(
        "measured GPU memory in use at the end of training, whole device (GB)") < header.index(
        "measured GPU memory reserved by torch (GB)")  # which phase set the peak, beside it
    zero3 = next(line for line in memory if line.startswith("| zero3 "))
    assert "| 50 | 36 | 49 |" in zero3
    # a GPU run from before the device-wide figure leads with torch's reserved peak, under that name
    write_summary(root / "summary.tsv", [{**r, "device_memory_used_gb": ""} for r in read_rows(root / "summary.tsv")],
                  tuple(rows[0]))
    assert zbench("report", root, "--force").returncode == 0
    cases = case_rows((root / "report.md").read_text())
    assert cases["zero3"]["peak GPU memory reserved by torch (GB)"] == "15"
    assert cases["zero3"]["memory saved (%)"] == "50"
    cpu = make_run_root(tmp_path, SIX_CASES[:2], steps=2, name="cpu")
    assert zbench("report", cpu).returncode == 0
    assert "peak CPU memory used (RSS) (GB)" in next(iter(case_rows((cpu / "report.md").read_text()).values()))


def test_progress_shows_the_leading_figure_by_name(tmp_path: Path) -> None:
    cdir = tmp_path / "a"
    cdir.mkdir()
    record = {"step": 1, "perf/max_memory_allocated_gb": 10.0, "perf/max_memory_reserved_gb": 20.0,
              "perf/device_memory_used_gb": 41.5, "perf/cpu_memory_used_gb": 3.0}
    (cdir / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    out = io.StringIO()
    plain = PlainProgress([("a", 2)], out)
    plain.case_started("a", cdir, 1, 2)
    plain.poll()
    assert "[a] step 1/2 peak GPU in use 41.50 GB" in out.getvalue()
    from rich.console import Console

    live = LiveProgress([("a", 2)], Console(file=io.StringIO(), force_terminal=True, width=140))
    live.case_started("a", cdir, 1, 2)
    live.poll()
    console = Console(file=io.StringIO(), width=140)
    console.print(live.table())
    text = console.file.getvalue()
    assert "peak GPU in use GB" in text and "41.50" in text and "20.00" not in text and "10.00" not in text
