"""Running a matrix end to end: expand it, create (or reopen) a run root, build the models the cases need,
run every case as its own process, and leave summary.tsv behind. The CLI's `run` and `resume` call these."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from zbench import store
from zbench.config import ConfigError, RunConfig, dump_yaml, load_case_config
from zbench.launch import LaunchOptions, options_for_profile, run_cases
from zbench.matrix import Case, check_name, expand, load_matrix, shipped_matrices
from zbench.progress import make_progress
from zbench.runner_profile import RunnerProfile, load_runner_profile


@dataclass(frozen=True, kw_only=True)
class RunRequest:
    """What `zbench run` was asked for."""

    matrix: str
    seed: int
    steps: int
    sets: tuple[tuple[str, Any], ...] = ()
    case_globs: tuple[str, ...] = ()
    tag: str | None = None
    results_dir: str = "results"
    runner: str = "local"
    case_timeout_s: float | None = None
    step_timeout_s: float | None = None
    retries: int = 1


def plan_cases(req: RunRequest, profile: RunnerProfile) -> list[Case]:
    """The matrix's cases for this request; the runner's worker count applies unless the case or `--set` names
    one."""
    workers = {} if profile.num_workers is None else {"trainer.world_size": profile.num_workers}
    return expand(load_matrix(req.matrix), seed=req.seed, steps=req.steps, sets=req.sets, case_globs=req.case_globs,
                  run_defaults=workers)


def prepare_models(specs: set[str], out: TextIO) -> None:
    """Build the embedded models the cases name, once, before any case starts (so no case times out on it)."""
    from zbench.engine.models import resolve_model

    for spec in sorted(specs):
        if not Path(spec).is_dir():
            print(f"[zbench] preparing model {spec!r} ...", file=out, flush=True)
        print(f"[zbench] model {spec!r}: {resolve_model(spec)}", file=out, flush=True)


def _launch(root: store.RunRoot, cases: list[tuple[str, RunConfig]], options: LaunchOptions,
            out: TextIO) -> list[dict]:
    with make_progress([(name, cfg.steps) for name, cfg in cases], stream=out) as progress:
        return run_cases(root, [(name, dump_yaml(cfg)) for name, cfg in cases], options, progress)


def run_matrix(req: RunRequest, argv: list[str], out: TextIO = sys.stdout) -> tuple[store.RunRoot, list[dict]]:
    """Run every case of a matrix into a new run root; returns the root and each case's final status."""
    profile = load_runner_profile(req.runner)
    cases = plan_cases(req, profile)
    matrix = load_matrix(req.matrix)
    tag = check_name(req.tag or f"{matrix.name}_{req.steps}_seed{req.seed}", "tag")
    prepare_models({c.config.model.path for c in cases}, out)
    # recorded as the user named it: a shipped matrix by its package path, a file by the path given
    matrix_file = f"matrices/{matrix.name}.yaml" if req.matrix in shipped_matrices() else req.matrix
    root = store.RunRoot.create(req.results_dir, tag, matrix=matrix.name, matrix_file=matrix_file, seed=req.seed,
                                steps=req.steps, cases=cases, command=argv, runner=profile.name)
    print(f"[zbench] run root {root.path} ({len(cases)} cases)", file=out, flush=True)
    options = options_for_profile(profile, case_timeout_s=req.case_timeout_s, step_timeout_s=req.step_timeout_s,
                                  retries=req.retries)
    return root, _launch(root, [(c.name, c.config) for c in cases], options, out)


def resume_run(path: str, *, runner: str | None = None, case_timeout_s: float | None = None,
               step_timeout_s: float | None = None, retries: int = 1,
               out: TextIO = sys.stdout) -> tuple[store.RunRoot, list[dict]]:
    """Continue a run root: completed cases are kept, the others run again (from their checkpoint if any)."""
    root = store.RunRoot.open(path)
    manifest = root.manifest
    profile = load_runner_profile(runner or manifest.get("runner") or "local")
    cases = []
    for entry in manifest["cases"]:
        cfg_path = root.case_dir(entry["name"]) / "config.yaml"
        if not cfg_path.is_file():
            raise ConfigError("", f"{cfg_path} is missing: this case cannot be resumed (rerun the matrix instead)")
        cases.append((entry["name"], load_case_config(cfg_path)))
    prepare_models({cfg.model.path for _, cfg in cases}, out)
    options = options_for_profile(profile, case_timeout_s=case_timeout_s, step_timeout_s=step_timeout_s,
                                  retries=retries)
    print(f"[zbench] resuming {root.path}", file=out, flush=True)
    return root, _launch(root, cases, options, out)


def exit_code(statuses: list[dict]) -> int:
    """0 when every case completed, 1 otherwise."""
    return 0 if statuses and all(s.get("status") == "completed" for s in statuses) else 1
