"""Results on a disk that fills up mid-run, or that is read-only: a clear error at the first write that fails,
nothing already recorded damaged, no half-written or temporary file left, and `zbench resume` finishing once there
is room again. A small tmpfs holds the results (mounting one needs root: skipped, saying so, elsewhere)."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from zbench.config import dump_yaml, from_dict
from zbench.harness import launch
from zbench.runroot import casedir, summary
from zbench.runroot.root import RunRoot

FAKE = Path(__file__).parent / "fake_cases"
ZBENCH = [sys.executable, "-m", "zbench"]


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0755", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(mnt: Path) -> Path:
    """Write a file until the filesystem is full; return it."""
    filler = mnt / "filler"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC
    return filler


def leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.slow
def test_a_disk_filling_up_mid_run_stops_cleanly_and_resume_finishes(small_fs: Path) -> None:
    harness = subprocess.Popen(
        [*ZBENCH, "run", "grpo-six-case", "--cases", "zero2_no_offload,zero3_no_offload", "--steps", "2",
         "--retries", "0", "--set", "trainer.world_size=1", "--results-dir", str(small_fs)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 600
    first = None
    while time.monotonic() < deadline and harness.poll() is None:
        found = list(small_fs.glob("*/zero2_no_offload"))
        if found and (casedir.read_status(found[0]) or {}).get("status") == "completed" \
                and (found[0].parent / summary.SUMMARY).exists():
            first = found[0]
            break
        time.sleep(0.1)
    assert first is not None, harness.communicate()
    root = first.parent
    recorded = {name: (first / name).read_bytes() for name in (casedir.METRICS, casedir.RESULT, casedir.STATUS)}
    filler = fill(small_fs)
    out, err = harness.communicate(timeout=600)

    assert harness.returncode == 2, out[-2000:] + err[-2000:]
    assert "No space left on device" in err and f"zbench resume {root}" in err and "Traceback" not in err, err
    assert {name: (first / name).read_bytes() for name in recorded} == recorded  # the finished case untouched
    rows = summary.read_summary(root / summary.SUMMARY)  # whole: the previous table or a complete new one
    assert rows[0]["case"] == "zero2_no_offload" and rows[0]["status"] == "completed"
    assert not leftovers(root)

    filler.unlink()
    res = subprocess.run([*ZBENCH, "resume", str(root), "--retries", "0"], capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    second = root / "zero3_no_offload"
    assert [r["step"] for r in casedir.read_metrics(second).records] == [1, 2]
    assert [r["status"] for r in summary.read_summary(root / summary.SUMMARY)] == ["completed", "completed"]


def test_a_read_only_run_root_is_refused_naming_the_file(small_fs: Path) -> None:
    class Case:
        def __init__(self, name: str) -> None:
            self.name, self.overrides = name, {}

    cfg = from_dict({"name": "a", "algorithm": "grpo", "seed": 1, "steps": 3, "rollout": {"n": 2}})
    root = RunRoot.create(small_fs, "t", matrix="m", matrix_file=None, seed=1, steps=3,
                          cases=[Case("a"), Case("b")], environment={})
    options = launch.LaunchOptions(command=(sys.executable, str(FAKE / "ok.py")), kill_grace_s=1.0, poll_s=0.1)
    launch.run_cases(root, [("a", cfg)], options)
    (root.case_dir("b") / casedir.CONFIG).write_text(dump_yaml(cfg))
    before = {p: p.read_bytes() for p in root.path.rglob("*") if p.is_file()}
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)

    res = subprocess.run([*ZBENCH, "resume", str(root.path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"{root.path / 'lock'}: Read-only file system" in res.stderr, res.stderr
    plot = subprocess.run([*ZBENCH, "plot", "--run-root", str(root.path)], capture_output=True, text=True,
                          timeout=300)
    assert plot.returncode == 2 and "Read-only file system" in plot.stderr and "Traceback" not in plot.stderr, \
        plot.stderr
    assert {p: p.read_bytes() for p in root.path.rglob("*") if p.is_file()} == before
    assert json.loads((root.case_dir("a") / casedir.STATUS).read_text())["status"] == "completed"
