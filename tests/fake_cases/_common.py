"""Shared helpers of the fake engines: write what `python -m zbench.engine <case_dir>` writes."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import yaml


def case_dir() -> Path:
    """The case dir passed as the last argument."""
    return Path(sys.argv[-1])


def steps_target(cdir: Path) -> int:
    """`steps` of the case's config.yaml (3 when absent)."""
    try:
        cfg = yaml.safe_load((cdir / "config.yaml").read_text())
    except FileNotFoundError:
        return 3
    return int((cfg or {}).get("steps", 3))


def step(cdir: Path, n: int, delay: float = 0.05) -> None:
    """One fake training step: a metrics.jsonl record, a log line, a heartbeat."""
    time.sleep(delay)
    rec = {
        "step": n, "time": time.time(), "critic/score/mean": 0.1 * n, "actor/pg_loss": 1.0 / n,
        "critic/vf_loss": 2.0 / n, "timing_s/step": 1.0 if n == 1 else 0.5, "perf/throughput": 100.0 * n,
        "perf/cpu_memory_used_gb": 1.5,
    }  # fmt: skip
    with (cdir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(rec) + "\n")
    print(f"step:{n} - critic/score/mean:{rec['critic/score/mean']:.3f}", flush=True)
    (cdir / "heartbeat").touch()


def write_result(cdir: Path, done: int, target: int) -> None:
    """result.json, atomically, as the engine writes it after its last step."""
    result = {
        "steps_completed": done, "steps_target": target, "offload_effective": "none", "rollout_backend": "hf",
        "world_size": 2, "wall_s": 1.25, "versions": {}, "device": "cpu", "gpu_name": None,
    }  # fmt: skip
    tmp = cdir / "result.json.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, cdir / "result.json")


def run_all(cdir: Path, delay: float = 0.05) -> int:
    """Every step of the config, then result.json; returns the step count."""
    target = steps_target(cdir)
    for n in range(1, target + 1):
        step(cdir, n, delay)
    write_result(cdir, target, target)
    return target
