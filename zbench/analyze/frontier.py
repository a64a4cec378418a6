"""What memory buys: from a tune's `tuning.tsv`, each case's trials as the time batch geometry changes (the updates and
gradient-free passes; the whole step for tunes that recorded no phases) against peak memory (the frontier), and the
geometry chosen for each. `zbench report` adds it for a tune's run root and for a run of its `tuned.yaml`."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from zbench.runroot.tuning import TUNING, read_tuning

_SHORT = {"actor.micro_batch_size_per_gpu": "m", "actor.forward_micro_batch_size_per_gpu": "f",
          "model.gradient_checkpointing": "ckpt", "model.checkpoint_layers": "ckpt",
          "model.activation_memory_budget": "b"}


@dataclass(frozen=True, slots=True)
class Frontier:
    """The frontier figure, the per-case table and where the trials came from."""

    source: Path
    png: bytes
    table: pd.DataFrame
    note: str


def find_tuning(root: Path, manifest: dict[str, Any]) -> Path | None:
    """The tuning.tsv of a tune's run root, or of the tune whose tuned.yaml this run ran (beside that file, found as
    the run named it or under the same results folder)."""
    if (root / TUNING).is_file():
        return root / TUNING
    matrix_file = manifest.get("matrix_file")
    if not matrix_file:
        return None
    named = Path(matrix_file).parent
    for folder in (named, root.parent / named.name):
        if (folder / TUNING).is_file() and folder.resolve() != root.resolve():
            return folder / TUNING
    return None


def _num(text: str | None) -> float:
    try:
        return float(text) if text else math.nan
    except ValueError:
        return math.nan


def _label(row: dict[str, str]) -> str:
    parts = []
    for key, short in _SHORT.items():
        value = row.get(key, "")
        if key == "model.gradient_checkpointing":
            parts += [short] if value == "true" else []
        elif key == "model.checkpoint_layers":  # how many layers checkpoint, where not every one: ckpt20
            parts = [f"{short}{value}" if p == short and value else p for p in parts]
        elif key == "model.activation_memory_budget":  # a share below the compiler's default: b0.3
            every = row.get("model.gradient_checkpointing") == "true" and not row.get("model.checkpoint_layers")
            parts += [f"{short}{float(value):g}"] if value and float(value) < 1 and not every else []
        elif value and value != "0":
            parts.append(f"{short}{value}")
    return " ".join(parts)


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other beats on both memory (x) and step time (y), by memory."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points):
        if not front or y < front[-1][1]:
            front.append((x, y))
    return front


def frontier_figure(rows: list[dict[str, str]]) -> bytes:
    """One panel per case: its trials' step time against peak memory, the frontier, the budget, the choice."""
    cases = list(dict.fromkeys(r["case"] for r in rows))
    cols = min(3, len(cases))
    nrows = -(-len(cases) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.8 * nrows), layout="constrained", squeeze=False)
    for ax in axes.flat[len(cases):]:
        ax.set_visible(False)
    for ax, case in zip(axes.flat, cases, strict=False):
        trials = [r for r in rows if r["case"] == case]
        y_key = _ranked_key(trials)
        by_phases = y_key == "geometry_s"
        ok = [(r, _num(r["peak_memory_gb"]), _num(r[y_key])) for r in trials if r["status"] == "ok"]
        over = [(r, _num(r["peak_memory_gb"]), _num(r[y_key])) for r in trials if r["status"] == "over_budget"]
        if ok:
            ax.scatter([x for _, x, _ in ok], [y for _, _, y in ok], color="tab:blue", label="within budget", zorder=3)
            front = pareto([(x, y) for _, x, y in ok if not (math.isnan(x) or math.isnan(y))])
            if len(front) > 1:
                ax.step([x for x, _ in front], [y for _, y in front], where="post", color="tab:blue", alpha=0.4)
        if over:
            ax.scatter([x for _, x, _ in over], [y for _, _, y in over], color="tab:red", marker="x",
                       label="over budget", zorder=3)
        for r, x, y in ok + over:
            ax.annotate(_label(r), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        chosen = [(x, y) for r, x, y in ok if r.get("chosen") == "true"]
        if chosen:
            ax.scatter(*zip(*chosen, strict=True), s=220, marker="*", color="tab:orange", label="chosen", zorder=4)
        budget = _num(trials[0].get("budget_gb"))
        if not math.isnan(budget) and (ok or over) and budget <= 1.5 * max(x for _, x, _ in ok + over):
            ax.axvline(budget, color="tab:red", linestyle="--", linewidth=1, label=f"budget {budget:.3g} GB")
        unplotted = len(trials) - len(ok) - len(over)
        ax.set_title(f"{case} ({len(trials)} trials{f', {unplotted} without a step' if unplotted else ''})",
                     fontsize=10)
        measure = "device-wide GPU" if trials[0].get("memory_measure") == "device" else "CPU RSS"
        ax.set_xlabel(f"peak memory, {measure} (GB)")
        ax.set_ylabel("updates + gradient-free passes, steady mean (s)" if by_phases
                      else "step time, steady mean (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle("Tuning: time against peak memory\n(m: micro-batch, f: forward micro-batch, ckpt: checkpointing, b: activation budget)",
                 fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def frontier_table(rows: list[dict[str, str]]) -> pd.DataFrame:
    """Per case: trials by outcome, and the chosen geometry with its step time and peak memory."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        trials = [r for r in rows if r["case"] == case]
        chosen = next((r for r in trials if r.get("chosen") == "true"), None)
        others = [f"{r['trial']}: {r['status']}" + (f" ({r['reason']})" if r.get("reason") else "")
                  for r in trials if r["status"] != "ok" or r.get("reason")]  # ok ones with a warning too
        out.append({"case": case, "trials": str(len(trials)),
                    "chosen": f"{chosen['trial']} ({_label(chosen)})" if chosen else "none within the budget",
                    "step time (s)": _num(chosen["step_s"]) if chosen else math.nan,
                    "updates + gradient-free passes (s)": _num(chosen.get("geometry_s")) if chosen else math.nan,
                    "peak memory (GB)": _num(chosen["peak_memory_gb"]) if chosen else math.nan,
                    f"fastest / slowest trial within budget ({_RANKED_LABEL[_ranked_key(trials)]})": _spread(trials),
                    "trials with a reason or warning": "; ".join(others) or "–"})
    return pd.DataFrame(out)


_RANKED_LABEL = {"geometry_s": "updates + passes", "step_s": "step"}


def _ranked_key(trials: list[dict[str, str]]) -> str:
    """The column a tune compared its trials on: `geometry_s` where every measured trial has it, else `step_s`."""
    return "geometry_s" if all(r.get("geometry_s") for r in trials if r["status"] in ("ok", "over_budget")) \
        else "step_s"


def _spread(trials: list[dict[str, str]]) -> float:
    key = _ranked_key(trials)
    steps = [s for r in trials if r["status"] == "ok" and not math.isnan(s := _num(r[key]))]
    return min(steps) / max(steps) if steps else math.nan


def tuning_frontier(root: Path, manifest: dict[str, Any]) -> Frontier | None:
    """The frontier of the tune behind this run root, or None when there is none."""
    source = find_tuning(root, manifest)
    if source is None:
        return None
    rows = read_tuning(source)
    if not rows:
        return None
    note = (f"From {source.parent.name}/{TUNING}: every trial of the tune, its steady step time (steps 2..N) against "
            "its peak memory; the line joins the trials no other beats on both, the star marks the chosen one.")
    return Frontier(source, frontier_figure(rows), frontier_table(rows), note)
