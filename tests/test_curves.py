"""How the curves read: a constant panel says so, colours are colour-blind-safe and never faint, legends name each
case and each run root once (roots shortened), phase bars follow the pipeline, `plot --smooth N` draws a rolling
mean. `zbench plot` runs as a subprocess; the figure it draws is then checked through the same renderer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import matplotlib.colors as mcolors
import pandas as pd
import pytest
from PIL import Image
from test_analysis_runroot import SIX_CASES, FakeCase, make_run_root

from zbench.analyze.curves import PALETTE, case_styles, collect_series, render_curves, short_root_names
from zbench.analyze.report import ENGINE_COLUMN, phase_table, phase_times
from zbench.runroot.read import load_run_root, load_spec


def zbench(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zbench", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def figure(*roots: Path, smooth: int = 0):
    series, _ = collect_series([load_run_root(r) for r in roots])
    fig, _ = render_curves(series, load_spec("plot"), "t", smooth=smooth)
    return fig


def set_metric(root: Path, key: str, value: float) -> None:
    for metrics in root.glob("*/metrics.jsonl"):
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        metrics.write_text("".join(json.dumps({**r, key: value}) + "\n" for r in rows))


def test_a_constant_panel_says_so(tmp_path: Path) -> None:
    root = make_run_root(tmp_path, SIX_CASES[:3], steps=5)
    set_metric(root, "critic/score/mean", 0.0)
    res = zbench("plot", "--run-root", root)
    assert res.returncode == 0, res.stderr
    assert Image.open(root / "zero_six_curves.png").size[0] > 1000
    score = figure(root).axes[2]
    assert [t.get_text() for t in score.texts] == ["constant: 0\n(every case, steps 1–5)"]
    assert not score.lines and not score.get_yticks().size
    assert len(figure(root).axes[3].lines) == 3  # the loss varies: drawn as curves


def test_palette_is_colour_blind_safe_and_never_faint() -> None:
    """Okabe–Ito without its yellow: every colour has at least 2:1 contrast on white (the old light partners such
    as #dbdb8d were as low as 1.45); twelve cases still get twelve distinct colour-and-marker styles."""

    def contrast_on_white(color: str) -> float:
        r, g, b = (c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in mcolors.to_rgb(color))
        return 1.05 / (0.2126 * r + 0.7152 * g + 0.0722 * b + 0.05)

    assert all(contrast_on_white(c) >= 2.0 for c in PALETTE), [round(contrast_on_white(c), 2) for c in PALETTE]
    names = [f"zero{s}_{o}_{a}" for s in (1, 2, 3) for o in ("none", "cpu") for a in ("ppo", "grpo")]
    styles = case_styles(names)
    assert len(set(styles.values())) == 12
    assert sum(marker == "" for _, marker in styles.values()) == len(PALETTE)  # markers only past the colours


def test_case_colour_follows_its_name_not_its_position() -> None:
    names = [c.name for c in SIX_CASES]
    assert case_styles(names) == case_styles(names[::-1])
    assert len({color for color, _ in case_styles(names).values()}) == 6


def test_overlay_legend_names_cases_once_and_roots_shortened(tmp_path: Path) -> None:
    a = make_run_root(tmp_path, SIX_CASES[:2], steps=4, name="six-case_4_seed7777_20261121_120000")
    b = make_run_root(tmp_path, SIX_CASES[:2], steps=4, name="six-case_4_seed7777_20261122_093000")
    res = zbench("plot", "--run-root", a, "--run-root", b)
    assert res.returncode == 0, res.stderr
    labels = [t.get_text() for t in figure(a, b).legends[0].get_texts()]
    assert labels == ["zero0", "zero1", "run 20261121_120000", "run 20261122_093000"]
    single = [t.get_text() for t in figure(a).legends[0].get_texts()]
    assert single == ["zero0", "zero1"]


def test_short_root_names() -> None:
    assert short_root_names(["h200x2-six-case-vllm-20261122", "h200x2-six-case-maskless-20261122"]) == \
        {"h200x2-six-case-vllm-20261122": "vllm", "h200x2-six-case-maskless-20261122": "maskless"}
    # one name the start of the other: the last shared word stays so that neither is empty
    assert short_root_names(["run-a", "run-a-b"]) == {"run-a": "a", "run-a-b": "a-b"}
    long = short_root_names(["x_" + "a" * 40, "x_" + "b" * 40])
    assert all(len(v) == 28 and "…" in v for v in long.values())


def test_legend_gives_the_status_of_a_case_that_stopped(tmp_path: Path) -> None:
    root = make_run_root(tmp_path, (SIX_CASES[0], FakeCase("zero3", 3, status="oom", stop_step=2)), steps=4)
    labels = [t.get_text() for t in figure(root).legends[0].get_texts()]
    assert labels == ["zero0", "zero3 (oom at step 2)"]


def test_smooth_draws_a_rolling_mean_over_the_raw_score(tmp_path: Path) -> None:
    root = make_run_root(tmp_path, SIX_CASES[:1], steps=12)
    res = zbench("plot", "--run-root", root, "--smooth", 4)
    assert res.returncode == 0, res.stderr
    tsv = pd.read_csv(root / "zero_six_curves_metrics.tsv", sep="\t")
    raw = tsv["critic/score/mean"]
    fig = figure(root, smooth=4)
    score, loss = fig.axes[2], fig.axes[3]
    assert "rolling mean over 4 steps" in score.get_title()
    faint, mean = score.lines
    assert faint.get_alpha() == 0.25 and list(faint.get_ydata()) == raw.tolist()  # the TSV keeps raw values
    assert list(mean.get_ydata()) == raw.rolling(4, min_periods=1).mean().tolist()
    assert len(loss.lines) == 1 and "rolling" not in loss.get_title()  # only the spec's `smooth` panels
    bad = zbench("plot", "--run-root", root, "--smooth", 0)
    assert bad.returncode == 2 and "--smooth" in bad.stderr and "Traceback" not in bad.stderr


def test_phase_bars_follow_the_pipeline_with_readable_names(tmp_path: Path) -> None:
    root = make_run_root(tmp_path, SIX_CASES[:2], steps=4)
    for metrics in root.glob("*/metrics.jsonl"):  # keys sorted, as the engine records them
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        metrics.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    columns = list(phase_times(load_run_root(root), load_spec("report")).columns)
    assert columns == ["generate", "actor log-probs", "reference log-probs", "critic values", "advantages",
                       "critic update", "actor update", "weights to rollout"]
    res = zbench("report", "--run-root", root)
    assert res.returncode == 0, res.stderr
    assert Image.open(root / "phase_times.png").size[0] > 500


def test_a_critic_update_beside_the_actor_stacks_only_its_exposed_part(tmp_path: Path) -> None:
    """A case whose critic updated beside the actor (`trainer.critic_update` concurrent records `critic_wait`) shows
    that wait in its bar, not the critic's whole time, so the bar adds up to its step; a serial case is unchanged."""
    root = make_run_root(tmp_path, SIX_CASES[:2], steps=4)
    metrics = root / SIX_CASES[1].name / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    metrics.write_text("".join(json.dumps({**r, "timing_s/critic_wait": 0.01}) + "\n" for r in rows))
    table = phase_times(load_run_root(root), load_spec("report"))
    serial, concurrent = table.loc[SIX_CASES[0].name], table.loc[SIX_CASES[1].name]
    assert serial["critic update"] > 0 and serial["critic update, not overlapped"] == 0
    assert concurrent["critic update"] == 0 and concurrent["critic update, not overlapped"] == 0.01
    assert list(table.columns).index("critic update, not overlapped") == list(table.columns).index("critic update") + 1


def test_report_gives_the_phase_bars_as_numbers_and_the_rollout_engines_spread(tmp_path: Path) -> None:
    """report.md's phase table: the bars' mean seconds; "–" for a phase a case did not run (not 0 s); a critic update
    run beside the actor's with its own time and its exposed part (the bar stacks only the latter); the rollout
    engine's median and range over the same steps where a case recorded it, "not recorded" where it did not."""
    root = make_run_root(tmp_path, SIX_CASES[:2], steps=5)
    first, second = (root / c.name / "metrics.jsonl" for c in SIX_CASES[:2])
    rows = [json.loads(line) for line in first.read_text().splitlines()]
    engine = {2: 1.2, 3: 1.9, 4: 1.5, 5: 1.3}  # step 1 is warm-up: left out, as from the means
    first.write_text("".join(json.dumps({**r, "perf/rollout_engine_s": engine.get(r["step"], 40.0),
                                         "timing_s/critic_wait": 0.01}) + "\n" for r in rows))
    other = [json.loads(line) for line in second.read_text().splitlines()]
    second.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "timing_s/values"}) + "\n"
                              for r in other))
    run, spec = load_run_root(root), load_spec("report")
    table = phase_table(run, spec).set_index("case")
    steady = [r for r in rows if r["step"] >= 2]
    a, b = table.loc[SIX_CASES[0].name], table.loc[SIX_CASES[1].name]
    assert a["generate (s)"] == pytest.approx(sum(r["timing_s/gen"] for r in steady) / len(steady))
    assert a["critic update (s)"] == pytest.approx(sum(r["timing_s/update_critic"] for r in steady) / len(steady))
    assert a["critic update, not overlapped (s)"] == pytest.approx(0.01)
    assert phase_times(run, spec).loc[SIX_CASES[0].name, "critic update"] == 0  # the bar: the exposed part only
    assert a[ENGINE_COLUMN] == "1.4 (1.2–1.9), 4 steps"
    assert b[ENGINE_COLUMN] == "not recorded"
    assert pd.isna(b["critic values (s)"]) and pd.isna(b["critic update, not overlapped (s)"])
    res = zbench("report", "--run-root", root)
    assert res.returncode == 0, res.stderr
    md = (root / "report.md").read_text()
    section = md.split("## Phase times")[1].split("\n## ")[0]
    row = next(line for line in section.splitlines() if line.startswith(f"| {SIX_CASES[1].name} |"))
    assert "not recorded" in row and "| – |" in row
    assert "1.4 (1.2–1.9), 4 steps" in section and "1.4 (1.2–1.9), 4 steps" in (root / "report.html").read_text()


def test_report_gives_one_steady_step_of_the_rollout_engine_without_a_range(tmp_path: Path) -> None:
    """A case cut short after its first steady step (an interrupted run) has one rollout engine time: the table gives
    it as one step, not as a median with a range of one value."""
    root = make_run_root(tmp_path, SIX_CASES[:1], steps=2)
    metrics = root / SIX_CASES[0].name / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    metrics.write_text("".join(json.dumps({**r, "perf/rollout_engine_s": 40.0 if r["step"] == 1 else 1.89}) + "\n"
                               for r in rows))
    table = phase_table(load_run_root(root), load_spec("report")).set_index("case")
    assert table.loc[SIX_CASES[0].name, ENGINE_COLUMN] == "1.89, 1 step"


def test_report_says_how_each_rollout_ran_from_its_result_json(tmp_path: Path) -> None:
    """report.md's rollout table, from each case's result.json as the engine writes it: the graph loop's attention,
    its kernels' switches each named on or off (in result.json's order), its steps a replay, its draw, KV cache and
    prefill;
    "–" for a field of another engine; "not recorded" for one the case's zbench did not write; a case without
    result.json says so."""
    from zbench.runroot.casedir import write_result

    cases = SIX_CASES[:4]
    root = make_run_root(tmp_path, cases, steps=3)
    graph = {"rollout_engine": "hf-graph", "graph_decode_attention": "triton", "graph_sampling": "in-graph",
             "graph_kv_cache": "unmapped", "graph_steps_per_graph": 1, "graph_prefill": "compiled",
             "graph_decode_kernels": {"dense": True, "one_grid": True, "pdl": True, "inductor_pdl": False}}
    write_result(root / cases[0].name, graph)
    write_result(root / cases[1].name, {k: v for k, v in graph.items() if k != "graph_decode_kernels"})  # older
    write_result(root / cases[2].name, {"rollout_engine": "vllm", "vllm_model_runner": "v2"})
    (root / cases[3].name / "result.json").unlink(missing_ok=True)
    res = zbench("report", "--run-root", root)
    assert res.returncode == 0, res.stderr
    section = (root / "report.md").read_text().split("## Rollout as it ran (result.json)")[1]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in section.splitlines() if line.startswith("| zero")}
    assert ("| hf-graph | – | triton | dense on, inductor_pdl off, one_grid on, pdl on | 1 | in-graph | unmapped | "
            "compiled |") in rows[cases[0].name]
    assert "| triton | not recorded | 1 |" in rows[cases[1].name]
    assert "| vllm | v2 | – | – | – | – | – | – |" in rows[cases[2].name]
    assert "no result.json (the case did not finish)" in rows[cases[3].name]
    assert "Rollout as it ran" in (root / "report.html").read_text()
