"""Running a matrix end to end: expand it, create (or reopen) a run root, build the models the cases need,
run every case as its own process, and leave summary.tsv behind. The CLI's `run` and `resume` call these."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from zbench.config import RunConfig
from zbench.env import changed_variables
from zbench.harness.launch import LaunchOptions, options_for_profile, run_cases
from zbench.harness.matrix import Case, check_name, expand, load_matrix, shipped_matrices
from zbench.harness.progress import make_progress
from zbench.harness.runner_profile import RunnerProfile, load_runner_profile
from zbench.runroot.casedir import utc_now
from zbench.runroot.root import RunRoot


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
    """The matrix's cases for this request, each model checked loadable; the runner's worker count applies unless
    the case or `--set` names one."""
    from zbench.models import check_model_path

    workers = {} if profile.num_workers is None else {"trainer.world_size": profile.num_workers}
    cases = expand(load_matrix(req.matrix), seed=req.seed, steps=req.steps, sets=req.sets, case_globs=req.case_globs,
                   run_defaults=workers, device_defaults=True)
    for spec in dict.fromkeys(c.config.model.path for c in cases):
        check_model_path(spec)
    return cases


def describe_device_defaults(cases: list[Case], out: TextIO) -> None:
    """Say which GPU defaults the cases took (each case's config.yaml records the values that ran)."""
    for c in cases:
        if c.device_defaults:
            said = " ".join(f"{k}={v}" for k, v in c.device_defaults.items())
            print(f"[zbench] {c.name}: GPU defaults for keys nothing named: {said}", file=out, flush=True)


def prepare_models(specs: set[str], out: TextIO) -> dict[str, dict[str, Any]]:
    """Build the embedded and packaged models the cases name, once, before any case starts (so no case times out
    on it); returns what weights each model.path names, for the manifest."""
    from zbench.models import describe_model, resolve_model, source_of

    models = {}
    for spec in sorted(specs):
        if not Path(spec).is_dir():
            print(f"[zbench] preparing model {spec!r} ...", file=out, flush=True)
        folder = resolve_model(spec)
        print(f"[zbench] model {spec!r}: {folder}", file=out, flush=True)
        models[spec] = {**describe_model(spec), "folder": str(folder), **source_of(folder)}
    return models


def _launch(root: RunRoot, cases: list[tuple[str, RunConfig]], options: LaunchOptions,
            out: TextIO) -> list[dict]:
    with make_progress([(name, cfg.steps) for name, cfg in cases], stream=out) as progress:
        return run_cases(root, cases, options, progress)


def run_matrix(req: RunRequest, argv: list[str], out: TextIO = sys.stdout) -> tuple[RunRoot, list[dict]]:
    """Run every case of a matrix into a new run root; returns the root and each case's final status."""
    profile = load_runner_profile(req.runner)
    cases = plan_cases(req, profile)
    matrix = load_matrix(req.matrix)
    tag = check_name(req.tag or f"{matrix.name}_{req.steps}_seed{req.seed}", "tag")
    models = prepare_models({c.config.model.path for c in cases}, out)
    # recorded as the user named it: a shipped matrix by its package path, a file by the path given
    matrix_file = f"matrices/{matrix.name}.yaml" if req.matrix in shipped_matrices() else req.matrix
    root = RunRoot.create(req.results_dir, tag, matrix=matrix.name, matrix_file=matrix_file, seed=req.seed,
                                steps=req.steps, cases=cases, command=argv, runner=profile.name, models=models,
                                **profile.recorded_environment())
    print(f"[zbench] run root {root.path} ({len(cases)} cases)", file=out, flush=True)
    describe_device_defaults(cases, out)
    options = options_for_profile(profile, case_timeout_s=req.case_timeout_s, step_timeout_s=req.step_timeout_s,
                                  retries=req.retries)
    return root, _launch(root, [(c.name, c.config) for c in cases], options, out)


def resume_run(path: str, *, runner: str | None = None, case_timeout_s: float | None = None,
               step_timeout_s: float | None = None, retries: int = 1,
               out: TextIO = sys.stdout) -> tuple[RunRoot, list[dict]]:
    """Continue a run root: completed cases are kept, the others run again (from their checkpoint if any)."""
    root = RunRoot.open(path)
    profile = load_runner_profile(runner or root.manifest.get("runner") or "local")
    cases = root.case_configs()
    prepare_models({cfg.model.path for _, cfg in cases}, out)
    options = options_for_profile(profile, case_timeout_s=case_timeout_s, step_timeout_s=step_timeout_s,
                                  retries=retries)
    print(f"[zbench] resuming {root.path}", file=out, flush=True)

    def record_environment() -> None:
        """Once the run is this process's (its lock held): the resume's environment beside the run's, in the
        manifest, and a warning where they differ, as the resumed cases then run in another."""
        now, manifest = profile.recorded_environment(), root.manifest
        changed = changed_variables(manifest["variables"], now["variables"]) if "variables" in manifest else []
        if changed:
            print("[zbench] warning: this resume's environment differs from the run's: "
                  f"{', '.join(f'{k}={a} -> {b}' for k, a, b in changed)}; manifest.json keeps both (resumes)",
                  file=out, flush=True)
        root.update_manifest(resumes=[*manifest.get("resumes", []), {"at": utc_now(), "runner": profile.name, **now}])

    return root, _launch(root, cases, dataclasses.replace(options, on_locked=record_environment), out)


def exit_code(statuses: list[dict]) -> int:
    """0 when every case completed, 1 otherwise."""
    return 0 if statuses and all(s.get("status") == "completed" for s in statuses) else 1
