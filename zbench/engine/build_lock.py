"""torch's lock on a JIT-built op, with its holder named, so that a holder that died cannot hang every later case.

DeepSpeed builds its ops (``cpu_adam`` for offload, the CPU accelerator's shared-memory comm op, ...) through
``torch.utils.cpp_extension``, which guards each op's build directory with a ``lock`` file (``FileBaton``): the
first process creates it, builds, and removes it; every other load, even one with nothing to build, waits until the
file is gone. A process killed while it holds the file (a case stopped by its step timeout or by ^C during its first
start, which compiles) leaves the file behind, and from then on every worker that loads that op waits forever: each
later case hangs in its setup until its step timeout, in every later run.

``NamedBaton`` takes torch's place in the processes that build (a case's Ray workers, the floor ranks). It writes
its holder (pid and start time, as ``zbench.procs.identity``, and host) into the file. A process that finds a file naming a process of this host
that has ended removes it: one about to load takes the lock and builds; one already waiting goes on as if the holder
had released it, and loads what is there (a build cut short fails that load, and the case's retry builds afresh).
Naming and removing both happen under an ``flock`` on a ``lock.guard`` file beside it, so two waiters never remove
a lock that a third has just taken. A file naming no one (left by a process without this class, or by one killed
between creating and naming it) is taken as stale once it is older than ``UNNAMED_STALE_S`` and no process works in
the build directory (a build runs its compiler there).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
from torch.utils import cpp_extension
from torch.utils.file_baton import FileBaton

from zbench import procs

UNNAMED_STALE_S = 120.0


def _building_in(directory: Path) -> bool:
    """Whether a process (the compiler, ninja) has its working directory in ``directory``. Processes whose
    directory can't be read (another user's, init) are passed over: the build directory is this user's."""
    for proc in psutil.process_iter():
        try:
            cwd = proc.cwd()
        except psutil.Error:
            continue
        if Path(cwd) == directory or directory in Path(cwd).parents:
            return True
    return False


def stale_reason(lock_file: Path) -> str | None:
    """Why the lock file no longer guards a build (its holder ended), or None while it may."""
    try:
        text = lock_file.read_text()
        age = time.time() - lock_file.stat().st_mtime
    except OSError:
        return None  # gone, or unreadable: leave it to torch
    try:
        info = json.loads(text)
    except ValueError:
        info = None
    if isinstance(info, dict) and isinstance(info.get("process"), str):
        if info.get("host") != socket.gethostname() or procs.is_running(info["process"]):
            return None
        return f"its holder, pid {info['process'].partition(':')[0]}, has ended"
    if age > UNNAMED_STALE_S and not _building_in(lock_file.parent):
        return f"it names no holder, is {age:.0f} s old and no build runs in its directory"
    return None


@contextlib.contextmanager
def _guarded(lock_file: str) -> Iterator[None]:
    fd = os.open(f"{lock_file}.guard", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel however this process ends
        yield
    finally:
        os.close(fd)


class NamedBaton(FileBaton):
    """torch's FileBaton whose file names its holder, and whose waiters remove it once that holder has ended."""

    def try_acquire(self) -> bool:
        with _guarded(self.lock_file_path):
            self._remove_if_stale()
            if not super().try_acquire():
                return False
            holder = {"process": procs.identity(), "host": socket.gethostname()}
            with open(self.lock_file_path, "w") as f:  # torch opened it read-only
                f.write(json.dumps(holder))
            return True

    def wait(self) -> None:
        while os.path.exists(self.lock_file_path):
            with _guarded(self.lock_file_path):
                if self._remove_if_stale():
                    return
            time.sleep(self.wait_seconds)

    def _remove_if_stale(self) -> bool:
        path = Path(self.lock_file_path)
        reason = stale_reason(path)
        if reason is None:
            return False
        try:
            path.unlink()
        except FileNotFoundError:
            return False  # another waiter removed it first
        print(f"[zbench] removed the stale build lock {path}: {reason}", flush=True)
        return True


def install() -> None:
    """Make torch's JIT builds in this process take a NamedBaton."""
    cpp_extension.FileBaton = NamedBaton  # type: ignore[misc]
