"""Past one machine, simulated on this one: a Ray cluster of two nodes (a head on 127.0.0.1 and a second
`ray start --address`, one CPU each), a case of a cluster runner profile whose two ranks land on different nodes
(recorded per rank in result.json), and `node_loss` mid-case: every worker on one node dies, the attempt fails with
a lost worker, and the retry completes on the cluster that is left."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from zbench import procs
from zbench.engine.cluster import free_port
from zbench.runroot import casedir

RAY = Path(sys.executable).with_name("ray")
CASE = "zero2_no_offload"


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A head and a second node, one CPU each, joined at 127.0.0.1 (a multi-node Ray registers its nodes under the
    machine's own address: all traffic still stays on this machine)."""
    if not RAY.exists():
        pytest.skip("the ray command is not installed beside this interpreter")
    port = free_port("127.0.0.1")
    temp = Path("/tmp") / f"zbench-2n-{os.getpid()}"  # short: Ray's socket paths must stay < 108 bytes
    token = tmp_path / "auth_token"
    token.write_text(secrets.token_hex(32))
    env_add = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}  # Ray 2.60 clusters check a token
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **env_add}
    common = ["--num-cpus", "1", "--disable-usage-stats"]
    try:
        subprocess.run([str(RAY), "start", "--head", "--port", str(port), "--include-dashboard", "false",
                        "--temp-dir", str(temp), *common], check=True, capture_output=True, text=True, timeout=180,
                       env=env)
        second = subprocess.run([str(RAY), "start", "--address", f"127.0.0.1:{port}", *common],
                                capture_output=True, text=True, timeout=180, env=env)
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
        yield f"127.0.0.1:{port}", env_add
    finally:
        # only this cluster's processes (`ray stop` would stop every Ray on the machine)
        procs.kill_processes(None, procs.with_descendants(procs.processes_mentioning(
            str(temp), f"127.0.0.1:{port}", f":{port}", f"--gcs_server_port={port}")), grace_s=10.0)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_ranks_on_two_nodes_and_a_lost_node_is_retried(two_nodes: tuple[str, dict[str, str]],
                                                      tmp_path: Path) -> None:
    address, env = two_nodes
    profile = tmp_path / "two-nodes.yaml"
    profile.write_text(f"description: two nodes on this machine\nray_address: '{address}'\n"
                       f"num_workers: 2\nenv: {json.dumps(env)}\n")
    results = tmp_path / "results"
    res = subprocess.run(
        [sys.executable, "-m", "zbench", "run", "grpo-six-case", "--cases", CASE, "--steps", "3", "--retries", "1",
         "--set", "trainer.fault=node_loss@2", "--runner", str(profile), "--results-dir", str(results)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    case = next(results.iterdir()) / CASE
    status = json.loads((case / casedir.STATUS).read_text())
    assert status["status"] == "completed" and status["attempt"] == 2
    log = (case / casedir.TRAIN_LOG).read_text(errors="replace")
    first = log[: log.index("==== zbench attempt 2 started")]
    assert "[fault] node " in first and ": stopping its 1 workers" in first
    assert "ActorDiedError" in first and ": failed (exit code 1)" in first
    nodes = json.loads((case / casedir.RESULT).read_text())["rank_nodes"]
    assert len(nodes) == 2 and nodes[0] != nodes[1]  # one rank per node
    assert [r["step"] for r in casedir.read_metrics(case).records] == [1, 2, 3]
