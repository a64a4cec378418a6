"""A case that leaves processes behind like Ray does: a child in its group and a daemon in its own session.

The daemon's command line mentions ZBENCH_RAY_TMPDIR, as raylet and gcs_server mention their temp dir.
Arguments: `forever` keeps stepping until killed; `ignore-term` also ignores SIGTERM; else it completes.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

from _common import case_dir, run_all, step

cdir = case_dir()
ray_dir = os.environ["ZBENCH_RAY_TMPDIR"]
sleeper = [
    sys.executable,
    "-c",
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN) if 'ignore-term' in sys.argv else None; time.sleep(600)",
]
mode = sys.argv[1:-1]
child = subprocess.Popen([*sleeper, "zbench-fake-child", *mode])
daemon = subprocess.Popen([*sleeper, f"--temp-dir={ray_dir}"], start_new_session=True)
(Path(cdir) / "pids").write_text(f"{child.pid} {daemon.pid}\n")
if "ignore-term" in mode:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "forever" in mode or "ignore-term" in mode:
    for n in range(1, 10_000):
        step(cdir, n, delay=0.2)
run_all(cdir)
