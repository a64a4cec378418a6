"""Bad input on every command: a clear one-line message naming what is wrong (and what would be valid), a
non-zero exit, and never a traceback. Each command runs as a user runs it, in a subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_analysis_runroot import SIX_CASES, make_run_root, read_rows, write_summary


@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of bad inputs: an empty folder, a torn manifest, malformed YAML, a foreign TSV, a torn jsonl,
    a run root whose summary lacks columns, one whose only case's metrics are torn, a file where a folder goes."""
    d = tmp_path_factory.mktemp("bad")
    (d / "empty").mkdir()
    (d / "torn_manifest").mkdir()
    (d / "torn_manifest" / "manifest.json").write_text('{"matrix": "six-')
    (d / "bad.yaml").write_text("zero: [stage\n")
    (d / "foreign.tsv").write_text("a\tb\n1\t2\n")
    (d / "torn.jsonl").write_text('{"question": "1+1", "answer": "#### 2"}\n{"question": "2+')
    (d / "a_file").write_text("not a folder\n")
    (d / "panels.yaml").write_text("panels: 3\n")
    root = make_run_root(d, SIX_CASES[:2], steps=2, name="no_status_column")
    rows = read_rows(root / "summary.tsv")
    write_summary(root / "summary.tsv", rows, tuple(c for c in rows[0] if c != "status"))
    torn = make_run_root(d, SIX_CASES[:1], steps=2, name="torn_metrics")
    (torn / SIX_CASES[0].name / "metrics.jsonl").write_text('{"step": 1, "actor/pg_loss": 0.')
    return d


CASES: list[tuple[list[str], str]] = [
    (["show", "sixcase"], "did you mean 'six-case'?"),
    (["show", "{bad}/bad.yaml"], "bad.yaml: malformed YAML"),
    (["show", "six-case", "--set", "zero.stag=2"], "zero.stag: unknown key; did you mean 'stage'?"),
    (["show", "six-case", "--set", "rollout.n=two"], "rollout.n"),
    (["show", "six-case", "--set", "zero.stage"], "--set takes key=value"),
    (["show", "six-case", "--seed", "abc"], "Invalid value for '--seed': Input should be a valid integer"),
    (["show", "six-case", "--cases", "zz*"], "--cases zz* matches none of zero1_no_offload"),
    (["run", "six-case", "--runner", "nosuch", "--dry-run"], "unknown runner profile 'nosuch'; available: local, ray"),
    (["run", "six-case", "--steps", "0", "--dry-run"], "steps: must be > 0, got 0"),
    (["run", "six-case", "--steps", "1", "--cases", "zero1_no_offload", "--results-dir", "{bad}/a_file"],
     "a_file: is a file where a folder is needed"),
    (["resume", "{bad}/empty"], "is not a run root: it has no manifest.json"),
    (["resume", "{bad}/nosuch"], "does not exist"),
    (["merge", "{bad}/torn_manifest"], "torn_manifest/manifest.json"),
    (["merge", "{bad}/foreign.tsv"], "foreign.tsv does not exist (expected a directory"),
    (["plot", "{bad}/empty"], "is empty: not a zbench run root"),
    (["plot", "{bad}/torn_manifest"], "manifest.json: not valid JSON"),
    (["plot", "{bad}/no_status_column"], "missing summary column(s) status"),
    (["plot", "{bad}/torn_metrics"], "nothing to plot"),
    (["plot", "{bad}/no_status_column", "--summary", "{bad}/foreign.tsv"], "foreign.tsv: missing summary column(s)"),
    (["plot", "{bad}/torn_metrics", "--spec", "{bad}/bad.yaml"], "bad.yaml: not valid YAML"),
    (["plot", "{bad}/torn_metrics", "--spec", "{bad}/panels.yaml"], "panels must be a list of {title: ..., metric"),
    (["report", "{bad}/nosuch"], "does not exist"),
    (["report", "{bad}/torn_metrics", "--floors", "{bad}/nosuch.jsonl"], "--floors:"),
    (["report", "{bad}/torn_metrics", "--out", "{bad}/a_file"], "a_file is a file; give a folder"),
    (["compare", "{bad}/empty", "{bad}/empty"], "summary.tsv does not exist"),
    (["compare", "{bad}/foreign.tsv", "{bad}/foreign.tsv"], "foreign.tsv: missing summary column(s)"),
    (["compare", "{bad}/torn_metrics", "{bad}/torn_metrics", "--fail-on", "perf/throughput:5"],
     "must be a signed number"),
    (["compare", "{bad}/torn_metrics", "{bad}/torn_metrics", "--fail-on", "bogus:-5%"], "unknown metric 'bogus'"),
    (["parity", "{bad}/torn_manifest"], "manifest.json: not valid JSON"),
    (["parity", "{bad}/torn_metrics", "--step", "x"], "Invalid value for '--step'"),
    (["parity", "{bad}/torn_metrics", "--step", "0"], "Invalid value for '--step': Input should be greater than"),
    (["estimate", "{bad}/nosuch"], "does not exist: give a run root"),
    (["estimate", "{bad}/bad.yaml"], "bad.yaml: malformed YAML"),
    (["data", "gsm8k", "--src", "{bad}/torn.jsonl", "--out", "{bad}/out"], "torn.jsonl:2: not valid JSON"),
    (["data", "gsm8k", "--src", "{bad}/nosuch.jsonl"], "nosuch.jsonl: no such file"),
    (["data", "synthetic", "--out", "{bad}/a_file"], "a_file: is a file where a folder is needed"),
    (["data", "synthetic", "--n-train", "-5", "--out", "{bad}/out2"], "Invalid value for '--n-train': Input should be greater than or equal to 1"),
    (["model", "{bad}/empty"], "has no config.json; give 'tiny', 'qwen3-0.6b', 'qwen3-8b', 'smollm2-135m' or a local"),
    (["bench", "floor", "--stage", "7"], "stage: 7 is not one of 0, 1, 2, 3"),
    (["bench", "floor", "--seqs", "0"], "Invalid value for '--seqs': Input should be greater than or equal to 1"),
    (["bench", "floor", "--like", "{bad}/empty"], "not a run root"),
    (["bench", "gen", "--decode", "foo"], "--decode: 'foo' is not one of generate, static, graph"),
    (["bench", "gen", "--model", "{bad}/nosuch"], "is not a directory; give 'tiny'"),
]


@pytest.mark.parametrize(("args", "message"), CASES, ids=[" ".join(a[:3]) for a, _ in CASES])
def test_bad_input_is_a_clear_error(bad: Path, args: list[str], message: str) -> None:
    argv = [a.replace("{bad}", str(bad)) for a in args]
    res = subprocess.run([sys.executable, "-m", "zbench", *argv], capture_output=True, text=True, timeout=180)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "Traceback" not in out, out
    assert message in " ".join(out.replace("│", " ").split()), out  # Typer boxes and wraps usage errors


def test_parity_on_a_torn_metrics_file_fails(bad: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "zbench", "parity", str(bad / "torn_metrics")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr and "torn" in res.stderr
