"""Two processes taking a run root's lock at the same instant, a stale lock included: exactly one holds it, the
other is refused naming the holder. Real processes, many trials."""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from zbench.config import dump_yaml, from_dict
from zbench.runroot.root import LockError, RunRoot

RACER = """
import os, sys, time
from pathlib import Path
from zbench.runroot.casedir import RunRootError
from zbench.runroot.root import RunRoot
root, go = RunRoot.open(sys.argv[1]), Path(sys.argv[2])
while not go.exists():
    pass
try:
    lock = root.lock("resume").acquire()
except RunRootError as err:
    print("refused", err, flush=True)
else:
    print("held", os.getpid(), flush=True)
    time.sleep(1.0)
    lock.release()
"""


class Case:
    name, overrides = "a", {}


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def race(root: RunRoot, trial: int) -> list[str]:
    go = root.path / f"go{trial}"
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(root.path), str(go)], stdout=subprocess.PIPE,
                               text=True) for _ in range(2)]
    time.sleep(0.5)  # both are importing, then spinning on the go file
    go.touch()
    return [r.communicate(timeout=60)[0].strip() for r in racers]


def test_exactly_one_of_two_racing_processes_holds_the_lock(tmp_path: Path) -> None:
    root = RunRoot.create(tmp_path, "t", matrix="m", matrix_file=None, seed=1, steps=3, cases=[Case()],
                          environment={})
    trials = 24
    for trial in range(trials):
        if trial % 3:  # a stale lock, left by a holder that died without releasing it, here or on another host
            host = socket.gethostname() if trial % 3 == 1 else "another-host"
            (root.path / "lock").write_text(json.dumps({"pid": dead_pid(), "host": host, "command": "run"}))
        outcomes = race(root, trial)
        held = [o for o in outcomes if o.startswith("held")]
        refused = [o for o in outcomes if o.startswith("refused")]
        assert len(held) == 1 and len(refused) == 1, (trial, outcomes)
        holder_pid = held[0].split()[1]
        assert f"in use by pid {holder_pid} on host" in refused[0], (trial, outcomes)


def test_resume_is_refused_while_a_run_holds_the_root(tmp_path: Path) -> None:
    root = RunRoot.create(tmp_path, "t", matrix="m", matrix_file=None, seed=1, steps=3, cases=[Case()],
                          environment={})
    (root.case_dir("a") / "config.yaml").write_text(dump_yaml(from_dict({"name": "a", "steps": 3})))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom zbench.runroot.root import RunRoot\n"
         "lock = RunRoot.open(sys.argv[1]).lock('run').acquire()\nprint('locked', flush=True)\ntime.sleep(60)",
         str(root.path)], stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        res = subprocess.run([sys.executable, "-m", "zbench", "resume", str(root.path)], capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 2
        assert f"is in use by pid {holder.pid} on host" in res.stderr and "(run started" in res.stderr, res.stderr
    finally:
        holder.kill()
        holder.wait()


def test_the_refusal_waits_for_the_details_of_a_holder_that_took_over_another_hosts_stale_lock(
    tmp_path: Path,
) -> None:
    """The instant between a holder's flock and its details: the file still names the stale holder on another
    host, which can't be checked for life. The refusal names the new holder once it has written; a holder on
    another host that never rewrites is named after the wait."""
    root = RunRoot.create(tmp_path, "t", matrix="m", matrix_file=None, seed=1, steps=3, cases=[Case()],
                          environment={})
    path = root.path / "lock"
    path.write_text(json.dumps({"pid": 4321, "host": "another-host", "command": "run"}))
    fd = os.open(path, os.O_RDWR)
    details = {"pid": os.getpid(), "host": socket.gethostname(), "started_at": "now",
               "started_unix": psutil.Process().create_time(), "command": "run"}

    def write_details() -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(details).encode(), 0)

    timer = threading.Timer(0.3, write_details)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # taken over here; details not written yet
        timer.start()
        with pytest.raises(LockError, match=re.escape(f"in use by pid {os.getpid()} on host {socket.gethostname()}")):
            root.lock("resume").acquire()
        timer.join()
        path.write_text(json.dumps({"pid": 4321, "host": "another-host", "command": "run"}))  # a holder there
        with pytest.raises(LockError, match="in use by pid 4321 on host another-host"):
            root.lock("resume").acquire()
    finally:
        timer.cancel()
        os.close(fd)
