"""Parity: at the same seed, every ZeRO stage computes the same maths, so step-K metrics must agree."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zbench.runroot.read import (
    CaseRun,
    RunRootError,
    load_run_root,
    load_spec,
    read_metrics,
)


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One metric of one case that differs from its group's reference case."""

    case: str
    reference: str
    metric: str
    value: float
    expected: float

    def __str__(self) -> str:
        return (f"{self.case}: {self.metric} = {self.value!r}, but {self.reference} has {self.expected!r} "
                f"(diff {abs(self.value - self.expected):.3g})")


@dataclass(slots=True)
class ParityResult:
    """What was compared, under which tolerances, and what differed."""

    step: int
    rtol: float
    atol: float
    groups: dict[str, list[str]]
    compared: int
    mismatches: list[Mismatch]
    skipped: list[str]


def is_math_metric(name: str, spec: dict[str, Any]) -> bool:
    """Whether a metric is maths (compared) rather than timing, perf or memory (never compared)."""
    if any(name.startswith(p) for p in spec.get("exclude", [])):
        return False
    return any(name.startswith(p) for p in spec.get("include", []))


def check_parity(root: Path, step: int = 1, rtol: float | None = None, atol: float | None = None,
                 spec: str | Path = "parity") -> ParityResult:
    """Compare step-``step`` math metrics of every case against the first case of its algorithm."""
    run = load_run_root(root)
    pspec = load_spec(spec)
    tol = pspec.get("tolerance", {}).get(run.device, {"rtol": 1e-3, "atol": 1e-5})
    rtol = float(tol["rtol"]) if rtol is None else rtol
    atol = float(tol["atol"]) if atol is None else atol
    groups: dict[str, list[tuple[CaseRun, dict[str, float]]]] = {}
    skipped = []
    for case in run.cases:
        m = read_metrics(case.dir)
        if step not in m.index:
            skipped.append(f"{case.name}: no step {step} ({case.status})")
            continue
        row = {k: float(v) for k, v in m.loc[step].items() if is_math_metric(str(k), pspec)}
        groups.setdefault(case.algorithm, []).append((case, row))
    if not groups:
        raise RunRootError(f"{root}: no case recorded step {step}")
    mismatches, compared = [], 0
    for members in groups.values():
        ref_case, ref = members[0]
        for case, row in members[1:]:
            for metric, expected in ref.items():
                value = row.get(metric, math.nan)
                if math.isnan(expected) and math.isnan(value):
                    continue
                compared += 1
                if not math.isclose(value, expected, rel_tol=rtol, abs_tol=atol):
                    mismatches.append(Mismatch(case.name, ref_case.name, metric, value, expected))
    names = {algo: [c.name for c, _ in members] for algo, members in groups.items()}
    return ParityResult(step, rtol, atol, names, compared, mismatches, skipped)
