"""Training curves of one or several run roots: a 2×2 figure (memory, throughput, score, loss) and its TSV.

One line per case in matrix order; a case keeps its colour in every figure (colour by name, from a
colour-blind-safe palette); a case that stopped early ends where it stopped, with an × and its status. Several
run roots overlay for before/after: same colour per case, one line style per root; the legend names each case
once and each root once, shortened to what tells the roots apart. A panel whose metric never changes says
``constant: <value>`` instead of drawing a flat line; `smooth` panels can show a rolling mean over the raw line.
"""

from __future__ import annotations

import hashlib
import io
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from zbench.runroot.casedir import atomic_write_bytes, atomic_write_text
from zbench.runroot.memory_figures import HOST, LEADING_ORDER
from zbench.runroot.read import CaseRun, RunRoot, RunRootError, load_run_root, load_spec, read_metrics

# Okabe & Ito's colour-blind-safe palette without its yellow, too pale for a line on white: no case is faint.
PALETTE: tuple[str, ...] = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")
# A figure with more cases than colours marks the second round of colours with these, then the third, ...
MARKERS: tuple[str, ...] = ("", "o", "s", "^", "D")
LINE_STYLES: tuple[str, ...] = ("-", "--", ":", "-.")
ROOT_LABEL_CHARS = 28  # a run root's name in an overlay's legend, at most (shortened in the middle)
_STATUS_SHORT = {"completed": "", "oom": "OOM", "timeout": "timeout", "failed": "failed",
                 "interrupted": "interrupted", "running": "running", "pending": "pending"}


def case_styles(names: list[str]) -> dict[str, tuple[str, str]]:
    """Colour and marker per case name: a hash of the name picks the colour (so the same case has the same colour
    in every figure); a clash inside one figure moves the later name (sorted order) to the next free colour, and
    once every colour is taken, the next names reuse them with a marker."""
    out: dict[str, tuple[str, str]] = {}
    names = sorted(set(names))
    for round_start in range(0, len(names), len(PALETTE)):
        taken: set[int] = set()
        marker = MARKERS[(round_start // len(PALETTE)) % len(MARKERS)]
        for name in names[round_start : round_start + len(PALETTE)]:
            slot = int(hashlib.sha1(name.encode()).hexdigest(), 16) % len(PALETTE)
            while slot in taken:
                slot = (slot + 1) % len(PALETTE)
            taken.add(slot)
            out[name] = (PALETTE[slot], marker)
    return out


def short_root_names(names: list[str]) -> dict[str, str]:
    """Run-root names as an overlay's legend shows them: the words (split at _ and -) that all of them share at
    the start and at the end dropped, at most ROOT_LABEL_CHARS long; each name unchanged when that would make
    two of them alike."""
    words = {n: re.split(r"(?<=[_-])", n) for n in names}
    shortest = min(len(w) for w in words.values())
    head = 0
    while head < shortest - 1 and len({tuple(w[: head + 1]) for w in words.values()}) == 1:
        head += 1
    tail = 0
    while head + tail < shortest - 1 and len({tuple(w[len(w) - tail - 1 :]) for w in words.values()}) == 1:
        tail += 1
    out = {}
    for name, w in words.items():
        short = "".join(w[head : len(w) - tail]).strip("_-") or name
        if len(short) > ROOT_LABEL_CHARS:
            keep = ROOT_LABEL_CHARS - 1
            short = short[: keep - keep // 2] + "…" + short[len(short) - keep // 2 :]
        out[name] = short
    return out if len(set(out.values())) == len(out) else {n: n for n in names}


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
    """The panel a spec asks for with `memory: leading`: the leading memory figure (zbench.runroot.memory_figures), then
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
            df = read_metrics(case.dir, warnings)
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


def _values(s: Series, panel: dict[str, Any]) -> pd.Series:
    """Case `s`'s recorded values of the panel's metric by step (empty when it has none)."""
    metric = _panel_metric(panel, s.case.algorithm)
    return s.metrics[metric].dropna() if metric in s.metrics.columns else pd.Series(dtype=float)


def _constant(values: list[pd.Series]) -> float | None:
    """The one value every series of a panel takes at every step, or None when it varies."""
    finite = pd.concat(values) if values else pd.Series(dtype=float)
    if finite.empty:
        return None
    low, high = float(finite.min()), float(finite.max())
    return low if high - low <= 1e-12 * max(1.0, abs(low)) else None


def render_curves(series: list[Series], spec: dict[str, Any], title: str,
                  panels: list[dict[str, Any]] | None = None, smooth: int = 0) -> tuple[Figure, pd.DataFrame]:
    """Draw the 2×2 figure (its `panels` as resolved by `_resolve_panels`, resolved here if not given); return it
    with its metrics table. `smooth` > 1: panels marked `smooth` in the spec draw a rolling mean over that many
    steps, the raw line faint behind it."""
    panels = panels if panels is not None else _resolve_panels(spec, series)
    styles = case_styles([s.case.name for s in series])
    roots = list(dict.fromkeys(s.case.root_name for s in series))
    dashes = {r: LINE_STYLES[i % len(LINE_STYLES)] for i, r in enumerate(roots)}
    fig, axes = plt.subplots(2, 2, figsize=tuple(spec.get("figsize", (13, 8.5))), layout="constrained")
    for ax, panel in zip(axes.flat, panels, strict=False):
        algos = {s.case.algorithm for s in series}
        names = list(dict.fromkeys(_panel_metric(panel, a) for a in sorted(algos)))
        drawn = [(s, y) for s in series if not (y := _values(s, panel)).empty]
        value = _constant([y for _, y in drawn])
        smoothed = smooth > 1 and bool(panel.get("smooth")) and value is None
        note = f" · rolling mean over {smooth} steps" if smoothed else ""
        ax.set_title(f"{panel['title']}\n{' · '.join(names)}{note}", fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.grid(True, alpha=0.3)
        if not drawn:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="grey")
            continue
        if value is not None:
            steps = pd.concat([y for _, y in drawn]).index
            ax.text(0.5, 0.5, f"constant: {value:.6g}\n(every case, steps {int(steps.min())}–{int(steps.max())})",
                    transform=ax.transAxes, ha="center", va="center", fontsize=12)
            ax.set_xlim(steps.min() - 0.5, steps.max() + 0.5)
            ax.set_yticks([])
            continue
        for s, y in drawn:
            color, marker = styles[s.case.name]
            line = dict(color=color, linestyle=dashes[s.case.root_name], marker=marker or None, markersize=4,
                        markevery=max(1, len(y) // 12))
            if smoothed:
                ax.plot(y.index.to_numpy(), y.to_numpy(), linewidth=0.8, alpha=0.25, **line)
                y = y.rolling(smooth, min_periods=1).mean()
            ax.plot(y.index.to_numpy(), y.to_numpy(), linewidth=1.4, **line)
            if s.case.status != "completed":
                ax.plot([y.index[-1]], [y.iloc[-1]], marker="X", markersize=9, color=color,
                        markeredgecolor="black", linestyle="none")
                ax.annotate(_STATUS_SHORT.get(s.case.status, s.case.status) or s.case.status,
                            (y.index[-1], y.iloc[-1]), textcoords="offset points", xytext=(5, 4),
                            fontsize=8, color=color, fontweight="bold")
    handles, labels = _legend(series, styles, dashes)
    if handles:
        width_chars = fig.get_figwidth() * 16  # about 16 legend characters per inch at font size 9
        per_row = max(1, int(width_chars // (max(map(len, labels)) + 6)))  # long labels: fewer columns
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 4, per_row), fontsize=9,
                   frameon=False)
    fig.suptitle(title, fontsize=12)
    return fig, metrics_table(series, panels)


def _legend(series: list[Series], styles: dict[str, tuple[str, str]],
            dashes: dict[str, str]) -> tuple[list[Line2D], list[str]]:
    """One entry per case (its colour; with one run root, its status when it did not complete), then, when
    several run roots overlay, one entry per root (its line style, its shortened name)."""
    handles, labels = [], []
    overlay = len(dashes) > 1
    for s in series:
        label = s.case.name if overlay else _legend_label(s)
        if label in labels:
            continue
        color, marker = styles[s.case.name]
        handles.append(Line2D([], [], color=color, marker=marker or None, markersize=4, linewidth=1.4))
        labels.append(label)
    if overlay:
        for root, short in short_root_names(list(dashes)).items():
            handles.append(Line2D([], [], color="#444444", linestyle=dashes[root], linewidth=1.4))
            labels.append(f"run {short}")
    return handles, labels


def _legend_label(s: Series) -> str:
    if s.case.status == "completed":
        return s.case.name
    return f"{s.case.name} ({s.case.status} at step {int(s.metrics.index[-1])})"


def default_names(run: RunRoot, overlay: bool) -> tuple[Path, Path]:
    """Default PNG and TSV paths in the run root."""
    spec_names = load_spec("plot").get("output_names", {})
    prefix = spec_names.get(run.matrix, run.matrix) + ("_overlay" if overlay else "")
    return run.path / f"{prefix}_curves.png", run.path / f"{prefix}_curves_metrics.tsv"


def plot_curves(run_roots: list[Path], summary: Path | None = None, output: Path | None = None,
                metrics_tsv: Path | None = None, max_step: int | None = None,
                spec: str | Path = "plot", smooth: int = 0) -> CurvesResult:
    """Write the curves PNG and the metrics TSV (raw values) of one or several run roots; `smooth` > 1 draws a
    rolling mean over that many steps in the spec's `smooth` panels."""
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
    root_names = list(dict.fromkeys(s.case.root_name for s in series))
    title = f"{runs[0].matrix} — " + (" vs " if len(" vs ".join(root_names)) < 110 else "\nvs ").join(root_names)
    panels = _resolve_panels(plot_spec, series)
    fig, table = render_curves(series, plot_spec, title, panels, smooth)
    warnings += _blank_in_panels(series, panels)
    _atomic_savefig(fig, png, dpi=int(plot_spec.get("dpi", 110)))
    plt.close(fig)
    atomic_write_text(tsv, table.to_csv(sep="\t", index=False, na_rep=""))
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
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    atomic_write_bytes(path, buf.getvalue())
