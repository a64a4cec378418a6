"""zbench command line: parse, call one function, print. Every command's logic lives in its module.

    zbench run six-case --seed 7777 --steps 60
    zbench plot results/six-case_60_seed7777_20261121_120000
    zbench merge results/<first-run> results/<rerun-of-failed-cases>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from zbench import __version__
from zbench.cli_analysis import CasesOpt, SetOpt, parse_globs, parse_sets
from zbench.config import ConfigError, dump_yaml

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Which DeepSpeed ZeRO configuration for RL post-training, and what each costs.")
data_app = typer.Typer(no_args_is_help=True, help="Prepare training prompts (verl's GSM8K parquet schema).")
app.add_typer(data_app, name="data")
bench_app = typer.Typer(no_args_is_help=True, help="Floors to measure the engine against: bare DeepSpeed, bare generate.")
app.add_typer(bench_app, name="bench")
console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # messages stay one line: greppable, copyable

def fail(message: str, code: int = 2) -> None:
    """Print an error (no traceback) and exit."""
    err_console.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(code)


def _print_version(asked: bool) -> None:
    if asked:
        print(f"zbench {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option("--version", help="Print zbench's version and exit.", is_eager=True,
                                          callback=_print_version)] = False,
) -> None:
    """Which DeepSpeed ZeRO configuration for RL post-training, and what each costs."""


@app.command()
def matrices() -> None:
    """List the shipped matrices: name, number of cases, description."""
    from zbench.harness.matrix import expand, load_matrix, shipped_matrices

    rows = []
    for name in shipped_matrices():
        m = load_matrix(name)
        rows.append([name, str(len(expand(m))), m.description])
    _print_table(["matrix", "cases", "description"], rows)


@app.command()
def show(
    matrix: Annotated[str, typer.Argument(help="A shipped matrix name or a YAML file.")],
    set_: SetOpt = None,
    seed: Annotated[int | None, typer.Option(help="Seed for every case.")] = None,
    steps: Annotated[int | None, typer.Option(help="Steps for every case.")] = None,
    cases: CasesOpt = None,
    full: Annotated[bool, typer.Option(help="Print each case's whole resolved config.yaml.")] = False,
) -> None:
    """Show the expanded cases of a matrix with their effective knobs (a table on a terminal, TSV when piped)."""
    from zbench.config import effective_offload, rollout_engine
    from zbench.harness.matrix import expand, load_matrix

    try:
        chosen = expand(load_matrix(matrix), seed=seed, steps=steps, sets=parse_sets(set_), case_globs=parse_globs(cases),
                        device_defaults=True)
    except ConfigError as err:
        fail(str(err))
    if full:
        for c in chosen:
            print(f"# --- {c.name}\n{dump_yaml(c.config)}")
        return
    rows = []
    for c in chosen:
        cfg = c.config
        eff = effective_offload(cfg.zero.stage, cfg.zero.offload).label
        rows.append([c.name, cfg.algorithm, str(cfg.zero.stage), f"{cfg.zero.offload} → {eff}", str(cfg.rollout.n),
                     str(cfg.trainer.world_size), str(cfg.trainer.train_batch_size), cfg.model.path,
                     rollout_engine(cfg, cfg.trainer.uses_cuda()),
                     ", ".join([*(f"{k}={v}" for k, v in c.overrides.items()),
                                *(f"{k}={v} (GPU default)" for k, v in c.device_defaults.items())])])
    _print_table(["case", "algorithm", "zero", "offload (asked → effective)", "n", "world", "batch", "model",
                  "rollout", "overrides"], rows)


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    """A table on a terminal; tab-separated lines, nothing cut short, when stdout is a pipe or a file."""
    if not sys.stdout.isatty():
        for row in [header, *rows]:
            print("\t".join(row))
        return
    table = Table(*header)
    for row in rows:
        table.add_row(*row)
    console.print(table)


@app.command()
def keys(markdown: Annotated[bool, typer.Option(help="Print the Markdown table of the README's reference.")] = False
         ) -> None:
    """Every config key (for --set and matrices) with its default and meaning."""
    from zbench.config import reference, reference_markdown

    if markdown:
        print(reference_markdown(), end="")
        return
    for key, default, meaning in reference():
        print(f"{key}={default}\t{meaning}")


@app.command()
def env(ray_address: Annotated[str | None, typer.Option(help="Also report this Ray cluster's status.")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Versions, GPUs, CPU, the environment variables a run records, DeepSpeed op compatibility and Ray status:
    what a bug report needs."""
    from zbench.env import environment_report

    report = environment_report(ray_address)
    if as_json:
        print(json.dumps(report, indent=2, default=str))
    else:
        for key, value in report.items():
            if isinstance(value, dict):
                console.print(f"[bold]{key}[/bold]" + ("" if value else ": none"))
                for k, v in value.items():
                    console.print(f"  {k}: {v}", highlight=False)
            else:
                console.print(f"[bold]{key}[/bold]: {value}", highlight=False)
    if "error" in report.get("ray", {}):
        fail(f"--ray-address {ray_address}: {report['ray']['error']}", code=1)


@app.command()
def run(
    matrix: Annotated[str, typer.Argument(help="A shipped matrix name (see `zbench matrices`) or a YAML file.")],
    seed: Annotated[int, typer.Option(help="Seed of every case (a matrix axis may set its own).")] = 7777,
    steps: Annotated[int, typer.Option(help="Training steps per case.")] = 60,
    set_: SetOpt = None,
    cases: CasesOpt = None,
    tag: Annotated[str | None, typer.Option(help="Run-root name prefix (default <matrix>_<steps>_seed<seed>).")] = None,
    results_dir: Annotated[str, typer.Option(help="Where run roots are created.")] = "results",
    runner: Annotated[str, typer.Option(help="Runner profile: local, ray, or a YAML file.")] = "local",
    case_timeout: Annotated[float | None, typer.Option(
        help="Kill a case after this many seconds (not retried: a second attempt would take as long).")] = None,
    step_timeout: Annotated[float | None, typer.Option(help="Kill a case when no step lands for this many "
                                                           "seconds (start-up counts as the first step).")] = 1800.0,
    retries: Annotated[int, typer.Option(help="Extra attempts for transient failures (hangs, lost workers).")] = 1,
    dry_run: Annotated[bool, typer.Option(help="Expand and validate the cases, print them, run nothing.")] = False,
) -> None:
    """Run every case of a matrix, each as its own process, into a new run root."""
    from zbench.harness.launch import RunInterrupted
    from zbench.harness.runner_profile import load_runner_profile
    from zbench.harness.runs import RunRequest, exit_code, plan_cases, run_matrix
    from zbench.runroot.casedir import RunRootError

    try:
        req = RunRequest(matrix=matrix, seed=seed, steps=steps, sets=parse_sets(set_),
                         case_globs=parse_globs(cases), tag=tag,
                         results_dir=results_dir, runner=runner, case_timeout_s=case_timeout,
                         step_timeout_s=step_timeout, retries=retries)
        if dry_run:
            for c in plan_cases(req, load_runner_profile(runner)):
                print(f"{c.name}\t" + " ".join(f"{k}={v}" for k, v in c.overrides.items()))
            return
        root, statuses = run_matrix(req, ["zbench", *sys.argv[1:]])
    except (ConfigError, RunRootError, ValueError) as err:
        fail(str(err))
    except RunInterrupted as stop:
        err_console.print(f"interrupted: summary written; continue with `zbench resume <run root>` ({stop})")
        raise typer.Exit(stop.exit_code) from None
    print(f"summary: {root.path / 'summary.tsv'}")
    raise typer.Exit(exit_code(statuses))


@app.command()
def tune(
    matrix: Annotated[str, typer.Argument(help="A shipped matrix name (see `zbench matrices`) or a YAML file.")],
    set_: SetOpt = None,
    cases: Annotated[str | None, typer.Option(help="Only cases matching these globs, comma-separated.")] = None,
    memory_budget: Annotated[float | None, typer.Option(
        help="GB a trial's peak may reach: device-wide per GPU, or the processes' RSS on CPU (default: what the "
             "device has)."
    )] = None,
    time_budget: Annotated[float | None, typer.Option(
        help="Seconds for the whole tune, shared out equally among the cases; a stopped tune still writes what "
             "it found (default: no limit).")] = None,
    steps: Annotated[int, typer.Option(help="Steps per trial: a warm-up step, then timed ones.")] = 3,
    seed: Annotated[int, typer.Option(help="Seed of every trial.")] = 7777,
    tag: Annotated[str | None, typer.Option(help="Run-root name prefix (default tune_<matrix>).")] = None,
    results_dir: Annotated[str, typer.Option(help="Where run roots are created.")] = "results",
    runner: Annotated[str, typer.Option(help="Runner profile: local, ray, or a YAML file.")] = "local",
    step_timeout: Annotated[float | None, typer.Option(help="Kill a trial when no step lands for this long.")
                            ] = 1800.0,
) -> None:
    """Find each case's fastest batch geometry within a memory budget; writes tuning.tsv and tuned.yaml (a matrix
    that `zbench run` takes)."""
    from zbench.harness.launch import RunInterrupted
    from zbench.harness.tune import TuneRequest, run_tune
    from zbench.runroot.tuning import TUNED, TUNING

    try:
        req = TuneRequest(matrix=matrix, sets=parse_sets(set_), seed=seed, steps=steps, tag=tag, results_dir=results_dir,
                          case_globs=tuple(g.strip() for g in (cases or "").split(",") if g.strip()),
                          memory_budget_gb=memory_budget, time_budget_s=time_budget, runner=runner,
                          step_timeout_s=step_timeout)
        outcome = run_tune(req, ["zbench", *sys.argv[1:]])
    except (ConfigError, ValueError) as err:
        fail(str(err))
    except RunInterrupted as stop:
        err_console.print(f"interrupted: {TUNING} and {TUNED} hold what was found ({stop})")
        raise typer.Exit(stop.exit_code) from None
    tuned = outcome.root.path / TUNED
    print(f"trials: {outcome.root.path / TUNING}")
    print(f"tuned matrix: {tuned}" if tuned.is_file() else "tuned matrix: none (no case ran within the budget)")
    if outcome.stopped:
        err_console.print(f"stopped early: {outcome.stopped}", highlight=False)
    raise typer.Exit(0 if all(t.chosen() for t in outcome.cases) and not outcome.stopped else 1)


@app.command()
def resume(
    run_root: Annotated[str, typer.Argument(help="The run root to continue.")],
    runner: Annotated[str | None, typer.Option(help="Runner profile (default: the one the run used).")] = None,
    case_timeout: Annotated[float | None, typer.Option(
        help="Kill a case after this many seconds (not retried: a second attempt would take as long).")] = None,
    step_timeout: Annotated[float | None, typer.Option(help="Kill a case when no step lands for this long.")] = 1800.0,
    retries: Annotated[int, typer.Option(help="Extra attempts for transient failures.")] = 1,
) -> None:
    """Continue a run root: keep completed cases, rerun the others (from their checkpoint when there is one)."""
    from zbench.harness.launch import RunInterrupted
    from zbench.harness.runs import exit_code, resume_run
    from zbench.runroot.casedir import RunRootError

    try:
        root, statuses = resume_run(run_root, runner=runner, case_timeout_s=case_timeout,
                                    step_timeout_s=step_timeout, retries=retries)
    except (ConfigError, RunRootError, ValueError) as err:
        fail(str(err))
    except RunInterrupted as stop:
        err_console.print(f"interrupted: summary written; continue with `zbench resume {run_root}`")
        raise typer.Exit(stop.exit_code) from None
    print(f"summary: {root.path / 'summary.tsv'}")
    raise typer.Exit(exit_code(statuses))


@app.command()
def merge(
    run_roots: Annotated[list[str], typer.Argument(help="Run roots, first the original run, then reruns.")],
    out: Annotated[str | None, typer.Option(help="Output TSV (default <first run root>/summary_complete.tsv).")] = None,
    force: Annotated[bool, typer.Option(help="Replace the output file if it exists.")] = False,
    mixed_configs: Annotated[bool, typer.Option(help="Merge cases of one name even if their configs differ.")
                             ] = False,
) -> None:
    """Combine the summaries of several run roots; the latest completed attempt of each case wins (a case never
    completed: the attempt that got furthest)."""
    from zbench.runroot.casedir import RunRootError
    from zbench.runroot.merge import merge as merge_roots

    try:
        result = merge_roots(run_roots, out, mixed_configs=mixed_configs, overwrite=force)
    except (RunRootError, ValueError) as err:
        fail(str(err))
    for w in result.warnings:
        err_console.print(f"warning: {w}")
    done = sum(r.get("status") == "completed" for r in result.rows)
    print(f"{result.path}: {len(result.rows)} cases, {done} completed")


@data_app.command("gsm8k")
def data_gsm8k(
    src: Annotated[Path, typer.Option(help="GSM8K jsonl file or a folder holding train.jsonl and test.jsonl.")],
    out: Annotated[Path, typer.Option(help="Folder for train.parquet / test.parquet.")] = Path("data/gsm8k"),
) -> None:
    """Convert GSM8K jsonl into verl's parquet schema."""
    from zbench.data import convert_gsm8k

    try:
        for p in convert_gsm8k(src, out):
            print(p)
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))


@data_app.command("synthetic")
def data_synthetic(
    out: Annotated[Path, typer.Option(help="Folder for train.parquet / test.parquet.")] = Path("data/synthetic"),
    n_train: Annotated[int, typer.Option(min=1, help="Training problems.")] = 4096,
    n_test: Annotated[int, typer.Option(min=1, help="Test problems.")] = 512,
    seed: Annotated[int, typer.Option(help="Generator seed.")] = 0,
) -> None:
    """Generate GSM8K-style arithmetic problems in the same schema."""
    from zbench.data import write_synthetic

    for p in write_synthetic(out, n_train, n_test, seed):
        print(p)


@app.command()
def model(
    spec: Annotated[str, typer.Argument(help="tiny (the embedded default), qwen3-0.6b / qwen3-8b (shape presets) or "
                                             "smollm2-135m (a packaged real checkpoint).")],
) -> None:
    """Build an embedded or packaged model into the cache now (runs build them on first use); print its folder."""
    from zbench.models import resolve_model

    try:
        print(resolve_model(spec))
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))


@bench_app.command("floor")
def bench_floor(
    model: Annotated[str | None, typer.Option(help="tiny, qwen3-0.6b, qwen3-8b, or a local model directory [tiny].")] = None,
    stage: Annotated[list[int] | None, typer.Option(help="ZeRO stage; repeat to measure several [2].")] = None,
    offload: Annotated[list[str] | None, typer.Option(
        help="none, cpu, nvme or auto; repeat to measure several (every stage with every offload) [none].")] = None,
    seqs: Annotated[int | None, typer.Option(min=1, help="Sequences per rank per optimizer step [32].")] = None,
    seq_len: Annotated[int | None, typer.Option(min=1, help="Tokens per sequence [612].")] = None,
    micro: Annotated[int | None, typer.Option(min=1, help="Micro-batch per rank [8].")] = None,
    world_size: Annotated[int | None, typer.Option(min=1, help="Ranks (GPUs) [1].")] = None,
    steps: Annotated[int, typer.Option(min=1, help="Timed optimizer steps.")] = 5,
    warmup: Annotated[int, typer.Option(min=0, help="Untimed optimizer steps first.")] = 2,
    gradient_checkpointing: Annotated[bool, typer.Option(help="Activation checkpointing.")] = False,
    fused_ops: Annotated[bool, typer.Option(
        help="The engine's lean RMSNorm and SwiGLU, as `model.fused_ops` (the engine's default) gives them.")] = True,
    head: Annotated[list[str] | None, typer.Option(
        help="lm (the actor's causal LM) or value (the critic's token head); repeat to measure both [lm].")] = None,
    like: Annotated[Path | None, typer.Option(
        help="A run root: measure the floors of its cases (model, ranks, stage, offload, micro-batch, sequences "
             "per rank and their mean length, both heads for PPO) on this machine, and append them to its "
             "floors.jsonl, which `zbench report` reads.")] = None,
    halve_on_oom: Annotated[bool, typer.Option(
        help="A floor that runs out of memory is measured again at a micro-batch of at most half (the largest that "
             "divides its sequences, so more accumulation), down to 1; each attempt is a line, the smaller floor "
             "naming the micro-batch asked (asked_micro).")] = True,
) -> None:
    """Bare DeepSpeed training speed on random tokens (the update-phase floor); prints one JSON line per head,
    stage and offload, measured one after another in the same processes. A floor that runs out of memory is a
    line with "status": "oom" and a warning, then (--halve-on-oom) the same floor at a micro-batch of at most half;
    the floors after it are still measured."""
    from zbench.bench import FloorError, FloorSpec, floors, specs_like

    out = None
    try:
        if like is not None:
            given = {"--model": model, "--stage": stage, "--offload": offload, "--seqs": seqs, "--seq-len": seq_len,
                     "--micro": micro, "--world-size": world_size, "--head": head}
            clash = [name for name, value in given.items() if value is not None]
            clash += ["--gradient-checkpointing"] if gradient_checkpointing else []
            clash += [] if fused_ops else ["--no-fused-ops"]
            if clash:
                fail(f"--like takes the shape of every floor from the run root; drop {', '.join(clash)}")
            specs, notes = specs_like(like, steps, warmup)
            for note in notes:
                err_console.print(f"warning: {note}", markup=False, highlight=False)
            out = like / "floors.jsonl"
        else:
            specs = [FloorSpec(model=model or "tiny", stage=st, offload=off, seqs=_or(seqs, 32),
                               seq_len=_or(seq_len, 612), micro=_or(micro, 8), world_size=_or(world_size, 1),
                               steps=steps, warmup=warmup,
                               gradient_checkpointing=gradient_checkpointing, fused_ops=fused_ops, head=hd)
                     for hd in head or ["lm"] for off in offload or ["none"] for st in stage or [2]]
        groups: dict[tuple[str, int], list[FloorSpec]] = {}
        for spec in specs:  # floors measured together share the model and the ranks
            groups.setdefault((spec.model, spec.world_size), []).append(spec)
        for group in groups.values():
            try:
                results = floors(group, halve_on_oom=halve_on_oom)
            except FloorError as err:
                _emit(err.done, out)  # what finished before the failure is still printed and kept
                fail(str(err))
            _emit(results, out)
    except (ValueError, ConfigError) as err:
        fail(str(err))


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _emit(results: list[dict], out: Path | None) -> None:
    """Print floor records, and append them to `out` when given; a floor that ran out of memory is also a warning."""
    for result in results:
        print(json.dumps(result))
        if result.get("status") == "oom":
            err_console.print(f"warning: floor (stage {result['stage']}, offload {result['offload']}, head "
                              f"{result['head']}, micro {result['micro']} x {result['seq_len']} tokens) ran out of "
                              f"memory: recorded as oom: {result['error']}", markup=False, highlight=False)
        elif result.get("asked_micro"):
            err_console.print(f"note: floor (stage {result['stage']}, offload {result['offload']}, head "
                              f"{result['head']}) measured at micro {result['micro']} in place of micro "
                              f"{result['asked_micro']}, which ran out of memory", markup=False, highlight=False)
    if out is not None and results:
        with out.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in results))


@bench_app.command("gen")
def bench_gen(
    model: Annotated[str, typer.Option(help="tiny, qwen3-0.6b, qwen3-8b, or a local model directory.")] = "tiny",
    prompts: Annotated[int, typer.Option(min=1, help="Prompts in the batch.")] = 64,
    prompt_len: Annotated[int, typer.Option(min=1, help="Prompt tokens.")] = 100,
    new_tokens: Annotated[int, typer.Option(min=1, help="Generated tokens per prompt (forced).")] = 512,
    decode: Annotated[str, typer.Option(
        help="generate (dynamic KV cache), static (generate, static cache, compiled), graph (zbench's CUDA-graph "
             "decode loop).")] = "generate",
) -> None:
    """Hugging Face generation speed (sampling, forced length); prints JSON."""
    from zbench.bench import DECODES, generation

    if decode not in DECODES:
        fail(f"--decode: {decode!r} is not one of {', '.join(DECODES)}")
    try:
        print(json.dumps(generation(model, prompts, prompt_len, new_tokens, decode)))
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))


def _register_analysis() -> None:
    from zbench import cli_analysis

    for fn in (cli_analysis.plot, cli_analysis.report, cli_analysis.compare, cli_analysis.parity,
               cli_analysis.estimate):
        app.command()(fn)


_register_analysis()


def main() -> None:
    """Console-script entry; a file the system refuses (a folder where a file should be, no permission, a full
    disk) ends as a one-line error naming it, not a traceback."""
    try:
        app()
    except OSError as err:
        what = {FileExistsError: "is a file where a folder is needed", NotADirectoryError: "is a file where a folder "
                "is needed", IsADirectoryError: "is a folder where a file is needed"}.get(type(err), err.strerror)
        where = f"{err.filename}: " if err.filename else ""
        err_console.print(f"[red]error:[/red] {where}{what or err}", highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
