"""A run root's report: report.md and a self-contained report.html (figures embedded as base64 PNG)."""

from __future__ import annotations

import base64
import html
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from zbench.analyze.curves import collect_series, render_curves
from zbench.analyze.frontier import tuning_frontier
from zbench.analyze.memory import GIB, estimate_case
from zbench.config import RunConfig
from zbench.env import REACH_CLUSTER, VERSIONED_PACKAGES
from zbench.runroot.casedir import atomic_write_bytes, atomic_write_text, read_result
from zbench.runroot.memory_figures import ALLOCATED, DEVICE, GEN, HOST, RESERVED, TRAIN, MemoryFigure, leading
from zbench.runroot.read import (
    RunRoot,
    RunRootError,
    load_run_root,
    load_spec,
    read_case_config,
    read_metrics,
    require_completed,
)


@dataclass(slots=True)
class Report:
    """Paths written and warnings collected."""

    markdown: Path
    html: Path
    written: list[Path]
    warnings: list[str]


REPORT_FILES = ("report.md", "report.html", "curves.png", "phase_times.png", "frontier.png")


def environment_lines(manifest: dict) -> list[str]:
    """The environment in two lines, software, then hardware and run; a third with the environment variables the
    manifest recorded (`zbench.env.recorded_variables`), where there are any."""
    v = manifest.get("versions", {})
    git = manifest.get("git", {})
    soft = " · ".join([f"zbench {manifest.get('zbench_version', '?')}",
                       f"git {str(git.get('commit') or '?')[:10]}{' (dirty)' if git.get('dirty') else ''}",
                       *(f"{k} {v[k]}" for k in ("python", *VERSIONED_PACKAGES) if v.get(k))])
    gpus = manifest.get("gpus") or []
    hw = f"{len(gpus)}× {gpus[0].get('name')} ({gpus[0].get('memory_gb')} GB)" if gpus else "no GPU"
    cpu = manifest.get("cpu") or {}  # runs recorded before the manifest named the CPU have none
    if cpu.get("model") or cpu.get("logical_cores"):
        hw += f" · CPU {cpu.get('model') or 'unnamed'} ({cpu.get('logical_cores', '?')} cores)"
    elif not gpus:
        hw = "CPU only"
    run = " · ".join([hw, f"host {manifest.get('host', '?')}", f"runner {manifest.get('runner', '?')}",
                      f"matrix {manifest.get('matrix', '?')}", f"seed {manifest.get('seed', '?')}",
                      f"{manifest.get('steps', '?')} steps",
                      f"{manifest.get('started_at', '?')} → {manifest.get('ended_at', '?')}"])
    variables = manifest.get("variables") or {}
    reach = manifest.get("variables_reach")
    where = f" ({reach})" if reach == REACH_CLUSTER else ""  # on a Ray cluster, the workers have their nodes' own
    return [soft, run, *([f"variables{where}: " + " · ".join(f"{k}={v}" for k, v in variables.items())]
                         if variables else [])]


def _fmt(x: float, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:,.0f}" if abs(x) >= 10**digits else f"{x:.{digits}g}"


def _count(x: float) -> int:
    """A step count from the summary; empty (a case that never recorded a step) is 0."""
    return 0 if math.isnan(x) else int(x)


def case_table(run: RunRoot, baseline: str | None) -> tuple[pd.DataFrame, str]:
    """One row per case with its figures and ratios to the baseline case."""
    done = require_completed(run)
    base = next((c for c in run.cases if c.name == baseline), None) if baseline else done[0]
    if base is None:
        raise ValueError(f"report baseline {baseline!r} is not a case of {run.path}")
    lead = leading(lambda f: recorded(run, f))
    rows = []
    for c in run.cases:
        mem, base_mem = c.value(lead.column), base.value(lead.column)
        rows.append({
            "case": c.name, "status": c.status,
            "steps": f"{_count(c.value('steps_completed'))}/{_count(c.value('steps_target'))}",
            "step time (s)": c.value("step_time_mean_s"), "step time sd (s)": c.value("step_time_sd_s"),
            "throughput (tok/s/GPU)": c.value("throughput_mean"),
            f"peak {lead.heading}": mem,
            "final score": c.value("score_last"), "best score": c.value("score_max"),
            "memory saved (%)": (1 - mem / base_mem) * 100 if base_mem else math.nan,
            "speed ×": c.value("throughput_mean") / base.value("throughput_mean"),
            "score Δ": c.value("score_last") - base.value("score_last"),
        })
    return pd.DataFrame(rows), base.name


def recorded(run: RunRoot, figure: MemoryFigure) -> bool:
    """Whether some case of the run has a value of a memory figure in its summary row."""
    return any(not math.isnan(c.value(figure.column)) for c in run.cases)


def first_steady_step(spec: dict) -> int:
    """The first step the report's means count (its spec's `mean_from_step`; step 1 warms up)."""
    return int(spec.get("mean_from_step", 2))


def phase_times(run: RunRoot, spec: dict, stacked: bool = True) -> pd.DataFrame:
    """Mean phase seconds per case (timing_s/* except the step total, steps mean_from_step..N), one column per
    phase in the spec's pipeline order under its readable name (phases the spec does not name follow, as named).

    `stacked` (the bars): a phase the spec lists as `overlapped` is left out for a case that recorded its exposed
    part instead, so that a bar adds up to its step, and a phase a case did not run is 0 s. Otherwise (the table):
    every phase a case recorded, its own time even where it ran beside others, and a phase it did not run missing."""
    prefix, exclude, start = spec.get("phase_prefix", "timing_s/"), set(spec.get("phase_exclude", [])), \
        first_steady_step(spec)
    overlapped = {f"{prefix}{phase}": f"{prefix}{exposed}" for phase, exposed in (spec.get("overlapped") or {}).items()}
    out = {}
    for c in run.cases:
        m = read_metrics(c.dir, steady_from=start)
        # a phase run beside others stacks only as its exposed part, so that the bar adds up to the step
        beside = {phase for phase, exposed in overlapped.items() if exposed in m.columns} if stacked else set()
        cols = [k for k in m.columns if str(k).startswith(prefix) and k not in exclude and k not in beside]
        if cols:
            out[c.name] = m[cols].mean()
    table = pd.DataFrame(out).T
    table = table.fillna(0.0) if stacked else table
    names = {f"{prefix}{phase}": label for phase, label in (spec.get("phases") or {}).items()}
    order = [c for c in names if c in table.columns] + [c for c in table.columns if c not in names]
    return table[order].rename(columns=lambda c: names.get(c, str(c).removeprefix(prefix)))


ENGINE_KEY = "perf/rollout_engine_s"
ENGINE_COLUMN = "rollout engine, slowest rank (s): median (min–max)"


def phase_table(run: RunRoot, spec: dict) -> pd.DataFrame:
    """The phase bars as numbers: each case's mean seconds per phase (`phase_times` unstacked: a phase the case did
    not run is "–", one that ran beside others shows its own time beside its exposed part) and, where the case
    recorded it, the rollout engine's own time inside generation (the slowest rank's) over the same steps, as a
    median and its range. A rollout's time swings from step to step (vLLM's host loop: 1.18 to 1.89 s within one
    2 x H200 case), which a mean hides."""
    start = first_steady_step(spec)
    table = phase_times(run, spec, stacked=False).rename(columns=lambda c: f"{c} (s)")
    table.insert(0, "case", table.index.astype(str))
    spread = {}
    for c in run.cases:
        m = read_metrics(c.dir, steady_from=start)
        engine = m[ENGINE_KEY].dropna() if ENGINE_KEY in m.columns else pd.Series(dtype=float)
        if len(engine) == 1:  # one step has no spread
            spread[c.name] = f"{_fmt(engine.iloc[0])}, 1 step"
        elif len(engine) > 1:
            spread[c.name] = (f"{_fmt(engine.median())} ({_fmt(engine.min())}–{_fmt(engine.max())}), "
                              f"{len(engine)} steps")
    if spread:
        table[ENGINE_COLUMN] = [spread.get(name, "not recorded") for name in table["case"]]
    return table.reset_index(drop=True)


TRAINING_PHASES = ("old_log_prob", "ref", "values", "update_critic", "update_actor")


def read_floors(path: Path, warnings: list[str]) -> list[dict]:
    """Bare-DeepSpeed floors (`zbench bench floor` JSON lines) saved beside a run root, if any. A floor that ran out
    of memory (`status: oom`) is kept with no rate: bare DeepSpeed could not train that shape."""
    floors = []
    if path.is_file():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            try:
                floor = json.loads(line)
                oom = floor.get("status") == "oom"
                floors.append({**{k: floor[k] for k in ("stage", "offload", "seqs", "seq_len")},
                               "tokens_per_s_per_gpu": None if oom else float(floor["tokens_per_s_per_gpu"]),
                               "oom": oom, "micro": floor.get("micro"), "asked_micro": floor.get("asked_micro"),
                               "head": floor.get("head", "lm"), "fused_ops": bool(floor.get("fused_ops", False)),
                               "coalesce": bool(floor.get("coalesce", False))})
            except (json.JSONDecodeError, KeyError, TypeError):
                if line.strip():
                    warnings.append(f"{path}:{n}: not a `zbench bench floor` record; skipped")
    return floors


def phase_throughput(run: RunRoot, spec: dict, floors: list[dict]) -> pd.DataFrame:
    """Tokens per second per GPU of each training phase (step tokens, times PPO epochs for the updates, over
    phase seconds and ranks; mean over steps from mean_from_step), beside the bare-DeepSpeed floor measured for
    the case's ZeRO stage and offload (`floors.jsonl` in the run root) and the actor and critic updates' distance
    to it."""
    start = first_steady_step(spec)
    rows = []
    for c in run.cases:
        cfg = read_case_config(c.dir)
        world, epochs = cfg.trainer.world_size, cfg.actor.ppo_epochs
        m = read_metrics(c.dir, steady_from=start)
        if "perf/total_num_tokens" not in m.columns:
            continue
        row: dict[str, object] = {"case": c.name}
        for phase in TRAINING_PHASES:
            seconds = m.get(f"timing_s/{phase}")
            if seconds is not None and (seconds > 0).any():
                tokens = m["perf/total_num_tokens"] * (epochs if phase.startswith("update") else 1)
                row[f"{phase} (tok/s/GPU)"] = (tokens / (seconds * world)).mean()
        fused = cfg.model.fused_ops
        same_stage = [f for f in floors if f["stage"] == cfg.zero.stage and f["offload"] == cfg.zero.offload]
        shape = _case_floor_shape(cfg, m)
        # a measured floor wins over one that ran out of memory, one of the case's own shape (`zbench bench floor
        # --like`: its sequences, their length and its micro-batch, or measured in place of it) over another, one
        # run with the case's own model code (`model.fused_ops`) and gradient reduction (`coalesce`) over one
        # without; among those, the fastest: a floor is the least time the work takes, and a slower repeat of it
        # measured the host's noise
        coalesced = cfg.zero.coalesce_grad_reduction
        match = {f["head"]: f for f in sorted(same_stage, key=lambda f: (not f["oom"], _same_shape(f, shape),
                                                                          f["fused_ops"] == fused,
                                                                          f["coalesce"] == coalesced,
                                                                          f["tokens_per_s_per_gpu"] or 0.0))}
        if "lm" in match:
            row["bare DeepSpeed (tok/s/GPU)"] = _floor_rate(match["lm"])
            row["floor shape (seqs × tokens per GPU)"] = _floor_shape(match["lm"])
        if "value" in match and "update_critic (tok/s/GPU)" in row:
            row["bare DeepSpeed, value head (tok/s/GPU)"] = _floor_rate(match["value"])
        # the critic is set against a floor of its own model where one was measured, else against the LM's
        for role, floor in (("actor", match.get("lm")), ("critic", match.get("value", match.get("lm")))):
            rate = row.get(f"update_{role} (tok/s/GPU)")
            if floor is not None and not floor["oom"] and isinstance(rate, float) and rate > 0:
                row[f"{role} update: floor ÷ measured"] = floor["tokens_per_s_per_gpu"] / rate
        rows.append(row)
    return pd.DataFrame(rows)


def _case_floor_shape(cfg: RunConfig, m: pd.DataFrame) -> dict | None:
    """The floor shape `zbench bench floor --like` gives a case (`RunConfig.floor_shape`, and the sequences' mean
    length over the steps read); None without lengths."""
    if not {"prompt_length/mean", "response_length/mean"} <= set(m.columns):
        return None
    lengths = (m["prompt_length/mean"] + m["response_length/mean"]).dropna()
    if lengths.empty:
        return None
    seqs, micro = cfg.floor_shape()
    return {"seqs": seqs, "seq_len": float(lengths.mean()), "micro": micro}


def _same_shape(floor: dict, shape: dict | None) -> bool:
    """Whether a floor was measured at a case's shape (`_case_floor_shape`; None: unknown): its sequences, its
    head's micro-batch or in place of it, and a length within 2 % of the case's mean (the steps `--like` read may
    not be the report's)."""
    if shape is None:
        return False
    micro = floor.get("asked_micro") or floor.get("micro")
    return (floor["seqs"] == shape["seqs"] and micro == shape["micro"].get(floor["head"])
            and abs(floor["seq_len"] - shape["seq_len"]) <= 0.02 * shape["seq_len"])


def _floor_shape(floor: dict) -> str:
    """A floor's sequences and tokens per GPU, and its micro-batch where it was measured in place of a larger one
    that ran out of memory (`zbench.bench.halved`)."""
    shape = f"{floor['seqs']} × {floor['seq_len']}"
    if floor.get("asked_micro") and not floor["oom"]:
        shape += f", micro {floor['micro']} ({floor['asked_micro']}: out of memory)"
    return shape


def _floor_rate(floor: dict) -> float | str:
    """A floor's tokens per second per GPU, or what stopped it: bare DeepSpeed ran out of memory at that shape (at
    the micro-batch asked and every smaller one tried, down to the one named)."""
    if not floor["oom"]:
        return floor["tokens_per_s_per_gpu"]
    if floor.get("asked_micro"):
        return f"out of memory at micro {floor['asked_micro']} and down to {floor['micro']}"
    return f"out of memory at micro {floor['micro']}"


def memory_table(run: RunRoot) -> pd.DataFrame:
    """Predicted per-rank memory (ZeRO formulas) beside measured peaks, the leading figure first."""
    lead = leading(lambda f: recorded(run, f))
    measured = [lead, *(f for f in (DEVICE, GEN, TRAIN, RESERVED, ALLOCATED, HOST) if f != lead and recorded(run, f))]
    rows = []
    for c in run.cases:
        try:
            est = estimate_case(read_case_config(c.dir), base_dir=c.dir, name=c.name, on_cuda=run.device == "cuda")
        except (RunRootError, ValueError, KeyError) as e:
            rows.append({"case": c.name, "note": str(e)})
            continue
        rows.append({"case": c.name, "stage": est.stage, "offload": est.offload_effective,
                     "predicted on the training device (GB)": est.gpu_bytes / GIB,
                     "predicted offloaded to CPU (GB)": est.cpu_bytes / GIB,
                     **{f"measured {f.heading}": c.value(f.column) for f in measured}})
    return pd.DataFrame(rows)


# what a case's rollout ran, from its result.json: (key, column, the engines it describes; empty: every engine)
GRAPH_LOOP = ("hf-graph", "hf-loop")
ROLLOUT_FIELDS = (
    ("rollout_engine", "engine", ()),
    ("vllm_model_runner", "vLLM model runner", ("vllm",)),
    ("graph_decode_attention", "decode attention", GRAPH_LOOP),
    ("graph_decode_kernels", "attention kernels", GRAPH_LOOP),
    ("graph_steps_per_graph", "decode steps a replay", GRAPH_LOOP),
    ("graph_sampling", "draw", GRAPH_LOOP),
    ("graph_kv_cache", "KV cache between rollouts", GRAPH_LOOP),
    ("graph_prefill", "prefill", GRAPH_LOOP),
)


def rollout_table(run: RunRoot) -> pd.DataFrame:
    """How each case's rollout ran, as its result.json recorded it: the engine, and for the graph loop its attention,
    the attention kernels' switches, its decode steps a replay, where it draws, what its KV cache does between
    rollouts and how it prefills. "not recorded" where the case's zbench did not record a field; "–" where it does
    not apply to the engine that ran; columns that apply to no case are left out."""
    rows = []
    for c in run.cases:
        result = read_result(c.dir)
        if result is None:
            rows.append({"case": c.name, "engine": "no result.json (the case did not finish)"})
            continue
        engine = result.get("rollout_engine")
        row = {"case": c.name}
        for key, column, engines in ROLLOUT_FIELDS:
            if engines and engine is not None and engine not in engines:  # unknown engine: nothing ruled out
                row[column] = "–"
            elif key not in result or result[key] is None:
                row[column] = "not recorded"
            elif isinstance(result[key], dict):  # switches: each named on or off
                row[column] = ", ".join(f"{k} {'on' if v else 'off'}" for k, v in result[key].items())
            else:
                row[column] = result[key]
        rows.append(row)
    table = pd.DataFrame(rows)
    applies = [col for col in table.columns if col == "case" or (table[col].dropna() != "–").any()]
    return table[applies].fillna("–") if len(applies) > 1 else pd.DataFrame()


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def phase_figure(phases: pd.DataFrame, first_step: int) -> bytes:
    """Stacked horizontal bar of mean phase times per case, phases left to right in the order of the columns; the
    means are over steps `first_step`..N (the spec's `mean_from_step`)."""
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(phases) + 1.8), layout="constrained")
    left = pd.Series(0.0, index=phases.index)
    cmap = plt.get_cmap("tab10")
    for i, col in enumerate(phases.columns):
        ax.barh(phases.index, phases[col], left=left, label=str(col), color=cmap(i % 10))
        left += phases[col]
    ax.invert_yaxis()
    ax.set_xlabel(f"seconds per step (mean over steps {first_step}..N, a profiled step left out)")
    ax.set_title("Phase times per case")
    fig.legend(loc="outside right upper", fontsize=8, frameon=False)
    return _png(fig)


def _md_table(df: pd.DataFrame) -> str:
    cells = [[_fmt(v) if isinstance(v, float) else str(v) for v in row] for row in df.itertuples(index=False)]
    head = "| " + " | ".join(map(str, df.columns)) + " |\n|" + "---|" * len(df.columns) + "\n"
    return head + "".join("| " + " | ".join(r) + " |\n" for r in cells)


def _html_table(df: pd.DataFrame) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v) if isinstance(v, float) else str(v))}</td>"
                                    for v in row) + "</tr>" for row in df.itertuples(index=False))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_CSS = ("body{font-family:system-ui,sans-serif;margin:2em;max-width:1300px;color:#222}"
        "table{border-collapse:collapse;margin:1em 0;font-size:14px}td,th{border:1px solid #ccc;padding:4px 8px;"
        "text-align:right}th{background:#f0f0f0}td:first-child{text-align:left}img{max-width:100%}"
        ".env{color:#555;font-size:13px}")


def write_report(root: Path, spec: str | Path = "report", floors: Path | None = None,
                 summary: Path | None = None, out_dir: Path | None = None, overwrite: bool = False) -> Report:
    """Write report.md and report.html, and the curves.png and phase_times.png they show, into `out_dir`
    (default: the run root); nothing else. Training phases are set against the floors in `floors` (default: the
    run root's floors.jsonl, if any). `summary` (e.g. the `zbench merge` output) replaces the run root's own
    summary, so reruns in other run roots are reported too. An existing report there is an error unless
    `overwrite`."""
    run = load_run_root(root, summary)
    out = Path(out_dir) if out_dir is not None else run.path
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder for {', '.join(REPORT_FILES)}")
    earlier = [out / n for n in REPORT_FILES[:2] if (out / n).exists()]
    if earlier and not overwrite:
        raise ValueError(f"{' and '.join(map(str, earlier))} already exist(s); pass --force to replace the report, "
                         "or --out DIR to write it elsewhere")
    rspec = load_spec(spec)
    table, base = case_table(run, rspec.get("baseline"))
    series, warnings = collect_series([run])
    fig, _ = render_curves(series, load_spec("plot"), f"{run.matrix} — {run.name}")
    curves_png = _png(fig)
    phases = phase_times(run, rspec)
    phase_png = phase_figure(phases, first_steady_step(rspec)) if not phases.empty else b""
    phase_rows = phase_table(run, rspec)
    mem = memory_table(run)
    rollouts = rollout_table(run)
    env = environment_lines(run.manifest)
    floor_warnings: list[str] = []
    floors_path = floors or run.path / "floors.jsonl"
    speeds = phase_throughput(run, rspec, read_floors(floors_path, floor_warnings))
    speed_title = "Training phases: tokens per second per GPU, beside bare DeepSpeed"
    value_floor = speeds.get("bare DeepSpeed, value head (tok/s/GPU)")
    critic_ratio = speeds.get("critic update: floor ÷ measured")
    critic_vs_lm = critic_ratio is not None and bool(
        (critic_ratio.notna() & (value_floor.isna() if value_floor is not None else True)).any())
    speed_note = ("The critic is set against the causal-LM floor (no value-head floor was measured: `zbench bench "
                  "floor --head value`); the LM floor trains a vocabulary head the critic lacks." if critic_vs_lm
                  else "")

    md = [f"# zbench report — {run.name}", "", *(f"{line}  " for line in env), "",
          f"## Cases (baseline: {base})", "", _md_table(table), "## Curves", "", "![curves](curves.png)", "",
          *(["## Phase times", "", "![phases](phase_times.png)", "", _md_table(phase_rows)] if phase_png else []),
          f"## {speed_title}", "", _md_table(speeds),
          *([speed_note, ""] if speed_note else []),
          "## Memory per rank: predicted (ZeRO model states) vs measured", "", _md_table(mem),
          *(["## Rollout as it ran (result.json)", "", _md_table(rollouts)] if not rollouts.empty else [])]
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "curves.png"]
    tuning = tuning_frontier(run.path, run.manifest)  # a tune's run root, or a run of its tuned.yaml
    if tuning is not None:
        atomic_write_bytes(out / "frontier.png", tuning.png)
        written.append(out / "frontier.png")
        md += ["", "## Tuning: what memory buys", "", tuning.note, "", "![frontier](frontier.png)", "",
               _md_table(tuning.table)]
    atomic_write_bytes(out / "curves.png", curves_png)
    if phase_png:
        atomic_write_bytes(out / "phase_times.png", phase_png)
        written.append(out / "phase_times.png")
    md_path, html_path = out / "report.md", out / "report.html"
    atomic_write_text(md_path, "\n".join(md) + "\n")

    def img(data: bytes, alt: str) -> str:
        return f'<img alt="{alt}" src="data:image/png;base64,{base64.b64encode(data).decode()}">' if data else ""

    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>zbench report — {html.escape(run.name)}"
            f"</title><style>{_CSS}</style></head><body><h1>zbench report — {html.escape(run.name)}</h1>"
            + "".join(f"<div class='env'>{html.escape(line)}</div>" for line in env)
            + f"<h2>Cases (baseline: {html.escape(base)})</h2>{_html_table(table)}"
            + f"<h2>Curves</h2>{img(curves_png, 'curves')}<h2>Phase times</h2>{img(phase_png, 'phase times')}"
            + (_html_table(phase_rows) if phase_png else "")
            + f"<h2>{html.escape(speed_title)}</h2>{_html_table(speeds)}"
            + (f"<p>{html.escape(speed_note)}</p>" if speed_note else "")
            + "<h2>Memory per rank: predicted (ZeRO model states) vs measured</h2>" + _html_table(mem)
            + (f"<h2>Rollout as it ran (result.json)</h2>{_html_table(rollouts)}" if not rollouts.empty else "")
            + (f"<h2>Tuning: what memory buys</h2><p>{html.escape(tuning.note)}</p>{img(tuning.png, 'frontier')}"
               f"{_html_table(tuning.table)}" if tuning is not None else "")
            + "</body></html>")
    atomic_write_text(html_path, page)
    return Report(md_path, html_path, [md_path, html_path, *written], run.warnings + warnings + floor_warnings)
