"""The `ray` runner profile: a case joins an existing Ray cluster (a real head started on 127.0.0.1) instead of
starting its own, trains, and leaves the cluster running."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zbench.engine.workers import free_port

RAY = Path(sys.executable).with_name("ray")


@pytest.fixture
def ray_head(tmp_path: Path):
    """A Ray head on loopback with its own temp dir; stopped afterwards."""
    if not RAY.exists():
        pytest.skip("the ray command is not installed beside this interpreter")
    port = free_port()
    temp = Path("/tmp") / f"zbench-test-head-{os.getpid()}"  # short: Ray's socket paths must stay < 108 bytes
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([str(RAY), "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                    "--num-cpus", "6", "--include-dashboard", "false", "--temp-dir", str(temp), "--disable-usage-stats"],
                   check=True, capture_output=True, text=True, timeout=180, env=env)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([str(RAY), "stop", "--force"], capture_output=True, timeout=120, env=env)
        shutil.rmtree(temp, ignore_errors=True)


def test_case_runs_on_an_existing_cluster(ray_head: str, tmp_path: Path) -> None:
    profile = tmp_path / "cluster.yaml"
    profile.write_text(f"description: test cluster\nray_address: '{ray_head}'\nnum_workers: 2\nenv: {{}}\n")
    results = tmp_path / "results"
    res = subprocess.run([sys.executable, "-m", "zbench", "run", "grpo-six-case", "--cases", "zero2_no_offload",
                          "--steps", "2", "--seed", "5", "--runner", str(profile), "--results-dir", str(results),
                          "--retries", "0"], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    root = next(results.iterdir())
    with open(root / "summary.tsv", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    assert [(r["case"], r["status"], r["steps_completed"]) for r in rows] == [("zero2_no_offload", "completed", "2")]
    log = (root / "zero2_no_offload" / "train.log").read_text()
    assert "Connecting to existing Ray cluster" in log or "Connected to Ray cluster" in log, log[-3000:]
    assert not (root / "zero2_no_offload" / "ray_tmpdir").exists()  # the case started no Ray of its own
    # the cluster outlives the case
    status = subprocess.run([str(RAY), "status", "--address", ray_head], capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
