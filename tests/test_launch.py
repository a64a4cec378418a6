"""run_case / run_cases against small scripts that imitate the engine: real processes, real signals."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from zbench import procs
from zbench.config import dump_yaml, from_dict
from zbench.harness import launch
from zbench.harness.progress import PlainProgress, make_progress
from zbench.harness.runner_profile import available_runners, load_runner_profile
from zbench.runroot import casedir, summary
from zbench.runroot.root import RunRoot

FAKE = Path(__file__).parent / "fake_cases"
CONFIG = from_dict({"name": "x", "algorithm": "grpo", "seed": 1, "steps": 3, "rollout": {"n": 2},
                    "zero": {"stage": 2, "offload": "none"}})


def fake(script: str, *args: str) -> list[str]:
    return [sys.executable, str(FAKE / f"{script}.py"), *args]


def run(tmp_path: Path, script: str, *args: str, **kw) -> dict:
    cdir = tmp_path / "case"
    cdir.mkdir(exist_ok=True)
    (cdir / "config.yaml").write_text(dump_yaml(CONFIG))
    opts = {"case_timeout_s": None, "step_timeout_s": None, "attempt": 1, "kill_grace_s": 1.0, "poll_s": 0.1}
    opts.update(kw)
    return launch.run_case(cdir, fake(script, *args, str(cdir)), {}, **opts)


def assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        alive = [
            p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        if not alive:
            return
        time.sleep(0.05)
    raise AssertionError(f"processes still alive: {alive}")


def test_completed(tmp_path: Path) -> None:
    status = run(tmp_path, "ok")
    assert status["status"] == "completed" and status["exit_code"] == 0 and status["last_step"] == 3
    assert status == casedir.read_status(tmp_path / "case")
    assert "step:3 - critic/score/mean:0.300" in (tmp_path / "case" / "train.log").read_text()


def test_step_timeout_kills_hung_case(tmp_path: Path) -> None:
    t0 = time.monotonic()
    status = run(tmp_path, "hang", step_timeout_s=1.0)
    assert status["status"] == "timeout" and "step timeout" in status["reason"]
    assert status["last_step"] == 1 and time.monotonic() - t0 < 6


def test_a_timeout_prints_where_the_case_hung(tmp_path: Path) -> None:
    """The processes that registered for stack dumps print their stacks into train.log before the kill."""
    cdir = tmp_path / "case"
    status = run(tmp_path, "hang_in_function", step_timeout_s=1.0)
    assert status["status"] == "timeout" and "step timeout" in status["reason"]
    log = (cdir / "train.log").read_text()
    assert "==== zbench: step timeout: no heartbeat for 1 s; the stacks of its 1 Python processes follow" in log
    dump = log.split("the stacks of its 1 Python processes follow")[1]
    assert "Current thread" in dump and "blocked_in_fake_engine" in dump
    assert not (cdir / "stack_pids").exists()


def test_a_timeout_prints_where_a_ray_worker_hung(tmp_path: Path) -> None:
    """Through Ray's log forwarding, a hung worker's stack reaches the case's train.log too."""
    pytest.importorskip("ray")
    cdir = tmp_path / "case"
    status = run(tmp_path, "ray_hang", step_timeout_s=20.0)  # Ray's start-up counts against it
    assert status["status"] == "timeout", status
    log = (cdir / "train.log").read_text()
    assert "the stacks of its 2 Python processes follow" in log
    dump = log.split("Python processes follow")[1]
    assert "waiting_for_worker" in dump and "stuck_in_worker" in dump
    assert not procs.processes_mentioning(str(casedir.ray_tmpdir(cdir)))
    shutil.rmtree(casedir.ray_tmpdir(cdir), ignore_errors=True)


def test_case_timeout(tmp_path: Path) -> None:
    status = run(tmp_path, "slow", case_timeout_s=1.5, step_timeout_s=30.0)
    assert status["status"] == "timeout" and "case timeout" in status["reason"]
    assert status["last_step"] >= 2


def test_crash_reason_is_the_exception_line(tmp_path: Path) -> None:
    status = run(tmp_path, "crash")
    assert status["status"] == "failed" and status["exit_code"] == 1
    assert status["reason"] == "RuntimeError: shape mismatch in update_actor: [4, 8] vs [4, 9]"


def test_cuda_oom(tmp_path: Path) -> None:
    status = run(tmp_path, "cuda_oom")
    assert status["status"] == "oom" and "CUDA out of memory" in status["reason"]


def test_sigkill_after_memoryerror_is_oom(tmp_path: Path) -> None:
    status = run(tmp_path, "sigkill_memoryerror")
    assert status["status"] == "oom" and status["exit_code"] == -signal.SIGKILL


def test_a_silent_sigkill_is_oom_only_where_the_kernel_counted_an_oom_kill(tmp_path: Path, monkeypatch) -> None:
    # the kernel's OOM killer cannot be made to strike safely here: its counter is what is stood in for
    for d in ("quiet", "killed", "elsewhere"):
        (tmp_path / d).mkdir()
    monkeypatch.setattr(launch.procs, "oom_kill_count", lambda: (7, "/sys/fs/cgroup/memory.events"))
    status = run(tmp_path / "quiet", "sigkill")
    assert status["status"] == "failed" and "check the kernel log for the OOM killer" in status["reason"]
    # counted in the case's own memory cgroup: the attempt ran out of memory
    counts = iter([(7, "/sys/fs/cgroup/memory.events"), (8, "/sys/fs/cgroup/memory.events")])
    monkeypatch.setattr(launch.procs, "oom_kill_count", lambda: next(counts))
    status = run(tmp_path / "killed", "sigkill")
    assert status["status"] == "oom" and status["exit_code"] == -signal.SIGKILL, status
    assert status["reason"].startswith("the kernel's OOM killer ended a process during this attempt "
                                       "(/sys/fs/cgroup/memory.events oom_kill 7 -> 8)")
    # counted machine-wide only: maybe another machine user's process; a warning, the status unchanged
    counts = iter([(3, str(procs.SYSTEM_OOM_COUNTER)), (4, str(procs.SYSTEM_OOM_COUNTER))])
    status = run(tmp_path / "elsewhere", "sigkill")
    assert status["status"] == "failed" and "/proc/vmstat oom_kill 3 -> 4" in status["warnings"][0], status


def test_the_oom_kill_counter_is_read_from_the_kernel(tmp_path: Path) -> None:
    count = procs.oom_kill_count()  # this Linux machine's own: a container's cgroup or /proc/vmstat
    assert count is not None and count[0] >= 0 and Path(count[1]).name in ("memory.events", "memory.oom_control",
                                                                          "vmstat")
    # cgroup v2 and v1 layouts, as /proc/self/cgroup names them
    assert procs._cgroup_oom_files("0::/box/job\n", tmp_path) == [tmp_path / "box/job/memory.events",
                                                                  tmp_path / "memory.events"]
    v1 = procs._cgroup_oom_files("4:memory:/box\n3:cpu:/box\n", tmp_path)
    assert v1 == [tmp_path / "memory/box/memory.oom_control", tmp_path / "memory/memory.oom_control"]
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 2\noom 1\noom_kill 3\n")
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert procs.oom_kill_count(tmp_path, "0::/\n") == (3, str(tmp_path / "memory.events"))
    assert procs.oom_kill_count(tmp_path, "4:memory:/\n") == (5, str(tmp_path / "memory/memory.oom_control"))
    # lines not of the form id:controllers:path are skipped; no cgroup file: the machine's count
    assert procs._cgroup_oom_files("garbage\n\n0::/x\n", tmp_path) == [tmp_path / "x/memory.events",
                                                                       tmp_path / "memory.events"]
    assert procs.oom_kill_count(tmp_path / "none", "garbage\n")[1] == str(procs.SYSTEM_OOM_COUNTER)


def test_a_hit_recompile_limit_is_a_warning_of_the_case(tmp_path: Path) -> None:
    status = run(tmp_path, "recompile_limit")
    assert status["status"] == "completed", status
    [warning] = status["warnings"]
    assert warning.startswith("torch.compile hit its recompile limit (torch._dynamo hit config.recompile_limit (2)")
    assert "ran eager" in warning


def test_models_of_an_earlier_trial_alive_in_the_process_are_a_warning_of_the_case(tmp_path: Path) -> None:
    status = run(tmp_path, "carried_models")
    assert status["status"] == "completed", status
    [warning] = status["warnings"]
    assert warning == ("models of an earlier trial are still alive in this case's processes (train.log: actor rank "
                       "0: 1 DeepSpeedZeroOptimizer, 1 Qwen3ForCausalLM; 1.11 GB of parameters; actor rank 1: 1 "
                       "DeepSpeedZeroOptimizer, 1 Qwen3ForCausalLM; 1.11 GB of parameters): its memory figures include "
                       "theirs and overstate this geometry's")


def test_completed_then_abort_is_completed_with_warning(tmp_path: Path) -> None:
    status = run(tmp_path, "complete_then_abort")
    assert status["status"] == "completed" and status["exit_code"] == -signal.SIGABRT
    assert len(status["warnings"]) == 1 and "SIGABRT" in status["warnings"][0]


def test_leftover_daemons_are_killed(tmp_path: Path) -> None:
    status = run(tmp_path, "spawner")
    assert status["status"] == "completed"
    pids = [int(p) for p in (tmp_path / "case" / "pids").read_text().split()]
    assert_gone(pids)
    assert not procs.processes_mentioning(str(casedir.ray_tmpdir(tmp_path / "case")))


def test_ray_tmpdir_is_short_enough_for_unix_sockets(tmp_path: Path) -> None:
    deep = tmp_path / ("x" * 60) / "zero3_cpu_offload"
    assert len(str(casedir.ray_tmpdir(deep))) <= 40
    assert casedir.ray_tmpdir(deep) == casedir.ray_tmpdir(deep) != casedir.ray_tmpdir(tmp_path)


@pytest.mark.parametrize(("name", "swept"), [("zbench-ray-0123456789", True), ("elsewhere-ray", False)])
def test_ray_tmpdir_recorded_by_the_engine_is_swept(tmp_path: Path, name: str, swept: bool) -> None:
    """A Ray folder the engine recorded is swept when it has the shape zbench gives Ray folders; any other path in
    that file (the run root is data) decides nothing about which processes die."""
    cdir = tmp_path / "case"
    cdir.mkdir()
    marker = tmp_path / name
    (cdir / casedir.RAY_TMPDIR_FILE).write_text(f"{marker}\n")
    daemon = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", f"--temp-dir={marker}"], start_new_session=True
    )
    try:
        status = launch.run_case(cdir, fake("ok", str(cdir)), {}, None, None, 1, kill_grace_s=1.0, poll_s=0.1)
        assert status["status"] == "completed"
        if swept:
            assert daemon.wait(timeout=5) is not None
        else:
            assert daemon.poll() is None
    finally:
        daemon.kill()


def make_root(tmp_path: Path, names: list[str]) -> RunRoot:
    class C:
        def __init__(self, name: str) -> None:
            self.name, self.overrides = name, {}

    return RunRoot.create(
        tmp_path,
        "t",
        matrix="m",
        matrix_file=None,
        seed=1,
        steps=3,
        cases=[C(n) for n in names],
        environment={},
    )


def options(script: str, **kw) -> launch.LaunchOptions:
    kw.setdefault("kill_grace_s", 1.0)
    kw.setdefault("poll_s", 0.1)
    return launch.LaunchOptions(command=tuple(fake(script)), **kw)


def test_retries_only_transient_failures(tmp_path: Path) -> None:
    root = make_root(tmp_path, ["a"])
    [flaky] = launch.run_cases(root, [("a", CONFIG)], options("flaky", retries=1))
    assert flaky["status"] == "completed" and flaky["attempt"] == 2
    assert (root.path / "a" / "metrics.attempt1.jsonl").is_file()
    assert [r["step"] for r in casedir.read_metrics(root.path / "a").records] == [1, 2, 3]
    for script, status in (("config_error", "failed"), ("cuda_oom", "oom")):
        root = make_root(tmp_path / script, ["a"])
        [st] = launch.run_cases(root, [("a", CONFIG)], options(script, retries=3))
        assert st["status"] == status and st["attempt"] == 1, st
    assert st["reason"].startswith("CUDA") or "OutOfMemoryError" in st["reason"]


def test_config_error_reason(tmp_path: Path) -> None:
    root = make_root(tmp_path, ["a"])
    [st] = launch.run_cases(root, [("a", CONFIG)], options("config_error", retries=3))
    assert st["status"] == "failed" and st["exit_code"] == 2 and st["attempt"] == 1
    assert st["reason"].startswith("config error: ValueError: config.yaml: zero.offload")


def test_run_cases_resume_skips_completed_and_writes_summary(tmp_path: Path) -> None:
    root = make_root(tmp_path, ["a", "b"])
    out = io.StringIO()
    first = launch.run_cases(root, [("a", CONFIG), ("b", CONFIG)], options("ok"), PlainProgress([], out))
    assert [s["status"] for s in first] == ["completed", "completed"]
    assert "[a] step 3/3 score 0.300" in out.getvalue() and "[b] completed" in out.getvalue()
    mtime = (root.path / "a" / "status.json").stat().st_mtime_ns
    again = launch.run_cases(root, [("a", CONFIG), ("b", CONFIG)], options("crash"))
    assert [s["status"] for s in again] == ["completed", "completed"]
    assert (root.path / "a" / "status.json").stat().st_mtime_ns == mtime
    rows = summary.read_summary(root.path / "summary.tsv")
    assert [(r["case"], r["status"], r["steps_completed"]) for r in rows] == [("a", "completed", "3")] * 1 + [
        ("b", "completed", "3")
    ]
    assert root.manifest["ended_at"] and not (root.path / "lock").exists()


def test_make_progress_plain_when_not_a_terminal() -> None:
    assert isinstance(make_progress([("a", 3)], io.StringIO()), PlainProgress)


DRIVER = textwrap.dedent(
    """
    import sys
    from zbench.config import load_case_config
    from zbench.harness import launch
    from zbench.runroot.root import RunRoot
    root = RunRoot.open(sys.argv[1])
    opts = launch.LaunchOptions(command=(sys.executable, sys.argv[2], sys.argv[3]), kill_grace_s=float(sys.argv[4]),
                                poll_s=0.1)
    try:
        launch.run_cases(root, [("a", load_case_config(sys.argv[5])), ("b", load_case_config(sys.argv[5]))], opts)
    except launch.RunInterrupted as e:
        sys.exit(e.exit_code)
    """
)


@pytest.mark.parametrize(
    "mode,grace,signals,sig",
    [("forever", 5.0, 1, signal.SIGINT), ("ignore-term", 30.0, 2, signal.SIGINT),
     ("forever", 5.0, 1, signal.SIGHUP)],  # a dropped ssh session stops the run as Ctrl-C does
)
def test_sigint_stops_run(tmp_path: Path, mode: str, grace: float, signals: int, sig: int) -> None:
    root = make_root(tmp_path, ["a", "b"])
    cfg = tmp_path / "config.yaml"
    cfg.write_text(dump_yaml(CONFIG))
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(root.path), str(FAKE / "spawner.py"), mode, str(grace), str(cfg)]
    )
    cdir = root.path / "a"
    deadline = time.monotonic() + 20
    while not ((cdir / "pids").exists() and (cdir / "metrics.jsonl").exists()):
        assert time.monotonic() < deadline and driver.poll() is None, "case never started"
        time.sleep(0.1)
    pids = [int(p) for p in (cdir / "pids").read_text().split()]
    engine = [p.pid for p in psutil.Process(driver.pid).children()]
    t0 = time.monotonic()
    for _ in range(signals):
        driver.send_signal(sig)
        time.sleep(0.5)
    assert driver.wait(timeout=15) == 130
    assert time.monotonic() - t0 < grace  # a second SIGINT does not wait out the grace period
    assert_gone(pids + engine)
    assert casedir.read_status(cdir)["status"] == "interrupted"
    assert casedir.read_status(root.path / "b") is None
    rows = summary.read_summary(root.path / "summary.tsv")
    assert [(r["case"], r["status"]) for r in rows] == [("a", "interrupted"), ("b", "pending")]
    assert not (root.path / "lock").exists() and root.manifest["ended_at"]
    # Every config.yaml was written up front, so the run resumes from the run root alone.
    resumed = launch.run_cases(root, root.case_configs(), options("ok"))
    assert [(s["status"], s["attempt"]) for s in resumed] == [("completed", 2), ("completed", 1)]


def test_runner_profiles(tmp_path: Path) -> None:
    assert {"local", "ray"} <= set(available_runners())
    local = load_runner_profile("local")
    assert local.case_env()["ZBENCH_RAY_ADDRESS"] == "" and "ZBENCH_NUM_WORKERS" not in local.case_env()
    assert local.command()[1:] == ("-m", "zbench.engine")
    assert load_runner_profile("ray").case_env()["ZBENCH_RAY_ADDRESS"] == "auto"
    with pytest.raises(ValueError, match=r"unknown runner profile 'rey' \(did you mean 'ray'\?\)"):
        load_runner_profile("rey")
    bad = tmp_path / "mine.yaml"
    bad.write_text("ray_adress: auto\n")
    with pytest.raises(
        ValueError, match=r"mine.yaml: unknown key 'ray_adress' \(did you mean 'ray_address'\?\)"
    ):
        load_runner_profile(str(bad))
    bad.write_text("ray_address: 'http//x'\nnum_workers: 4\nenv: {NCCL_DEBUG: INFO}\n")
    with pytest.raises(ValueError, match="ray_address 'http//x' is not valid"):
        load_runner_profile(str(bad))
    bad.write_text("ray_address: 10.0.0.1:6379\nnum_workers: 4\nenv: {NCCL_DEBUG: INFO}\n")
    env = load_runner_profile(str(bad)).case_env()
    assert env == {"NCCL_DEBUG": "INFO", "ZBENCH_RAY_ADDRESS": "10.0.0.1:6379", "ZBENCH_RAY_NODE_IP": ""}


def test_status_json_keys(tmp_path: Path) -> None:
    status = json.loads(json.dumps(run(tmp_path, "ok")))
    assert set(status) == {
        "status", "attempt", "exit_code", "reason", "last_step", "started_at", "ended_at", "warnings",
    }  # fmt: skip
    assert os.path.basename(summary.SUMMARY) == "summary.tsv"


def test_reason_and_patterns() -> None:
    log = 'x\n(WorkerDict pid=12) Traceback (most recent call last):\n(WorkerDict pid=12) ray.exceptions.RayTaskError: "boom"\nbye\n'
    assert launch.reason_from_log(log) == 'ray.exceptions.RayTaskError: "boom"'
    assert launch.reason_from_log("just a line\n\n") == "just a line"
    assert launch.TRANSIENT_PATTERNS.search("torch.distributed.DistBackendError: NCCL error: remote error")
    assert launch.TRANSIENT_PATTERNS.search("[E] Gloo connectFullMesh failed: Connection reset by peer")
    assert not launch.TRANSIENT_PATTERNS.search("initialising gloo process group, connected 2 ranks")
    assert launch.OOM_PATTERNS.search("Task was killed due to the node running low on memory.")


def test_options_for_profile() -> None:
    opts = launch.options_for_profile(load_runner_profile("ray"), step_timeout_s=60, retries=0)
    assert opts.env["ZBENCH_RAY_ADDRESS"] == "auto" and opts.command[-2:] == ("-m", "zbench.engine")
    with pytest.raises(ValueError, match="step_timeout_s must be > 0"):
        launch.LaunchOptions(step_timeout_s=0)


def test_live_progress_table(tmp_path: Path) -> None:
    from rich.console import Console

    from zbench.harness.progress import LiveProgress

    cdir = tmp_path / "a"
    cdir.mkdir()
    (cdir / "metrics.jsonl").write_text(
        '{"step": 1, "critic/score/mean": 0.25, "perf/throughput": 12.5, "perf/cpu_memory_used_gb": 3.5}\n{"step": 2'
    )
    out = io.StringIO()
    progress = LiveProgress([("a", 4), ("b", 4)], Console(file=out, force_terminal=True, width=120))
    progress.case_started("a", cdir, 1, 4)
    progress.poll()
    console = Console(file=io.StringIO(), width=120)
    console.print(progress.table())
    text = console.file.getvalue()
    assert "1/4" in text and "0.250" in text and "12.5" in text and "3.50" in text and "pending" in text


def test_real_ray_daemons_do_not_survive_a_killed_case(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    cdir = tmp_path / "case"
    status = run(tmp_path, "ray_crash", step_timeout_s=120.0)
    assert status["status"] == "failed" and status["exit_code"] == -signal.SIGKILL, status
    assert status["reason"].startswith("killed by SIGKILL without an OOM message")
    log = (cdir / "train.log").read_text()
    worker = int(log.split("worker pid ")[1].split()[0])
    assert_gone([worker])
    assert not procs.processes_mentioning(str(casedir.ray_tmpdir(cdir)))
    shutil.rmtree(casedir.ray_tmpdir(cdir), ignore_errors=True)


def test_attempt_after_a_checkpoint_keeps_the_metrics(tmp_path):
    """A retried or resumed case with a checkpoint continues its curve: metrics.jsonl stays (and is archived);
    without one, the new attempt starts a fresh file."""
    from zbench.harness.launch import _prepare_attempt

    case = tmp_path / "case"
    case.mkdir()
    (case / "metrics.jsonl").write_text('{"step": 1}\n')
    (case / "result.json").write_text("{}")
    _prepare_attempt(case, 2)
    assert not (case / "metrics.jsonl").exists() and (case / "metrics.attempt1.jsonl").exists()
    assert not (case / "result.json").exists() and (case / "result.attempt1.json").exists()
    (case / "ckpt").mkdir()
    (case / "ckpt" / "state.json").write_text('{"step": 2, "tag": "step_2", "seed": 1}')
    (case / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    _prepare_attempt(case, 3)
    assert (case / "metrics.jsonl").read_text() == (case / "metrics.attempt2.jsonl").read_text()


def test_a_case_timeout_is_not_retried_a_hang_is(tmp_path: Path) -> None:
    # the whole-case limit would be spent again by a second attempt; a hang (step timeout) may not recur
    root = make_root(tmp_path / "case", ["a"])
    [st] = launch.run_cases(root, [("a", CONFIG)], options("slow", retries=2, case_timeout_s=1.5))
    assert st["status"] == "timeout" and st["reason"].startswith("case timeout") and st["attempt"] == 1, st
    root = make_root(tmp_path / "step", ["a"])
    [st] = launch.run_cases(root, [("a", CONFIG)], options("hang", retries=1, step_timeout_s=1.0))
    assert st["status"] == "timeout" and "case timeout" not in st["reason"] and st["attempt"] == 2, st
