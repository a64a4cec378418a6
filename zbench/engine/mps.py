"""A private NVIDIA MPS server for one case's GPU processes (`trainer.critic_sm_percent`).

Without MPS a GPU runs the kernels of one process at a time and switches between processes by time slices, so
PPO's critic update behind the rollout (`trainer.critic_update` overlap) takes turns with the decode rather than
filling the SMs the decode leaves idle. Through MPS the processes' kernels run at once; each client may be capped
to a share of the SMs (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`), so the update takes what the decode does not.

The control daemon runs in the foreground as a child of the engine, in the case's process group, so that the
harness's kill of a hung or crashed case takes it (and the server it starts) down too. Its pipe lives in the case's
private Ray folder (a socket path must stay short), its logs in the case's folder; clients find it through
`CUDA_MPS_PIPE_DIRECTORY`, which the case passes to its Ray workers. A process that cannot reach the daemon runs
without MPS and says nothing, so `clients` reads from the daemon's log which processes did connect, for the case to
check against its workers. `stop` asks the daemon to quit (it stops its server first) and kills it if it does not.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
SM_SHARE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
CLIENT_LINE = re.compile(r"NEW CLIENT (\d+) from user")  # the daemon's log, one per CUDA context a process opens


LOGS = ("daemon.out", "control.log")  # the daemon's output in the foreground (-f), and the log it may write too


class MPSError(RuntimeError):
    """The MPS control daemon could not be found or started; the message says why and what to do."""


class MPSServer:
    """One private MPS control daemon: its pipe in `pipe`, its logs in `logs`."""

    def __init__(self, pipe: Path, logs: Path, control: str | None = None):
        found = control or shutil.which(CONTROL)
        if not found:
            raise MPSError(f"{CONTROL} is not on PATH: NVIDIA MPS comes with the driver's utilities; install them, "
                           "or set trainer.critic_sm_percent=0 (no MPS)")
        self.control = found
        self.pipe, self.logs = pipe, logs
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_start: dict[str, int] = {}  # where this daemon's lines begin in each log (an attempt before appended)

    def client_env(self) -> dict[str, str]:
        """What a process needs in its environment to run its kernels through this server."""
        return {PIPE_ENV: str(self.pipe), LOG_ENV: str(self.logs)}

    def _daemon_env(self) -> dict[str, str]:
        """The daemon sees every GPU: a client's CUDA_VISIBLE_DEVICES (Ray's GPU ids) counts among the server's
        devices, so a server limited to some would renumber them."""
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        return {**env, **self.client_env()}

    def start(self, timeout_s: float = 20.0) -> None:
        """Start the daemon and wait for its control pipe; on failure, stop it and raise with its output."""
        self.pipe.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.logs.mkdir(parents=True, exist_ok=True, mode=0o700)
        for stale in self.pipe.iterdir():  # a killed daemon's pipe would pass for this one's
            stale.unlink()
        self._log_start = {name: (self.logs / name).stat().st_size if (self.logs / name).is_file() else 0
                           for name in LOGS}
        with (self.logs / "daemon.out").open("ab") as out:
            self.proc = subprocess.Popen([self.control, "-f"], env=self._daemon_env(), stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not (self.pipe / "control").exists():
            code = self.proc.poll()
            if code is not None or time.monotonic() > deadline:
                self.stop()
                why = f"exited with code {code}" if code is not None else f"made no control pipe in {timeout_s:.0f} s"
                raise MPSError(f"{CONTROL} -f {why} (pipe {self.pipe}); its output: {self._own_log()[-600:].strip()!r}")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the daemon to quit, then kill it if it has not within `timeout_s`; safe to call twice, and the daemon
        is gone afterwards whatever interrupts the asking."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            with contextlib.suppress(subprocess.TimeoutExpired):  # a daemon deaf to quit is killed below
                if proc.poll() is None:
                    subprocess.run([self.control], input=b"quit\n", env=self._daemon_env(), capture_output=True,
                                   timeout=timeout_s, check=False)
                    proc.wait(timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def clients(self) -> set[int]:
        """The process ids that have connected to this daemon so far, from what it logged since it started."""
        return {int(pid) for pid in CLIENT_LINE.findall(self._own_log())}

    def _own_log(self) -> str:
        texts = []
        for name in LOGS:
            path = self.logs / name
            if path.is_file():
                with path.open("rb") as f:
                    f.seek(self._log_start.get(name, 0))
                    texts.append(f.read().decode(errors="replace"))
        return "".join(texts)
