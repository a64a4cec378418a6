"""Soak: the twelve-case matrix at a few steps, again and again, with faults injected at random steps, for a bounded
time. Counts runs, cases, faults, recoveries and unexpected outcomes; after every run, processes and Ray temp folders
its cases left behind (goal 0); and the harness's memory (RSS) sampled while it runs (goal flat).

    python benchmarks/soak.py --minutes 30 --steps 3 --results-dir /tmp/soak    # prints a table, writes soak.json

Each run is `zbench run` on a matrix written here: the twelve cases of `twelve-case`, each given
`trainer.fault=KIND@STEP` with probability --fault-rate (KIND and STEP drawn from --seed). What each kind must end as:
crash -> failed, oom -> oom, hang / worker_exit -> completed on attempt 2 (with --retries 1), slow / none -> completed.
No new run starts once --minutes have passed; the one running then finishes.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from zbench import procs
from zbench.harness.matrix import expand, load_matrix
from zbench.runroot import casedir

KINDS = ("crash", "hang", "oom", "worker_exit", "slow")  # node_loss needs nodes: see tests/test_two_nodes.py
EXPECTED = {"": ("completed", 1), "slow": ("completed", 1), "crash": ("failed", 1), "oom": ("oom", 1),
            "hang": ("completed", 2), "worker_exit": ("completed", 2)}


def faulted_matrix(rng: random.Random, steps: int, rate: float) -> tuple[dict[str, Any], dict[str, str]]:
    """The twelve-case matrix as explicit cases, each with a random fault or none; and the fault of each case."""
    cases, faults = [], {}
    for case in expand(load_matrix("twelve-case"), seed=1, steps=steps):
        kind = rng.choice(KINDS) if rng.random() < rate else ""
        fault = f"{kind}@{rng.randint(1, steps)}" if kind else ""
        faults[case.name] = kind
        cases.append({"name": case.name, "set": {**case.overrides, "trainer.fault": fault}})
    base = load_matrix("twelve-case").base
    return {"description": "twelve-case with random faults (benchmarks/soak.py)", "base": base, "cases": cases}, faults


def sample_rss(proc: subprocess.Popen[bytes], out: list[tuple[float, float, float]], t0: float) -> None:
    """Append (seconds since the soak started, since this run started, harness RSS in MiB) every 5 s while ``proc``
    runs."""
    started = time.monotonic()
    while proc.poll() is None:
        try:
            now = time.monotonic()
            out.append((now - t0, now - started, psutil.Process(proc.pid).memory_info().rss / 2**20))
        except psutil.Error:
            return
        time.sleep(5)


def one_run(i: int, args: argparse.Namespace, rng: random.Random, t0: float,
            rss: list[tuple[float, float, float]]) -> dict[str, Any]:
    matrix, faults = faulted_matrix(rng, args.steps, args.fault_rate)
    path = args.results_dir / f"soak{i}.yaml"
    path.write_text(yaml.safe_dump(matrix, sort_keys=False))
    results = args.results_dir / f"run{i}"
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "zbench", "run", str(path), "--steps", str(args.steps), "--retries", "1",
         "--step-timeout", str(args.step_timeout), "--results-dir", str(results)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    sampler = threading.Thread(target=sample_rss, args=(proc, rss, t0), daemon=True)
    sampler.start()
    proc.wait()
    sampler.join()
    [root] = results.iterdir()
    outcome: dict[str, Any] = {"run": i, "exit": proc.returncode, "wall_s": round(time.monotonic() - started, 1),
                               "cases": {}, "unexpected": [], "leaked_processes": 0, "leaked_tmpdirs": 0}
    for name, kind in faults.items():
        cdir = root / name
        status = casedir.read_status(cdir) or {}
        got = (status.get("status"), status.get("attempt"))
        outcome["cases"][name] = {"fault": kind, "status": got[0], "attempt": got[1]}
        if got != EXPECTED[kind]:
            outcome["unexpected"].append(f"{name}: fault {kind or 'none'} ended {got}, expected {EXPECTED[kind]}")
        outcome["leaked_processes"] += len(procs.case_processes(cdir))
        outcome["leaked_tmpdirs"] += int(casedir.ray_tmpdir(cdir).exists())
    return outcome


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="start no new run after this long")
    ap.add_argument("--steps", type=int, default=3, help="training steps per case")
    ap.add_argument("--fault-rate", type=float, default=0.5, help="share of cases given a fault")
    ap.add_argument("--step-timeout", type=float, default=60.0, help="zbench run --step-timeout (catches hang)")
    ap.add_argument("--seed", type=int, default=0, help="draws the faults")
    ap.add_argument("--results-dir", type=Path, default=Path("results/soak"))
    args = ap.parse_args()
    args.results_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    runs: list[dict[str, Any]] = []
    rss: list[tuple[float, float, float]] = []
    while time.monotonic() - t0 < args.minutes * 60:
        runs.append(one_run(len(runs), args, rng, t0, rss))
        r = runs[-1]
        print(f"run {r['run']}: exit {r['exit']}, {r['wall_s']} s, unexpected {len(r['unexpected'])}, "
              f"leaked processes {r['leaked_processes']}, leaked Ray temp folders {r['leaked_tmpdirs']}", flush=True)
    cases = [c for r in runs for c in r["cases"].values()]
    faulted = [c for c in cases if c["fault"]]
    report = {
        "minutes": round((time.monotonic() - t0) / 60, 1), "runs": len(runs), "cases": len(cases),
        "faults_injected": len(faulted),
        "recoveries": sum(1 for c in faulted if c["fault"] in ("hang", "worker_exit") and c["status"] == "completed"),
        "unexpected": [u for r in runs for u in r["unexpected"]],
        "leaked_processes": sum(r["leaked_processes"] for r in runs),
        "leaked_tmpdirs": sum(r["leaked_tmpdirs"] for r in runs),
        # from a minute into each run (start-up imports done) to its end: flat is the goal
        "harness_rss_mib": {"after_1_min": next((m for _, r, m in rss if r >= 60), None),
                            "max": max((m for _, r, m in rss if r >= 60), default=None),
                            "last": rss[-1][2] if rss else None, "samples": len(rss)},
        "runs_detail": runs, "rss_samples": rss,
    }  # fmt: skip
    (args.results_dir / "soak.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k not in ("runs_detail", "rss_samples")}, indent=2))


if __name__ == "__main__":
    main()
