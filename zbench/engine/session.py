"""A trial session: one engine process serving the trials of one case, one after another.

`zbench tune` measures a case at several batch geometries. Started afresh, every trial would pay for Ray, the
workers' imports, the model build, vLLM's start and torch.compile (about a minute or two on a GPU) before a few
seconds of timed steps. Trials that differ only in batch geometry instead share one process: the first builds
everything as a case does; each later one has the workers drop their models and build them again from the
checkpoint with the case's seed for the new geometry (`Trainer.retarget`, `_Worker.reconfigure`), while Ray, the
process groups and the rollout engine stay. Each trial still starts where a case starts (same weights, same
prompts, same sampling seeds) and writes its own case folder.

The harness (`zbench.harness.sessions`) starts the server, `python -m zbench.engine --session <dir>`, and runs
each trial through its usual launcher as a client, `python -m zbench.engine --trial <dir> <case_dir>`: the
launcher supervises the client as it supervises a case (heartbeat in the trial's folder, timeouts, stack dumps
passed on to the server's processes, the classification of the outcome), and the client relays the server's
console for the trial into the trial's train.log and exits as the trial ended. The two talk through files in the
session folder (`zbench.runroot.casedir`'s SESSION_* names): the client writes the request; the server answers
in the done file.

A trial that fails in any way ends the session: the server exits, and the next trial starts a new one, so an
out-of-memory trial never leaves a fragmented allocator or half-built engines to the trials after it. A client that
goes away before its trial is done (its timeout fired, the run was interrupted) takes the server down with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

from zbench import procs, stacks
from zbench.runroot import casedir

POLL_S = 0.1
DRAIN_S = 1.0  # after the answer: the last lines Ray forwards from the workers reach the log


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return casedir.read_json(path)
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- the server


def serve(session_dir: Path) -> int:
    """Serve trials until told to stop (0) or a trial fails (1; 2 for a config error)."""
    stacks.enable_stack_dumps(session_dir)
    procs.watch_supervisor(session_dir)
    casedir.atomic_write_text(session_dir / casedir.SESSION_SERVER, procs.identity() + "\n")
    from zbench.config import ConfigError
    from zbench.engine.trainer import Trainer

    trainer: Trainer | None = None
    served = 0
    code = 0
    try:
        while (request := _next_request(session_dir)) is not None:
            served += 1
            case_dir = Path(request["case_dir"])
            os.environ[procs.ATTEMPT_ENV] = str(request.get("attempt", 1))  # trainer.fault fires on the first
            watching = _watch_client(session_dir, request["client"], case_dir.name)
            print(f"[session] trial {served}: {case_dir.name}", flush=True)
            try:
                if trainer is None:
                    trainer = Trainer(case_dir, process_dir=session_dir)
                    trainer.open()
                else:
                    trainer.retarget(case_dir)
                trainer.session = {"dir": session_dir.name, "trial": served}  # result.json says who served it
                trainer.train()
            except ConfigError as err:
                print(f"ConfigError: {err}", flush=True)
                code = 2
            except BaseException:
                traceback.print_exc()
                sys.stdout.flush()
                code = 1
            watching.set()
            casedir.atomic_write_json(session_dir / casedir.SESSION_DONE, {"id": request["id"], "exit": code})
            if code:
                break
    finally:
        if trainer is not None:
            trainer.close()
    return code


def _next_request(session_dir: Path) -> dict[str, Any] | None:
    """The next request, claimed (removed), or None once the harness asks the server to stop."""
    request, stop, idle = (session_dir / name for name in (casedir.SESSION_REQUEST, casedir.SESSION_STOP,
                                                            casedir.SESSION_IDLE))
    casedir.atomic_write_text(idle, "")
    while True:
        if stop.exists():
            return None
        found = _read(request)
        if found is not None:
            request.unlink()
            if not procs.is_running(str(found.get("client", ""))):  # its client is gone already: nobody waits
                continue
            idle.unlink()
            return found
        time.sleep(POLL_S)


def _watch_client(session_dir: Path, client: str, trial: str) -> threading.Event:
    """Stop the session when the trial's client is gone before the trial is done; set the event when it is."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(procs.SUPERVISOR_POLL_S):
            if not procs.is_running(client):
                procs.stop_case_and_exit(session_dir, f"the client of trial {trial} is gone (timed out or stopped)")

    threading.Thread(target=loop, name="zbench-trial-client-watch", daemon=True).start()
    return done


# ---------------------------------------------------------------- the client


def run_trial(session_dir: Path, case_dir: Path) -> int:
    """Have the session's server run the trial in `case_dir`, relaying its console; exit as the trial ended.

    Stopped (SIGTERM: its timeout fired, the run was interrupted) before the answer, the client first takes the
    server and its processes down, so that nothing writes into the trial's folder once the launcher has
    classified it."""
    stacks.forward_stack_dumps(case_dir, session_dir)
    procs.watch_supervisor(case_dir)
    server = (session_dir / casedir.SESSION_SERVER)
    ident = server.read_text().strip() if server.is_file() else ""
    answered = threading.Event()

    def on_term(signum: int, frame: object) -> None:
        if not answered.is_set():
            print("[session] trial stopped: stopping the session's processes", flush=True)
            pid = int(ident.partition(":")[0]) if ident and procs.is_running(ident) else None
            procs.kill_processes(pid, procs.case_processes(session_dir), 2.0)  # the server leads its group
        os._exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    log = session_dir / casedir.SESSION_LOG
    if not ident or not procs.is_running(ident):
        print(f"[session] no server runs for {session_dir} ({ident or 'none started'}); the end of its log:",
              flush=True)
        with contextlib.suppress(OSError):
            sys.stdout.write("".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:]))
        return 1
    offset = log.stat().st_size if log.exists() else 0
    request_id = uuid.uuid4().hex
    casedir.atomic_write_json(session_dir / casedir.SESSION_REQUEST, {
        "id": request_id, "case_dir": str(case_dir.resolve()), "client": procs.identity(),
        "attempt": int(os.environ.get(procs.ATTEMPT_ENV, "1"))})
    done_path = session_dir / casedir.SESSION_DONE
    code: int | None = None
    ended_at: float | None = None
    while True:
        offset = _relay(log, offset)
        done = _read(done_path)
        if code is None and done is not None and done.get("id") == request_id:
            code, ended_at = int(done["exit"]), time.monotonic()
            answered.set()
        elif code is None and not procs.is_running(ident):
            code, ended_at = 1, time.monotonic()
            print("[session] the server ended before answering", flush=True)
        if ended_at is not None and time.monotonic() - ended_at >= DRAIN_S:
            _relay(log, offset)
            return code
        time.sleep(POLL_S)


def _relay(log: Path, offset: int) -> int:
    """Copy the server's console from `offset` to stdout; returns the new offset."""
    try:
        with log.open("rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return offset
    if chunk:
        sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
    return offset + len(chunk)


def main(argv: list[str]) -> int:
    """`--session DIR` serves; `--trial DIR CASE_DIR` is a trial's client."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if len(argv) == 2 and argv[0] == "--session":
        return serve(Path(argv[1]))
    if len(argv) == 3 and argv[0] == "--trial":
        return run_trial(Path(argv[1]), Path(argv[2]))
    print("usage: python -m zbench.engine --session <session_dir> | --trial <session_dir> <case_dir>",
          file=sys.stderr)
    return 2
