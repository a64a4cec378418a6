"""Regression gate: case-by-case deltas of two runs' summary figures, failing on crossed thresholds."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from zbench.env import changed_variables
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


def manifest_of(source: Path) -> dict:
    """The manifest of a run root (or of the run root a summary TSV lies in); empty for a TSV on its own."""
    source = Path(source)
    manifest = (source if source.is_dir() else source.parent) / "manifest.json"
    try:
        data = json.loads(manifest.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def matrix_of(source: Path) -> str | None:
    """The matrix a run root (or a summary TSV inside one) ran, from its manifest; None for a TSV on its own."""
    data = manifest_of(source)
    return str(data["matrix"]) if data.get("matrix") else None


def environment_differences(base: dict, new: dict) -> list[str]:
    """What differs between two runs' environments, from their manifests: package versions, GPUs, CPU, and the
    recorded environment variables (`zbench.env.recorded_variables`). A difference does not fail the gate, but a
    delta it explains is no regression of the code. A part only one manifest recorded is said to be so (runs from
    before zbench recorded variables have none); a part neither recorded is not compared. A merged summary
    (`summary_complete.tsv`) is described by the manifest of the run root it lies in, not its reruns'."""
    def gpus(m: dict) -> str:
        names = [g.get("name") for g in m["gpus"] or []]
        return f"{len(names)}× {names[0]}" if names else "no GPU"

    def both(key: str) -> bool:
        return key in base and key in new

    out = []
    if both("versions"):
        old_v, new_v = base["versions"] or {}, new["versions"] or {}
        out += [f"{k} {old_v.get(k) or '(not installed)'} in BASE, {new_v.get(k) or '(not installed)'} in NEW"
                for k in sorted(set(old_v) | set(new_v)) if old_v.get(k) != new_v.get(k)]
    if both("gpus") and gpus(base) != gpus(new):
        out.append(f"GPUs: {gpus(base)} in BASE, {gpus(new)} in NEW")
    old_cpu, new_cpu = ((m.get("cpu") or {}).get("model") for m in (base, new))
    if old_cpu and new_cpu and old_cpu != new_cpu:
        out.append(f"CPU: {old_cpu} in BASE, {new_cpu} in NEW")
    if both("variables"):
        out += [f"{k}={a} in BASE, {b} in NEW"
                for k, a, b in changed_variables(base["variables"] or {}, new["variables"] or {})]
    else:
        for side, m in (("BASE", base), ("NEW", new)):
            if m.get("variables"):
                other = "NEW" if side == "BASE" else "BASE"
                out.append(f"environment variables recorded only in {side} ({other} has no record of them): "
                           + ", ".join(f"{k}={v}" for k, v in m["variables"].items()))
    return out


def incomparable(base: pd.DataFrame, new: pd.DataFrame, base_matrix: str | None,
                 new_matrix: str | None) -> list[str]:
    """Why two runs measure different things (other matrices, a case of one name under another algorithm)."""
    reasons = []
    if base_matrix and new_matrix and base_matrix != new_matrix:
        reasons.append(f"BASE ran matrix {base_matrix!r}, NEW ran {new_matrix!r}")
    algos = dict(zip(new["case"], new["algorithm"], strict=True))
    for case, algo in zip(base["case"], base["algorithm"], strict=True):
        if case in algos and str(algos[case]).lower() != str(algo).lower():
            reasons.append(f"{case}: {algo} in BASE, {algos[case]} in NEW")
    return reasons


@dataclass(slots=True)
class Comparison:
    """Deltas (one row per case and figure), the failures of the gate, and the gated figures neither run has."""

    deltas: pd.DataFrame
    failures: list[str]
    thresholds: list[Threshold]
    unmeasured: list[str]
    differences: list[str] = field(default_factory=list)  # of the two runs' environments, which do not fail it


def compare(base: pd.DataFrame, new: pd.DataFrame, thresholds: list[Threshold]) -> Comparison:
    """Compare two summaries case by case; a case missing or not completed in NEW fails, and so does a gated
    figure that one run recorded and the other did not."""
    if base.empty:
        raise RunRootError("BASE summary has no case rows")
    new_by_case = {r["case"]: r for r in new.to_dict("records")}
    rows, failures = [], []
    unmeasured: dict[str, None] = {}
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
            if math.isnan(o) and math.isnan(n):
                unmeasured[t.column] = None
            elif math.isnan(o) or math.isnan(n):
                side, other, value = ("BASE", "NEW", n) if math.isnan(o) else ("NEW", "BASE", o)
                failures.append(f"{case}: {t.column} not recorded in {side} ({other} has {value:.4g}); {t} "
                                "cannot be checked")
            elif t.crossed(o, n):
                failures.append(f"{case}: {t.column} {o:.4g} -> {n:.4g} crosses {t}")
    deltas = pd.DataFrame(rows, columns=["case", "metric", "old", "new", "delta", "delta_pct"])
    return Comparison(deltas, failures, thresholds, list(unmeasured))


FORMATS = ("text", "md", "json")


def render(result: Comparison, fmt: str) -> str:
    """The comparison as a plain table (text), a Markdown table and verdict for a PR (md), or one JSON object."""
    if fmt == "json":
        records = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
                   for r in result.deltas.to_dict("records")]
        return json.dumps({"ok": not result.failures, "failures": result.failures,
                           "thresholds": [str(t) for t in result.thresholds],
                           "not_recorded_by_either_run": result.unmeasured,
                           "environment_differences": result.differences, "deltas": records}, indent=2)
    gates = "thresholds: " + ", ".join(map(str, result.thresholds))
    blind = (f"not recorded by either run, so not gated: {', '.join(result.unmeasured)}" if result.unmeasured
             else "")
    differ = (f"the runs' environments differ: {'; '.join(result.differences)}" if result.differences else "")
    if fmt == "md":
        def cell(v: object) -> str:
            return "–" if isinstance(v, float) and math.isnan(v) else f"{v:.4g}" if isinstance(v, float) else str(v)

        cols = list(result.deltas.columns)
        table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        table += ["| " + " | ".join(cell(v) for v in row) + " |" for row in result.deltas.itertuples(index=False)]
        verdict = (["**FAIL**", "", *(f"- {f}" for f in result.failures)] if result.failures
                   else ["**OK**: no threshold crossed"])
        return "\n".join([*table, "", gates, *([blind] if blind else []), *([differ] if differ else []), "",
                          *verdict])
    text = result.deltas.to_string(index=False, float_format=lambda x: f"{x:.4g}") if not result.deltas.empty else ""
    return "\n".join(filter(None, [text, gates, blind, differ]))


def compare_sources(base: Path, new: Path, fail_on: str | None = None, force: bool = False) -> Comparison:
    """Compare two run roots (or summary TSVs) under `fail_on` (default: the compare spec's thresholds); runs of
    different matrices or algorithms are refused unless `force`."""
    thresholds = parse_fail_on(fail_on) if fail_on else default_thresholds()
    old, cur = summary_of(base), summary_of(new)
    reasons = incomparable(old, cur, matrix_of(base), matrix_of(new))
    if reasons and not force:
        raise ValueError(f"{base} and {new} measure different things ({'; '.join(reasons)}); compare runs of one "
                         "matrix, or pass --force to compare them anyway")
    result = compare(old, cur, thresholds)
    result.differences = environment_differences(manifest_of(base), manifest_of(new))
    return result
