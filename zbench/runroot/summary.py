"""summary.tsv: one row per case from its case directory, the statistics behind the row, and the TSV itself.

The one rule for steady-state figures lives here (`steady_records`): steps 2..N (step 1 includes warm-up), without a
profiled step (the profiler slows it), each falling back to all steps when nothing else is left. The report and the
summary both ask it.
"""

from __future__ import annotations

import hashlib
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from zbench.config import ConfigError, RunConfig, as_recorded, dump_yaml, from_dict, load_case_config
from zbench.runroot import casedir
from zbench.runroot.casedir import RunRootError

SUMMARY = "summary.tsv"
SUMMARY_COMPLETE = "summary_complete.tsv"

SUMMARY_COLUMNS = (
    "case", "algorithm", "zero_stage", "offload", "offload_effective", "rollout_backend", "world_size", "seed",
    "status", "steps_completed", "steps_target", "wall_s", "step_time_mean_s", "throughput_mean", "mfu_mean",
    "max_memory_allocated_gb", "max_memory_reserved_gb", "cpu_memory_used_gb", "score_first", "score_last",
    "score_max", "loss_last", "attempt", "exit_code", "reason", "case_dir", "config_hash", "device_memory_used_gb",
    "step_time_sd_s", "device_memory_gen_gb", "device_memory_train_gb", "rollout_engine",
)  # fmt: skip
# Columns added after the first release: a summary written before them reads back with them empty.
LATER_SUMMARY_COLUMNS = ("device_memory_used_gb", "step_time_sd_s", "device_memory_gen_gb", "device_memory_train_gb",
                         "rollout_engine")
TEXT_COLUMNS = frozenset({"case", "algorithm", "offload", "offload_effective", "rollout_backend", "status", "reason",
                          "case_dir", "config_hash", "rollout_engine"})  # fmt: skip

STEADY_FROM_STEP = 2  # step 1 includes warm-up (compilation, allocator growth, engine start)


def steady_records(records: Sequence[Mapping[str, Any]], start: int = STEADY_FROM_STEP) -> list[Mapping[str, Any]]:
    """The steady-state steps of a case: from ``start`` on, without a profiled step; each filter falls back to the
    records it was given when it would leave none."""
    by_step = [r for r in records if isinstance(r.get("step"), int)]
    unprofiled = [r for r in by_step if not r.get("perf/profiled")] or by_step
    return [r for r in unprofiled if r["step"] >= start] or unprofiled


def config_hash(text: str) -> str:
    """sha256 of a case's config, first 12 hex characters.

    The config is read through the current schema first, as a recorded config (`as_recorded`: a key added to
    zbench later reads as the behaviour the config ran with), so formatting, key order and later keys do not change
    the hash: a rerun with a newer zbench still merges with the first run when it ran the same case, and not when
    a new default changed what the case does. A config the schema no longer accepts is hashed as written."""
    try:
        canonical = dump_yaml(from_dict(as_recorded(yaml.safe_load(text) or {})))
    except (ConfigError, yaml.YAMLError, TypeError, ValueError, AttributeError):
        canonical = text
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:12]


def _fmt(value: Any) -> str:
    """One TSV cell: empty for missing or non-finite values; floats with 6 significant digits."""
    if value is None or value == "":
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return "" if not math.isfinite(value) else f"{value:.6g}"
    # Tabs or newlines inside a cell would break the table.
    return " ".join(str(value).split())


def _series(records: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    out = []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append(float(v))
    return out


def _mean(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = _series(records, key)
    return statistics.fmean(values) if values else None


def _sd(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """The sample standard deviation of a metric over the records (None below two values): how far one step's
    figure strays, so that a difference between cases can be set against it."""
    values = _series(records, key)
    return statistics.stdev(values) if len(values) >= 2 else None


def _peak(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = _series(records, key)
    return max(values) if values else None


def loss_key(cfg: RunConfig) -> str:
    """The loss a case's summary reports: the critic's value loss with a critic, else the policy loss."""
    return "critic/vf_loss" if cfg.needs_critic else "actor/pg_loss"


def case_summary_row(run_root: str | os.PathLike[str], case: str, case_dir: str | None = None) -> dict[str, str]:
    """One summary row for a case, from its config.yaml, metrics.jsonl, status.json and result.json.

    A config.yaml the current schema does not accept leaves the config columns empty (the row still says what ran).
    """
    rel = case_dir or case
    cdir = Path(run_root) / rel
    config_path = cdir / casedir.CONFIG
    config_text: str | None
    try:
        config_text = config_path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        config_text = None
    cfg: RunConfig | None = None
    if config_text is not None:
        try:
            cfg = load_case_config(config_path)
        except ConfigError:
            cfg = None
    status = casedir.read_status(cdir) or {}
    result = casedir.read_result(cdir) or {}
    records = casedir.steps_by_number(casedir.read_metrics(cdir).records)
    steady = steady_records(records)
    unprofiled = [r for r in records if not r.get("perf/profiled")] or records  # the profiler holds memory
    scores = _series(records, "critic/score/mean")
    steps_completed = result.get("steps_completed")
    if steps_completed is None and records:
        steps_completed = records[-1]["step"]
    algorithm = cfg.algorithm if cfg else None
    row: dict[str, Any] = {
        "case": case,
        "algorithm": algorithm,
        "zero_stage": cfg.zero.stage if cfg else None,
        "offload": cfg.zero.offload if cfg else None,
        "offload_effective": result.get("offload_effective"),
        "rollout_backend": result.get("rollout_backend") or (cfg.rollout.backend if cfg else None),
        "rollout_engine": result.get("rollout_engine"),  # which loop ran (hf-graph, hf-generate, ..., vllm)
        "world_size": result.get("world_size", cfg.trainer.world_size if cfg else None),
        "seed": cfg.seed if cfg else None,
        "status": status.get("status", "pending"),
        "steps_completed": steps_completed,
        "steps_target": result.get("steps_target", cfg.steps if cfg else None),
        "wall_s": result.get("wall_s"),
        "step_time_mean_s": _mean(steady, "timing_s/step"),
        "step_time_sd_s": _sd(steady, "timing_s/step"),
        "throughput_mean": _mean(steady, "perf/throughput"),
        "mfu_mean": _mean(steady, "perf/mfu/actor"),
        "max_memory_allocated_gb": _peak(unprofiled, "perf/max_memory_allocated_gb"),
        "max_memory_reserved_gb": _peak(unprofiled, "perf/max_memory_reserved_gb"),
        "device_memory_used_gb": _peak(unprofiled, "perf/device_memory_used_gb"),
        "device_memory_gen_gb": _peak(unprofiled, "perf/device_memory_gen_gb"),
        "device_memory_train_gb": _peak(unprofiled, "perf/device_memory_train_gb"),
        "cpu_memory_used_gb": _peak(unprofiled, "perf/cpu_memory_used_gb"),
        "score_first": scores[0] if scores else None,
        "score_last": scores[-1] if scores else None,
        "score_max": max(scores) if scores else None,
        "loss_last": (_series(records, loss_key(cfg)) or [None])[-1] if cfg else None,
        "attempt": status.get("attempt"),
        "exit_code": status.get("exit_code"),
        "reason": status.get("reason"),
        "case_dir": rel,
        "config_hash": config_hash(config_text) if config_text is not None else None,
    }
    return {k: _fmt(row[k]) for k in SUMMARY_COLUMNS}


def write_summary(path: str | os.PathLike[str], rows: Sequence[Mapping[str, str]]) -> None:
    """Write rows as a TSV with SUMMARY_COLUMNS, atomically (tmp + os.replace)."""
    # Cells hold no tabs or newlines (_fmt folds whitespace), so plain joins are a faithful TSV.
    lines = ["\t".join(SUMMARY_COLUMNS)]
    lines += ["\t".join(_fmt(row.get(k)) for k in SUMMARY_COLUMNS) for row in rows]
    casedir.atomic_write_text(path, "\n".join(lines) + "\n")


def read_summary(path: str | os.PathLike[str], warnings: list[str] | None = None) -> list[dict[str, str]]:
    """Read a summary TSV as text rows holding every column of SUMMARY_COLUMNS, in that order.

    A column added later (LATER_SUMMARY_COLUMNS) and absent from an older file reads back empty; any other missing
    column is an error naming the file and the columns; unknown extra columns are dropped, noted in ``warnings``.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise RunRootError(f"{path} does not exist: no case of this run has finished yet (or wrong path)") from None
    except (UnicodeDecodeError, IsADirectoryError, NotADirectoryError) as e:
        raise RunRootError(f"{path}: not a zbench summary ({e})") from None
    if not lines:
        raise RunRootError(f"{path} is empty: expected the zbench summary header ({', '.join(SUMMARY_COLUMNS[:4])}, ...)")
    header = lines[0].split("\t")
    missing = [c for c in SUMMARY_COLUMNS if c not in header and c not in LATER_SUMMARY_COLUMNS]
    if missing:
        raise RunRootError(f"{path}: missing summary column(s) {', '.join(missing)}; "
                           f"expected the columns {', '.join(SUMMARY_COLUMNS)}")
    unknown = [c for c in header if c not in SUMMARY_COLUMNS]
    if unknown and warnings is not None:
        warnings.append(f"{path}: ignoring unknown summary column(s) {', '.join(unknown)}")
    rows = []
    for line in lines[1:]:
        if line:
            cells = dict(zip(header, line.split("\t"), strict=False))
            rows.append({c: cells.get(c, "") for c in SUMMARY_COLUMNS})
    return rows
