"""Where a hung case hangs: Python stacks of the engine's processes, printed into `train.log` before a timeout kills
them.

Every engine process (the trainer and each Ray worker) calls `enable_stack_dumps(case_dir)` as it starts: it has
`faulthandler` print all its threads' stacks to stderr on SIGUSR1, and records its pid (with its start time, so a
reused pid is never signalled, and its host) in `<case>/stack_pids`. When the launcher's step or case timeout fires, it
signals those processes (`request_stack_dumps`), gives Ray a moment to forward its workers' output to the
trainer's log, then kills the case as before. Only processes that registered the handler are signalled: for any
other process SIGUSR1 is fatal.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import socket
import sys
import time
from pathlib import Path

import psutil

from zbench.runroot.casedir import STACK_PIDS

STACK_SIGNAL = signal.SIGUSR1


def enable_stack_dumps(case_dir: str | os.PathLike[str]) -> None:
    """Print every thread's stack to stderr on SIGUSR1, and record this process in the case's `stack_pids`."""
    faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    _register(case_dir)


def forward_stack_dumps(case_dir: str | os.PathLike[str], serving_dir: str | os.PathLike[str]) -> None:
    """Record this process in the case's `stack_pids`, but answer SIGUSR1 by passing it to the processes registered
    in `serving_dir`: a trial's client (`zbench.engine.session`), whose trial runs in a session's processes."""

    def forward(signum: int, frame: object) -> None:
        for p in registered(Path(serving_dir)):
            with contextlib.suppress(psutil.Error):
                p.send_signal(STACK_SIGNAL)

    signal.signal(STACK_SIGNAL, forward)
    _register(case_dir)


def _register(case_dir: str | os.PathLike[str]) -> None:
    with contextlib.suppress(OSError, psutil.Error):
        me = psutil.Process()
        with (Path(case_dir) / STACK_PIDS).open("a") as f:
            f.write(f"{me.pid} {me.create_time():.3f} {socket.gethostname()} {' '.join(me.cmdline()[:3])}\n")


def registered(case_dir: Path) -> list[psutil.Process]:
    """The live processes recorded in `stack_pids` on this host (same pid and start time; workers of a Ray cluster
    on other nodes are out of reach)."""
    alive: list[psutil.Process] = []
    host = socket.gethostname()
    with contextlib.suppress(OSError):
        for line in (case_dir / STACK_PIDS).read_text().splitlines():
            pid, created, where, *_ = [*line.split(), "", "", ""]
            if where != host:
                continue
            with contextlib.suppress(ValueError, psutil.Error):
                p = psutil.Process(int(pid))
                if abs(p.create_time() - float(created)) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
    return alive


def request_stack_dumps(targets: list[psutil.Process], wait_s: float = 3.0) -> int:
    """Signal registered processes (`registered`) to print their stacks, wait `wait_s` for the output to reach the
    log, and return how many were signalled."""
    signalled = 0
    for p in targets:
        with contextlib.suppress(psutil.Error):
            p.send_signal(STACK_SIGNAL)
            signalled += 1
    if signalled:
        time.sleep(wait_s)
    return signalled


def forget(case_dir: Path) -> None:
    """Drop the record once the case's processes are gone."""
    with contextlib.suppress(FileNotFoundError):
        (case_dir / STACK_PIDS).unlink()
