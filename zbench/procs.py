"""Which processes belong to a case, how they are stopped, and how a case notices that its supervisor is gone.

A process is named by its pid AND its start time: a pid read back from a file (or the environment) alone could by
now belong to anyone. A case's processes are the ones it registered in ``<case>/stack_pids`` (checked that way),
those whose command line carries the case's Ray temp folder (Ray's daemons), and their descendants (Ray workers,
which retitle themselves).

The harness passes its own identity to the engine in ``ZBENCH_SUPERVISOR`` (``<pid>:<start time>``); the engine
watches it (``watch_supervisor``) and, when the harness is gone (SIGKILL, a dropped ssh), takes down its Ray and its
process group, so that no case ever runs without a watchdog.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from zbench import stacks
from zbench.runroot import casedir

SUPERVISOR_ENV = "ZBENCH_SUPERVISOR"  # "<pid>:<create time>" of the process supervising a case
ATTEMPT_ENV = "ZBENCH_ATTEMPT"  # the attempt number of this run of the case (trainer.fault fires on the first)
# where the engine's processes register (stack_pids): the case folder, or a trial session's (zbench.engine.session)
PROCESS_DIR_ENV = "ZBENCH_PROCESS_DIR"
SUPERVISOR_POLL_S = 1.0  # how often the engine checks that its supervisor is still there
_RAY_TMPDIR_NAME = re.compile(r"zbench-ray-[0-9a-f]{10}")


def identity(proc: psutil.Process | None = None) -> str:
    """``<pid>:<create time>`` of ``proc`` (default: this process), as SUPERVISOR_ENV carries it."""
    p = proc or psutil.Process()
    return f"{p.pid}:{p.create_time():.3f}"


def is_running(ident: str) -> bool:
    """Whether the process named by ``identity`` still runs (same pid and same start time, not a zombie)."""
    pid, _, created = ident.partition(":")
    try:
        p = psutil.Process(int(pid))
        return abs(p.create_time() - float(created)) < 0.01 and p.status() != psutil.STATUS_ZOMBIE
    except (ValueError, psutil.Error):
        return False


# ---------------------------------------------------------------- finding


def ray_markers(case_dir: Path) -> list[str]:
    """Strings whose presence in a command line marks a process as Ray started by this case.

    The folder the engine recorded counts only when it has the shape zbench gives Ray folders: a run root is data,
    and a file in it must not decide that unrelated processes get killed."""
    markers = {str(casedir.ray_tmpdir(case_dir))}
    recorded = casedir.recorded_ray_tmpdir(case_dir)
    if recorded and _RAY_TMPDIR_NAME.fullmatch(Path(recorded).name):
        markers.add(recorded)
    return sorted(markers)


def alive(procs: Sequence[psutil.Process]) -> list[psutil.Process]:
    """The processes of ``procs`` that still run (zombies count as gone)."""
    out = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def processes_mentioning(*markers: str) -> list[psutil.Process]:
    """Processes (other than this one) whose command line contains one of ``markers``."""
    found = []
    me = os.getpid()
    for p in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            args = p.info["cmdline"] or ()
            if p.info["pid"] != me and any(m in arg for arg in args for m in markers):
                found.append(p)
    return found


def with_descendants(procs: Sequence[psutil.Process]) -> list[psutil.Process]:
    """``procs`` and every descendant of them, each once."""
    out = {p.pid: p for p in procs}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            for child in p.children(recursive=True):
                out.setdefault(child.pid, child)
    return list(out.values())


def case_processes(case_dir: Path) -> list[psutil.Process]:
    """The live processes of a case on this host, other than this one: registered ones, its Ray, and their
    descendants."""
    me = os.getpid()
    found = [*stacks.registered(case_dir), *processes_mentioning(*ray_markers(case_dir))]
    return [p for p in alive(with_descendants(found)) if p.pid != me]


# ---------------------------------------------------------------- stopping


def group_alive(pgid: int | None) -> bool:
    """Whether a process group has a member that is not a zombie."""
    if pgid is None:
        return False
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # A group whose only members are zombies awaiting our wait() counts as gone.
    for p in psutil.process_iter(["pid", "status"]):
        with contextlib.suppress(psutil.Error):
            if os.getpgid(p.info["pid"]) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
    return False


def kill_processes(pgid: int | None, extra: Sequence[psutil.Process], grace_s: float) -> None:
    """SIGTERM a process group and extra processes, wait up to ``grace_s``, then SIGKILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if pgid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
        for p in alive(extra):
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        if sig == signal.SIGTERM:
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and (group_alive(pgid) or alive(extra)):
                time.sleep(0.1)
    psutil.wait_procs(alive(extra), timeout=2.0)


def reap_case(case_dir: Path, grace_s: float = 5.0) -> int:
    """Stop every live process of a case left by an earlier supervisor; return how many there were."""
    found = case_processes(case_dir)
    if found:
        kill_processes(None, found, grace_s)
    return len(found)


# How the warning begins that a served trial prints when its processes still hold models of earlier trials
# (`zbench.engine.workers.carried_line`); the launcher turns the line into the case's warning
CARRIED_WARNING = "models of an earlier trial are still alive in this case's processes"

# How an out-of-memory failure reads in a log or an error: CUDA's and torch's, the host allocator's, Python's, and
# Ray's memory monitor killing a worker
OOM_PATTERNS = re.compile(
    r"CUDA out of memory|CUDA error: out of memory|OutOfMemoryError|MemoryError|Cannot allocate memory"
    r"|running low on memory|exceeds the memory usage threshold"
)
SYSTEM_OOM_COUNTER = Path("/proc/vmstat")  # the whole machine's count: not the case's own


def _cgroup_oom_files(proc_cgroup: str, root: Path) -> list[Path]:
    """Where the memory cgroup of this process counts its OOM kills, from /proc/self/cgroup's text: cgroup v2's
    memory.events and v1's memory.oom_control, at the process's cgroup path and at the mount's root (which is the
    process's own cgroup inside a container). Lines not of the form `id:controllers:path` are skipped."""
    out: list[Path] = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.strip().lstrip("/")
        if controllers == "":  # v2
            out += [root / rel / "memory.events", root / "memory.events"]
        elif "memory" in controllers.split(","):
            out += [root / "memory" / rel / "memory.oom_control", root / "memory" / "memory.oom_control"]
    return out


def oom_kill_count(cgroup_root: Path = Path("/sys/fs/cgroup"), proc_cgroup: str | None = None
                   ) -> tuple[int, str] | None:
    """How many processes the kernel's OOM killer has ended, and where that was read: this process's memory cgroup
    (a container's own; `proc_cgroup`: /proc/self/cgroup's text), else the whole machine (/proc/vmstat,
    `SYSTEM_OOM_COUNTER`); None where the kernel says neither."""
    candidates: list[Path] = []
    with contextlib.suppress(OSError, UnicodeDecodeError):
        text = proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text()
        candidates = _cgroup_oom_files(text, cgroup_root)
    for path in [*candidates, SYSTEM_OOM_COUNTER]:
        with contextlib.suppress(OSError, UnicodeDecodeError, ValueError):
            for line in path.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value), str(path)
    return None


def remove_ray_tmpdir(case_dir: Path) -> None:
    """Remove the case's Ray temp folder (its sockets, logs and session files) once its processes are gone."""
    for marker in ray_markers(case_dir):
        shutil.rmtree(marker, ignore_errors=True)


# ---------------------------------------------------------------- the engine's side


def _stop_orphaned_case(case_dir: Path, supervisor: str) -> None:
    stop_case_and_exit(case_dir, f"supervisor {supervisor} is gone")


def stop_case_and_exit(case_dir: Path, why: str) -> None:
    """In the engine: take down the case's other processes, its Ray and its process group, and exit (1)."""
    print(f"[zbench] {why}: stopping this case (its Ray and process group)", flush=True)
    mine = {os.getpid()}
    others = [p for p in case_processes(case_dir) if p.pid not in mine]
    kill_processes(None, others, 2.0)
    remove_ray_tmpdir(case_dir)
    stacks.forget(case_dir)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgrp() == os.getpid():  # the case leads its own group: take the whole group
            os.killpg(os.getpgrp(), signal.SIGKILL)
    os._exit(1)


def watch_supervisor(case_dir: Path) -> threading.Thread | None:
    """In the engine: when ``ZBENCH_SUPERVISOR`` names a process, stop the case as soon as that process is gone.

    Returns the watching (daemon) thread, or None when no supervisor is named (the engine run by hand)."""
    supervisor = os.environ.get(SUPERVISOR_ENV, "").strip()
    if not supervisor:
        return None
    if not is_running(supervisor):
        print(f"[zbench] supervisor {supervisor} is not running; refusing to start unsupervised", file=sys.stderr)
        raise SystemExit(1)

    def loop() -> None:
        while is_running(supervisor):
            time.sleep(SUPERVISOR_POLL_S)
        _stop_orphaned_case(case_dir, supervisor)

    thread = threading.Thread(target=loop, name="zbench-supervisor-watch", daemon=True)
    thread.start()
    return thread
