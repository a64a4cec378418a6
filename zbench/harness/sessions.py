"""The harness's end of a trial session (`zbench.engine.session`): one serving engine process per tuned case.

`TrialServer.ensure_running` starts the server when none runs: before the first trial, and again after a trial
that failed (the server ends with it). Each trial then runs through the launcher as usual, with
`client_command()` in place of the engine's command. `close` asks the server to stop, and makes sure that it,
its Ray and its workers are gone.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from zbench import procs, stacks
from zbench.runroot import casedir

START_WAIT_S = 120.0  # for the server to say who it is (its interpreter's start)


class TrialServer:
    """The serving process of one case's trials, started from the runner profile's engine command."""

    def __init__(self, session_dir: Path, command: Sequence[str], env: Mapping[str, str]):
        self.dir = session_dir
        self.command = tuple(command)
        self.env = dict(env)
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        # torch.compile warns of its recompile limit once per process, then runs eager in silence: the warning of
        # the server now running, which every trial it serves after the one that hit the limit carries too
        self.recompile_warning: str | None = None

    def client_command(self) -> tuple[str, ...]:
        """The command a trial runs as (the launcher appends the trial's folder)."""
        return (*self.command, "--trial", str(self.dir.resolve()))

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        """Running and waiting for a request."""
        return self.running() and (self.dir / casedir.SESSION_IDLE).exists()

    def ensure_running(self) -> None:
        """Start a server unless one runs and waits for a request. A server still busy here lost its trial's
        client (timed out, stopped) and is about to stop itself: it is stopped now, with what it left."""
        if self.ready():
            with contextlib.suppress(FileNotFoundError):  # a request whose client never saw it through
                (self.dir / casedir.SESSION_REQUEST).unlink()
            return
        self._clean()
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in (casedir.SESSION_REQUEST, casedir.SESSION_DONE, casedir.SESSION_STOP, casedir.SESSION_SERVER,
                     casedir.SESSION_IDLE):
            with contextlib.suppress(FileNotFoundError):
                (self.dir / name).unlink()
        self.starts += 1
        self.recompile_warning = None
        env = {
            **os.environ, **self.env, "PYTHONUNBUFFERED": "1", "ZBENCH_RAY_TMPDIR": str(casedir.ray_tmpdir(self.dir)),
            procs.SUPERVISOR_ENV: procs.identity(),  # the server stops itself when the harness is gone
            procs.ATTEMPT_ENV: "1",
        }  # fmt: skip
        argv = [*self.command, "--session", str(self.dir.resolve())]
        with (self.dir / casedir.SESSION_LOG).open("ab") as logf:
            logf.write(f"==== zbench session {self.starts} started {casedir.utc_now()}: {' '.join(argv)}\n".encode())
            logf.flush()
            self.proc = subprocess.Popen(argv, cwd=self.dir, env=env, stdin=subprocess.DEVNULL, stdout=logf,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_WAIT_S
        while (self.running() and not (self.dir / casedir.SESSION_SERVER).exists()
               and time.monotonic() < deadline):
            time.sleep(0.05)

    def close(self, grace_s: float = 60.0) -> None:
        """Ask an idle server to stop (it shuts its Ray down), then stop whatever is left; a busy one (its trial's
        client gone) is stopped at once."""
        if self.ready():
            casedir.atomic_write_text(self.dir / casedir.SESSION_STOP, "")
            with contextlib.suppress(subprocess.TimeoutExpired):
                assert self.proc is not None
                self.proc.wait(timeout=grace_s)
        self._clean()

    def _clean(self) -> None:
        pgid = self.proc.pid if self.proc is not None else None
        procs.kill_processes(pgid if procs.group_alive(pgid) else None, procs.case_processes(self.dir), 5.0)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10.0)
        procs.remove_ray_tmpdir(self.dir)
        stacks.forget(self.dir)
