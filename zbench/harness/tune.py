"""`zbench tune`: every case of a matrix at its own fastest batch geometry within a memory budget.

    zbench tune six-case --cases 'zero1_*' --memory-budget 80 --time-budget 1800
    zbench run results/tune_six-case_<stamp>/tuned.yaml --steps 60

Each trial is a short real run of the case (a warm-up step, then timed steps) in its own case directory
`<case>.t<k>` of one run root, started and classified by the same launcher as `zbench run` (an out-of-memory trial
is a recorded outcome, never fatal). The trials of a case share one engine process, its Ray, workers and rollout
engine (`zbench.engine.session`, served from `<case>.session`): a trial after the first pays for building the
models at its geometry, not for starting everything again. A trial that fails ends its session; the next trial
starts a new one. A trial whose measured peak (device-wide on GPU, the processes' RSS on CPU) exceeds the budget is
`over_budget`. Trials are compared on the phases batch geometry changes (the updates and the gradient-free passes:
`geometry_s` in tuning.tsv, the step time beside it): generation, the reward and the weight push are the same work
at every geometry, and a host-bound rollout's spread would drown the rest. Which geometry comes next is
`zbench.harness.tune_search`'s job; keys the case's matrix entry or `--set` gives are fixed, never tuned. On CUDA
with `rollout.backend: vllm` every trial fits the KV cache to one rollout (`rollout.kv_cache_fit: true`: the least
memory at which a rollout never waits for cache) unless the case fixes `rollout.kv_cache_fit` or
`rollout.gpu_memory_utilization`. After every trial `tuning.tsv` and `tuned.yaml` are rewritten, so a tune stopped
by its time budget or a signal leaves what it found. The time budget is shared out: each case may start trials within an equal share of what is left when its turn comes (its
first trial within what the whole budget has left), so one slow case cannot leave the others untuned.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from zbench.analyze.activations import GeometryMemory, geometry_memory, model_dims
from zbench.analyze.memory import GIB
from zbench.config import RunConfig, dotted_value, with_overrides
from zbench.harness.launch import (
    CASE_TIMEOUT,
    RECOMPILE_WARNING,
    RunInterrupted,
    options_for_profile,
    run_cases,
)
from zbench.harness.matrix import Case, check_name, load_matrix, shipped_matrices
from zbench.harness.progress import make_progress
from zbench.harness.runner_profile import RunnerProfile, load_runner_profile
from zbench.harness.runs import RunRequest, describe_device_defaults, plan_cases, prepare_models
from zbench.harness.sessions import TrialServer
from zbench.harness.tune_search import OK, OVER_BUDGET, Geometry, Phases, Search, Space, TrialResult, divisors
from zbench.runroot import casedir
from zbench.runroot.root import RunRoot
from zbench.runroot.summary import case_summary_row, steady_records
from zbench.runroot.tuning import (
    FORWARD_PHASES,
    GEOMETRY_KEYS,
    GEOMETRY_PHASES,
    PHASES,
    TUNED,
    TUNING,
    write_tuned,
    write_tuning,
)

TRIAL_STEPS = 3  # a warm-up step, then timed steps (the steady-state rule skips step 1)
# the activation budgets a case whose layers compile may try (`zbench.harness.tune_search.Search._budget`): steps of
# 0.05 up to 0.5, where a GB buys the most time (results/reference/h200x2-activation-budget-20261128), so the search
# can stop close under a memory budget instead of at the next of 0, 0.15, 0.3 below it; then 0.75 and 1
TUNE_BUDGETS = (*(round(0.05 * i, 2) for i in range(11)), 0.75, 1.0)
TIGHT_PEAK = 0.9  # a chosen peak above this share of the memory budget is pointed out (longer batches need more)


@dataclass(frozen=True, kw_only=True)
class TuneRequest:
    """What `zbench tune` was asked for."""

    matrix: str
    sets: tuple[tuple[str, Any], ...] = ()
    case_globs: tuple[str, ...] = ()
    memory_budget_gb: float | None = None  # None: what the device has
    time_budget_s: float | None = None  # None: no limit
    steps: int = TRIAL_STEPS
    seed: int = 7777
    tag: str | None = None
    results_dir: str = "results"
    runner: str = "local"
    step_timeout_s: float | None = 1800.0
    retries: int = 1

    def __post_init__(self) -> None:
        if self.steps < 2:
            raise ValueError(f"--steps {self.steps}: a trial needs a warm-up step and at least one timed step (>= 2)")
        for name, value in (("--memory-budget", self.memory_budget_gb), ("--time-budget", self.time_budget_s)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")


@dataclass
class CaseTune:
    """One case's search and the trial rows it produced."""

    case: Case
    search: Search
    keys: dict[str, tuple[str, ...]]  # which dotted keys each geometry knob sets (the ones not fixed)
    constant: dict[str, Any]  # keys tune sets for every trial of the case (vLLM's fitted KV cache)
    trial_names: dict[Geometry, str] = field(default_factory=dict)
    complete: bool = False

    def overrides(self, g: Geometry) -> dict[str, Any]:
        """The dotted keys a geometry sets on this case."""
        return geometry_overrides(self.keys, self.constant, g)

    def chosen(self) -> TrialResult | None:
        """The trial chosen so far (`Search.best`)."""
        return self.search.best()


@dataclass
class TuneOutcome:
    """A finished (or stopped) tune."""

    root: RunRoot
    cases: list[CaseTune]
    stopped: str | None


def geometry_overrides(keys: dict[str, tuple[str, ...]], constant: dict[str, Any], g: Geometry) -> dict[str, Any]:
    """The dotted keys geometry `g` sets, given which keys each knob owns and what every trial sets."""
    out: dict[str, Any] = dict(constant)
    out.update({k: g.train_micro for k in keys["train"]})
    out.update({k: g.forward_micro for k in keys["forward"]})
    out.update({k: g.checkpointing for k in keys["checkpointing"]})
    out.update({k: g.checkpoint_layers if g.checkpointing else None for k in keys["checkpoint_layers"]})
    if g.activation_budget is not None:
        out.update({k: g.activation_budget for k in keys.get("activation_budget", ())})
    return out


def device_budget_gb(on_cuda: bool) -> tuple[float, str]:
    """What the device has, in GiB, and what is measured against it."""
    if on_cuda:
        import torch

        # the device's size without allocating on it (which would count in the trials' device-wide figure)
        total = torch.cuda.get_device_properties(0).total_memory
        return total / GIB, "device-wide GPU memory in use (perf/device_memory_used_gb)"
    import psutil

    return psutil.virtual_memory().total / GIB, "CPU RSS of the case's processes (perf/cpu_memory_used_gb)"


def case_space(case: Case, budget_gb: float, on_cuda: bool, device_bytes: int) -> CaseTune:
    """The search space of one case: the geometry keys its matrix entry and --set leave free."""
    cfg, fixed = case.config, set(case.overrides)
    roles = ("actor", "critic") if cfg.needs_critic else ("actor",)
    keys = {
        "train": tuple(k for r in roles if (k := f"{r}.micro_batch_size_per_gpu") not in fixed),
        "forward": tuple(k for r in roles if (k := f"{r}.forward_micro_batch_size_per_gpu") not in fixed),
        "checkpointing": () if "model.gradient_checkpointing" in fixed else ("model.gradient_checkpointing",),
        "checkpoint_layers": () if "model.checkpoint_layers" in fixed else ("model.checkpoint_layers",),
        "activation_budget": () if "model.activation_memory_budget" in fixed or not cfg.model.compiles_layers(on_cuda)
        else ("model.activation_memory_budget",),
    }
    vllm = on_cuda and cfg.rollout.backend == "vllm"
    kv_free = not fixed & {"rollout.kv_cache_fit", "rollout.gpu_memory_utilization"}
    constant = {"rollout.kv_cache_fit": True} if vllm and kv_free else {}
    plan = cfg.batch_plan()
    section = cfg.critic if keys["train"] and keys["train"][0].startswith("critic") else cfg.actor
    start = Geometry(section.micro_batch_size_per_gpu,
                     0 if keys["forward"] else section.forward_micro_batch_size_per_gpu,
                     cfg.model.gradient_checkpointing,
                     activation_budget=cfg.model.activation_memory_budget if keys["activation_budget"] else None)
    dims = model_dims(cfg.model.path)

    def memory(g: Geometry) -> GeometryMemory:
        return geometry_memory(with_overrides(cfg, geometry_overrides(keys, constant, g)), on_cuda, device_bytes, dims)

    def phases(g: Geometry) -> Phases:
        m = memory(g)
        return Phases(gen=m.gen_bytes / GIB, train=m.train_bytes / GIB)

    space = Space(
        train_micros=divisors(plan.mini_batch_sequences // cfg.trainer.world_size) if keys["train"]
        else (start.train_micro,),
        forward_micros=divisors(plan.sequences_per_rank) if keys["forward"] else (),
        checkpointing=(False, True) if keys["checkpointing"] else (cfg.model.gradient_checkpointing,),
        start=start, budget_gb=budget_gb, predict_gb=lambda g: memory(g).peak_gb,
        predict_phases=phases if on_cuda else None,  # a GPU trial measures memory at the end of each phase
        num_layers=dims.num_layers if keys["checkpoint_layers"] else 0,
        budgets=TUNE_BUDGETS if keys["activation_budget"] else (),
    )
    return CaseTune(case, Search(space), keys, constant)


def _trial_row(root: RunRoot, tune: CaseTune, name: str, g: Geometry, cfg: RunConfig, status: dict[str, Any],
               budget_gb: float, on_cuda: bool, wall_s: float, stopped: str | None) -> tuple[dict, TrialResult]:
    """The tuning.tsv row of a finished trial and the result the search is sent."""
    cdir = root.case_dir(name)
    row = case_summary_row(root.path, name)
    steady = steady_records(casedir.steps_by_number(casedir.read_metrics(cdir).records))

    def num(value: str) -> float | None:
        return float(value) if value else None

    def phase(p: str) -> float | None:
        values = [r[f"timing_s/{p}"] for r in steady if isinstance(r.get(f"timing_s/{p}"), (int, float))]
        return sum(values) / len(values) if values else None

    peak = (num(row["device_memory_used_gb"]) or num(row["max_memory_reserved_gb"])) if on_cuda \
        else num(row["cpu_memory_used_gb"])
    step = num(row["step_time_mean_s"])
    state, reason = status.get("status", "failed"), str(status.get("reason") or "")
    warned = "; ".join(status.get("warnings") or [])  # a trial's warnings qualify its times
    if state == "completed":
        state, reason = OK, warned
        if peak is not None and peak > budget_gb:
            state = OVER_BUDGET
            reason = "; ".join(filter(None, [f"measured peak {peak:.2f} GB > memory budget {budget_gb:.2f} GB", warned]))
    elif stopped:
        state, reason = "stopped", stopped
    phases = {p: phase(p) for p in PHASES}
    forward = sum(v for p in FORWARD_PHASES if (v := phases[p]) is not None)
    measured = [v for p in GEOMETRY_PHASES if (v := phases[p]) is not None]
    geometry = sum(measured) if measured else None
    gen, train = num(row.get("device_memory_gen_gb", "")), num(row.get("device_memory_train_gb", ""))
    by_phase = Phases(gen, train) if on_cuda and gen is not None and train is not None else None
    result = TrialResult(g, state, step, peak, forward, geometry, by_phase)
    values = {k: dotted_value(cfg, k) for k in GEOMETRY_KEYS
              if (cfg.needs_critic or not k.startswith("critic.")) and (k in tune.constant or not k.startswith("rollout."))}
    tsv = {"case": tune.case.name, "trial": name, **values, "status": state, "step_s": step, "geometry_s": geometry,
           **{f"{p}_s": v for p, v in phases.items()}, "peak_memory_gb": peak,
           "memory_measure": "device" if on_cuda else "cpu_rss", "predicted_gb": tune.search.predicted_gb(g),
           "budget_gb": budget_gb, "wall_s": wall_s, "reason": reason, "trial_dir": name}
    return tsv, result


@dataclass
class _Tuner:
    """The state of one tune across its cases: the run root, the rows of tuning.tsv, the clock."""

    req: TuneRequest
    root: RunRoot
    profile: RunnerProfile
    tunes: list[CaseTune]
    base: dict[str, Any]  # the matrix's base, for tuned.yaml
    description: str
    budget_gb: float
    on_cuda: bool
    started: float
    clock: Callable[[], float]
    out: TextIO
    rows: list[dict] = field(default_factory=list)
    # every trial's seconds, for the time budget: those that started their case's session (Ray, workers, vLLM,
    # compiling) and those a running session served, which take a fraction of that
    walls_started: list[float] = field(default_factory=list)
    walls_served: list[float] = field(default_factory=list)
    servers: dict[str, TrialServer] = field(default_factory=dict)  # each case's trial session

    def server(self, case: str) -> TrialServer:
        if case not in self.servers:
            self.servers[case] = TrialServer(self.root.path / f"{case}{casedir.SESSION_SUFFIX}",
                                             self.profile.command(), self.profile.case_env())
        return self.servers[case]

    def expected_walls(self, case: str) -> list[float]:
        """The trials so far that say how long the case's next one takes: served ones where its session runs and
        waits, those that started a session otherwise (either kind where the other has none yet)."""
        server = self.servers.get(case)
        if server is not None and server.ready():
            return self.walls_served or self.walls_started
        return self.walls_started or self.walls_served

    def close_servers(self) -> None:
        """Stop every case's session (a tuned case's memory goes back before the next case's trials)."""
        for server in self.servers.values():
            server.close()

    def say(self, text: str) -> None:
        print(f"[tune] {text}", file=self.out, flush=True)

    def write(self) -> bool:
        """Rewrite tuning.tsv and tuned.yaml (when some case has a geometry); True when tuned.yaml was written."""
        chosen = {tune.trial_names.get(c.geometry) for tune in self.tunes if (c := tune.chosen())}
        write_tuning(self.root.path / TUNING, [{**r, "chosen": r["trial"] in chosen} for r in self.rows])
        cases = []
        for tune in self.tunes:
            best = tune.chosen()
            if best is not None:
                own = {k: v for k, v in tune.case.overrides.items() if k != "steps"}
                cases.append((tune.case.name, {**own, **tune.overrides(best.geometry)}))
        if cases:
            write_tuned(self.root.path / TUNED, self.description, self.base, cases)
        return bool(cases)

    def tune_case(self, tune: CaseTune, share_s: float | None) -> str | None:
        """Run one case's search to its end, or until its share of the time budget is spent; returns why it stopped
        early, or None."""
        try:
            return self._search(tune, share_s)
        finally:
            self.close_servers()

    def _search(self, tune: CaseTune, share_s: float | None) -> str | None:
        name = tune.case.name
        plan = tune.search.plan()
        geometry = next(plan, None)
        case_started = self.clock()
        while geometry is not None:
            now = self.clock()
            left = None if self.req.time_budget_s is None else self.req.time_budget_s - (now - self.started)
            stop = out_of_time(self.req.time_budget_s, left, self.expected_walls(name))
            if not stop and tune.search.trials and share_s is not None:
                # a case's first trial may take what the whole budget has left; later ones keep to the case's share
                stop = out_of_time(self.req.time_budget_s, share_s - (now - case_started),
                                   self.expected_walls(name), share=share_s)
            if stop:
                self.say(f"{name}: stopped before {geometry.label()}: {stop}")
                return stop
            result, stop = self.trial(tune, geometry, left)
            if stop:
                tune.search.trials.append(result)  # the plan is not resumed: the trial is recorded here
                self.write()
                return stop
            try:
                geometry = plan.send(result)
            except StopIteration:
                geometry = None
            self.write()
        tune.complete = True
        best = tune.chosen()
        if best is not None and best.peak_gb is not None and best.peak_gb > TIGHT_PEAK * self.budget_gb:
            tune.search.notes.append(
                f"the chosen geometry's peak, {best.peak_gb:.2f} GB, is {best.peak_gb / self.budget_gb:.0%} of the "
                f"memory budget: a run whose batches are longer than its trials' may not fit; a smaller "
                f"--memory-budget leaves room")
        for note in tune.search.notes:
            self.say(f"{name}: {note}")
        verdict = (f"chose {best.geometry.label()} ({tune.trial_names[best.geometry]}), step {best.step_s:.3f} s"
                   f"{_geometry_part(best)}, peak {best.peak_gb:.2f} GB"
                   if best and best.step_s is not None and best.peak_gb is not None
                   else "no geometry ran within the budget")
        count = len(tune.search.trials)
        self.say(f"{name}: {count} trial{'' if count == 1 else 's'}; {verdict}")
        return None

    def trial(self, tune: CaseTune, g: Geometry, left_s: float | None) -> tuple[TrialResult, str | None]:
        """Run one trial through the launcher (killed when the time budget runs out), record its row; returns its
        result and, when the time budget ended it, why the tune stops."""
        number = len(tune.search.trials) + 1
        trial = f"{tune.case.name}.t{number}"
        tune.trial_names[g] = trial
        # trials are measurements: no profiled step, checkpoint or tracker (the tuned run keeps the case's own)
        overrides = {**tune.overrides(g), "steps": self.req.steps, "name": trial, "trainer.profile_step": 0,
                     "trainer.save_freq": 0, "trainer.logger": ["console"]}
        cfg = with_overrides(tune.case.config, overrides)
        model_gb, predicted_gb = tune.search.space.predict_gb(g), tune.search.predicted_gb(g)
        calibrated_by = len(tune.search.calibrating(g))
        self.root.update_manifest(cases=[*self.root.manifest["cases"], {
            "name": trial, "dir": trial, "overrides": {**tune.case.overrides, **overrides}}])
        server = self.server(tune.case.name)
        starts = server.starts
        options = dataclasses.replace(
            options_for_profile(self.profile, case_timeout_s=left_s, step_timeout_s=self.req.step_timeout_s,
                                retries=self.req.retries),
            command=server.client_command(), before_attempt=server.ensure_running)
        t0 = self.clock()
        try:
            with make_progress([(trial, cfg.steps)], stream=self.out) as progress:
                status = run_cases(self.root, [(trial, cfg)], options, progress)[0]
        except RunInterrupted:
            status = casedir.read_status(self.root.case_dir(trial)) or {}
            row, result = _trial_row(self.root, tune, trial, g, cfg, status, self.budget_gb, self.on_cuda,
                                     self.clock() - t0, "interrupted by a signal")
            tune.search.trials.append(result)
            self.rows.append(row)
            raise
        wall = self.clock() - t0
        (self.walls_started if server.starts > starts else self.walls_served).append(wall)
        status = self._session_warnings(trial, status, server)
        timed_out = left_s is not None and status.get("status") == "timeout" \
            and str(status.get("reason", "")).startswith(CASE_TIMEOUT)
        stop = f"time budget of {self.req.time_budget_s:g} s spent during this trial" if timed_out else None
        row, result = _trial_row(self.root, tune, trial, g, cfg, status, self.budget_gb, self.on_cuda, wall, stop)
        self.rows.append(row)
        step = f"step {result.step_s:.3f} s{_geometry_part(result)}" if result.step_s is not None else "no timed step"
        peak = f"peak {result.peak_gb:.2f} GB" if result.peak_gb is not None else "no memory figure"
        by = f"calibrated by {calibrated_by} earlier trial{'s' if calibrated_by > 1 else ''} of this case" \
            if calibrated_by else "not calibrated yet"
        self.say(f"{tune.case.name} trial {number} ({trial}): {g.label()} -> {result.status}, {step}, {peak} "
                 f"(predicted {predicted_gb:.2f} GB: memory model {model_gb:.2f}, {by})"
                 f"{'; ' + row['reason'] if row['reason'] else ''}")
        return result, stop

    def _session_warnings(self, trial: str, status: dict[str, Any], server: TrialServer) -> dict[str, Any]:
        """A recompile limit hit by an earlier trial of the session's server (torch.compile warns once, then runs
        eager in silence) qualifies this trial's times too: its warning goes into the trial's status."""
        warned = status.get("warnings") or []
        own = next((w for w in warned if w.startswith(RECOMPILE_WARNING)), None)
        if own is not None or server.recompile_warning is None:
            server.recompile_warning = server.recompile_warning or own
            return status
        status = {**status, "warnings": [*warned, f"an earlier trial of this session: {server.recompile_warning}"]}
        casedir.write_status(self.root.case_dir(trial), status)
        return status

    def manifest_entry(self, stopped: str | None) -> dict[str, Any]:
        """The tune's settings and each case's outcome, for manifest.json."""
        return {"memory_budget_gb": self.budget_gb, "time_budget_s": self.req.time_budget_s,
                "trial_steps": self.req.steps, "stopped": stopped,
                "cases": {t.case.name: {"trials": len(t.search.trials), "complete": t.complete,
                                        "chosen": t.trial_names.get(c.geometry) if (c := t.chosen()) else None,
                                        "notes": t.search.notes} for t in self.tunes}}


def run_tune(req: TuneRequest, argv: list[str], out: TextIO = sys.stdout,
             clock: Callable[[], float] = time.monotonic) -> TuneOutcome:
    """Tune every case of the request's matrix into a new run root; see the module docstring."""
    started = clock()
    profile = load_runner_profile(req.runner)
    cases = plan_cases(RunRequest(matrix=req.matrix, seed=req.seed, steps=req.steps, sets=req.sets,
                                  case_globs=req.case_globs, runner=req.runner), profile)
    matrix = load_matrix(req.matrix)
    on_cuda = cases[0].config.trainer.uses_cuda()
    device_gb, measure = device_budget_gb(on_cuda)
    budget_gb = req.memory_budget_gb or device_gb
    print(f"[tune] memory budget {budget_gb:.2f} GB ({'given' if req.memory_budget_gb else 'what the device has'}),"
          f" measured as {measure}; time budget "
          f"{f'{req.time_budget_s:g} s' if req.time_budget_s else 'none'}; {req.steps} steps per trial "
          f"(step 1 warm-up)", file=out, flush=True)
    prepare_models({c.config.model.path for c in cases}, out)
    tag = check_name(req.tag or f"tune_{matrix.name}", "tag")
    matrix_file = f"matrices/{matrix.name}.yaml" if req.matrix in shipped_matrices() else req.matrix
    root = RunRoot.create(req.results_dir, tag, matrix=matrix.name, matrix_file=matrix_file, seed=req.seed,
                          steps=req.steps, cases=[], command=argv, runner=profile.name,
                          **profile.recorded_environment())
    print(f"[tune] run root {root.path} ({len(cases)} cases)", file=out, flush=True)
    describe_device_defaults(cases, out)
    tuner = _Tuner(req=req, root=root, profile=profile, tunes=[case_space(c, budget_gb, on_cuda, int(device_gb * GIB))
                                                               for c in cases],
                   base=matrix.base, budget_gb=budget_gb, on_cuda=on_cuda, started=started, clock=clock, out=out,
                   description=f"{matrix.name} tuned by zbench tune ({root.path.name}): each case at its fastest "
                               f"batch geometry within {budget_gb:.2f} GB ({measure})")
    stopped: str | None = None
    try:
        for i, tune in enumerate(tuner.tunes):
            # each case an equal share of the time left (what a case leaves unused goes to the ones after it)
            share = None
            if req.time_budget_s is not None:
                left = max(0.0, req.time_budget_s - (clock() - started))
                share = left / (len(tuner.tunes) - i)
                tuner.say(f"{tune.case.name}: {share:.0f} s of the time budget (an equal share of the {left:.0f} s "
                          f"left)")
            stop = tuner.tune_case(tune, share)  # every case has its turn, whatever stopped the one before
            stopped = stopped or stop
    except RunInterrupted:
        stopped = "interrupted by a signal"
        raise
    finally:
        tuner.close_servers()
        tuner.write()
        root.write_summary()
        root.update_manifest(ended_at=casedir.utc_now(), tune={**tuner.manifest_entry(stopped),
                                                               "memory_measure": measure})
    return TuneOutcome(root, tuner.tunes, stopped)


def _geometry_part(r: TrialResult) -> str:
    return f" (updates and gradient-free passes {r.geometry_s:.3f} s)" if r.geometry_s is not None else ""


def out_of_time(budget_s: float | None, left_s: float | None, walls: list[float],
                share: float | None = None) -> str | None:
    """Why the next trial must not start, or None: the budget (or, with `share`, the case's share of it, in
    seconds) is spent, or less of it is left than the longest trial like it so far took (`walls`; a trial cut short
    measures nothing)."""
    if budget_s is None or left_s is None:
        return None
    if left_s <= 0 or (walls and max(walls) > left_s):
        of = f" (this case's share: {share:.0f} s)" if share is not None else ""
        return (f"time budget of {budget_s:g} s{of}: {max(left_s, 0):.0f} s left, the longest trial so far took "
                f"{max(walls, default=0):.0f} s")
    return None
