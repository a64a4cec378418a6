"""plot, report, compare, parity and estimate through Typer's CliRunner on contract-shaped run roots."""

from __future__ import annotations

import json
import shutil
import subprocess

import pandas as pd
import pytest
import typer
from PIL import Image
from test_analysis_runroot import SIX_CASES, FakeCase, make_run_root, read_rows, write_summary
from typer.testing import CliRunner

from zbench import cli_analysis
from zbench.config import load_case_config

app = typer.Typer()
for fn in (cli_analysis.plot, cli_analysis.report, cli_analysis.compare, cli_analysis.parity,
           cli_analysis.estimate):
    app.command()(fn)


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_plot_defaults_and_metrics_tsv(tmp_path):
    cases = (FakeCase("zero0", 0, status="oom", stop_step=4), *SIX_CASES[1:])
    root = make_run_root(tmp_path, cases, steps=10, device="cuda")
    r = invoke("plot", root)
    assert r.exit_code == 0, r.output
    png, tsv = root / "zero_six_curves.png", root / "zero_six_curves_metrics.tsv"
    assert Image.open(png).size[0] > 1000
    df = pd.read_csv(tsv, sep="\t")
    assert list(df.columns[:5]) == ["run_root", "case", "algorithm", "status", "step"]
    assert "perf/max_memory_reserved_gb" in df.columns and "critic/vf_loss" in df.columns
    assert len(df) == 4 + 5 * 10 and df[df.case == "zero0"].step.max() == 4


def test_plot_cpu_fallback_overlay_and_max_step(tmp_path):
    a = make_run_root(tmp_path, SIX_CASES[:2], steps=6, matrix="grpo-six", name="before")
    b = make_run_root(tmp_path, SIX_CASES[:2], steps=6, matrix="grpo-six", name="after")
    r = invoke("plot", a, b, "--max-step", 3)
    assert r.exit_code == 0, r.output
    df = pd.read_csv(a / "grpo-six_overlay_curves_metrics.tsv", sep="\t")
    assert "perf/cpu_memory_used_gb" in df.columns and "perf/max_memory_reserved_gb" not in df.columns
    assert set(df.run_root) == {"before", "after"} and df.step.max() == 3


def test_plot_memory_panel_prefers_the_whole_device_figure(tmp_path):
    """GPU runs draw the device-wide memory in use where recorded, else torch's reserved peak (runs before the
    device-wide figure existed); CPU runs fall through to CPU memory (test above)."""
    old = make_run_root(tmp_path, SIX_CASES[:2], steps=3, device="cuda", name="old")
    assert invoke("plot", old).exit_code == 0
    df = pd.read_csv(next(old.glob("*_curves_metrics.tsv")), sep="\t")
    assert "perf/max_memory_reserved_gb" in df.columns and "perf/device_memory_used_gb" not in df.columns
    new = make_run_root(tmp_path, SIX_CASES[:2], steps=3, device="cuda", name="new")
    metrics = new / SIX_CASES[0].name / "metrics.jsonl"  # one case is enough for the panel to be drawn
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    metrics.write_text("".join(json.dumps({**r, "perf/device_memory_used_gb": 40.0 + r["step"]}) + "\n" for r in rows))
    r = invoke("plot", new)
    assert r.exit_code == 0, r.output
    df = pd.read_csv(next(new.glob("*_curves_metrics.tsv")), sep="\t")
    assert "perf/device_memory_used_gb" in df.columns and "perf/max_memory_reserved_gb" not in df.columns
    assert df[df.case == SIX_CASES[0].name]["perf/device_memory_used_gb"].tolist() == [41.0, 42.0, 43.0]
    warning = " ".join(r.output.split())  # the console wraps long lines
    assert f"no perf/device_memory_used_gb for {SIX_CASES[1].name}; drawn for the other cases only" in warning


def test_plot_errors_are_clear(tmp_path):
    (tmp_path / "empty").mkdir()
    r = invoke("plot", tmp_path / "empty")
    assert r.exit_code == 2 and "is empty" in r.output
    root = make_run_root(tmp_path, steps=2)
    cols = tuple(c for c in read_rows(root / "summary.tsv")[0] if c != "status")
    write_summary(root / "summary.tsv", read_rows(root / "summary.tsv"), cols)
    r = invoke("plot", root)
    assert r.exit_code == 2 and "missing summary column(s) status" in r.output


def test_compare_passes_then_fails_on_doctored_copy(tmp_path):
    base = make_run_root(tmp_path, steps=5, name="base")
    new = tmp_path / "new"
    shutil.copytree(base, new)
    assert invoke("compare", base, new).exit_code == 0
    rows = read_rows(new / "summary.tsv")
    rows[1]["throughput_mean"] = str(float(rows[1]["throughput_mean"]) * 0.9)
    rows[2] |= {"status": "oom", "reason": "CUDA out of memory"}
    write_summary(new / "summary.tsv", rows[:-1])
    r = invoke("compare", base, new / "summary.tsv", "--fail-on", "perf/throughput:-5%,score_last:-0.05")
    assert r.exit_code == 1
    assert "zero1: throughput_mean" in r.output and "crosses throughput_mean:-5%" in r.output
    assert "zero2: oom in NEW" in r.output and "zero3_cpu_offload: missing in NEW" in r.output
    assert invoke("compare", base, new, "--fail-on", "bogus:-5%").exit_code == 2


def test_compare_gates_the_whole_device_memory_by_default(tmp_path):
    """The default gates include the device-wide GPU memory (+10%); summaries without it (CPU runs, older runs)
    pass that gate untouched."""
    base = make_run_root(tmp_path, steps=3, device="cuda", name="base")
    assert invoke("compare", base, base).exit_code == 0  # no device-wide figure on either side
    rows = read_rows(base / "summary.tsv")
    columns = tuple(rows[0])
    write_summary(base / "summary.tsv", [{**r, "device_memory_used_gb": "40.0"} for r in rows], columns)
    new = tmp_path / "new"
    shutil.copytree(base, new)
    write_summary(new / "summary.tsv", [{**r, "device_memory_used_gb": "40.0" if i else "45.0"}
                                        for i, r in enumerate(rows)], columns)
    r = invoke("compare", base, new)
    assert r.exit_code == 1
    assert f"{rows[0]['case']}: device_memory_used_gb 40 -> 45 crosses device_memory_used_gb:+10%" in r.output


def test_parity_detects_divergence(tmp_path):
    root = make_run_root(tmp_path, (*SIX_CASES[:3], FakeCase("grpo_zero1", 1, algorithm="grpo")), steps=2)
    r = invoke("parity", root)
    assert r.exit_code == 0 and "ppo: zero0, zero1, zero2; grpo: grpo_zero1" in r.output
    path = root / "zero2" / "metrics.jsonl"
    text = path.read_text().splitlines()
    rec = json.loads(text[0])
    rec["actor/pg_loss"] += 0.5
    rec["timing_s/gen"] += 9  # timing never counts
    path.write_text("\n".join([json.dumps(rec), *text[1:]]) + "\n")
    r = invoke("parity", root, "--step", 1)
    assert r.exit_code == 1 and "zero2: actor/pg_loss" in r.output and "zero0 has" in r.output
    assert "timing" not in r.output


def test_estimate_run_root(tmp_path):
    root = make_run_root(tmp_path, SIX_CASES[:2], steps=1, model="qwen3-0.6b")
    r = invoke("estimate", root)
    assert r.exit_code == 0 and "596,049,920" in r.output
    assert invoke("estimate").exit_code == 2


def test_report_renders_in_headless_chromium(tmp_path):
    root = make_run_root(tmp_path, (FakeCase("zero0", 0, status="oom", stop_step=3), *SIX_CASES[1:]),
                         steps=8, device="cuda")
    r = invoke("report", root)
    assert r.exit_code == 0, r.output
    md, page = (root / "report.md").read_text(), (root / "report.html").read_text()
    assert "baseline: zero1" in md and "| zero0 | oom | 3/8 |" in md
    assert page.count("data:image/png;base64,") == 2 and "src=\"http" not in page
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.skip("chromium not installed")
    shot = tmp_path / "shot.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--no-first-run", f"--screenshot={shot}",
                    "--window-size=1400,2000", (root / "report.html").as_uri()], check=True, timeout=120,
                   capture_output=True)
    img = Image.open(shot).convert("L")
    assert img.size == (1400, 2000) and img.getextrema()[0] < 50  # rendered dark text, not a blank page


def test_report_without_completed_case(tmp_path):
    root = make_run_root(tmp_path, (FakeCase("zero0", 0, status="failed", stop_step=1),), steps=2)
    r = invoke("report", root)
    assert r.exit_code == 2 and "no completed case (zero0=failed)" in r.output


def test_report_with_a_case_interrupted_before_its_first_step(tmp_path):
    """A matrix stopped while its second case started: the summary (as the harness writes it) leaves that case's
    step count empty, and the report shows it as 0 steps beside the completed one."""
    from zbench.runroot.root import RunRoot

    root = make_run_root(tmp_path, (FakeCase("zero1", 1), FakeCase("zero2", 2, status="interrupted", stop_step=0)),
                         steps=4, device="cuda")
    RunRoot.open(root).write_summary()
    assert read_rows(root / "summary.tsv")[1]["steps_completed"] == ""
    r = invoke("report", root)
    assert r.exit_code == 0, r.output
    md = (root / "report.md").read_text()
    assert "| zero2 | interrupted | 0/4 |" in md and "| zero1 | completed | 4/4 |" in md


def test_report_sets_training_phases_against_bare_deepspeed_floors(tmp_path):
    root = make_run_root(tmp_path, steps=6, device="cuda")
    floor = {"model": "qwen3-0.6b", "stage": 2, "offload": "none", "seqs": 128, "seq_len": 690, "micro": 8,
             "world_size": 2, "tokens_per_s_per_gpu": 12345.0, "step_s_median": 3.3}
    floors = tmp_path / "floors.jsonl"
    floors.write_text(json.dumps(floor) + "\nnot json\n")
    r = invoke("report", root, "--floors", floors)
    assert r.exit_code == 0, r.output
    assert "floors.jsonl:2: not a `zbench bench floor` record; skipped" in r.output
    md = (root / "report.md").read_text()
    section = md.split("## Training phases")[1].split("## Memory")[0]
    lines = [line.strip("| ").split(" | ") for line in section.splitlines() if line.startswith("| ")]
    rows = {cells[0]: dict(zip(lines[0], cells, strict=True)) for cells in lines[1:]}
    # the actor update's rate, recomputed from the case's own metrics (steps 2.., 2 ranks, 1 epoch)
    m = pd.read_json(root / "zero2" / "metrics.jsonl", lines=True).set_index("step").loc[2:]
    actor = (m["perf/total_num_tokens"] / (m["timing_s/update_actor"] * 2)).mean()
    zero2 = rows["zero2"]
    assert zero2["update_actor (tok/s/GPU)"] == f"{actor:,.0f}"
    assert zero2["bare DeepSpeed (tok/s/GPU)"] == "12,345"
    assert zero2["floor shape (seqs × tokens per GPU)"] == "128 × 690"
    assert zero2["actor update: floor ÷ measured"] == f"{12345.0 / actor:.3g}"
    critic = (m["perf/total_num_tokens"] / (m["timing_s/update_critic"] * 2)).mean()
    assert zero2["critic update: floor ÷ measured"] == f"{12345.0 / critic:.3g}"
    assert set(zero2) >= {"old_log_prob (tok/s/GPU)", "values (tok/s/GPU)", "update_critic (tok/s/GPU)"}
    assert rows["zero3"]["bare DeepSpeed (tok/s/GPU)"] == "–"  # no floor measured for that stage
    assert "no value-head floor was measured" in md
    # with a floor of the critic's own model, the critic is set against it instead
    floors.write_text(json.dumps(floor) + "\n" + json.dumps({**floor, "head": "value", "tokens_per_s_per_gpu": 23456.0})
                      + "\n")
    assert invoke("report", root, "--floors", floors, "--force").exit_code == 0
    md = (root / "report.md").read_text()
    section = md.split("## Training phases")[1].split("## Memory")[0]
    lines = [line.strip("| ").split(" | ") for line in section.splitlines() if line.startswith("| ")]
    zero2 = {cells[0]: dict(zip(lines[0], cells, strict=True)) for cells in lines[1:]}["zero2"]
    assert zero2["bare DeepSpeed, value head (tok/s/GPU)"] == "23,456"
    assert zero2["critic update: floor ÷ measured"] == f"{23456.0 / critic:.3g}"
    assert zero2["actor update: floor ÷ measured"] == f"{12345.0 / actor:.3g}"
    assert "no value-head floor was measured" not in md
    # a case whose critic is still set against the LM floor (no value-head floor for its stage) brings the note back
    floors.write_text("".join(json.dumps(f) + "\n" for f in (
        floor, {**floor, "head": "value", "tokens_per_s_per_gpu": 23456.0}, {**floor, "stage": 3})))
    assert invoke("report", root, "--floors", floors, "--force").exit_code == 0
    assert "no value-head floor was measured" in (root / "report.md").read_text()
    # a floor run with the case's own model code wins over a later, faster one with the other: these cases ran
    # with `model.fused_ops` on (the default their config.yaml records)
    floors.write_text("".join(json.dumps(f) + "\n" for f in (
        {**floor, "fused_ops": True, "tokens_per_s_per_gpu": 11111.0}, {**floor, "fused_ops": False})))
    assert invoke("report", root, "--floors", floors, "--force").exit_code == 0
    assert "| 11,111 |" in (root / "report.md").read_text().split("## Training phases")[1].split("## Memory")[0]
    # likewise one run with the case's own gradient reduction (these cases: per micro-batch, `coalesce` false; a
    # floor recorded before the field reads as false) over a faster coalesced one
    floors.write_text("".join(json.dumps(f) + "\n" for f in (
        {**floor, "fused_ops": True, "tokens_per_s_per_gpu": 11111.0},
        {**floor, "fused_ops": True, "coalesce": True, "tokens_per_s_per_gpu": 22222.0})))
    assert invoke("report", root, "--floors", floors, "--force").exit_code == 0
    assert "| 11,111 |" in (root / "report.md").read_text().split("## Training phases")[1].split("## Memory")[0]
    # repeats of one floor: the fastest is the floor, whichever came last
    floors.write_text("".join(json.dumps({**floor, "fused_ops": True, "tokens_per_s_per_gpu": rate}) + "\n"
                              for rate in (11111.0, 13579.0, 12000.0)))
    assert invoke("report", root, "--floors", floors, "--force").exit_code == 0
    assert "| 13,579 |" in (root / "report.md").read_text().split("## Training phases")[1].split("## Memory")[0]
    # a floor that ran out of memory (`zbench bench floor` records it as such): said so, and nothing set against it;
    # a measured floor of the same stage still wins over it
    oom = {k: v for k, v in floor.items() if k not in ("tokens_per_s_per_gpu", "step_s_median")}
    floors.write_text(json.dumps({**oom, "micro": 64, "status": "oom", "error": "torch.OutOfMemoryError: CUDA out "
                                  "of memory. Tried to allocate 24.74 GiB."}) + "\n")
    r = invoke("report", root, "--floors", floors, "--force")
    assert r.exit_code == 0 and "not a `zbench bench floor` record" not in r.output, r.output
    section = (root / "report.md").read_text().split("## Training phases")[1].split("## Memory")[0]
    lines = [line.strip("| ").split(" | ") for line in section.splitlines() if line.startswith("| ")]
    zero2 = {cells[0]: dict(zip(lines[0], cells, strict=True)) for cells in lines[1:]}["zero2"]
    assert zero2["bare DeepSpeed (tok/s/GPU)"] == "out of memory at micro 64"
    assert not any("floor ÷ measured" in column for column in zero2)
    floors.write_text(json.dumps({**oom, "micro": 64, "status": "oom", "error": "x"}) + "\n" + json.dumps(floor) + "\n")
    assert invoke("report", root, "--floors", floors, "--force").exit_code == 0
    assert "| 12,345 |" in (root / "report.md").read_text().split("## Training phases")[1].split("## Memory")[0]
    # measured again at a smaller micro-batch in place of the one that ran out of memory: set against, and said so
    floors.write_text(json.dumps({**oom, "micro": 64, "status": "oom", "error": "x"}) + "\n"
                      + json.dumps({**floor, "micro": 32, "asked_micro": 64}) + "\n")
    assert invoke("report", root, "--floors", floors, "--force").exit_code == 0
    section = (root / "report.md").read_text().split("## Training phases")[1].split("## Memory")[0]
    lines = [line.strip("| ").split(" | ") for line in section.splitlines() if line.startswith("| ")]
    zero2 = {cells[0]: dict(zip(lines[0], cells, strict=True)) for cells in lines[1:]}["zero2"]
    assert zero2["bare DeepSpeed (tok/s/GPU)"] == "12,345"
    assert zero2["floor shape (seqs × tokens per GPU)"] == "128 × 690, micro 32 (64: out of memory)"
    assert zero2["actor update: floor ÷ measured"] == f"{12345.0 / actor:.3g}"
    # of two measured floors, the one of the case's own shape (what `--like` measures: its sequences a rank, its
    # micro-batch, its mean length) wins over a faster one of another shape, left in the file by an older run
    cfg = load_case_config(root / "zero2" / "config.yaml")
    own = {**floor, "seqs": cfg.batch_plan().mini_batch_sequences // 2, "micro": cfg.actor.micro_batch_size_per_gpu,
           "seq_len": round((m["prompt_length/mean"] + m["response_length/mean"]).mean()), "tokens_per_s_per_gpu": 2222.0}
    floors.write_text(json.dumps(own) + "\n" + json.dumps({**own, "micro": 1, "tokens_per_s_per_gpu": 99999.0}) + "\n")
    assert invoke("report", root, "--floors", floors, "--force").exit_code == 0
    assert "| 2,222 |" in (root / "report.md").read_text().split("## Training phases")[1].split("## Memory")[0]
    floors.write_text(json.dumps({**own, "seq_len": own["seq_len"] * 2, "tokens_per_s_per_gpu": 99999.0}) + "\n"
                      + json.dumps(own) + "\n")
    assert invoke("report", root, "--floors", floors, "--force").exit_code == 0
    assert "| 2,222 |" in (root / "report.md").read_text().split("## Training phases")[1].split("## Memory")[0]
    # out of memory at every micro-batch tried: the one asked is named, and how far down it was tried
    floors.write_text("".join(json.dumps({**oom, "status": "oom", "error": "x", **micro}) + "\n"
                              for micro in ({"micro": 64}, {"micro": 32, "asked_micro": 64}, {"micro": 16, "asked_micro": 64})))
    assert invoke("report", root, "--floors", floors, "--force").exit_code == 0
    section = (root / "report.md").read_text().split("## Training phases")[1].split("## Memory")[0]
    assert "| out of memory at micro 64 and down to 16 |" in section
    missing = invoke("report", root, "--floors", tmp_path / "nope.jsonl", "--force")
    assert missing.exit_code == 2 and "--floors:" in missing.output and "does not exist" in missing.output


def test_report_of_a_merged_summary_takes_reruns_from_their_own_run_root(tmp_path):
    """`--summary summary_complete.tsv`: a case rerun in another run root is reported from that root's files."""
    first = make_run_root(tmp_path, (FakeCase("zero1", 1), FakeCase("zero3", 3, status="failed", stop_step=2)),
                          steps=6, device="cuda")
    rerun = make_run_root(tmp_path, (FakeCase("zero3", 3),), steps=6, device="cuda", name="rerun")
    rows = read_rows(first / "summary.tsv")
    rows = [r for r in rows if r["case"] != "zero3"] + [{**read_rows(rerun / "summary.tsv")[0],
                                                         "case_dir": "../rerun/zero3"}]
    columns = tuple((first / "summary.tsv").read_text().splitlines()[0].split("\t"))
    write_summary(first / "summary_complete.tsv", rows, columns)
    r = invoke("report", first, "--summary", first / "summary_complete.tsv")
    assert r.exit_code == 0, r.output
    md = (first / "report.md").read_text()
    assert "| zero3 | completed | 6/6 |" in md and "| zero1 | completed | 6/6 |" in md
    own = invoke("report", first, "--force")
    assert own.exit_code == 0 and "| zero3 | failed | 2/6 |" in (first / "report.md").read_text()
