"""A tune's files in its run root: `tuning.tsv` (one row per trial, rewritten atomically after each) and
`tuned.yaml` (a matrix of the chosen geometries, which `zbench run` takes as it is)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from zbench.config import TRIAL_GEOMETRY_KEYS
from zbench.runroot.casedir import RunRootError, atomic_write_text

TUNING = "tuning.tsv"
TUNED = "tuned.yaml"

GEOMETRY_KEYS = (*TRIAL_GEOMETRY_KEYS, "rollout.kv_cache_fit")  # a case's KV cache is the same in all its trials
PHASES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "update_weights")
FORWARD_PHASES = ("old_log_prob", "ref", "values")  # the gradient-free passes the forward micro-batch sizes
# the phases batch geometry changes, on which trials are compared: the rest of a step (generation, reward, weight
# push) is the same work at every geometry, and generation's spread from step to step (a host-bound engine loop)
# would drown what the geometry changes
GEOMETRY_PHASES = (*FORWARD_PHASES, "update_critic", "update_actor")
TUNING_COLUMNS = (
    "case", "trial", *GEOMETRY_KEYS, "status", "chosen", "step_s", "geometry_s", *(f"{p}_s" for p in PHASES),
    "peak_memory_gb",
    "memory_measure", "predicted_gb", "budget_gb", "wall_s", "reason", "trial_dir",
)  # fmt: skip


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.6g}" if math.isfinite(value) else ""
    return " ".join(str(value).split())


def write_tuning(path: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]]) -> None:
    """Write the trials as a TSV with TUNING_COLUMNS, atomically."""
    lines = ["\t".join(TUNING_COLUMNS)] + ["\t".join(_cell(r.get(c)) for c in TUNING_COLUMNS) for r in rows]
    atomic_write_text(path, "\n".join(lines) + "\n")


def read_tuning(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    """The trials of a tuning.tsv as text rows; an error names the file when it is not one."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (FileNotFoundError, IsADirectoryError):
        raise RunRootError(f"{path} does not exist: no trial of this tune has finished yet (or wrong path)") from None
    header = lines[0].split("\t") if lines else []
    missing = [c for c in ("case", "trial", "status", "step_s", "peak_memory_gb") if c not in header]
    if missing:
        raise RunRootError(f"{path}: not a zbench tuning table (missing column(s) {', '.join(missing)})")
    return [dict(zip(header, line.split("\t"), strict=False)) for line in lines[1:] if line]


def write_tuned(path: str | os.PathLike[str], description: str, base: Mapping[str, Any],
                cases: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
    """Write a matrix file holding one explicit case per tuned case: its own overrides and its chosen geometry."""
    data = {"description": description, "base": dict(base),
            "cases": [{"name": name, "set": dict(overrides)} for name, overrides in cases]}
    atomic_write_text(path, yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=1_000))
