"""The `ray` runner profile: a case joins an existing Ray cluster (a real head started on 127.0.0.1) instead of
starting its own, trains, and leaves the cluster running."""

from __future__ import annotations

import csv
import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zbench.engine.cluster import free_port
from zbench.procs import kill_processes, processes_mentioning

RAY = Path(sys.executable).with_name("ray")


@pytest.fixture
def ray_head(tmp_path: Path):
    """A Ray head on this machine, joined at 127.0.0.1; stopped afterwards.

    Ray resolves a loopback address to the machine's own interface address internally (its processes, workers
    included, always register under it), so the head keeps Ray's own node address; all traffic stays on this
    machine."""
    if not RAY.exists():
        pytest.skip("the ray command is not installed beside this interpreter")
    port = free_port()
    temp = Path("/tmp") / f"zbench-test-head-{os.getpid()}"  # short: Ray's socket paths must stay < 108 bytes
    token = tmp_path / "auth_token"  # Ray 2.60 clusters authenticate clients by token
    token.write_text(secrets.token_hex(32))
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **auth}
    subprocess.run([str(RAY), "start", "--head", "--port", str(port), "--num-cpus", "6", "--include-dashboard",
                    "false", "--temp-dir", str(temp), "--disable-usage-stats"],
                   check=True, capture_output=True, text=True, timeout=180, env=env)
    try:
        yield f"127.0.0.1:{port}", auth
    finally:
        # only this head's processes (`ray stop` would stop every Ray on the machine, other runs' included)
        kill_processes(None, processes_mentioning(str(temp), f"--gcs-address=127.0.0.1:{port}",
                                                  f"--gcs_server_port={port}"), grace_s=10.0)
        shutil.rmtree(temp, ignore_errors=True)


def test_case_runs_on_an_existing_cluster(ray_head: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    address, auth = ray_head
    profile = tmp_path / "cluster.yaml"
    profile.write_text(f"description: test cluster\nray_address: '{address}'\nnum_workers: 2\nenv: {json.dumps(auth)}\n")
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
    assert "Connecting to existing Ray cluster" in log, log[-3000:]
    assert not (root / "zero2_no_offload" / "ray_tmpdir").exists()  # the case started no Ray of its own
    # the cluster outlives the case
    alive = subprocess.run([sys.executable, "-c", f"import ray; ray.init('{address}'); print(ray.cluster_resources()['CPU'])"],
                           capture_output=True, text=True, timeout=120, env={**os.environ, **auth})
    assert alive.returncode == 0 and alive.stdout.strip().endswith("6.0"), alive.stderr[-2000:]
