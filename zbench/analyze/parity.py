"""Parity: at the same seed, every ZeRO stage computes the same maths, so step-K metrics must agree."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from zbench.runroot import casedir
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
        if math.isnan(self.value):
            return f"{self.case}: {self.metric} not recorded, but {self.reference} has {self.expected!r}"
        if math.isnan(self.expected):
            return f"{self.case}: {self.metric} = {self.value!r}, but {self.reference} did not record it"
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
    skipped: list[str]  # cases that did not complete and never reached the step: nothing asked of them
    unchecked: list[str]  # what the gate was asked to check and could not: each one fails it


def is_math_metric(name: str, spec: dict[str, Any]) -> bool:
    """Whether a metric is maths (compared) rather than timing, perf or memory (never compared)."""
    if any(name.startswith(p) for p in spec.get("exclude", [])):
        return False
    return any(name.startswith(p) for p in spec.get("include", []))


def _ranks(case: CaseRun) -> str:
    """The ranks a case ran (or was to run) with, as its summary row says, for a parity group's name."""
    value = case.value("world_size")
    if math.isnan(value):
        return "unknown ranks"
    return f"{int(value)} rank{'' if value == 1 else 's'}"


def check_parity(root: Path, step: int = 1, rtol: float | None = None, atol: float | None = None,
                 spec: str | Path = "parity") -> ParityResult:
    """Compare step-``step`` math metrics of every case against the first case of its algorithm, and where the run's
    cases ran at several world sizes, of its algorithm at its world size: each rank samples its own responses, so
    one rank's step and two ranks' draw different ones, and only cases of one world size can agree."""
    run = load_run_root(root)
    pspec = load_spec(spec)
    tol = pspec.get("tolerance", {}).get(run.device, {"rtol": 1e-3, "atol": 1e-5})
    rtol = float(tol["rtol"]) if rtol is None else rtol
    atol = float(tol["atol"]) if atol is None else atol
    groups: dict[str, list[tuple[CaseRun, dict[str, float]]]] = {}
    recorded: list[tuple[CaseRun, dict[str, float], str]] = []  # with each case's ranks
    skipped: list[str] = []
    unchecked: list[str] = []
    for case in run.cases:
        m = read_metrics(case.dir)
        if step not in m.index:
            if case.status == "completed":
                unchecked.append(f"{case.name}: completed, but {_why_no_step(case.dir, m, step)}")
            else:
                skipped.append(f"{case.name}: no step {step} ({case.status})")
            continue
        row = {k: float(v) for k, v in m.loc[step].items() if is_math_metric(str(k), pspec)}
        recorded.append((case, row, _ranks(case)))
    sizes = {ranks for _, _, ranks in recorded}
    for case, row, ranks in recorded:
        groups.setdefault(case.algorithm if len(sizes) == 1 else f"{case.algorithm} at {ranks}", []).append((case, row))
    if not groups and not unchecked:
        raise RunRootError(f"{root}: no case recorded step {step}")
    mismatches, compared = [], 0
    for algo, members in groups.items():
        ref_case, ref = members[0]
        if len(members) == 1:
            skipped.append(f"{ref_case.name}: the only {algo} case with step {step}; nothing to compare it with")
        for case, row in members[1:]:
            for metric in dict.fromkeys([*ref, *row]):
                expected, value = ref.get(metric, math.nan), row.get(metric, math.nan)
                if math.isnan(expected) and math.isnan(value):
                    continue
                compared += 1
                if not math.isclose(value, expected, rel_tol=rtol, abs_tol=atol):
                    mismatches.append(Mismatch(case.name, ref_case.name, metric, value, expected))
    if not compared and not unchecked:
        unchecked.append(f"no two cases of one algorithm share a value of step {step} to compare")
    names = {algo: [c.name for c, _ in members] for algo, members in groups.items()}
    return ParityResult(step, rtol, atol, names, compared, mismatches, skipped, unchecked)


def _why_no_step(case_dir: Path, m: pd.DataFrame, step: int) -> str:
    """Why a completed case has no readable record of `step`: no file, a torn last line, or steps that stop short."""
    path = Path(case_dir) / casedir.METRICS
    if not path.is_file():
        return f"its {path} is missing"
    if casedir.read_metrics(case_dir).torn_tail and (m.empty or m.index.max() < step):
        return f"step {step} is not readable in {path}: its last line is torn (a write cut short)"
    have = f"steps {m.index.min()}..{m.index.max()}" if not m.empty else "no readable step"
    return f"{path} has no step {step} ({have})"
