"""Typer command functions of the analysis commands (registered by zbench.cli): plot, report, compare,
parity, estimate. Each parses, calls one function, prints."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from zbench.runread import RunRootError


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def plot(
    run_root: Annotated[list[Path], typer.Option("--run-root", help="Run root; repeat to overlay runs.")],
    summary: Annotated[Path | None, typer.Option(help="Summary TSV to use instead of <run-root>/summary.tsv.")] = None,
    output: Annotated[Path | None, typer.Option(help="PNG path (default <matrix>_curves.png in the run root).")] = None,
    metrics_tsv: Annotated[Path | None, typer.Option(help="Metrics TSV path (default beside the PNG).")] = None,
    max_step: Annotated[int | None, typer.Option(help="Plot steps up to N only.")] = None,
    spec: Annotated[str, typer.Option(help="Plot spec: a name in analysis/ or a YAML path.")] = "plot",
) -> None:
    """Draw memory, throughput, score and loss curves of every case (2×2 PNG) and write their TSV."""
    from zbench.curves import plot_curves

    try:
        result = plot_curves(run_root, summary, output, metrics_tsv, max_step, spec)
    except RunRootError as e:
        raise _fail(str(e)) from None
    for w in result.warnings:
        typer.echo(f"warning: {w}", err=True)
    typer.echo(f"wrote {result.png}\nwrote {result.tsv}")


def report(
    run_root: Annotated[Path, typer.Option("--run-root", help="Run root to report on.")],
    floors: Annotated[Path | None, typer.Option(
        help="`zbench bench floor` JSON lines to set the training phases against (default <run-root>/floors.jsonl)."
    )] = None,
    summary: Annotated[Path | None, typer.Option(
        help="Summary TSV to use instead of <run-root>/summary.tsv (e.g. summary_complete.tsv from zbench merge)."
    )] = None,
) -> None:
    """Write report.md and a self-contained report.html into the run root."""
    from zbench.report import write_report

    if floors is not None and not floors.is_file():
        raise _fail(f"--floors: {floors} does not exist; give a file of `zbench bench floor` output lines")
    try:
        result = write_report(run_root, floors=floors, summary=summary)
    except (RunRootError, ValueError) as e:
        raise _fail(str(e)) from None
    for w in result.warnings:
        typer.echo(f"warning: {w}", err=True)
    typer.echo(f"wrote {result.markdown}\nwrote {result.html}")


def _verdict(problems: list, label: str, ok: str, failed: bool = False) -> None:
    """A gate's ending: each problem on stderr and exit 1 (also when `failed` already), or the all-clear line."""
    for p in problems:
        typer.echo(f"{label} {p}", err=True)
    if problems or failed:
        raise typer.Exit(1)
    typer.echo(ok)


def compare(
    base: Annotated[Path, typer.Argument(help="Baseline run root or summary TSV.")],
    new: Annotated[Path, typer.Argument(help="New run root or summary TSV.")],
    fail_on: Annotated[str | None, typer.Option(
        help="Thresholds 'metric:rule,...', e.g. 'perf/throughput:-5%,score_last:-0.05' (default: analysis spec).")
    ] = None,
    fmt: Annotated[str, typer.Option("--format", help="text (a table), md (Markdown, for a PR) or json (for CI).")
                   ] = "text",
    force: Annotated[bool, typer.Option(help="Compare runs of different matrices or algorithms anyway.")] = False,
) -> None:
    """Case-by-case deltas of two runs; exit 1 when a threshold is crossed, a gated figure is recorded on one side
    only, or a case is missing/failed in NEW."""
    from zbench.compare import FORMATS, compare_sources, render

    if fmt not in FORMATS:
        raise _fail(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
    try:
        result = compare_sources(base, new, fail_on, force)
    except (RunRootError, ValueError) as e:
        raise _fail(str(e)) from None
    typer.echo(render(result, fmt))
    for f in result.failures:
        typer.echo(f"FAIL {f}", err=True)
    if result.failures:
        raise typer.Exit(1)
    if fmt == "text":
        typer.echo("OK: no threshold crossed")


def parity(
    run_root: Annotated[Path, typer.Argument(help="Run root whose cases share a seed.")],
    step: Annotated[int, typer.Option(help="Step whose metrics are compared.")] = 1,
    rtol: Annotated[float | None, typer.Option(help="Relative tolerance (default per device, analysis spec).")] = None,
    atol: Annotated[float | None, typer.Option(help="Absolute tolerance (default per device, analysis spec).")] = None,
) -> None:
    """Check that step-K math metrics agree across the cases of one algorithm; exit 1 naming any that diverge."""
    from zbench.parity import check_parity

    try:
        result = check_parity(run_root, step, rtol, atol)
    except RunRootError as e:
        raise _fail(str(e)) from None
    for s in result.skipped:
        typer.echo(f"skipped {s}", err=True)
    groups = "; ".join(f"{algo}: {', '.join(names)}" for algo, names in result.groups.items())
    typer.echo(f"step {result.step}, rtol {result.rtol:g}, atol {result.atol:g}; {groups}; "
               f"{result.compared} values compared")
    for u in result.unchecked:
        typer.echo(f"CANNOT CHECK {u}", err=True)
    _verdict(result.mismatches, "DIVERGES", "OK: all cases agree", failed=bool(result.unchecked))


def estimate(
    matrix: Annotated[str | None, typer.Argument(help="Matrix name or YAML path.")] = None,
    run_root: Annotated[Path | None, typer.Option("--run-root", help="Estimate the cases of a run root.")] = None,
) -> None:
    """Predict per-rank model-state memory of each case (GPU and CPU) from the ZeRO formulas."""
    from zbench.memory import GIB, estimate_case
    from zbench.runread import load_run_root, read_case_config

    if (matrix is None) == (run_root is None):
        raise _fail("give either a MATRIX or --run-root")
    try:
        if run_root is not None:
            run = load_run_root(run_root)
            configs = [(read_case_config(c.dir), c.dir) for c in run.cases]
        else:
            from zbench.matrix import expand, load_matrix

            configs = [(dataclasses.asdict(c.config) | {"name": c.name}, None)
                       for c in expand(load_matrix(matrix))]
        estimates = [estimate_case(cfg, base_dir=d) for cfg, d in configs]
    except (RunRootError, ValueError) as e:
        raise _fail(str(e)) from None
    typer.echo(f"{'case':<28}{'algo':>5}{'stage':>6} {'offload':<17}{'ranks':>6}{'params':>12}"
               f"{'GPU GB/rank':>13}{'CPU GB/rank':>13}{'NVMe GB/rank':>14}")
    for e in estimates:
        typer.echo(f"{e.case:<28}{e.algorithm:>5}{e.stage:>6} {e.offload_effective:<17}{e.world_size:>6}"
                   f"{e.n_params:>12,}{e.gpu_bytes / GIB:>13.3f}{e.cpu_bytes / GIB:>13.3f}{e.nvme_bytes / GIB:>14.3f}")
