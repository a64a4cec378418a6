"""The case-directory contract: every file a case leaves, how it is written and how it is read back.

The harness writes ``config.yaml`` and ``status.json`` and appends the engine's console to ``train.log``; the
engine appends ``metrics.jsonl``, touches ``heartbeat``, records ``ray_tmpdir`` and ``stack_pids``, writes
``result.json`` at the end and, when saving, ``ckpt/`` with ``ckpt/state.json`` last. Nothing outside this module
spells one of those names.

Every file is written through a temporary file and ``os.replace`` (fsynced), so a reader never sees half of one;
``metrics.jsonl`` is append-only, and its reader skips a torn line instead of failing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import tempfile
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
STATUS = "status.json"
RESULT = "result.json"
TRAIN_LOG = "train.log"
HEARTBEAT = "heartbeat"
STACK_PIDS = "stack_pids"  # one line per engine process that prints its stack on request (zbench.stacks)
# A trial session's folder, `<case>.session` beside the trial folders (zbench.engine.session): the serving process's
# console, who it is, whether it waits for a request, the request it is sent, what it answers, and the harness's
# word to stop.
SESSION_SUFFIX = ".session"
SESSION_LOG = "session.log"
SESSION_SERVER = "server"
SESSION_IDLE = "idle"
SESSION_REQUEST = "request.json"
SESSION_DONE = "done.json"
SESSION_STOP = "stop"
RAY_TMPDIR_FILE = "ray_tmpdir"  # the Ray temp folder the engine used, so the harness can sweep its processes
CKPT_DIR = "ckpt"
CKPT_STATE = "state.json"  # inside ckpt/: written last, so a checkpoint counts only once this names it

_UMASK = os.umask(0o022)
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK  # every file of a run root, written whole or appended to: what open() would give

STATUSES = ("pending", "running", "completed", "failed", "oom", "timeout", "interrupted")

# One path component, starting with a letter or digit: no separators, no "..", nothing a shell must quote.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
_NAME_RULE = "1-128 characters from A-Z a-z 0-9 . _ + -, starting with a letter or digit, without '..'"


class RunRootError(RuntimeError):
    """A run root or case directory on disk is missing, malformed, or in a state that forbids the operation; the
    message names the file and why."""


def utc_now() -> str:
    """Current time as ISO-8601 UTC with seconds, e.g. ``2026-11-21T23:49:05Z``."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def validate_name(value: str, what: str = "name") -> str:
    """Return ``value`` if it is safe as one directory name inside a results dir, else raise ValueError."""
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value) or ".." in value:
        raise ValueError(f"invalid {what} {value!r}: use {_NAME_RULE}")
    return value


# ---------------------------------------------------------------- writing


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` via a fsynced temporary file in the same directory and ``os.replace``."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` via a fsynced temporary file in the same directory and ``os.replace``; on any
    failure (a full disk, say) the temporary file is removed and ``path`` keeps what it held."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, FILE_MODE)  # mkstemp's 0600 would differ from the files appended to
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, sort_keys: bool = False) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")


def write_status(case_dir: str | os.PathLike[str], status: Mapping[str, Any]) -> None:
    """Write ``<case_dir>/status.json`` atomically; ``status["status"]`` must be one of STATUSES."""
    if status.get("status") not in STATUSES:
        raise ValueError(f"{Path(case_dir) / STATUS}: status {status.get('status')!r} is not one of {STATUSES}")
    atomic_write_json(Path(case_dir) / STATUS, dict(status))


def write_result(case_dir: str | os.PathLike[str], result: Mapping[str, Any]) -> None:
    """Write the engine's final record, ``<case_dir>/result.json``, atomically."""
    atomic_write_json(Path(case_dir) / RESULT, dict(result), sort_keys=True)


# ---------------------------------------------------------------- reading


def read_json(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Read a JSON object from ``path``; None if the file is absent or not a JSON object."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def read_status(case_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``<case_dir>/status.json``; None if the case never started (or the file is unreadable)."""
    return read_json(Path(case_dir) / STATUS)


def read_result(case_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``<case_dir>/result.json``; None if the engine never finished the case (or the file is unreadable)."""
    return read_json(Path(case_dir) / RESULT)


def _load_checked(path: Path, required: Mapping[str, tuple[type, ...]]) -> dict[str, Any] | None:
    """A JSON object from ``path`` holding ``required`` keys of the given types; None when the file is absent,
    RunRootError naming the file when it is there but is not that (truncated, foreign)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise RunRootError(f"{path}: cannot read it ({err})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise RunRootError(f"{path}: not valid JSON ({err}); truncated or not written "
                           f"by zbench: move it aside to run the case again") from None
    if not isinstance(obj, dict):
        raise RunRootError(f"{path}: expected a JSON object, found {type(obj).__name__}")
    for key, types in required.items():
        value = obj.get(key)
        if not isinstance(value, types) or isinstance(value, bool):
            raise RunRootError(f"{path}: {key!r} is {value!r}, expected {' or '.join(t.__name__ for t in types)}; "
                               f"not a zbench {path.name}: move it aside to run the case again")
    return obj


def load_status(case_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``<case_dir>/status.json`` checked as resume needs it: None when absent, RunRootError when unreadable or
    not a status zbench wrote (status one of STATUSES, attempt a positive integer)."""
    path = Path(case_dir) / STATUS
    status = _load_checked(path, {"status": (str,), "attempt": (int,)})
    if status is not None and (status["status"] not in STATUSES or status["attempt"] < 1):
        raise RunRootError(f"{path}: status {status['status']!r}, attempt {status['attempt']!r}: expected a status "
                           f"among {', '.join(STATUSES)} and an attempt >= 1")
    return status


def load_result(case_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``<case_dir>/result.json`` checked as resume needs it: None when absent, RunRootError when unreadable or
    lacking the integer ``steps_completed`` and ``steps_target`` every engine result holds."""
    return _load_checked(Path(case_dir) / RESULT, {"steps_completed": (int,), "steps_target": (int,)})


def archived_attempts(case_dir: str | os.PathLike[str]) -> int:
    """The highest attempt number whose files an attempt set aside (``metrics.attemptN.jsonl``), 0 if none."""
    found = [0]
    for p in Path(case_dir).glob("*.attempt*.*"):
        m = re.fullmatch(r"(?:metrics|result)\.attempt(\d+)\.(?:jsonl|json)", p.name)
        if m:
            found.append(int(m.group(1)))
    return max(found)


class MetricsFile(NamedTuple):
    """Records of a metrics.jsonl file, how many lines were skipped, and whether the last line was torn."""

    records: list[dict[str, Any]]
    skipped: int
    torn_tail: bool = False


def parse_metrics(data: bytes) -> MetricsFile:
    """The one rule for metrics.jsonl: every line that is a JSON object with an integer ``step`` is a record; any
    other non-blank line is skipped and counted (``torn_tail`` when it is the last, as a writer killed mid-append
    leaves it)."""
    records: list[dict[str, Any]] = []
    skipped = 0
    torn_tail = False
    lines = [line for line in data.split(b"\n") if line.strip()]
    for i, line in enumerate(lines):
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("step"), int) and not isinstance(obj["step"], bool):
            records.append(obj)
        else:
            skipped += 1
            torn_tail = torn_tail or i == len(lines) - 1
    return MetricsFile(records, skipped, torn_tail)


def read_metrics(case_dir: str | os.PathLike[str]) -> MetricsFile:
    """``<case_dir>/metrics.jsonl`` by ``parse_metrics``; no records when the file does not exist."""
    try:
        data = (Path(case_dir) / METRICS).read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return MetricsFile([], 0)
    return parse_metrics(data)


def steps_by_number(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records in step order, one per step (a step recorded again keeps its last record)."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in records:
        by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


# ---------------------------------------------------------------- checkpoints


def checkpoint_dir(case_dir: str | os.PathLike[str]) -> Path:
    """Where the engine saves DeepSpeed checkpoints of a case."""
    return Path(case_dir) / CKPT_DIR


def write_checkpoint_state(case_dir: str | os.PathLike[str], state: Mapping[str, Any]) -> None:
    """Name the checkpoint a resume continues from (step, tag, seed); written after the checkpoint itself."""
    atomic_write_json(checkpoint_dir(case_dir) / CKPT_STATE, dict(state))


def read_checkpoint_state(case_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The saved checkpoint's state (``step``, ``tag``, ``seed``), or None when the case has no usable one."""
    state = read_json(checkpoint_dir(case_dir) / CKPT_STATE)
    if state is None or not isinstance(state.get("step"), int) or not isinstance(state.get("tag"), str):
        return None
    return state


# ---------------------------------------------------------------- Ray temp folder


def ray_tmpdir(case_dir: str | os.PathLike[str]) -> Path:
    """The Ray temp folder of a case: ``<tmp>/zbench-ray-<hash of the case dir>``.

    Not inside the case dir: Ray puts unix sockets at ``<tmp>/session_<date>_<pid>/sockets/...`` and the OS caps
    socket paths at 107 bytes. The hash (sha1 of the resolved case dir) makes it stable per case.
    """
    digest = hashlib.sha1(str(Path(case_dir).resolve()).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"zbench-ray-{digest}"


def prepare_ray_tmpdir(path: Path) -> Path:
    """Make the case's Ray folder (``ray_tmpdir``) private, 0700 and owned by this user, and return the folder
    inside it to give Ray: Ray makes the folders it is given world-writable, so they live one level down.

    Its name is predictable, in a shared temp dir: one that exists but is a link or someone else's is refused."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise RunRootError(f"{path}: exists but is not a directory owned by this user; refusing to start Ray there")
    os.chmod(path, 0o700)
    return path / "ray"


def record_ray_tmpdir(case_dir: str | os.PathLike[str], path: Path) -> None:
    """Record the Ray temp folder the engine actually used."""
    atomic_write_text(Path(case_dir) / RAY_TMPDIR_FILE, f"{path}\n")


def recorded_ray_tmpdir(case_dir: str | os.PathLike[str]) -> str | None:
    """The Ray temp folder the engine recorded, if any."""
    try:
        return (Path(case_dir) / RAY_TMPDIR_FILE).read_text(encoding="utf-8").strip() or None
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return None
