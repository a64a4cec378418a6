"""torch's lock on a JIT-built op: a holder that was killed no longer hangs every later load (zbench.engine.build_lock).
Real processes holding and dying with the lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import cpuinfo
import pytest
from torch.utils import cpp_extension
from torch.utils.file_baton import FileBaton

from zbench import procs
from zbench.engine import build_lock
from zbench.engine.build_lock import NamedBaton, stale_reason

HOLDER = """
import sys, time
from zbench.engine.build_lock import NamedBaton
assert NamedBaton(sys.argv[1]).try_acquire()
print("held", flush=True)
time.sleep(600)
"""


def hold(lock: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def waiting(baton: NamedBaton) -> threading.Event:
    """Start baton.wait() in a thread; the event is set once it returns."""
    done = threading.Event()
    threading.Thread(target=lambda: (baton.wait(), done.set()), daemon=True).start()
    return done


def test_a_killed_holders_lock_is_removed_and_a_live_ones_is_waited_for(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    lock = tmp_path / "lock"
    holder = hold(lock)
    info = json.loads(lock.read_text())
    assert info["process"].startswith(f"{holder.pid}:")
    assert stale_reason(lock) is None and not NamedBaton(str(lock)).try_acquire()
    waiter = waiting(NamedBaton(str(lock)))
    assert not waiter.wait(1.0) and lock.exists()  # a live holder is waited for
    os.kill(holder.pid, signal.SIGKILL)  # killed mid-build: the file stays behind, and the waiter goes on
    holder.wait()
    assert waiter.wait(5.0) and not lock.exists()
    assert f"removed the stale build lock {lock}: its holder, pid {holder.pid}, has ended" in capsys.readouterr().out
    # a process that comes later finds the dead holder named, takes the lock at once, and names itself
    holder = hold(lock)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert stale_reason(lock) == f"its holder, pid {holder.pid}, has ended"
    baton = NamedBaton(str(lock))
    assert baton.try_acquire() and json.loads(lock.read_text())["process"] == procs.identity()
    baton.release()
    assert not lock.exists()


def test_a_lock_naming_no_one_is_stale_only_when_old_and_no_build_runs_there(tmp_path: Path) -> None:
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()  # as torch's own FileBaton leaves it
    assert stale_reason(lock) is None  # young: its holder may be about to build
    old = time.time() - build_lock.UNNAMED_STALE_S - 5
    os.utime(lock, (old, old))
    compiler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=lock.parent)
    try:
        time.sleep(0.2)
        assert stale_reason(lock) is None  # a process works in the build directory: a build runs
    finally:
        compiler.kill()
        compiler.wait()
    assert stale_reason(lock) is not None and stale_reason(lock).startswith("it names no holder")
    # another host's holder can't be checked for life: its lock is kept
    lock.write_text(json.dumps({"process": "1:0.000", "host": "another-host"}))
    assert stale_reason(lock) is None


def test_installed_torch_builds_take_the_named_lock() -> None:
    """torch looks its FileBaton up in cpp_extension's namespace when it builds: what install() replaces."""
    original = cpp_extension.FileBaton
    try:
        build_lock.install()
        assert cpp_extension._jit_compile.__globals__["FileBaton"] is NamedBaton
    finally:
        cpp_extension.FileBaton = original


def test_the_worker_setup_hook_leaves_torch_alone() -> None:
    """Ray runs the hook before it gives the process its GPU: a hook that imported torch's extension builder left
    both ranks of a 2-GPU case on one GPU (NCCL "Duplicate GPU detected", 2 x H200), so the workers take the build
    lock in their own __init__ instead. Checked in a fresh interpreter, as Ray's worker process is."""
    probe = ("import sys\n"
             "from zbench.engine.cluster import worker_process_setup\n"
             "worker_process_setup()\n"
             "print(','.join(m for m in ('torch', 'torch.utils.cpp_extension') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == ""


def test_workers_take_the_named_lock_as_they_start(tmp_path: Path) -> None:
    """A worker installs the NamedBaton in its __init__, once Ray has given it its device."""
    from zbench.config import from_dict
    from zbench.engine.workers import PolicyWorker
    from zbench.models import resolve_model

    original, probe = cpp_extension.FileBaton, cpuinfo.get_cpu_info
    cpp_extension.FileBaton = FileBaton  # type: ignore[misc]
    try:
        PolicyWorker(from_dict({"trainer": {"device": "cpu", "world_size": 1}}), 0, 1, str(tmp_path),
                     str(resolve_model("tiny")))
        assert cpp_extension._jit_compile.__globals__["FileBaton"] is NamedBaton
    finally:  # the worker also installed the CPU-description cache: this process's later tests get it back as it was
        cpp_extension.FileBaton, cpuinfo.get_cpu_info = original, probe
