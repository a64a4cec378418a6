"""Training curves of one or several run roots: a 2×2 figure (memory, throughput, score, loss) and its TSV.

One line per case in matrix order; a case keeps its colour in every figure (colour by name); a case that
stopped early ends where it stopped, with an × and its status. Several run roots overlay for before/after:
same colour per case, one line style per root, labels ``<run-root-name>:<case>``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from zbench.memory_figures import HOST, LEADING_ORDER
from zbench.runread import CaseRun, RunRoot, RunRootError, load_run_root, load_spec, read_metrics

# Ten strong colours first, then their light partners: hashing lands on the strong ones as often.
PALETTE: tuple[str, ...] = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5",
)
LINE_STYLES: tuple[str, ...] = ("-", "--", ":", "-.")
_STATUS_SHORT = {"completed": "", "oom": "OOM", "timeout": "timeout", "failed": "failed",
                 "interrupted": "interrupted", "running": "running", "pending": "pending"}


def case_colors(names: list[str]) -> dict[str, str]:
    """Colour per case name: a hash of the name picks the palette slot (so the same case has the same colour
    in every figure); a clash inside one figure moves the later name (sorted order) to the next free slot."""
    taken: dict[int, str] = {}
    out: dict[str, str] = {}
    for name in sorted(set(names)):
        slot = int(hashlib.sha1(name.encode()).hexdigest(), 16) % len(PALETTE)
        for _ in range(len(PALETTE)):
            if slot not in taken:
                break
            slot = (slot + 1) % len(PALETTE)
        taken[slot] = name
        out[name] = PALETTE[slot]
    return out


@dataclass(slots=True)
class Series:
    """One case's metrics as plotted."""

    case: CaseRun
    label: str
    metrics: pd.DataFrame


@dataclass(slots=True)
class CurvesResult:
    """What ``plot_curves`` wrote, and what it skipped."""

    png: Path
    tsv: Path
    warnings: list[str] = field(default_factory=list)


def _panel_metric(panel: dict[str, Any], algorithm: str) -> str:
    metric = panel["metric"]
    return str(metric.get(algorithm, next(iter(metric.values())))) if isinstance(metric, dict) else str(metric)


def _has(s: Series, panel: dict[str, Any]) -> bool:
    """Whether case `s` recorded a value of the panel's metric."""
    metric = _panel_metric(panel, s.case.algorithm)
    return metric in s.metrics.columns and bool(s.metrics[metric].notna().any())


def _resolve_panels(spec: dict[str, Any], series: list[Series]) -> list[dict[str, Any]]:
    """Each panel as drawn: its own metric if some case in the figure has it, else the first of its `fallbacks`
    (or its older single `cpu_fallback`) that some case has."""
    panels = []
    for panel in spec["panels"]:
        if panel.get("memory") == "leading":
            panel = memory_panel()
        chain = panel.get("fallbacks") or ([panel["cpu_fallback"]] if panel.get("cpu_fallback") else [])
        if chain and not any(_has(s, panel) for s in series):
            candidates = [{**panel, **f} for f in chain]
            panel = next((c for c in candidates if any(_has(s, c) for s in series)), candidates[-1])
        panels.append(panel)
    return panels


def memory_panel() -> dict[str, Any]:
    """The panel a spec asks for with `memory: leading`: the leading memory figure (zbench.memory_figures), then
    the figures that lead in its place in runs that lack it, each titled as what it is."""
    chain = [{"title": f.label + ("" if f == HOST else " (max over ranks)"), "metric": f.metric, "ylabel": "GB"}
             for f in LEADING_ORDER]
    return {**chain[0], "fallbacks": chain[1:]}


def collect_series(runs: list[RunRoot], max_step: int | None = None) -> tuple[list[Series], list[str]]:
    """Read every case's metrics; cases with no step yet are left out with a warning."""
    warnings: list[str] = []
    roots = list(dict.fromkeys(c.root_name for r in runs for c in r.cases))
    series = []
    for run in runs:
        warnings.extend(run.warnings)
        for case in run.cases:
            df = read_metrics(case.dir / "metrics.jsonl", warnings)
            if max_step is not None:
                df = df[df.index <= max_step]
            if df.empty:
                warnings.append(f"{case.root_name}:{case.name}: no metrics ({case.status}); not plotted")
                continue
            label = f"{case.root_name}:{case.name}" if len(roots) > 1 else case.name
            series.append(Series(case=case, label=label, metrics=df))
    return series, warnings


def metrics_table(series: list[Series], panels: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per case and step, the plotted metrics as columns."""
    columns = list(dict.fromkeys(
        _panel_metric(p, algo) for p in panels for algo in (["ppo", "grpo"] if isinstance(p["metric"], dict) else [""])
    ))
    frames = []
    for s in series:
        df = s.metrics.reindex(columns=columns).reset_index()
        df.insert(0, "status", s.case.status)
        df.insert(0, "algorithm", s.case.algorithm)
        df.insert(0, "case", s.case.name)
        df.insert(0, "run_root", s.case.root_name)
        frames.append(df)
    if not frames:
        return pd.DataFrame(columns=["run_root", "case", "algorithm", "status", "step", *columns])
    return pd.concat(frames, ignore_index=True)


def render_curves(series: list[Series], spec: dict[str, Any], title: str,
                  panels: list[dict[str, Any]] | None = None) -> tuple[Figure, pd.DataFrame]:
    """Draw the 2×2 figure (its `panels` as resolved by `_resolve_panels`, resolved here if not given); return it
    with its metrics table."""
    panels = panels if panels is not None else _resolve_panels(spec, series)
    colors = case_colors([s.case.name for s in series])
    roots = list(dict.fromkeys(s.case.root_name for s in series))
    styles = {r: LINE_STYLES[i % len(LINE_STYLES)] for i, r in enumerate(roots)}
    fig, axes = plt.subplots(2, 2, figsize=tuple(spec.get("figsize", (13, 8.5))), layout="constrained")
    for ax, panel in zip(axes.flat, panels, strict=False):
        algos = {s.case.algorithm for s in series}
        names = list(dict.fromkeys(_panel_metric(panel, a) for a in sorted(algos)))
        ax.set_title(f"{panel['title']}\n{' · '.join(names)}", fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.grid(True, alpha=0.3)
        for s in series:
            metric = _panel_metric(panel, s.case.algorithm)
            if metric not in s.metrics.columns:
                continue
            y = s.metrics[metric].dropna()
            if y.empty:
                continue
            color = colors[s.case.name]
            ax.plot(y.index.to_numpy(), y.to_numpy(), color=color, linestyle=styles[s.case.root_name],
                    linewidth=1.4, label=_legend_label(s))
            if s.case.status != "completed":
                ax.plot([y.index[-1]], [y.iloc[-1]], marker="X", markersize=9, color=color,
                        markeredgecolor="black", linestyle="none")
                ax.annotate(_STATUS_SHORT.get(s.case.status, s.case.status) or s.case.status,
                            (y.index[-1], y.iloc[-1]), textcoords="offset points", xytext=(5, 4),
                            fontsize=8, color=color, fontweight="bold")
        if not ax.lines:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="grey")
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if handles:
        width_chars = fig.get_figwidth() * 16  # about 16 legend characters per inch at font size 9
        per_row = max(1, int(width_chars // (max(map(len, labels)) + 6)))  # long overlay labels: fewer columns
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 4, per_row), fontsize=9,
                   frameon=False)
    fig.suptitle(title, fontsize=12)
    return fig, metrics_table(series, panels)


def _legend_label(s: Series) -> str:
    if s.case.status == "completed":
        return s.label
    return f"{s.label} ({s.case.status} at step {int(s.metrics.index[-1])})"


def default_names(run: RunRoot, overlay: bool) -> tuple[Path, Path]:
    """Default PNG and TSV paths in the run root."""
    spec_names = load_spec("plot").get("output_names", {})
    prefix = spec_names.get(run.matrix, run.matrix) + ("_overlay" if overlay else "")
    return run.path / f"{prefix}_curves.png", run.path / f"{prefix}_curves_metrics.tsv"


def plot_curves(run_roots: list[Path], summary: Path | None = None, output: Path | None = None,
                metrics_tsv: Path | None = None, max_step: int | None = None,
                spec: str | Path = "plot") -> CurvesResult:
    """Write the curves PNG and the metrics TSV of one or several run roots."""
    if not run_roots:
        raise RunRootError("no run root given")
    if summary is not None and len(run_roots) > 1:
        raise RunRootError("--summary replaces one run root's summary.tsv: give a single run root with it")
    runs = [load_run_root(r, summary) for r in run_roots]
    plot_spec = load_spec(spec)
    panels_given = plot_spec.get("panels")
    if not isinstance(panels_given, list) or not all(
            isinstance(p, dict) and (p.get("memory") == "leading" or {"title", "metric"} <= set(p))
            for p in panels_given):
        raise RunRootError(f"plot spec {spec}: panels must be a list of {{title: ..., metric: ...}} mappings (or "
                           f"{{memory: leading}}), got {panels_given!r}")
    series, warnings = collect_series(runs, max_step)
    if not series:
        raise RunRootError(f"nothing to plot: no case of {', '.join(map(str, run_roots))} has recorded a step")
    overlay = len({s.case.root_name for s in series}) > 1
    png, tsv = default_names(runs[0], overlay)
    if output is not None:  # the TSV goes beside the PNG asked for, named after it
        png = Path(output)
        tsv = png.with_name(f"{png.stem}_metrics.tsv")
    tsv = Path(metrics_tsv or tsv)
    title = f"{runs[0].matrix} — " + " vs ".join(dict.fromkeys(s.case.root_name for s in series))
    panels = _resolve_panels(plot_spec, series)
    fig, table = render_curves(series, plot_spec, title, panels)
    warnings += _blank_in_panels(series, panels)
    _atomic_savefig(fig, png, dpi=int(plot_spec.get("dpi", 110)))
    plt.close(fig)
    tmp = tsv.with_name(tsv.name + ".tmp")
    table.to_csv(tmp, sep="\t", index=False, na_rep="")
    tmp.replace(tsv)
    return CurvesResult(png=png, tsv=tsv, warnings=warnings)


def _blank_in_panels(series: list[Series], panels: list[dict[str, Any]]) -> list[str]:
    """A warning per panel naming the cases it draws nothing for while others have its metric (an overlay of a
    run recorded before that metric existed, say)."""
    out = []
    for panel in panels:
        blank = [s.label for s in series if not _has(s, panel)]
        if blank and len(blank) < len(series):
            metrics = ", ".join(dict.fromkeys(_panel_metric(panel, s.case.algorithm) for s in series))
            out.append(f"{panel['title']}: no {metrics} for {', '.join(blank)}; drawn for the other cases only")
    return out


def _atomic_savefig(fig: Figure, path: Path, dpi: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, dpi=dpi, format="png")
    tmp.replace(path)
