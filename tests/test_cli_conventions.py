"""The conventions users bring from other tools, through the real CLI: --version, shell completion, JSON that
parses, one spelling of each option, one way to name a run root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_analysis_runroot import SIX_CASES, make_run_root

from zbench import __version__


def zbench(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zbench", *map(str, args)], capture_output=True, text=True,
                          timeout=180, env=env)


def test_env_json_is_json_on_stdout() -> None:
    """DeepSpeed's accelerator warning goes to stderr; stdout parses whole."""
    res = zbench("env", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["versions"]["deepspeed"] and isinstance(report["deepspeed_ops"], dict) and report["deepspeed_ops"]


def test_version_and_shell_completion() -> None:
    res = zbench("--version")
    assert res.returncode == 0 and res.stdout == f"zbench {__version__}\n"
    script = Path(sys.executable).parent / "zbench"  # completion keys on the program's name
    env = {**os.environ, "_ZBENCH_COMPLETE": "complete_bash", "COMP_WORDS": "zbench re", "COMP_CWORD": "1"}
    res = subprocess.run([script], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0 and res.stdout.split() == ["resume", "report"]
    env |= {"COMP_WORDS": "zbench merge --", "COMP_CWORD": "2"}
    res = subprocess.run([script], capture_output=True, text=True, timeout=60, env=env)
    assert {"--out", "--force", "--mixed-configs"} <= set(res.stdout.split())


def test_report_and_plot_write_only_what_they_say_where_they_say(tmp_path: Path) -> None:
    root = make_run_root(tmp_path, SIX_CASES[:2], steps=3)
    before = {p.name for p in root.iterdir()}
    res = zbench("report", root)
    assert res.returncode == 0, res.stderr
    written = {Path(line.removeprefix("wrote ")) for line in res.stdout.splitlines()}
    assert written == {root / n for n in ("report.md", "report.html", "curves.png", "phase_times.png")}
    assert {p.name for p in root.iterdir()} - before == {p.name for p in written}  # no <matrix>_curves.png
    md = (root / "report.md").read_text()
    res = zbench("report", root)  # a second report does not replace the first unasked
    assert res.returncode == 2 and "already exist" in res.stderr and "--force" in res.stderr
    assert "--out DIR" in res.stderr and (root / "report.md").read_text() == md
    out = tmp_path / "reports" / "a"
    res = zbench("report", root, "--out", out)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["curves.png", "phase_times.png", "report.html", "report.md"]
    assert zbench("report", root, "--force").returncode == 0
    # plot --out: the metrics TSV goes beside the PNG, named after it, as --help says
    png = tmp_path / "figs" / "six.png"
    res = zbench("plot", root, "--out", png)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["wrote", str(png), "wrote", str(png.with_name("six_metrics.tsv"))]
    assert png.is_file() and png.with_name("six_metrics.tsv").is_file()
    assert not list(root.glob("*_curves*"))


def test_older_spellings_still_work_with_a_warning(tmp_path: Path) -> None:
    """One spelling each: the run root is an argument, output paths are --out; the old ones warn."""
    root = make_run_root(tmp_path, SIX_CASES[:2], steps=2)
    res = zbench("plot", "--run-root", root, "--output", tmp_path / "c.png")
    assert res.returncode == 0, res.stderr
    assert "--run-root is deprecated; name the run root as an argument: zbench plot" in res.stderr
    assert "--output is deprecated; use --out" in res.stderr and (tmp_path / "c_metrics.tsv").is_file()
    res = zbench("estimate", "--run-root", root)
    assert res.returncode == 0 and "--run-root is deprecated" in res.stderr
    res = zbench("report", root, "--run-root", root)
    assert res.returncode == 2 and "give the run root(s) as arguments only" in res.stderr
    for command in ("plot", "report", "estimate"):
        res = zbench(command)
        assert res.returncode == 2 and "give a run root" in res.stderr and "Traceback" not in res.stderr
