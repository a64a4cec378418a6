"""A run root on disk: its manifest, its case directories, and the lock that lets one run or resume at a time.

Layout (see DESIGN.md): ``<results_dir>/<tag>_<YYYYmmdd_HHMMSS>/`` holding ``manifest.json``, ``summary.tsv``,
a ``lock`` while a run or resume is active, and one directory per case (its files: `zbench.runroot.casedir`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import psutil

import zbench
from zbench.config import ConfigError, RunConfig, load_case_config
from zbench.env import REACH_PRIVATE_RAY, collect_environment
from zbench.runroot.casedir import (
    CONFIG,
    FILE_MODE,
    RunRootError,
    atomic_write_json,
    read_json,
    utc_now,
    validate_name,
)
from zbench.runroot.summary import SUMMARY, case_summary_row, write_summary

MANIFEST = "manifest.json"
LOCK = "lock"


class LockError(RunRootError):
    """Another live process holds the run root's lock."""


class CaseLike(Protocol):
    """What the manifest needs of a case (``zbench.harness.matrix.Case`` satisfies it)."""

    @property
    def name(self) -> str: ...

    @property
    def overrides(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class RunRoot:
    """A run root directory holding a manifest.json; create it with ``create`` or open it with ``open``."""

    path: Path

    @classmethod
    def create(
        cls,
        results_dir: str | os.PathLike[str],
        tag: str,
        *,
        matrix: str,
        matrix_file: str | None,
        seed: int,
        steps: int,
        cases: Sequence[CaseLike],
        command: Sequence[str] | None = None,
        runner: str = "local",
        environment: Mapping[str, Any] | None = None,
        models: Mapping[str, Any] | None = None,
        variables: Mapping[str, str] | None = None,
        variables_reach: str = REACH_PRIVATE_RAY,
    ) -> RunRoot:
        """Create ``<results_dir>/<tag>_<YYYYmmdd_HHMMSS>/`` with its manifest and one directory per case.

        ``environment`` defaults to ``collect_environment()``; ``command`` to ``sys.argv``; ``models`` says which
        weights each model.path of the cases names (`zbench.models.describe_model`). ``variables``: the recorded
        environment variables the cases start with (default: the environment's, i.e. this process's); and
        ``variables_reach``, which processes have them (on a Ray cluster, the workers have their nodes' own).
        """
        validate_name(tag, "tag")
        names = [validate_name(c.name, "case name") for c in cases]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate case names in matrix {matrix!r}: {', '.join(dupes)}")
        results = Path(results_dir)
        results.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d_%H%M%S")
        path = results / f"{tag}_{stamp}"
        for n in range(2, 100):  # two runs started within one second get _2, _3, ...
            try:
                path.mkdir()
                break
            except FileExistsError:
                path = results / f"{tag}_{stamp}_{n}"
        else:
            raise RunRootError(f"{results}: could not create a fresh run root for tag {tag!r}")
        env = dict(environment) if environment is not None else collect_environment()
        manifest = {
            "zbench_version": zbench.__version__,
            "matrix": matrix,
            "matrix_file": matrix_file,
            "tag": tag,
            "seed": seed,
            "steps": steps,
            "command": list(command) if command is not None else list(sys.argv),
            # device_defaults: what a GPU case took for keys nothing named (zbench.config.cuda_defaults)
            "cases": [{"name": c.name, "dir": c.name, "overrides": dict(c.overrides),
                       **({"device_defaults": dict(d)} if (d := getattr(c, "device_defaults", None)) else {})}
                      for c in cases],
            "git": env.get("git", {"commit": None, "dirty": None}),
            "versions": env.get("versions", {}),
            "gpus": env.get("gpus", []),
            "host": env.get("host", socket.gethostname()),
            "cpu": env.get("cpu"),  # a host-bound phase (vLLM's decode loop) moves with it
            # what changes how the cases run in the environment they start with (zbench.env.recorded_variables)
            "variables": dict(variables) if variables is not None else env.get("variables", {}),
            "variables_reach": variables_reach,
            "runner": runner,
            "models": dict(models or {}),
            "started_at": utc_now(),
            "ended_at": None,
        }
        root = cls(path)
        atomic_write_json(path / MANIFEST, manifest)
        for c in cases:
            root.case_dir(c.name).mkdir(exist_ok=True)
        return root

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> RunRoot:
        """Open an existing run root; RunRootError if ``path`` is missing or holds no readable manifest.json."""
        p = Path(path)
        if not p.is_dir():
            raise RunRootError(
                f"run root {p} does not exist (expected a directory like results/<tag>_<YYYYmmdd_HHMMSS>)"
            )
        if not (p / MANIFEST).is_file():
            raise RunRootError(f"{p} is not a run root: it has no {MANIFEST}")
        manifest = read_json(p / MANIFEST)
        if manifest is None or not isinstance(manifest.get("cases"), list):
            raise RunRootError(
                f"{p / MANIFEST}: not a zbench manifest (needs a JSON object with a 'cases' list)"
            )
        return cls(p)

    @property
    def manifest(self) -> dict[str, Any]:
        """The parsed manifest.json."""
        manifest = read_json(self.path / MANIFEST)
        if manifest is None:
            raise RunRootError(f"{self.path / MANIFEST}: missing or not a JSON object")
        return manifest

    def update_manifest(self, **fields: Any) -> dict[str, Any]:
        """Set top-level manifest fields (e.g. ``ended_at``) and rewrite manifest.json atomically."""
        manifest = self.manifest
        manifest.update(fields)
        atomic_write_json(self.path / MANIFEST, manifest)
        return manifest

    def case_names(self) -> list[str]:
        """Case names in matrix order."""
        return [c["name"] for c in self.manifest["cases"]]

    def case_dir(self, name: str) -> Path:
        """Directory of case ``name`` (validated so that it cannot leave the run root)."""
        return self.path / validate_name(name, "case name")

    def case_configs(self) -> list[tuple[str, RunConfig]]:
        """(name, config) of every case in matrix order, as ``launch.run_cases`` takes them (resume); a missing or
        invalid config.yaml is an error naming it."""
        out = []
        for name in self.case_names():
            path = self.case_dir(name) / CONFIG
            if not path.is_file():
                raise RunRootError(f"{path} is missing: this case cannot be resumed (rerun the matrix instead)")
            try:
                out.append((name, load_case_config(path, complete=True)))
            except ConfigError as e:
                raise RunRootError(f"{e}; this case cannot be resumed as it is (rerun the matrix instead)") from None
        return out

    def summary_rows(self) -> list[dict[str, str]]:
        """One summary row per case of the manifest, in matrix order."""
        return [
            case_summary_row(self.path, c["name"], c.get("dir") or c["name"]) for c in self.manifest["cases"]
        ]

    def write_summary(self) -> Path:
        """Recompute and atomically rewrite ``summary.tsv``; return its path."""
        path = self.path / SUMMARY
        write_summary(path, self.summary_rows())
        return path

    def lock(self, command: str = "run") -> RunLock:
        """The run root's lock; use as a context manager around a run or resume."""
        return RunLock(self.path / LOCK, command)


# ---------------------------------------------------------------- lock


def _names_live_process(info: Mapping[str, Any]) -> bool:
    """Whether lock details name a process that runs (on another host: assumed to)."""
    if info.get("host") != socket.gethostname():
        return bool(info.get("host"))
    pid, started = info.get("pid"), info.get("started_unix")
    try:
        return isinstance(started, float) and abs(psutil.Process(pid).create_time() - started) < 0.01
    except (psutil.Error, TypeError, ValueError):
        return False


class RunLock:
    """An exclusive lock guarding a run root against two concurrent runs or resumes.

    The lock is an ``flock`` on the ``lock`` file, held for as long as the process lives: the kernel releases it
    when the holder dies however it dies, so a stale lock is never "taken over" by a race of readers, and of two
    processes only one ever holds it. The file also names the holder (pid, host, start time, command), for the
    message that refuses the other one.
    """

    def __init__(self, path: Path, command: str = "run") -> None:
        self.path = path
        self.command = command
        self.held = False
        self._fd: int | None = None

    def _holder(self, seen: dict[str, Any] | None, wait_s: float = 2.0) -> dict[str, Any]:
        """The holder's details; a holder that has just taken the lock may not have written them yet (the file
        then is empty, or still names the dead process before it), so wait a moment for them.

        ``seen`` is what the file said before this process tried the lock. Details naming another host can't be
        checked for a live process, so they count only once they differ from ``seen`` (a stale lock from another
        host, just taken over here) or the wait is over (a holder on that host)."""
        deadline = time.monotonic() + wait_s
        while True:
            holder = read_json(self.path) or {}
            local = holder.get("host") == socket.gethostname()
            if (_names_live_process(holder) and (local or holder != seen)) or time.monotonic() > deadline:
                return holder
            time.sleep(0.02)

    def _refusal(self, seen: dict[str, Any] | None) -> LockError:
        holder = self._holder(seen)
        who = (f"pid {holder.get('pid')} on host {holder.get('host')} ({holder.get('command', 'run')} started "
               f"{holder.get('started_at')})") if holder else "another process (still writing its details)"
        return LockError(f"{self.path.parent} is in use by {who}; wait for it to finish or stop it")

    def acquire(self) -> RunLock:
        """Take the lock or raise LockError naming the holder's pid and host."""
        info = {
            "pid": os.getpid(), "host": socket.gethostname(), "started_at": utc_now(),
            "started_unix": psutil.Process().create_time(), "command": self.command,
        }  # fmt: skip
        for _ in range(10):
            seen = read_json(self.path)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, FILE_MODE)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._refusal(seen) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the holder released (and removed) the file between our open and flock: try afresh
                os.close(fd)
                continue
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
                os.fsync(fd)
            except OSError as err:  # a full or read-only disk: say which file
                os.close(fd)
                raise OSError(err.errno, err.strerror, str(self.path)) from None
            self._fd, self.held = fd, True
            return self
        raise LockError(f"{self.path}: could not take the lock; other processes keep taking and releasing it")

    def release(self) -> None:
        """Remove the lock file and release the lock, if this process holds it."""
        if self.held and self._fd is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()  # while still locked: a waiting opener then sees a removed file and retries
            os.close(self._fd)
            self._fd, self.held = None, False

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
