"""Regression gate: case-by-case deltas of two runs' summary figures, failing on crossed thresholds."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from zbench.runroot.read import SUMMARY_COLUMNS, RunRootError, load_spec, read_summary

# verl metric names accepted in --fail-on, and the summary column each one is summarised into.
METRIC_ALIASES: dict[str, str] = {
    "perf/throughput": "throughput_mean",
    "perf/max_memory_reserved_gb": "max_memory_reserved_gb",
    "perf/max_memory_allocated_gb": "max_memory_allocated_gb",
    "perf/device_memory_used_gb": "device_memory_used_gb",
    "perf/cpu_memory_used_gb": "cpu_memory_used_gb",
    "perf/mfu/actor": "mfu_mean",
    "timing_s/step": "step_time_mean_s",
    "critic/score/mean": "score_last",
}
FIGURES: tuple[str, ...] = ("step_time_mean_s", "throughput_mean", "mfu_mean", "max_memory_allocated_gb",
                            "max_memory_reserved_gb", "device_memory_used_gb", "cpu_memory_used_gb", "score_last", "score_max",
                            "loss_last", "wall_s")
_THRESHOLD = re.compile(r"^([+-])(\d+(?:\.\d*)?|\.\d+)(%?)$")


@dataclass(frozen=True, slots=True)
class Threshold:
    """Fail when ``column`` moves in ``direction`` (+1 up, -1 down) by more than ``amount`` (% or absolute)."""

    column: str
    direction: int
    amount: float
    percent: bool

    def crossed(self, old: float, new: float) -> bool:
        """Whether old → new moves further than allowed."""
        if math.isnan(old) or math.isnan(new):
            return False
        change = (new - old) * self.direction
        limit = abs(old) * self.amount / 100 if self.percent else self.amount
        return change > limit

    def __str__(self) -> str:
        return f"{self.column}:{'+' if self.direction > 0 else '-'}{self.amount:g}{'%' if self.percent else ''}"


def parse_threshold(metric: str, rule: str) -> Threshold:
    """One threshold from a metric (summary column or verl name) and a rule like "-5%", "+10%", "-0.05"."""
    column = METRIC_ALIASES.get(metric.strip(), metric.strip())
    if column not in SUMMARY_COLUMNS:
        raise ValueError(f"--fail-on: unknown metric {metric!r}; use a summary column ({', '.join(FIGURES)}) "
                         f"or one of {', '.join(METRIC_ALIASES)}")
    m = _THRESHOLD.match(str(rule).strip())
    if not m:
        raise ValueError(f"--fail-on {metric}: rule {rule!r} must be a signed number, optionally with %: "
                         "'-5%' (drop), '+10%' (rise), '-0.05' (absolute)")
    return Threshold(column, 1 if m[1] == "+" else -1, float(m[2]), m[3] == "%")


def parse_fail_on(text: str) -> list[Threshold]:
    """Thresholds from "metric:rule,metric:rule,..."."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        metric, sep, rule = item.rpartition(":")
        if not sep:
            raise ValueError(f"--fail-on item {item!r} must be metric:rule, e.g. perf/throughput:-5%")
        out.append(parse_threshold(metric, rule))
    return out


def default_thresholds(spec: str | Path = "compare") -> list[Threshold]:
    """The thresholds of the compare spec (analysis/compare.yaml)."""
    return [parse_threshold(k, str(v)) for k, v in load_spec(spec).get("fail_on", {}).items()]


def summary_of(source: Path) -> pd.DataFrame:
    """A summary from a run root (its summary.tsv) or a summary TSV file."""
    source = Path(source)
    if source.is_dir():
        source = source / "summary.tsv"
    return read_summary(source)


@dataclass(slots=True)
class Comparison:
    """Deltas (one row per case and figure) and the failures of the gate."""

    deltas: pd.DataFrame
    failures: list[str]


def compare(base: pd.DataFrame, new: pd.DataFrame, thresholds: list[Threshold]) -> Comparison:
    """Compare two summaries case by case; a case missing or not completed in NEW fails."""
    if base.empty:
        raise RunRootError("BASE summary has no case rows")
    new_by_case = {r["case"]: r for r in new.to_dict("records")}
    rows, failures = [], []
    for old in base.to_dict("records"):
        case = old["case"]
        cur = new_by_case.get(case)
        if cur is None:
            failures.append(f"{case}: missing in NEW")
            continue
        if cur["status"] != "completed":
            failures.append(f"{case}: {cur['status']} in NEW (was {old['status']}): {cur['reason'] or 'no reason'}")
        for col in FIGURES:
            o, n = float(old[col]), float(cur[col])
            if math.isnan(o) and math.isnan(n):
                continue
            rel = (n - o) / abs(o) * 100 if o and not math.isnan(o) and not math.isnan(n) else math.nan
            rows.append({"case": case, "metric": col, "old": o, "new": n, "delta": n - o, "delta_pct": rel})
        if old["status"] != "completed" or cur["status"] != "completed":
            continue
        for t in thresholds:
            o, n = float(old[t.column]), float(cur[t.column])
            if t.crossed(o, n):
                failures.append(f"{case}: {t.column} {o:.4g} -> {n:.4g} crosses {t}")
    return Comparison(pd.DataFrame(rows, columns=["case", "metric", "old", "new", "delta", "delta_pct"]), failures)
