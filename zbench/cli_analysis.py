"""Typer command functions of the analysis commands (registered by zbench.cli): plot, report, compare,
parity, estimate. Each parses, calls one function, prints."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from zbench.config import parse_set
from zbench.runroot.read import RunRootError

# options the run-side commands (zbench.cli) share with `estimate`; defined here, the module zbench.cli imports
SetOpt = Annotated[list[str] | None, typer.Option("--set", help=(
    "Override a config key for every case: key=value (e.g. rollout.max_new_tokens=256, model.path=/models/qwen3); "
    "a key a case's name stands for (a matrix axis, e.g. zero.stage) is refused: choose cases with --cases."))]
CasesOpt = Annotated[str | None, typer.Option(help="Only cases matching these globs, comma-separated "
                                                   "(e.g. 'zero3_*,zero2_cpu_offload').")]


def parse_sets(items: list[str] | None) -> tuple[tuple[str, object], ...]:
    """`--set` values as (key, value) pairs."""
    return tuple(parse_set(i) for i in items or [])


def parse_globs(cases: str | None) -> tuple[str, ...]:
    """`--cases` as its globs."""
    return tuple(g.strip() for g in (cases or "").split(",") if g.strip())


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
    """Check that step-K math metrics agree across the cases of one algorithm (and world size, where the run has
    several: each rank samples its own responses); exit 1 naming any that diverge."""
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
    device: Annotated[str, typer.Option(
        help="A matrix's cases as they would run: auto (on this machine), cuda or cpu. A run root's cases are "
             "estimated on the device they ran on.")] = "auto",
    device_memory: Annotated[float | None, typer.Option(
        help="GB of one GPU: sizes vLLM's share where its KV cache is not fitted, and decides `fits` [this "
             "machine's GPU].", show_default=False)] = None,
    set_: SetOpt = None,
    cases: CasesOpt = None,
) -> None:
    """Predict per-rank memory of each case: model states from the ZeRO formulas (parameters counted by
    transformers from the model's own config, in the precision the engine trains in), then the largest pass's
    activations and logits and vLLM's KV cache at the case's batch geometry, their sum, and whether it fits; on a
    GPU, also the largest micro-batch that would fit without and with activation checkpointing."""
    from zbench.analyze.activations import geometry_memory, largest_fitting_micro, model_dims
    from zbench.analyze.memory import GIB, estimate_target
    from zbench.config import ConfigError

    if target is not None and legacy_run_root:
        raise _fail("give a run root or a matrix as the argument only (drop --run-root)")
    if target is None:
        target = str(_run_roots(None, legacy_run_root, "estimate")[0]) if legacy_run_root else None
    if target is None:
        raise _fail("give a run root, a shipped matrix name (zbench matrices) or a matrix YAML file: "
                    "zbench estimate TARGET")
    if device not in ("auto", "cuda", "cpu"):
        raise _fail(f"--device {device!r}: give auto, cuda or cpu")
    if device_memory is not None and device_memory <= 0:
        raise _fail(f"--device-memory {device_memory:g}: give one GPU's memory in GB, more than 0")
    gpu_bytes = int(device_memory * 2**30) if device_memory else _this_gpu_bytes()
    try:
        sets, globs = parse_sets(set_), parse_globs(cases)
        if (sets or globs) and Path(target).is_dir():
            raise _fail("--set and --cases apply to a matrix; a run root is estimated as it ran")
        targets = estimate_target(target, None if device == "auto" else device == "cuda", sets, globs)
        rows = []
        for e, cfg, cuda in targets:
            dims = model_dims(cfg.model.path)
            fit = tuple(largest_fitting_micro(cfg, ckpt, gpu_bytes, dims) for ckpt in (False, True)) \
                if cuda and gpu_bytes else None
            rows.append((e, geometry_memory(cfg, cuda, gpu_bytes, dims), cuda, fit))
    except (RunRootError, ConfigError, ValueError) as e:
        raise _fail(str(e)) from None
    width = max(len(e.case) for e, *_ in rows) + 2
    typer.echo(f"{'case':<{width}}{'algo':>5}{'stage':>6} {'offload':<24}{'ranks':>6}{'precision':>10}{'params':>15}"
               f"{'states GB':>11}{'host GB':>9}{'NVMe GB':>9}{'passes GB':>11}{'KV GB':>8}{'critic GB':>11}"
               f"{'peak GB':>9}{'fits':>6}{'fit micro':>11}{'fit ckpt':>10}")
    for e, g, cuda, fit in rows:
        fits = ("yes" if g.peak_bytes <= gpu_bytes else "no") if cuda and gpu_bytes else "?" if cuda else "-"
        plain, ckpt = (("none" if m is None else str(m)) for m in fit) if fit else ("-", "-")
        typer.echo(f"{e.case:<{width}}{e.algorithm:>5}{e.stage:>6} {e.offload_effective:<24}{e.world_size:>6}"
                   f"{e.precision:>10}{e.n_params:>15,}{e.gpu_bytes / GIB:>11.2f}{e.cpu_bytes / GIB:>9.2f}"
                   f"{e.nvme_bytes / GIB:>9.2f}{max(g.training, g.forward) / GIB:>11.2f}{(g.kv_cache + g.held_kv) / GIB:>8.2f}"
                   f"{g.critic / GIB:>11.2f}{g.peak_gb:>9.2f}{fits:>6}{plain:>11}{ckpt:>10}")
    typer.echo("per rank: states = model states on the device (host memory when the case trains on CPU); host / NVMe = "
               "states offloaded there; passes = the largest training or gradient-free micro-batch's activations and "
               "logits (upper bound: full-length sequences); KV = the rollout's cache (vLLM's, or the hf graph loop's); "
               "critic = PPO's critic's largest pass, which its process keeps cached on a GPU while the actor trains "
               "and vLLM generates; peak = states + critic + the larger of passes and KV (vLLM sleeps, its cache "
               "released, while the model trains; the graph loop's cache likewise with rollout.release_kv_cache, else it "
               "stays and adds to the peak; on CPU: the "
               "host, every rank, the critic's passes counted among the passes). "
               "precision as the engine trains (model.dtype auto: bf16 on CUDA, fp32 on CPU)")
    if any(cuda for _, _, cuda, _ in rows):
        typer.echo(f"fits: peak within {gpu_bytes / GIB:.1f} GB of one GPU; fit micro / fit ckpt: the largest "
                   "training micro-batch (forward passes the same) predicted to fit without / with activation "
                   "checkpointing, none: not even one sequence" if gpu_bytes else
                   "fits: ? (no GPU here: give --device-memory GB)")


def _this_gpu_bytes() -> int:
    """Total memory of this machine's first GPU, or 0 when it has none."""
    import torch

    return int(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else 0
