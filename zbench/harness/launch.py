"""Run cases as isolated processes: one process group per case, a watchdog, classification, retries.

Each case runs as ``<command> <case_dir>`` (normally ``python -m zbench.engine <case_dir>``) in its own session,
with stdout and stderr appended to ``<case_dir>/train.log``. A watchdog thread kills the whole process group
when the heartbeat stalls (step timeout) or the case runs too long (case timeout). Ray daemonizes its raylet and
GCS out of that group, so after every case any process whose command line mentions the case's Ray temp dir
(``ZBENCH_RAY_TMPDIR``, set here, or the one the engine recorded in ``<case_dir>/ray_tmpdir``) is killed as
well, with its descendants and every descendant of the case the watchdog saw while it ran.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

import psutil

from zbench import procs, stacks
from zbench.config import RunConfig, dump_yaml
from zbench.harness.runner_profile import RunnerProfile
from zbench.procs import CARRIED_WARNING, OOM_PATTERNS
from zbench.runroot import casedir
from zbench.runroot.casedir import RunRootError
from zbench.runroot.root import RunRoot

CONFIG_ERROR_EXIT = 2  # the engine's exit code for an invalid config: never retried
INTERRUPTED_EXIT = 130  # what the CLI exits with after SIGINT/SIGTERM
CASE_TIMEOUT = "case timeout"  # how a whole-case time limit names itself in a reason: never retried

# A lost worker or a broken collective near the end of the log: worth another attempt.
TRANSIENT_PATTERNS = re.compile(
    r"ActorDiedError|RayActorError|ActorUnavailableError|WorkerCrashedError|NodeDiedError"
    r"|(?i:(?:nccl|gloo)[^\n]*(?:connection (?:reset|refused|closed)|connect(?:ion)? (?:failed|timed out)"
    r"|timed out|broken pipe|remote error|system error))"
)
# Dynamo's warning when a compiled function meets more variants than its limit: what it stopped compiling runs eager
RECOMPILE_LIMIT = re.compile(r"torch\._dynamo hit config\.(?:accumulated_)?(?:recompile|cache_size)_limit[^\n]*")
RECOMPILE_WARNING = "torch.compile hit its recompile limit"  # how the warning a case gets for it begins
CARRIED = re.compile(re.escape(CARRIED_WARNING) + r" \((.*?)\); this trial")  # `carried_line`'s
_TRANSIENT_TAIL_LINES = 200  # a transient cause shows at the end of the log, not in start-up chatter


def recompile_warning(log_text: str) -> str | None:
    """The warning a case gets when its train.log shows torch.compile's recompile limit hit, or None."""
    hit = RECOMPILE_LIMIT.search(log_text)
    if hit is None:
        return None
    return (f"{RECOMPILE_WARNING} ({hit.group(0).strip()}, train.log): what it stopped compiling ran eager from "
            "then on, so this case's times are not those of its compiled path")


def carried_warning(log_text: str) -> str | None:
    """The warning a case gets when, at its start, its processes still held models of earlier trials
    (`zbench.procs.CARRIED_WARNING`, `zbench.engine.workers.carried_line`: a trial served by a session's
    processes), or None: its memory figures then include theirs."""
    held = list(dict.fromkeys(CARRIED.findall(log_text)))
    if not held:
        return None
    return f"{CARRIED_WARNING} (train.log: {'; '.join(held)}): its memory figures include theirs and overstate " \
           "this geometry's"


# The final line of a Python traceback, optionally behind a Ray "(pid=...)" style prefix.
EXCEPTION_LINE = re.compile(
    r"^(?:\([^)]*\)\s*)?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failure|Died)\b.*)$"
)

_LOG_SCAN_BYTES = 4 << 20  # classify from the last 4 MiB of an attempt's log



# ---------------------------------------------------------------- one case


@dataclass(eq=False)  # identity semantics: kept in a set of active cases
class _Watch:
    """Shared state between a running case, its watchdog thread and the signal handler."""

    proc: subprocess.Popen[bytes]
    pgid: int
    stop: threading.Event
    case_dir: Path
    seen: dict[int, psutil.Process] = field(default_factory=dict)
    fired: str | None = None  # "step timeout ..." / "case timeout ..." when the watchdog killed the case
    interrupted: bool = False

    def remember_descendants(self) -> None:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(child.pid, child)

    def leftovers(self) -> list[psutil.Process]:
        # Ray workers retitle themselves (ray::Worker...): they are reached as descendants of their raylet.
        return procs.alive([*self.seen.values(), *procs.case_processes(self.case_dir)])


def _heartbeat_mtime(case_dir: Path) -> float | None:
    newest = None
    for name in (casedir.HEARTBEAT, casedir.METRICS):
        with contextlib.suppress(FileNotFoundError):
            m = (case_dir / name).stat().st_mtime
            newest = m if newest is None else max(newest, m)
    return newest


def _watchdog(
    watch: _Watch,
    case_dir: Path,
    case_timeout_s: float | None,
    step_timeout_s: float | None,
    grace_s: float,
    poll_s: float,
    tick: Callable[[], None] | None,
) -> None:
    started = time.time()
    while watch.proc.poll() is None:
        watch.remember_descendants()
        now = time.time()
        beat = _heartbeat_mtime(case_dir)
        # Before the first step (no heartbeat of this attempt yet) the step timeout counts from the start.
        last = max(beat, started) if beat is not None else started
        if watch.stop.is_set():
            watch.interrupted = True
        elif case_timeout_s is not None and now - started > case_timeout_s:
            watch.fired = f"{CASE_TIMEOUT}: still running after {case_timeout_s:g} s"
        elif step_timeout_s is not None and now - last > step_timeout_s:
            watch.fired = f"step timeout: no heartbeat for {step_timeout_s:g} s"
        if watch.fired:  # a hang: first ask the engine's processes where they are
            dumping = stacks.registered(case_dir)
            with contextlib.suppress(OSError), (case_dir / casedir.TRAIN_LOG).open("ab") as logf:
                logf.write(f"==== zbench: {watch.fired}; the stacks of its {len(dumping)} Python processes follow\n"
                           .encode())
            stacks.request_stack_dumps(dumping)
        if watch.interrupted or watch.fired:
            procs.kill_processes(watch.pgid, watch.leftovers(), grace_s)
            return
        if tick is not None:
            with contextlib.suppress(Exception):  # a display error must not stop the watchdog
                tick()
        watch.stop.wait(poll_s)


def _read_attempt_log(log: Path, offset: int) -> str:
    try:
        with log.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(offset, size - _LOG_SCAN_BYTES))
            return f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def exception_line(text: str) -> str | None:
    """The last line of ``text`` that names an exception (a traceback's final line), if any."""
    for ln in reversed(text.splitlines()):
        ln = ln.strip()
        m = EXCEPTION_LINE.match(ln)
        if m and not ln.startswith("Traceback"):
            return m.group(1)[:300]
    return None


def reason_from_log(text: str) -> str:
    """One line explaining a failure: the last exception line of the log, else its last non-empty line."""
    found = exception_line(text)
    if found:
        return found
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if OOM_PATTERNS.search(ln):
            return ln[:300]
    return lines[-1][:300] if lines else ""


def _exit_text(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _result_complete(case_dir: Path) -> bool:
    result = casedir.read_result(case_dir)
    if not result:
        return False
    done, target = result.get("steps_completed"), result.get("steps_target")
    return isinstance(done, int) and isinstance(target, int) and done >= target


def _last_step(case_dir: Path) -> int:
    return max((r["step"] for r in casedir.read_metrics(case_dir).records), default=0)


@dataclass(frozen=True)
class Attempt:
    """The outcome of one attempt: the status written to status.json and whether a retry may help."""

    status: dict[str, Any]
    retryable: bool
    config_error: bool


def _classify(
    case_dir: Path, watch: _Watch, exit_code: int | None, log_text: str, warnings: list[str],
    oom_kills: OomKills | None = None,
) -> tuple[str, str, bool, bool]:
    """(status, reason, retryable, config_error) of a finished attempt; `oom_kills` says that the kernel's OOM
    killer ended processes while it ran: counted in the case's own memory cgroup, the attempt is `oom` (a process
    ended by SIGKILL leaves no message: the engine, a worker, a trial's server); counted machine-wide, a note."""
    reason = reason_from_log(log_text)
    if _result_complete(case_dir):
        if exit_code != 0:
            warnings.append(
                f"process ended with {_exit_text(exit_code)} after completing all steps: {reason}"
            )
        return "completed", "", False, False
    if watch.interrupted:
        return "interrupted", "interrupted by signal", False, False
    if exit_code == CONFIG_ERROR_EXIT:
        return "failed", f"config error: {reason}" if reason else "config error", False, True
    if oom_kills and oom_kills.own:
        return "oom", f"the kernel's OOM killer ended a process during this attempt ({oom_kills.text}); then: " \
                      f"{watch.fired or reason or _exit_text(exit_code)}"[:400], False, False
    if oom_kills:
        warnings.append(f"the kernel's OOM killer ended a process on this machine during this attempt "
                        f"({oom_kills.text}), maybe one of this case's")
    if watch.fired:
        # a hang (step timeout) may be transient; a case out of its whole-case time would spend that time again
        return "timeout", watch.fired, not watch.fired.startswith(CASE_TIMEOUT), False
    killed = exit_code in (-signal.SIGKILL, 128 + signal.SIGKILL)
    if OOM_PATTERNS.search(log_text) or (killed and re.search(r"\bKilled\b", log_text)):
        oom_line = next((ln.strip() for ln in reversed(log_text.splitlines()) if OOM_PATTERNS.search(ln)), "")
        return "oom", (oom_line or reason or _exit_text(exit_code))[:300], False, False
    if exit_code == 0:
        return "failed", "exited 0 without a complete result.json", False, False
    if killed and not exception_line(log_text):
        reason = (
            "killed by SIGKILL without an OOM message in train.log (check the kernel log for the OOM killer)"
        )
    tail = "\n".join(log_text.splitlines()[-_TRANSIENT_TAIL_LINES:])
    retryable = bool(TRANSIENT_PATTERNS.search(tail))
    return "failed", reason or _exit_text(exit_code), retryable, False


def _prepare_attempt(case_dir: Path, attempt: int) -> None:
    """Set aside files a previous attempt left, so the new attempt's metrics and result stand alone.

    A case with a checkpoint continues from it: its metrics.jsonl stays (archived as a copy), and the engine
    drops the records after the checkpoint's step itself, so the curve runs on unbroken from step 1."""
    resumes = casedir.read_checkpoint_state(case_dir) is not None
    for name in (casedir.METRICS, casedir.RESULT):
        p = case_dir / name
        if p.exists():
            stem, dot, ext = name.partition(".")
            archived = case_dir / f"{stem}.attempt{attempt - 1}{dot}{ext}"
            if resumes and name == casedir.METRICS:
                shutil.copyfile(p, archived)
            else:
                os.replace(p, archived)
    with contextlib.suppress(FileNotFoundError):
        (case_dir / casedir.HEARTBEAT).unlink()


@dataclass(frozen=True, slots=True)
class OomKills:
    """The kernel's OOM killer ended processes while an attempt ran: where that was counted, and whether that count
    is the case's own (its memory cgroup: a container's) or the whole machine's."""

    text: str  # `<file> oom_kill a -> b`
    own: bool


def _oom_kills_since(before: tuple[int, str] | None) -> OomKills | None:
    """What the OOM-kill counter read at an attempt's start says now, when it rose."""
    after = procs.oom_kill_count()
    if before is None or after is None or after[1] != before[1] or after[0] <= before[0]:
        return None
    return OomKills(f"{after[1]} oom_kill {before[0]} -> {after[0]}", after[1] != str(procs.SYSTEM_OOM_COUNTER))


def run_attempt(
    case_dir: str | os.PathLike[str],
    command: Sequence[str],
    env: Mapping[str, str] | None,
    case_timeout_s: float | None,
    step_timeout_s: float | None,
    attempt: int,
    *,
    stop: threading.Event | None = None,
    kill_grace_s: float = 10.0,
    poll_s: float = 0.5,
    tick: Callable[[], None] | None = None,
) -> Attempt:
    """``run_case`` returning also whether the failure is transient (retryable) or a config error."""
    cdir = Path(case_dir).resolve()
    cdir.mkdir(parents=True, exist_ok=True)
    if attempt > 1 or (cdir / casedir.METRICS).exists() or (cdir / casedir.RESULT).exists():
        _prepare_attempt(cdir, max(attempt, 2))
    stacks.forget(cdir)
    ray_dir = casedir.ray_tmpdir(cdir)
    child_env = {
        **os.environ, **(env or {}), "ZBENCH_RAY_TMPDIR": str(ray_dir), "PYTHONUNBUFFERED": "1",
        procs.SUPERVISOR_ENV: procs.identity(),  # the engine stops itself when this process is gone
        procs.ATTEMPT_ENV: str(attempt),  # trainer.fault fires on the first attempt only
    }  # fmt: skip
    log = cdir / casedir.TRAIN_LOG
    started_at = casedir.utc_now()
    status: dict[str, Any] = {
        "status": "running", "attempt": attempt, "exit_code": None, "reason": "", "last_step": 0,
        "started_at": started_at, "ended_at": None, "warnings": [],
    }  # fmt: skip
    casedir.write_status(cdir, status)
    stop = stop or threading.Event()
    kills_before = procs.oom_kill_count()
    with log.open("ab") as logf:
        logf.write(f"==== zbench attempt {attempt} started {started_at}: {' '.join(command)}\n".encode())
        logf.flush()
        offset = logf.tell()
        proc = subprocess.Popen(
            list(command), cwd=cdir, env=child_env, stdin=subprocess.DEVNULL, stdout=logf,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    watch = _Watch(proc=proc, pgid=proc.pid, stop=stop, case_dir=cdir)
    _ACTIVE.add(watch)
    try:
        dog = threading.Thread(
            target=_watchdog, name=f"zbench-watchdog-{cdir.name}", daemon=True,
            args=(watch, cdir, case_timeout_s, step_timeout_s, kill_grace_s, poll_s, tick),
        )  # fmt: skip
        dog.start()
        exit_code = proc.wait()
        dog.join()
        # The engine is gone; whatever it left behind (Ray daemons, stray workers) goes too.
        procs.kill_processes(watch.pgid, watch.leftovers(), min(kill_grace_s, 5.0))
    finally:
        _ACTIVE.discard(watch)
        stacks.forget(cdir)
        procs.remove_ray_tmpdir(cdir)
    log_text = _read_attempt_log(log, offset)
    warnings: list[str] = []
    state, reason, retryable, config_error = _classify(cdir, watch, exit_code, log_text, warnings,
                                                       _oom_kills_since(kills_before))
    warnings += [w for w in (recompile_warning(log_text), carried_warning(log_text)) if w]
    status.update(
        status=state, exit_code=exit_code, reason=" ".join(reason.split()), last_step=_last_step(cdir),
        ended_at=casedir.utc_now(), warnings=warnings,
    )  # fmt: skip
    casedir.write_status(cdir, status)
    with log.open("ab") as logf:
        logf.write(
            f"==== zbench attempt {attempt} ended {status['ended_at']}: {state} ({_exit_text(exit_code)})\n".encode()
        )
    return Attempt(status, retryable, config_error)


def run_case(
    case_dir: str | os.PathLike[str],
    command: Sequence[str],
    env: Mapping[str, str] | None,
    case_timeout_s: float | None,
    step_timeout_s: float | None,
    attempt: int,
    *,
    stop: threading.Event | None = None,
    kill_grace_s: float = 10.0,
    poll_s: float = 0.5,
    tick: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Run one attempt of a case and return its status dict (also written to ``<case_dir>/status.json``).

    ``command`` is the full argv (the case dir included where the command needs it); it runs with cwd
    ``case_dir`` in its own process group, output appended to train.log. Setting ``stop`` kills the case and
    marks it interrupted.
    """
    return run_attempt(
        case_dir, command, env, case_timeout_s, step_timeout_s, attempt,
        stop=stop, kill_grace_s=kill_grace_s, poll_s=poll_s, tick=tick,
    ).status  # fmt: skip


DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)  # the results' disk, not the run, is at fault


def _disk_error(err: OSError, run_root: RunRoot) -> str:
    return (f"cannot write {err.filename or run_root.path}: {err.strerror}; the run stopped at this write, and "
            f"what it recorded before is intact. Free space (or make the results writable), then "
            f"`zbench resume {run_root.path}`")


# Cases running in this process, so that a second signal can kill them at once.
_ACTIVE: set[_Watch] = set()


# ---------------------------------------------------------------- many cases


class Progress(Protocol):
    """What run_cases reports to (zbench.harness.progress implements it)."""

    def case_started(self, name: str, case_dir: Path, attempt: int, steps_target: int | None) -> None: ...

    def poll(self) -> None: ...

    def case_finished(self, name: str, status: Mapping[str, Any]) -> None: ...


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """How run_cases starts and supervises each case."""

    command: tuple[str, ...] = (sys.executable, "-m", "zbench.engine")  # the case dir is appended
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment (runner profile)
    case_timeout_s: float | None = None  # whole-case limit per attempt; None = no limit
    step_timeout_s: float | None = None  # longest allowed silence of heartbeat/metrics; None = no limit
    retries: int = 1  # extra attempts for transient failures (step timeout, lost worker, NCCL/gloo errors)
    kill_grace_s: float = 10.0  # SIGTERM → SIGKILL delay when stopping a case
    poll_s: float = 0.5  # watchdog and progress poll interval
    before_attempt: Callable[[], None] | None = None  # called before each attempt (a trial session's server)
    on_locked: Callable[[], None] | None = None  # called once the run root's lock is held (resume's record)

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        for name in ("case_timeout_s", "step_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 seconds or None (no limit), got {value}")


def options_for_profile(
    profile: RunnerProfile,
    *,
    case_timeout_s: float | None = None,
    step_timeout_s: float | None = None,
    retries: int = 1,
) -> LaunchOptions:
    """LaunchOptions that start cases the way a runner profile says (its interpreter and environment)."""
    return LaunchOptions(
        command=profile.command(), env=profile.case_env(), case_timeout_s=case_timeout_s,
        step_timeout_s=step_timeout_s, retries=retries,
    )  # fmt: skip


class RunInterrupted(Exception):
    """SIGINT/SIGTERM stopped a run; the CLI should exit with ``exit_code`` (130)."""

    exit_code = INTERRUPTED_EXIT

    def __init__(self, signum: int, statuses: list[dict[str, Any]]) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum
        self.statuses = statuses


def _write_configs(run_root: RunRoot, cases: Sequence[tuple[str, RunConfig]]) -> set[str]:
    """Write every case's config.yaml up front (so a resume finds them all); return the cases whose config on disk
    is the one given now (only those can count as completed)."""
    same_config = set()
    for name, cfg in cases:
        config_text = dump_yaml(cfg)
        cdir = run_root.case_dir(name)
        cdir.mkdir(exist_ok=True)
        path = cdir / casedir.CONFIG
        if path.is_file() and path.read_text(encoding="utf-8") == config_text:
            same_config.add(name)
        else:
            casedir.atomic_write_text(path, config_text)
    return same_config


@dataclass(frozen=True)
class CaseState:
    """What a case directory says about a case before a new attempt: completed (its status), or the next attempt."""

    completed: dict[str, Any] | None
    next_attempt: int
    reaped: int  # live processes of an earlier supervisor stopped first


def case_state(case_dir: Path, steps: int, same_config: bool) -> CaseState:
    """Decide from everything the case directory holds whether a case is done, after stopping any process an
    earlier supervisor left running (so that two attempts never run at once).

    Completed means a result.json with every step and a metrics record for each of steps 1..``steps``, whatever
    status.json says (a harness killed after the last step never wrote it). A status.json or result.json that is
    there but unreadable or foreign is an error naming it, never a fresh start."""
    reaped = procs.reap_case(case_dir)
    status = casedir.load_status(case_dir)
    result = casedir.load_result(case_dir)
    recorded = {r["step"] for r in casedir.read_metrics(case_dir).records}
    complete = (
        result is not None and result["steps_target"] == steps and result["steps_completed"] >= steps
        and recorded >= set(range(1, steps + 1))
    )  # fmt: skip
    leftovers = result is not None or (case_dir / casedir.METRICS).exists()
    last = max(status["attempt"] if status else 0, casedir.archived_attempts(case_dir), 1 if leftovers else 0)
    if same_config and complete:
        if status is None or status["status"] != "completed":
            said = f"status.json said {status['status']!r}" if status else "status.json was missing"
            status = {
                **(status or {}), "status": "completed", "attempt": max(last, 1), "exit_code": None, "reason": "",
                "last_step": max(recorded), "ended_at": (status or {}).get("ended_at") or casedir.utc_now(),
                "warnings": [f"recorded as completed from result.json and metrics.jsonl ({said})"],
            }  # fmt: skip
            casedir.write_status(case_dir, status)
        return CaseState(status, last, reaped)
    return CaseState(None, last + 1, reaped)


def run_cases(
    run_root: RunRoot,
    cases: Sequence[tuple[str, RunConfig]],
    options: LaunchOptions,
    progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """Run ``cases`` — (name, config) in matrix order — under the run root's lock.

    Writes every case's config.yaml before the first starts; skips cases already completed with the same config
    (resume); retries transient failures up to ``options.retries`` times, never OOM or config errors; rewrites
    summary.tsv after every case. On SIGINT/SIGTERM the running case is killed (whole group), marked
    interrupted, the summary written, and RunInterrupted raised; a second signal kills at once.
    """
    stop = threading.Event()
    caught: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        caught.append(signum)
        stop.set()
        if len(caught) > 1:  # impatient second signal: no grace period
            for watch in list(_ACTIVE):
                procs.kill_processes(watch.pgid, watch.leftovers(), 0.0)

    in_main = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main:
        # SIGHUP too: a dropped ssh session stops the run cleanly instead of leaving the case to its own watch
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, on_signal)
    statuses: list[dict[str, Any]] = []
    tick: Callable[[], None] | None = progress.poll if progress is not None else None
    try:
        with run_root.lock("run"):
            try:
                if options.on_locked is not None:
                    options.on_locked()
                same_config = _write_configs(run_root, cases)
                for name, cfg in cases:
                    if stop.is_set():
                        break
                    cdir = run_root.case_dir(name)
                    state = case_state(cdir, cfg.steps, name in same_config)
                    if state.reaped:
                        print(f"[zbench] {name}: stopped {state.reaped} processes an earlier run left running",
                              file=sys.stderr, flush=True)
                    if state.completed is not None:
                        statuses.append(state.completed)
                        if progress is not None:
                            progress.case_finished(name, state.completed)
                        continue
                    attempt = state.next_attempt - 1
                    for retry in range(options.retries + 1):
                        attempt += 1
                        if options.before_attempt is not None:
                            options.before_attempt()
                        if progress is not None:
                            progress.case_started(name, cdir, attempt, cfg.steps)
                        outcome = run_attempt(
                            cdir, [*options.command, str(cdir.resolve())], options.env, options.case_timeout_s,
                            options.step_timeout_s, attempt, stop=stop, kill_grace_s=options.kill_grace_s,
                            poll_s=options.poll_s, tick=tick,
                        )  # fmt: skip
                        if progress is not None:
                            progress.case_finished(name, outcome.status)
                        if not outcome.retryable or stop.is_set() or retry == options.retries:
                            break
                    statuses.append(outcome.status)
                    run_root.write_summary()
            except OSError as err:
                if err.errno not in DISK_ERRNOS:
                    raise
                raise RunRootError(_disk_error(err, run_root)) from err
            finally:
                # Also after an error or an interrupt: the table on disk matches the case dirs. On a full or
                # read-only disk these fail too; the atomic writes then leave the previous files as they were.
                for write in (run_root.write_summary, lambda: run_root.update_manifest(ended_at=casedir.utc_now())):
                    try:
                        write()
                    except OSError as err:
                        if err.errno not in DISK_ERRNOS:
                            raise
                        print(f"[zbench] {_disk_error(err, run_root)}", file=sys.stderr, flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if caught:
        raise RunInterrupted(caught[0], statuses)
    return statuses
