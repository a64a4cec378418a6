"""Reading run roots for analysis: manifest, summary.tsv, per-case metrics.jsonl and config.yaml.

Every reader here is tolerant where the run root format allows it (a torn last line of metrics.jsonl, a case
that never started, an unknown extra summary column) and fails with a message naming the file where it cannot
go on (no run root, no summary, missing columns, no completed case).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from zbench import store

SUMMARY_COLUMNS = store.SUMMARY_COLUMNS
_TEXT_COLUMNS = {"case", "algorithm", "offload", "offload_effective", "rollout_backend", "status", "reason",
                 "case_dir", "config_hash"}


class RunRootError(Exception):
    """A run root (or a summary) that cannot be analysed; the message says which file and why."""


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

    def completed(self) -> list[CaseRun]:
        """Cases whose status is completed."""
        return [c for c in self.cases if c.status == "completed"]


def read_manifest(root: Path) -> dict[str, Any]:
    """manifest.json of a run root, or a clear error when the root is missing or empty."""
    root = Path(root)
    if not root.is_dir():
        raise RunRootError(f"run root {root} does not exist (or is not a directory)")
    path = root / "manifest.json"
    if not path.is_file():
        what = "is empty" if not any(root.iterdir()) else "has no manifest.json"
        raise RunRootError(f"run root {root} {what}: not a zbench run root, or the run never started")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RunRootError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise RunRootError(f"{path}: expected a JSON object")
    return data


def read_summary(path: Path, warnings: list[str] | None = None) -> pd.DataFrame:
    """summary.tsv (or a merged summary) as text-typed and numeric columns in the contract's order.

    Missing columns are an error (naming them); unknown extra columns are dropped with a warning.
    """
    path = Path(path)
    if not path.is_file():
        raise RunRootError(f"{path} does not exist: no case of this run has finished yet (or wrong path)")
    try:
        df = pd.read_csv(path, sep="\t", dtype=str, keep_default_na=False)
    except pd.errors.EmptyDataError as e:
        raise RunRootError(f"{path} is empty") from e
    for col in store.LATER_SUMMARY_COLUMNS:
        if col not in df.columns:
            df[col] = ""
    missing = [c for c in SUMMARY_COLUMNS if c not in df.columns]
    if missing:
        raise RunRootError(f"{path}: missing summary column(s) {', '.join(missing)}; "
                           f"expected the columns {', '.join(SUMMARY_COLUMNS)}")
    unknown = [c for c in df.columns if c not in SUMMARY_COLUMNS]
    if unknown and warnings is not None:
        warnings.append(f"{path}: ignoring unknown summary column(s) {', '.join(unknown)}")
    df = df[list(SUMMARY_COLUMNS)].copy()
    for col in SUMMARY_COLUMNS:
        if col not in _TEXT_COLUMNS:
            df[col] = pd.to_numeric(df[col].replace("", None), errors="coerce")
    return df


def read_metrics(path: Path, warnings: list[str] | None = None) -> pd.DataFrame:
    """metrics.jsonl as a DataFrame indexed by step (sorted; a repeated step keeps its last record).

    A torn last line (a writer interrupted mid-append) is skipped silently; an unreadable line elsewhere is
    skipped with a warning. A missing file gives an empty frame.
    """
    path = Path(path)
    if not path.is_file():
        return pd.DataFrame(index=pd.Index([], name="step", dtype="int64"))
    records: list[dict[str, Any]] = []
    lines = path.read_text(errors="replace").split("\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            step = int(rec["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            if i != last and warnings is not None:
                warnings.append(f"{path}:{i + 1}: unreadable metrics line skipped")
            continue
        rec["step"] = step
        records.append(rec)
    if not records:
        return pd.DataFrame(index=pd.Index([], name="step", dtype="int64"))
    df = pd.DataFrame.from_records(records)
    df = df.drop_duplicates("step", keep="last").set_index("step").sort_index()
    return df.apply(pd.to_numeric, errors="coerce")


def read_case_config(case_dir: Path) -> dict[str, Any]:
    """A case's config.yaml as a nested dict ({} when absent)."""
    path = Path(case_dir) / "config.yaml"
    if not path.is_file():
        return {}
    data = yaml.safe_load(path.read_text())
    return data if isinstance(data, dict) else {}


def read_case_json(case_dir: Path, name: str) -> dict[str, Any]:
    """A case's status.json or result.json as a dict ({} when absent or unreadable)."""
    try:
        data = json.loads((Path(case_dir) / name).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def load_run_root(root: Path, summary: Path | None = None) -> RunRoot:
    """Read a run root: manifest, summary (``summary`` overrides ``<root>/summary.tsv``), its cases.

    Case directories are resolved relative to the summary's folder, so a merged summary whose case_dir points
    into other run roots (``../<other root>/<case>``) yields cases of those roots.
    """
    root = Path(root)
    manifest = read_manifest(root)
    warnings: list[str] = []
    summary_path = Path(summary) if summary else root / "summary.tsv"
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
        try:
            import importlib.resources

            text = (importlib.resources.files("zbench.analysis") / fname).read_text()
        except (ModuleNotFoundError, FileNotFoundError, OSError):
            import zbench

            local = Path(zbench.__file__).parents[1] / "analysis" / fname
            if not local.is_file():
                raise RunRootError(f"analysis spec {name_or_path!r} not found (no file, no analysis/{fname})") from None
            text = local.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RunRootError(f"analysis spec {name_or_path}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise RunRootError(f"analysis spec {name_or_path}: expected a YAML mapping")
    return data
