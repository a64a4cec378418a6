"""Trial sessions (`zbench.engine.session`): one engine process serving a case's trials one after another.

A worker rebuilt for another geometry frees its old models (also compiled ones) and updates as a new worker
does; through real processes, a trial that runs out of memory and one that hangs each end their session with the
outcome the launcher gives a case (oom; timeout with the stacks of the serving processes in the trial's log), the
next trial is served by a new session, and nothing is left running.
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
import weakref
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from test_compile_layers import _CompiledOnCpu
from test_old_log_prob import _batch, _cfg

from zbench import procs
from zbench.config import RunConfig, from_dict, trial_differences
from zbench.engine import workers
from zbench.engine.cluster import free_port
from zbench.engine.workers import PolicyWorker, carried_line
from zbench.harness.launch import LaunchOptions, carried_warning, run_cases
from zbench.harness.sessions import TrialServer
from zbench.models import resolve_model
from zbench.procs import CARRIED_WARNING
from zbench.runroot import casedir
from zbench.runroot.root import RunRoot

ENGINE = (sys.executable, "-m", "zbench.engine")


def test_only_geometry_and_trial_bounds_may_differ_between_trials():
    base = from_dict(_cfg())
    other = from_dict(_cfg(actor={"micro_batch_size_per_gpu": 2}, model={"gradient_checkpointing": True},
                           trainer={"save_freq": 0, "logger": ["console"]}))
    assert trial_differences(base, other) == []
    assert trial_differences(base, from_dict(_cfg(zero={"stage": 3}, actor={"lr": 0.5}))) == ["actor.lr",
                                                                                               "zero.stage"]


class _Watched(_CompiledOnCpu):
    """Notes, when `setup` starts, whether any model it was told to watch is still alive."""

    watch: ClassVar[list[weakref.ref]] = []
    alive_at_setup: ClassVar[list[bool]] = []

    def setup(self):  # type: ignore[no-untyped-def]
        gc.collect()
        self.alive_at_setup.append(any(ref() is not None for ref in self.watch))
        return super().setup()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_reconfigured_worker_frees_its_old_models_and_updates_as_a_new_one(stage: int):
    """Compiled layers (through AOTAutograd on the CPU): `reconfigure` to another micro-batch with checkpointing
    frees the actor and the reference before building their successors (DeepSpeed's module-level references to
    them included), the update equals a freshly built worker's at that geometry, and going back to the first
    geometry compiles nothing new."""
    model_path = str(resolve_model("tiny"))
    case_dir = tempfile.mkdtemp(prefix="zbench-reconf-")
    first = from_dict(_cfg(zero={"stage": stage}))
    second = from_dict(_cfg(zero={"stage": stage}, actor={"micro_batch_size_per_gpu": 2},
                            model={"gradient_checkpointing": True}))
    torch._dynamo.reset()
    _Watched.watch, _Watched.alive_at_setup = [], []
    worker = _Watched(first, 0, 1, case_dir, model_path)
    worker.join("127.0.0.1", free_port())
    worker.setup()
    batch = _batch(pad_id=0)
    worker.update_actor(batch)
    worker.memory()  # the first report freezes the heap, as in a case
    assert worker.ref is not None  # the KL loss needs the reference
    _Watched.watch = [weakref.ref(getattr(m, "module", m)) for m in (worker.engine, worker.ref)]
    info = worker.reconfigure(second, case_dir)
    assert _Watched.alive_at_setup[-1] is False, "a model of the first trial was alive while the next was built"
    assert info["compiled_layers"] == 2 and worker.cfg.actor.micro_batch_size_per_gpu == 2
    served = worker.update_actor(batch)
    _Watched.watch = []
    fresh = _Watched(second, 0, 1, case_dir, model_path)
    fresh.setup()
    expected = fresh.update_actor(batch)
    assert torch.allclose(served.pop("old_log_probs"), expected.pop("old_log_probs"), atol=1e-6)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert served[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    # the rebuilt models run the graphs compiled for the first: a later trial compiles nothing it has seen
    seen = _CompiledOnCpu.graphs
    worker.reconfigure(first, case_dir)
    worker.update_actor(batch)
    assert _CompiledOnCpu.graphs == seen
    torch._dynamo.reset()


def _set_up_worker(cfg: RunConfig) -> tuple[PolicyWorker, str]:
    """A one-rank policy worker of `cfg` on the tiny model, joined and set up, and its case folder."""
    case_dir = tempfile.mkdtemp(prefix="zbench-reconf-")
    worker = PolicyWorker(cfg, 0, 1, case_dir, str(resolve_model("tiny")))
    worker.join("127.0.0.1", free_port())
    worker.setup()
    return worker, case_dir


def _trial_objects(worker: PolicyWorker) -> dict[str, weakref.ref]:
    """Weak references to what a trial's actor holds (engine, model, ZeRO optimizer and the optimizer it wraps,
    every parameter and its partition) and to its reference, by name."""
    engine = worker.engine
    held: dict[str, object] = {"engine": engine, "model": engine.module, "optimizer": engine.optimizer,
                               "inner optimizer": engine.optimizer.optimizer, "reference": worker.ref}
    for name, p in engine.module.named_parameters():
        held[f"parameter {name}"] = p
        held[f"partition of {name}"] = p.ds_tensor
    return {name: weakref.ref(obj) for name, obj in held.items()}


def test_a_checkpointed_zero3_trial_is_freed_by_reconfigure():
    """ZeRO-3 with activation checkpointing: the backward's recomputation of a checkpointed layer stops at its last
    saved tensor, inside a module's forward, so DeepSpeed's post-forward hook never takes that module off its
    module-level stack (`parameter_offload.FWD_MODULE_STACK`), and each such module kept its whole engine alive,
    optimizer states and gradients included, into every later trial of the session. After `reconfigure` nothing
    of the trial before is alive, and the stack holds only the models the worker holds, trial after trial."""
    from deepspeed.runtime.zero.parameter_offload import FWD_MODULE_STACK

    earlier = list(FWD_MODULE_STACK)  # the models of engines an earlier test of this process built
    cfg = from_dict(_cfg(zero={"stage": 3}, model={"gradient_checkpointing": True}))
    worker, case_dir = _set_up_worker(cfg)
    batch = _batch(pad_id=0)
    for _ in range(2):
        worker.update_actor(batch)
        worker.memory()  # the first report freezes the heap, as in a case
        before = _trial_objects(worker)
        worker.reconfigure(cfg, case_dir)
        gc.collect()
        assert [name for name, ref in before.items() if ref() is not None] == [], "alive after reconfigure"
        ours = [id(m) for m in FWD_MODULE_STACK if not any(m is e for e in earlier)]  # ids: nothing kept alive
        assert ours == [id(worker.engine.module), id(worker.ref.module)]
    worker.release()  # later tests of this process find no engine of this one on the stack


def test_a_model_held_past_its_release_is_reported_at_every_later_release_until_it_goes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Something outside the worker holding a released model (standing in for any leak) keeps its memory in the
    process: each later release reports it, with its optimizer, in the words the trial's warning line and then the
    launcher's warning carry, until the model goes; a clean release reports nothing."""
    monkeypatch.setattr(workers, "_RELEASED", [])  # this test's releases only
    cfg = from_dict(_cfg(zero={"stage": 2}))
    worker, case_dir = _set_up_worker(cfg)
    assert worker.release() == ""
    worker.reconfigure(cfg, case_dir)
    held = worker.engine.module
    reports = [worker.release()]
    worker.reconfigure(cfg, case_dir)
    reports.append(worker.release())  # the next trial's release: the model is still there
    for report in reports:
        assert report.startswith("actor rank 0: 1 DeepSpeedZeroOptimizer, 1 Qwen"), report
        assert report.endswith(" MB of parameters"), report
    warning = carried_warning(f"(PolicyWorker pid=1) {carried_line(reports[-1:])} [repeated 1x across cluster]\n")
    assert warning == (f"{CARRIED_WARNING} (train.log: {reports[-1]}): its memory figures include theirs and "
                       "overstate this geometry's")
    del held
    worker.reconfigure(cfg, case_dir)
    assert worker.release() == "" and workers.carried_objects() == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled layers run on CUDA only")
@pytest.mark.parametrize("compile_layers", ["always", "never"])
def test_reconfigure_gives_a_checkpointed_zero3_trials_gpu_memory_back(compile_layers: str):
    """ZeRO-3 on CUDA with activation checkpointing, layers compiled (leaf modules, as `zbench tune`'s trials run
    there) and eager (a DeepSpeed hook on every projection): after `release` nothing of the trial is alive, and the
    memory allocated returns to where it was before the trial built its models, short of half its Adam states (what
    the first trial leaves for good stays in that level: the rollout replica, the libraries' workspaces)."""
    cfg = from_dict(_cfg(trainer={"device": "cuda"}, zero={"stage": 3},
                         model={"gradient_checkpointing": True, "compile_layers": compile_layers}))
    worker, case_dir = _set_up_worker(cfg)
    batch = _batch(pad_id=0)
    worker.update_actor(batch)
    worker.memory()
    worker.release()
    level = torch.cuda.memory_allocated()
    for _ in range(2):
        compiled = worker.reconfigure(cfg, case_dir)["compiled_layers"]
        assert compiled == (len(worker.engine.module.model.layers) if compile_layers == "always" else 0)
        worker.update_actor(batch)
        worker.memory()
        adam = sum(t.numel() * t.element_size() for state in worker.engine.optimizer.optimizer.state.values()
                   for t in state.values() if torch.is_tensor(t))  # what a kept engine would hold at least
        before = _trial_objects(worker)
        worker.release()
        gc.collect()
        assert [name for name, ref in before.items() if ref() is not None] == [], "alive after release"
        assert adam > 0 and torch.cuda.memory_allocated() - level < adam / 2, "the trial's memory was not given back"


def test_failed_trials_end_their_session_and_the_next_trial_gets_a_new_one(tmp_path: Path):
    """Three trials of one case through the launcher and one TrialServer: an injected out-of-memory error (oom,
    its line as the reason), a hang (timeout, the serving processes' stacks in the trial's train.log), then a
    clean trial, served as the first trial of a third session."""
    trials = {"c.t1": "oom@1", "c.t2": "hang@2", "c.t3": ""}
    # one rank where it does (a rank is a worker process to start: CI time); the hang's rank 0 waits in a barrier
    # for a second one
    ranks = {"c.t1": 1, "c.t2": 2, "c.t3": 1}
    configs = [(name, from_dict({"name": name, "steps": 2, "seed": 5, "algorithm": "grpo", "rollout": {"n": 2},
                                 "trainer": {"fault": fault, "logger": ["console"], "world_size": ranks[name]}}))
               for name, fault in trials.items()]
    root = RunRoot.create(tmp_path / "results", "sessions", matrix="sessions", matrix_file=None, seed=5, steps=2,
                          cases=[], command=["test"])
    server = TrialServer(root.path / f"c{casedir.SESSION_SUFFIX}", ENGINE, {})
    # the limit covers a session's start-up on a loaded machine (Ray's alone took 27 s with three test processes on
    # two cores), which counts against it before the first step
    options = LaunchOptions(command=server.client_command(), step_timeout_s=60, retries=0,
                            before_attempt=server.ensure_running)
    try:
        statuses = [run_cases(root, [config], options)[0] for config in configs]
    finally:
        server.close()
    assert [s["status"] for s in statuses] == ["oom", "timeout", "completed"], statuses
    assert "injected by trainer.fault=oom@1" in statuses[0]["reason"]
    hung = (root.case_dir("c.t2") / casedir.TRAIN_LOG).read_text()
    assert "step timeout: no heartbeat for 60 s" in hung and "in _hang_in_barrier" in hung
    assert server.starts == 3
    result = json.loads((root.case_dir("c.t3") / casedir.RESULT).read_text())
    assert result["session"] == {"dir": "c.session", "trial": 1} and result["steps_completed"] == 2
    assert not procs.case_processes(server.dir) and not procs.processes_mentioning(str(root.path))
    assert not casedir.ray_tmpdir(server.dir).exists()


def test_a_trial_that_changes_more_than_its_geometry_is_refused(tmp_path: Path):
    """The server refuses a later trial whose config differs in anything but the geometry (the rollout engine
    and everything else are kept): a config error naming the keys, which ends the session."""
    root = RunRoot.create(tmp_path / "results", "sessions", matrix="sessions", matrix_file=None, seed=5, steps=1,
                          cases=[], command=["test"])
    base = {"steps": 1, "seed": 5, "algorithm": "grpo", "rollout": {"n": 2}, "trainer": {"logger": ["console"]}}
    configs = [("c.t1", from_dict({**base, "name": "c.t1"})),
               ("c.t2", from_dict({**base, "name": "c.t2", "rollout": {"n": 2, "temperature": 0.5}}))]
    server = TrialServer(root.path / f"c{casedir.SESSION_SUFFIX}", ENGINE, {})
    options = LaunchOptions(command=server.client_command(), retries=0, before_attempt=server.ensure_running)
    try:
        first = run_cases(root, [configs[0]], options)[0]
        # the same server must get the second trial: no new start between them
        second = run_cases(root, [configs[1]], options)[0]
    finally:
        server.close()
    assert first["status"] == "completed" and server.starts == 1
    assert second["status"] == "failed" and second["reason"].startswith("config error: ")
    assert "rollout.temperature" in second["reason"] and "a trial may change only its batch geometry" in second["reason"]


def test_a_recompile_limit_hit_earlier_in_the_session_qualifies_the_later_trials(tmp_path: Path) -> None:
    """torch.compile warns once per process, then runs what it stopped compiling eager in silence: a trial served
    after the one that hit the limit carries its warning; a new server (a new process) starts without it."""
    from types import SimpleNamespace

    from zbench.harness.launch import recompile_warning
    from zbench.harness.tune import _Tuner

    server = TrialServer(tmp_path / "c.session", (sys.executable, "-m", "zbench.engine"), {})
    tuner = SimpleNamespace(root=SimpleNamespace(case_dir=lambda name: tmp_path / name))
    hit = recompile_warning("[0/8] torch._dynamo hit config.recompile_limit (8)\n")
    assert hit is not None
    for name in ("c.t1", "c.t2", "c.t3"):
        (tmp_path / name).mkdir()
    clean = {"status": "completed", "warnings": []}
    assert _Tuner._session_warnings(tuner, "c.t1", {**clean, "warnings": [hit]}, server)["warnings"] == [hit]
    carried = _Tuner._session_warnings(tuner, "c.t2", clean, server)
    assert carried["warnings"] == [f"an earlier trial of this session: {hit}"]
    assert casedir.read_status(tmp_path / "c.t2")["warnings"] == carried["warnings"]
    try:
        server.ensure_running()  # a new server process: nothing carried into it
        assert server.running() and _Tuner._session_warnings(tuner, "c.t3", clean, server) == clean
    finally:
        server.close(grace_s=30.0)
    assert not server.running()
