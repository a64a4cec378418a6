"""A local case keeps to itself: every socket its processes listen on (Ray's GCS, raylet, object manager, agents,
workers, the torch.distributed rendezvous, gloo) is on loopback, Ray's metrics exporters are off, its temp folder is
private while it runs and gone when it ends, and the files it leaves share one mode. Real engine, through the CLI."""

from __future__ import annotations

import ipaddress
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from zbench import procs
from zbench.runroot import casedir

CASE = "zero2_no_offload"


def listening(found: list[psutil.Process]) -> list[tuple[int, str, str, int]]:
    """(pid, name, address, port) of every listening inet socket of ``found``."""
    out = []
    for p in found:
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.append((p.pid, p.name(), c.laddr.ip, c.laddr.port))
        except psutil.Error:
            continue
    return out


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


@pytest.mark.slow
def test_a_running_case_listens_on_loopback_only(tmp_path: Path) -> None:
    results = tmp_path / "results"
    harness = subprocess.Popen(
        [sys.executable, "-m", "zbench", "run", "grpo-six-case", "--cases", CASE, "--steps", "3", "--retries", "0",
         "--set", "trainer.fault=slow@3", "--results-dir", str(results)],  # step 3 lasts long enough to look
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 600
    case = None
    while time.monotonic() < deadline and harness.poll() is None:
        found = [c for c in results.glob(f"*/{CASE}") if (c / casedir.TRAIN_LOG).exists()]
        if found and "[fault] injecting slow" in (found[0] / casedir.TRAIN_LOG).read_text(errors="replace"):
            case = found[0]
            break
        time.sleep(0.2)
    assert case is not None, harness.communicate()[0][-3000:]
    # the rendezvous and Ray's servers were all bound before step 1: look while step 3 sleeps
    case_procs = procs.case_processes(case)
    sockets = listening(case_procs)
    names = {p.name() for p in procs.alive(case_procs)}
    ray_dir = casedir.ray_tmpdir(case)
    mode = stat.S_IMODE(ray_dir.stat().st_mode)
    out, _ = harness.communicate(timeout=600)
    assert harness.returncode == 0, out[-3000:]

    assert {"gcs_server", "raylet"} <= names, names
    assert len(sockets) >= 5, sockets  # GCS, raylet (2), agents, workers, the gloo rendezvous
    assert [s for s in sockets if not is_loopback(s[2])] == [], sockets
    assert mode == 0o700
    assert not ray_dir.exists()  # removed when the case ended
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in case.iterdir() if f.is_file()}
    assert len(set(modes.values())) == 1, modes


def test_worker_processes_leave_mlflow_unimported(tmp_path: Path) -> None:
    """A case's Ray worker processes start without mlflow, which DeepSpeed would import for nothing (its autotuner's
    logging), and DeepSpeed imports there without it; the controller's own process keeps it for the trackers."""
    import ray

    from zbench.engine.cluster import start_ray

    def deepspeed_has_mlflow() -> tuple[object, bool]:  # defined here: sent to the worker by value
        from deepspeed.autotuning import autotuner

        return sys.modules.get("mlflow", "never imported"), autotuner.has_mlflow

    start_ray(tmp_path, world_size=1, on_cuda=False)
    try:
        assert ray.get(ray.remote(deepspeed_has_mlflow).remote()) == (None, False)
    finally:
        ray.shutdown()
        procs.remove_ray_tmpdir(tmp_path)
    import mlflow  # the controller's process: unaffected

    assert mlflow.__name__ == "mlflow"
