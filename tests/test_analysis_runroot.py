"""Run roots written exactly as the contract describes, with realistic metrics, for the analysis tests.

``make_run_root`` is imported by the other analysis tests and by tests/bench/bench_plot.py; the tests at the
bottom check the reader on these roots and on broken ones (torn lines, missing columns, empty roots).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from zbench.config import dump_yaml, from_dict
from zbench.runroot.read import SUMMARY_COLUMNS, RunRootError, load_run_root, read_metrics, read_summary

PHASES = ("gen", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "update_weights")


@dataclass(frozen=True)
class FakeCase:
    """One case to write: its knobs and how it ends."""

    name: str
    stage: int
    offload: str = "none"
    algorithm: str = "ppo"
    status: str = "completed"
    stop_step: int | None = None  # last recorded step when the case did not complete


SIX_CASES = (
    FakeCase("zero0", 0), FakeCase("zero1", 1), FakeCase("zero2", 2), FakeCase("zero3", 3),
    FakeCase("zero2_cpu_offload", 2, "cpu"), FakeCase("zero3_cpu_offload", 3, "cpu"),
)


def _math_metrics(step: int, seed: int, algorithm: str) -> dict[str, float]:
    """Metrics that depend on the maths only: identical across ZeRO stages at the same seed and step."""
    rng = np.random.default_rng(seed * 100_003 + step)
    score = 0.15 + 0.5 * (1 - math.exp(-step / 40)) + rng.normal(0, 0.03)
    m = {
        "critic/score/mean": score, "critic/score/max": 1.0, "critic/score/min": 0.0,
        "critic/rewards/mean": score - 0.01, "critic/advantages/mean": rng.normal(0, 1e-3),
        "actor/pg_loss": -0.02 * math.exp(-step / 30) + rng.normal(0, 0.005),
        "actor/pg_clipfrac": abs(rng.normal(0.05, 0.01)), "actor/ppo_kl": abs(rng.normal(1e-3, 3e-4)),
        "actor/entropy": 1.2 - 0.004 * step + rng.normal(0, 0.01), "actor/grad_norm": abs(rng.normal(0.8, 0.1)),
        "actor/lr": 1e-6, "response_length/mean": 120 + rng.normal(0, 5), "response_length/max": 256.0,
        "response_length/clip_ratio": 0.02, "prompt_length/mean": 80.0,
    }
    if algorithm == "ppo":
        m |= {"critic/returns/mean": score, "critic/values/mean": score * 0.8,
              "critic/vf_loss": 0.3 * math.exp(-step / 25) + 0.02 + abs(rng.normal(0, 0.01)),
              "critic/vf_clipfrac": abs(rng.normal(0.1, 0.02)), "critic/grad_norm": abs(rng.normal(1.5, 0.2))}
    return m


def _perf_metrics(case: FakeCase, step: int, device: str, rng: np.random.Generator) -> dict[str, float]:
    """Perf metrics: memory falls with the stage and with offload, time rises with both."""
    slow = 1 + 0.08 * case.stage + (0.6 if case.offload != "none" else 0) + (1.5 if step == 1 else 0)
    phases = {p: t * slow * abs(rng.normal(1, 0.05)) for p, t in zip(PHASES, (2.0, 0.3, 0.2, 0.2, 0.01,
                                                                               0.8, 0.9, 0.1), strict=True)}
    if case.algorithm == "grpo":
        phases = {p: t for p, t in phases.items() if p not in ("values", "update_critic")}
    total = sum(phases.values()) + 0.05
    m = {f"timing_s/{p}": t for p, t in phases.items()} | {"timing_s/step": total}
    m |= {"perf/total_num_tokens": 8192.0, "perf/throughput": 8192 / total / 2, "perf/mfu/actor": 0.01 / slow}
    memory = 30 - 5 * case.stage - (8 if case.offload != "none" else 0) + rng.normal(0, 0.05)
    if device == "cuda":
        m |= {"perf/max_memory_allocated_gb": memory * 0.9, "perf/max_memory_reserved_gb": memory}
    m["perf/cpu_memory_used_gb"] = 12 + (10 if case.offload != "none" else 0) + rng.normal(0, 0.1)
    return m


def _write_json(path: Path, data: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def make_run_root(parent: Path, cases: tuple[FakeCase, ...] = SIX_CASES, steps: int = 20, seed: int = 7777,
                  device: str = "cpu", matrix: str = "six-case", name: str | None = None,
                  world_size: int = 2, model: str = "tiny") -> Path:
    """Write a complete run root under ``parent`` and return its path."""
    root = parent / (name or f"{matrix}_{steps}_seed{seed}_20260101_120000")
    root.mkdir(parents=True)
    manifest = {
        "zbench_version": "0.1.0", "matrix": matrix, "matrix_file": f"matrices/{matrix}.yaml",
        "tag": f"{matrix}_{steps}_seed{seed}", "seed": seed, "steps": steps,
        "command": ["zbench", "run", matrix, "--steps", str(steps)],
        "cases": [{"name": c.name, "dir": c.name, "overrides": {"zero.stage": c.stage, "zero.offload": c.offload}}
                  for c in cases],
        "git": {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": False},
        "versions": {"python": "3.11.9", "torch": "2.6.0", "deepspeed": "0.19.8", "ray": "2.50.0",
                     "transformers": "4.56.0", "vllm": None if device == "cpu" else "0.27.0"},
        "gpus": [] if device == "cpu" else [{"name": "NVIDIA H100 80GB HBM3", "memory_gb": 79.6}] * world_size,
        "host": "bench-host", "runner": "local",
        "started_at": "2026-01-01T12:00:00Z", "ended_at": "2026-01-01T13:00:00Z",
    }
    _write_json(root / "manifest.json", manifest)
    rows = []
    for i, case in enumerate(cases):
        cdir = root / case.name
        cdir.mkdir()
        config = {"name": case.name, "algorithm": case.algorithm, "seed": seed, "steps": steps,
                  "model": {"path": model}, "rollout": {"backend": "hf", "n": 4}, "actor": {"lr": 1e-6},
                  "critic": {"lr": 1e-5}, "algo": {"gamma": 1.0, "lam": 0.95},
                  "zero": {"stage": case.stage, "offload": case.offload},
                  "trainer": {"world_size": world_size, "device": device}}
        config_text = dump_yaml(from_dict(config))  # a config the engine would accept, as the harness writes it
        (cdir / "config.yaml").write_text(config_text)
        last = steps if case.status == "completed" else (case.stop_step or 0)
        rng = np.random.default_rng(seed + i)
        lines, log = [], []
        for step in range(1, last + 1):
            rec = {"step": step, "time": 1_767_268_800.0 + step * 5}
            rec |= _math_metrics(step, seed, case.algorithm) | _perf_metrics(case, step, device, rng)
            lines.append(json.dumps(rec))
            log.append(f"step:{step} - " + " - ".join(f"{k}:{v:.4g}" for k, v in rec.items() if k != "step"))
        (cdir / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
        (cdir / "train.log").write_text("".join(line + "\n" for line in log))
        eff = "none" if case.offload == "none" else ("optimizer+params:cpu" if case.stage == 3 else "optimizer:cpu")
        _write_json(cdir / "status.json", {
            "status": case.status, "attempt": 1, "exit_code": 0 if case.status == "completed" else 1,
            "reason": "" if case.status == "completed" else f"{case.status} at step {last + 1}",
            "last_step": last, "started_at": manifest["started_at"], "ended_at": manifest["ended_at"],
            "warnings": []})
        if case.status == "completed":
            _write_json(cdir / "result.json", {
                "steps_completed": steps, "steps_target": steps, "offload_effective": eff,
                "rollout_backend": "hf", "world_size": world_size, "wall_s": 5.0 * steps,
                "versions": manifest["versions"], "device": device,
                "gpu_name": None if device == "cpu" else "NVIDIA H100 80GB HBM3"})
        m = read_metrics(cdir)
        later = m[m.index >= 2] if len(m) >= 2 else m
        loss = "critic/vf_loss" if case.algorithm == "ppo" else "actor/pg_loss"

        def col(df, key):
            return float(df[key].mean()) if key in df.columns and not df.empty else None

        def peak(key, m=m):
            return float(m[key].max()) if key in m.columns and not m.empty else None

        rows.append({
            "case": case.name, "algorithm": case.algorithm, "zero_stage": case.stage, "offload": case.offload,
            "offload_effective": eff, "rollout_backend": "hf", "world_size": world_size, "seed": seed,
            "status": case.status, "steps_completed": last, "steps_target": steps, "wall_s": 5.0 * last,
            "step_time_mean_s": col(later, "timing_s/step"), "throughput_mean": col(later, "perf/throughput"),
            "mfu_mean": col(later, "perf/mfu/actor"),
            "max_memory_allocated_gb": peak("perf/max_memory_allocated_gb"),
            "max_memory_reserved_gb": peak("perf/max_memory_reserved_gb"),
            "cpu_memory_used_gb": peak("perf/cpu_memory_used_gb"),
            "score_first": float(m["critic/score/mean"].iloc[0]) if last else None,
            "score_last": float(m["critic/score/mean"].iloc[-1]) if last else None,
            "score_max": peak("critic/score/mean"),
            "loss_last": float(m[loss].iloc[-1]) if last else None,
            "attempt": 1, "exit_code": 0 if case.status == "completed" else 1,
            "reason": "" if case.status == "completed" else f"{case.status} at step {last + 1}",
            "case_dir": case.name, "config_hash": hashlib.sha256(config_text.encode()).hexdigest()[:12],
        })
    write_summary(root / "summary.tsv", rows)
    return root


def write_summary(path: Path, rows: list[dict], columns: tuple[str, ...] = SUMMARY_COLUMNS) -> None:
    """Write summary rows as the contract's TSV (empty cell = not available)."""
    def cell(v: object) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return ""
        return f"{v:.6g}" if isinstance(v, float) else str(v)

    text = "\t".join(columns) + "\n" + "".join("\t".join(cell(r.get(c)) for c in columns) + "\n" for r in rows)
    path.write_text(text)


def read_rows(path: Path) -> list[dict]:
    """Summary rows as dicts of strings (for doctoring copies)."""
    header, *lines = path.read_text().splitlines()
    cols = header.split("\t")
    return [dict(zip(cols, line.split("\t"), strict=True)) for line in lines]


# ---- the reader on these roots ---------------------------------------------------------------------------


def test_fixture_follows_contract(tmp_path):
    root = make_run_root(tmp_path, steps=5)
    header = (root / "summary.tsv").read_text().splitlines()[0].split("\t")
    assert tuple(header) == SUMMARY_COLUMNS
    run = load_run_root(root)
    assert [c.name for c in run.cases] == [c.name for c in SIX_CASES]
    assert all(c.status == "completed" for c in run.cases)
    assert run.cases[0].value("steps_completed") == 5
    assert math.isnan(run.cases[0].value("max_memory_reserved_gb"))  # CPU run: no GPU memory


def test_torn_last_line_is_skipped_and_middle_garbage_warned(tmp_path):
    root = make_run_root(tmp_path, steps=4)
    path = root / "zero1" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "{garbage", *lines[1:]]) + '\n{"step": 5, "critic/sc')
    warnings: list[str] = []
    df = read_metrics(path.parent, warnings)
    assert list(df.index) == [1, 2, 3, 4]
    assert warnings == [f"{path}: 1 unreadable line(s) skipped"]


def test_missing_and_unknown_columns(tmp_path):
    root = make_run_root(tmp_path, steps=3)
    rows = read_rows(root / "summary.tsv")
    cols = tuple(c for c in SUMMARY_COLUMNS if c not in ("score_last", "wall_s"))
    write_summary(root / "summary.tsv", rows, cols)
    with pytest.raises(RunRootError, match=r"missing summary column.*wall_s, score_last"):
        read_summary(root / "summary.tsv")
    write_summary(root / "summary.tsv", [r | {"extra": "x"} for r in rows], (*SUMMARY_COLUMNS, "extra"))
    warnings: list[str] = []
    df = read_summary(root / "summary.tsv", warnings)
    assert "extra" not in df.columns and "unknown summary column(s) extra" in warnings[0]


def test_missing_and_empty_roots(tmp_path):
    with pytest.raises(RunRootError, match="does not exist"):
        load_run_root(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunRootError, match="is empty"):
        load_run_root(tmp_path / "empty")
    root = make_run_root(tmp_path, steps=2)
    (root / "summary.tsv").unlink()
    with pytest.raises(RunRootError, match=r"summary\.tsv does not exist"):
        load_run_root(root)
