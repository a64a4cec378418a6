"""The read side of run roots, for the analysis: manifest, summary.tsv and per-case metrics as DataFrames.

Built on the case-directory contract (`casedir`) and the summary's reader (`summary`), so a torn line or an older
summary is handled by the same rule everywhere; fails with a message naming the file where it cannot go on (no run
root, no summary, missing columns, no completed case).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from zbench import shipped_specs
from zbench.config import ConfigError, RunConfig, load_case_config
from zbench.runroot import casedir, summary
from zbench.runroot.casedir import RunRootError
from zbench.runroot.root import MANIFEST
from zbench.runroot.summary import SUMMARY, SUMMARY_COLUMNS

__all__ = ["SUMMARY_COLUMNS", "CaseRun", "RunRoot", "RunRootError", "load_run_root", "load_spec", "read_case_config",
           "read_manifest", "read_metrics", "read_summary", "require_completed"]


@dataclass(frozen=True, slots=True)
class CaseRun:
    """One case of a run root as the analysis sees it: its summary row and its directory."""

    name: str
    root_name: str
    dir: Path
    row: dict[str, Any]

    @property
    def status(self) -> str:
        """Status from the summary ("completed", "oom", ...)."""
        return str(self.row.get("status") or "unknown")

    @property
    def algorithm(self) -> str:
        """"ppo" or "grpo" (lower case)."""
        return str(self.row.get("algorithm") or "").lower()

    def value(self, column: str) -> float:
        """A numeric summary figure, NaN when empty."""
        v = self.row.get(column)
        try:
            return float(v) if v is not None and v != "" else math.nan
        except (TypeError, ValueError):
            return math.nan


@dataclass(slots=True)
class RunRoot:
    """A run root read for analysis; ``warnings`` collects what was skipped or doubtful."""

    path: Path
    manifest: dict[str, Any]
    summary: pd.DataFrame
    cases: list[CaseRun]
    warnings: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The run root's directory name (its tag and time stamp)."""
        return self.path.name

    @property
    def matrix(self) -> str:
        """The matrix name from the manifest, "run" when unknown."""
        return str(self.manifest.get("matrix") or "run")

    @property
    def device(self) -> str:
        """"cuda" or "cpu", as the run ran: from the cases' result.json, else from the manifest's GPU list."""
        for case in self.cases:
            device = (casedir.read_result(case.dir) or {}).get("device")
            if device in ("cpu", "cuda"):
                return str(device)
        return "cuda" if self.manifest.get("gpus") else "cpu"

    def completed(self) -> list[CaseRun]:
        """Cases whose status is completed."""
        return [c for c in self.cases if c.status == "completed"]


def read_manifest(root: Path) -> dict[str, Any]:
    """manifest.json of a run root, or a clear error when the root is missing or empty."""
    root = Path(root)
    if not root.is_dir():
        raise RunRootError(f"run root {root} does not exist (or is not a directory)")
    path = root / MANIFEST
    if not path.is_file():
        what = "is empty" if not any(root.iterdir()) else f"has no {MANIFEST}"
        raise RunRootError(f"run root {root} {what}: not a zbench run root, or the run never started")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunRootError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise RunRootError(f"{path}: expected a JSON object (a zbench manifest is one)")
    return data


def read_summary(path: Path, warnings: list[str] | None = None) -> pd.DataFrame:
    """summary.tsv (or a merged summary) as a DataFrame: text columns as text, the others numeric (NaN when empty)."""
    df = pd.DataFrame(summary.read_summary(path, warnings), columns=list(SUMMARY_COLUMNS))
    for col in SUMMARY_COLUMNS:
        if col not in summary.TEXT_COLUMNS:
            df[col] = pd.to_numeric(df[col].replace("", None), errors="coerce")
    return df


def read_metrics(case_dir: Path, warnings: list[str] | None = None, steady_from: int | None = None) -> pd.DataFrame:
    """A case's metrics.jsonl as a DataFrame indexed by step (sorted; a repeated step keeps its last record);
    with ``steady_from``, only its steady-state steps from that step on (`summary.steady_records`).

    A torn last line (a writer interrupted mid-append) is skipped silently; an unreadable line elsewhere is noted in
    ``warnings``. A case without metrics gives an empty frame.
    """
    metrics = casedir.read_metrics(case_dir)
    bad = metrics.skipped - int(metrics.torn_tail)
    if bad and warnings is not None:
        warnings.append(f"{Path(case_dir) / casedir.METRICS}: {bad} unreadable line(s) skipped")
    records = casedir.steps_by_number(metrics.records)
    if steady_from is not None:
        records = summary.steady_records(records, steady_from)
    if not records:
        return pd.DataFrame(index=pd.Index([], name="step", dtype="int64"))
    df = pd.DataFrame.from_records(records).set_index("step")
    return df.apply(pd.to_numeric, errors="coerce")


def read_case_config(case_dir: Path) -> RunConfig:
    """A case's config.yaml through the config schema; an error naming the file when it is missing or invalid."""
    path = Path(case_dir) / casedir.CONFIG
    if not path.is_file():
        raise RunRootError(f"{path} is missing: the case's config is needed to analyse it")
    try:
        return load_case_config(path)
    except ConfigError as e:
        raise RunRootError(str(e)) from None


def load_run_root(root: Path, summary: Path | None = None) -> RunRoot:
    """Read a run root: manifest, summary (``summary`` overrides ``<root>/summary.tsv``), its cases.

    Case directories are resolved relative to the summary's folder, so a merged summary whose case_dir points
    into other run roots (``../<other root>/<case>``) yields cases of those roots.
    """
    root = Path(root)
    manifest = read_manifest(root)
    warnings: list[str] = []
    summary_path = Path(summary) if summary else root / SUMMARY
    df = read_summary(summary_path, warnings)
    if df.empty:
        raise RunRootError(f"{summary_path} has a header but no case rows")
    cases = []
    for row in df.to_dict("records"):
        row = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
        case_dir = (summary_path.parent / (row.get("case_dir") or row["case"])).resolve()
        root_name = case_dir.parent.name if case_dir.parent != root.resolve() else root.name
        cases.append(CaseRun(name=str(row["case"]), root_name=root_name, dir=case_dir, row=row))
    order = [c.get("name") for c in manifest.get("cases", []) if isinstance(c, dict)]
    if order:
        rank = {n: i for i, n in enumerate(order)}
        cases.sort(key=lambda c: rank.get(c.name, len(rank)))
    return RunRoot(path=root, manifest=manifest, summary=df, cases=cases, warnings=warnings)


def require_completed(run: RunRoot) -> list[CaseRun]:
    """The completed cases, or an error listing each case's status when there is none."""
    done = run.completed()
    if not done:
        states = ", ".join(f"{c.name}={c.status}" for c in run.cases)
        raise RunRootError(f"{run.path}: no completed case ({states})")
    return done


def load_spec(name_or_path: str | Path) -> dict[str, Any]:
    """An analysis spec: a YAML path, or a name ("plot", "report", "compare", "parity") in analysis/."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        text = path.read_text()
    else:
        fname = f"{name_or_path}.yaml"
        local = shipped_specs("analysis") / fname
        if not local.is_file():
            raise RunRootError(f"analysis spec {name_or_path!r} not found (no file, no analysis/{fname})")
        text = local.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RunRootError(f"analysis spec {name_or_path}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise RunRootError(f"analysis spec {name_or_path}: expected a YAML mapping")
    return data
