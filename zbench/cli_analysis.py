"""Typer command functions of the analysis commands (registered by zbench.cli): plot, report, compare,
parity, estimate. Each parses, calls one function, prints."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from zbench.runroot.read import RunRootError


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def _run_roots(given: list[Path] | None, legacy: list[Path] | None, command: str) -> list[Path]:
    """Run roots named as arguments; the older `--run-root` spelling still works, with a warning."""
    if given and legacy:
        raise _fail(f"give the run root(s) as arguments only: zbench {command} RUN_ROOT (drop --run-root)")
    if legacy:
        typer.echo(f"warning: --run-root is deprecated; name the run root as an argument: zbench {command} "
                   f"{' '.join(map(str, legacy))}", err=True)
    roots = list(given or legacy or [])
    if not roots:
        raise _fail(f"give a run root: zbench {command} RUN_ROOT")
    return roots


def _old_spelling(old: str, new: str) -> None:
    typer.echo(f"warning: {old} is deprecated; use {new}", err=True)


LegacyRunRoot = Annotated[list[Path] | None, typer.Option("--run-root", hidden=True,
                                                          help="Deprecated: give the run root as an argument.")]


def plot(
    run_roots: Annotated[list[Path] | None, typer.Argument(
        help="Run root(s); several overlay (before/after).", show_default=False)] = None,
    summary: Annotated[Path | None, typer.Option(help="Summary TSV to use instead of <run-root>/summary.tsv.")] = None,
    out: Annotated[Path | None, typer.Option(
        help="PNG path (default <matrix>_curves.png in the (first) run root).")] = None,
    metrics_tsv: Annotated[Path | None, typer.Option(
        help="Metrics TSV path (default beside the PNG: <PNG name>_metrics.tsv).")] = None,
    max_step: Annotated[int | None, typer.Option(min=1, help="Plot steps up to N only.")] = None,
    spec: Annotated[str, typer.Option(help="Plot spec: a name in analysis/ or a YAML path.")] = "plot",
    smooth: Annotated[int, typer.Option(min=1, help="Rolling mean over N steps on the score panel (the spec's "
                                                    "`smooth` panels), raw line faint behind; 1: none.")] = 1,
    legacy_run_root: LegacyRunRoot = None,
    legacy_output: Annotated[Path | None, typer.Option("--output", hidden=True, help="Deprecated: --out.")] = None,
) -> None:
    """Draw memory, throughput, score and loss curves of every case (2×2 PNG) and write their TSV."""
    from zbench.analyze.curves import plot_curves

    roots = _run_roots(run_roots, legacy_run_root, "plot")
    if legacy_output is not None:
        _old_spelling("--output", "--out")
    try:
        result = plot_curves(roots, summary, out or legacy_output, metrics_tsv, max_step, spec, smooth)
    except RunRootError as e:
        raise _fail(str(e)) from None
    for w in result.warnings:
        typer.echo(f"warning: {w}", err=True)
    typer.echo(f"wrote {result.png}\nwrote {result.tsv}")


def report(
    run_root: Annotated[Path | None, typer.Argument(help="Run root to report on.", show_default=False)] = None,
    out: Annotated[Path | None, typer.Option(
        help="Folder for report.md, report.html, curves.png and phase_times.png (default: the run root).")] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing report.md / report.html there.")] = False,
    floors: Annotated[Path | None, typer.Option(
        help="`zbench bench floor` JSON lines to set the training phases against (default <run-root>/floors.jsonl)."
    )] = None,
    summary: Annotated[Path | None, typer.Option(
        help="Summary TSV to use instead of <run-root>/summary.tsv (e.g. summary_complete.tsv from zbench merge)."
    )] = None,
    legacy_run_root: LegacyRunRoot = None,
) -> None:
    """Write report.md, a self-contained report.html, curves.png and phase_times.png into the run root (or --out);
    an existing report is replaced only with --force."""
    from zbench.analyze.report import write_report

    [root, *more] = _run_roots([run_root] if run_root else None, legacy_run_root, "report")
    if more:
        raise _fail("report takes one run root; to report several, merge them first (zbench merge)")
    if floors is not None and not floors.is_file():
        raise _fail(f"--floors: {floors} does not exist; give a file of `zbench bench floor` output lines")
    try:
        result = write_report(root, floors=floors, summary=summary, out_dir=out, overwrite=force)
    except (RunRootError, ValueError) as e:
        raise _fail(str(e)) from None
    for w in result.warnings:
        typer.echo(f"warning: {w}", err=True)
    typer.echo("\n".join(f"wrote {p}" for p in result.written))


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
    from zbench.analyze.compare import FORMATS, compare_sources, render

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
    step: Annotated[int, typer.Option(min=1, help="Step whose metrics are compared.")] = 1,
    rtol: Annotated[float | None, typer.Option(min=0.0, help="Relative tolerance (default per device, analysis spec).")
                    ] = None,
    atol: Annotated[float | None, typer.Option(min=0.0, help="Absolute tolerance (default per device, analysis spec).")
                    ] = None,
) -> None:
    """Check that step-K math metrics agree across the cases of one algorithm; exit 1 naming any that diverge."""
    from zbench.analyze.parity import check_parity

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
    target: Annotated[str | None, typer.Argument(
        help="A run root (the cases it ran), or a matrix name or YAML file (its cases, run on this machine).",
        show_default=False)] = None,
    legacy_run_root: LegacyRunRoot = None,
) -> None:
    """Predict per-rank model-state memory of each case (GPU and CPU) from the ZeRO formulas, with parameters
    counted by transformers from the model's own config, in the precision the engine trains in."""
    from zbench.analyze.memory import GIB, estimate_target
    from zbench.config import ConfigError

    if target is not None and legacy_run_root:
        raise _fail("give a run root or a matrix as the argument only (drop --run-root)")
    if target is None:
        target = str(_run_roots(None, legacy_run_root, "estimate")[0]) if legacy_run_root else None
    if target is None:
        raise _fail("give a run root, a shipped matrix name (zbench matrices) or a matrix YAML file: "
                    "zbench estimate TARGET")
    try:
        estimates = estimate_target(target)
    except (RunRootError, ConfigError, ValueError) as e:
        raise _fail(str(e)) from None
    width = max(len(e.case) for e in estimates) + 2
    typer.echo(f"{'case':<{width}}{'algo':>5}{'stage':>6} {'offload':<24}{'ranks':>6}{'precision':>10}{'params':>14}"
               f"{'device GB/rank':>16}{'host GB/rank':>14}{'NVMe GB/rank':>14}")
    for e in estimates:
        typer.echo(f"{e.case:<{width}}{e.algorithm:>5}{e.stage:>6} {e.offload_effective:<24}{e.world_size:>6}"
                   f"{e.precision:>10}{e.n_params:>14,}{e.gpu_bytes / GIB:>16.3f}{e.cpu_bytes / GIB:>14.3f}"
                   f"{e.nvme_bytes / GIB:>14.3f}")
    typer.echo("model states per rank: device = the GPU (host memory when the case trains on CPU); host = states "
               "offloaded to CPU memory; precision as the engine trains (model.dtype auto: bf16 on CUDA, fp32 on CPU)")
