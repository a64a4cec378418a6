"""A run root on disk: manifest, case directories, status, metrics, summary.tsv, merge and the run lock.

Layout (see DESIGN.md): ``<results_dir>/<tag>_<YYYYmmdd_HHMMSS>/`` holding ``manifest.json``, ``summary.tsv``,
a ``lock`` while a run or resume is active, and one directory per case with ``config.yaml``, ``metrics.jsonl``,
``train.log``, ``status.json``, ``result.json`` and ``heartbeat``.

Every file written here goes through a temporary file and ``os.replace``, so a reader never sees half of one;
``metrics.jsonl`` is append-only and read tolerantly (a torn last line is skipped and counted).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import psutil
import yaml

import zbench

MANIFEST = "manifest.json"
SUMMARY = "summary.tsv"
SUMMARY_COMPLETE = "summary_complete.tsv"
LOCK = "lock"
CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
STATUS = "status.json"
RESULT = "result.json"
TRAIN_LOG = "train.log"
HEARTBEAT = "heartbeat"

STATUSES = ("pending", "running", "completed", "failed", "oom", "timeout", "interrupted")

SUMMARY_COLUMNS = (
    "case", "algorithm", "zero_stage", "offload", "offload_effective", "rollout_backend", "world_size", "seed",
    "status", "steps_completed", "steps_target", "wall_s", "step_time_mean_s", "throughput_mean", "mfu_mean",
    "max_memory_allocated_gb", "max_memory_reserved_gb", "cpu_memory_used_gb", "score_first", "score_last",
    "score_max", "loss_last", "attempt", "exit_code", "reason", "case_dir", "config_hash", "device_memory_used_gb",
)  # fmt: skip
# Columns added after the first release: a summary written before them reads back with them empty.
LATER_SUMMARY_COLUMNS = ("device_memory_used_gb",)

VERSIONED_PACKAGES = ("torch", "deepspeed", "ray", "transformers", "vllm")

# One path component, starting with a letter or digit: no separators, no "..", nothing a shell must quote.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
_NAME_RULE = "1-128 characters from A-Z a-z 0-9 . _ + -, starting with a letter or digit, without '..'"


class StoreError(RuntimeError):
    """A run root on disk is missing, malformed, or in a state that forbids the operation."""


class LockError(StoreError):
    """Another live process holds the run root's lock."""


class CaseLike(Protocol):
    """What the manifest needs of a case (``zbench.matrix.Case`` satisfies it)."""

    @property
    def name(self) -> str: ...

    @property
    def overrides(self) -> Mapping[str, Any]: ...


def utc_now() -> str:
    """Current time as ISO-8601 UTC with seconds, e.g. ``2026-11-21T23:49:05Z``."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def validate_name(value: str, what: str = "name") -> str:
    """Return ``value`` if it is safe as one directory name inside a results dir, else raise ValueError."""
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value) or ".." in value:
        raise ValueError(f"invalid {what} {value!r}: use {_NAME_RULE}")
    return value


# ---------------------------------------------------------------- atomic files


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same directory and ``os.replace``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Read a JSON object from ``path``; None if the file is absent or not a JSON object."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


# ---------------------------------------------------------------- case files


def write_status(case_dir: str | os.PathLike[str], status: Mapping[str, Any]) -> None:
    """Write ``<case_dir>/status.json`` atomically; ``status["status"]`` must be one of STATUSES."""
    if status.get("status") not in STATUSES:
        raise ValueError(
            f"{Path(case_dir) / STATUS}: status {status.get('status')!r} is not one of {STATUSES}"
        )
    atomic_write_json(Path(case_dir) / STATUS, dict(status))


def read_status(case_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Read ``<case_dir>/status.json``; None if the case never started."""
    return read_json(Path(case_dir) / STATUS)


class MetricsFile(NamedTuple):
    """Records of a metrics.jsonl file and how many of its lines were skipped as unreadable."""

    records: list[dict[str, Any]]
    skipped: int


def read_metrics(path: str | os.PathLike[str]) -> MetricsFile:
    """Read a metrics.jsonl file: every line that is a complete JSON object; count the others (torn, blank-free)."""
    records: list[dict[str, Any]] = []
    skipped = 0
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return MetricsFile(records, 0)
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            skipped += 1
            continue
        if isinstance(obj, dict):
            records.append(obj)
        else:
            skipped += 1
    return MetricsFile(records, skipped)


def config_hash(text: str) -> str:
    """sha256 of a case's config, first 12 hex characters.

    The config is read through the current schema first, so formatting, key order and keys added to zbench later
    (present at their defaults) do not change the hash: a rerun with a newer zbench still merges with the first
    run when it ran the same case. A config the schema no longer accepts is hashed as written."""
    from zbench.config import ConfigError, dump_yaml, from_dict

    try:
        canonical = dump_yaml(from_dict(yaml.safe_load(text) or {}))
    except (ConfigError, yaml.YAMLError, TypeError, ValueError, AttributeError):
        canonical = text
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:12]


# ---------------------------------------------------------------- summary rows


def _fmt(value: Any) -> str:
    """One TSV cell: empty for missing or non-finite values; floats with 6 significant digits."""
    if value is None or value == "":
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return "" if not math.isfinite(value) else f"{value:.6g}"
    # Tabs or newlines inside a cell would break the table.
    return " ".join(str(value).split())


def _series(records: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    out = []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append(float(v))
    return out


def _steady_mean(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """Mean over steps 2..N when there are at least two steps (step 1 includes warm-up), else step 1; a profiled
    step is left out when there are others."""
    by_step = [r for r in records if isinstance(r.get("step"), int)]
    unprofiled = [r for r in by_step if not r.get("perf/profiled")]  # a profiled step is slowed by the profiler
    by_step = unprofiled or by_step
    later = [r for r in by_step if r["step"] >= 2]
    values = _series(later if later else by_step, key)
    return statistics.fmean(values) if values else None


def _last(values: list[float]) -> float | None:
    return values[-1] if values else None


def _dig(tree: Mapping[str, Any] | None, dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def case_summary_row(
    run_root: str | os.PathLike[str], case: str, case_dir: str | None = None
) -> dict[str, str]:
    """One summary row for a case, from its config.yaml, metrics.jsonl, status.json and result.json."""
    root = Path(run_root)
    rel = case_dir or case
    cdir = root / rel
    try:
        config_text = (cdir / CONFIG).read_text(encoding="utf-8")
    except FileNotFoundError:
        config_text = None
    try:
        config = yaml.safe_load(config_text) if config_text is not None else None
    except yaml.YAMLError as e:
        raise StoreError(f"{cdir / CONFIG}: not valid YAML: {e}") from e
    config = config if isinstance(config, Mapping) else {}
    status = read_status(cdir) or {}
    result = read_json(cdir / RESULT) or {}
    records = sorted(
        (r for r in read_metrics(cdir / METRICS).records if isinstance(r.get("step"), int)),
        key=lambda r: r["step"],
    )
    algorithm = config.get("algorithm")
    loss_key = "critic/vf_loss" if str(algorithm).lower() == "ppo" else "actor/pg_loss"
    scores = _series(records, "critic/score/mean")
    steps_completed = result.get("steps_completed")
    if steps_completed is None and records:
        steps_completed = records[-1]["step"]
    backend = result.get("rollout_backend") or _dig(config, "rollout.backend")

    unprofiled = [r for r in records if not r.get("perf/profiled")] or records  # the profiler holds host memory

    def peak(key: str) -> float | None:
        values = _series(unprofiled, key)
        return max(values) if values else None

    row: dict[str, Any] = {
        "case": case,
        "algorithm": algorithm,
        "zero_stage": _dig(config, "zero.stage"),
        "offload": _dig(config, "zero.offload"),
        "offload_effective": result.get("offload_effective"),
        "rollout_backend": backend,
        "world_size": result.get("world_size"),
        "seed": config.get("seed"),
        "status": status.get("status", "pending"),
        "steps_completed": steps_completed,
        "steps_target": result.get("steps_target", config.get("steps")),
        "wall_s": result.get("wall_s"),
        "step_time_mean_s": _steady_mean(records, "timing_s/step"),
        "throughput_mean": _steady_mean(records, "perf/throughput"),
        "mfu_mean": _steady_mean(records, "perf/mfu/actor"),
        "max_memory_allocated_gb": peak("perf/max_memory_allocated_gb"),
        "max_memory_reserved_gb": peak("perf/max_memory_reserved_gb"),
        "device_memory_used_gb": peak("perf/device_memory_used_gb"),
        "cpu_memory_used_gb": peak("perf/cpu_memory_used_gb"),
        "score_first": scores[0] if scores else None,
        "score_last": _last(scores),
        "score_max": max(scores) if scores else None,
        "loss_last": _last(_series(records, loss_key)),
        "attempt": status.get("attempt"),
        "exit_code": status.get("exit_code"),
        "reason": status.get("reason"),
        "case_dir": rel,
        "config_hash": config_hash(config_text) if config_text is not None else None,
    }
    return {k: _fmt(row[k]) for k in SUMMARY_COLUMNS}


def write_summary(path: str | os.PathLike[str], rows: Sequence[Mapping[str, str]]) -> None:
    """Write rows as a TSV with SUMMARY_COLUMNS, atomically (tmp + os.replace)."""
    # Cells hold no tabs or newlines (_fmt folds whitespace), so plain joins are a faithful TSV.
    lines = ["\t".join(SUMMARY_COLUMNS)]
    lines += ["\t".join(_fmt(row.get(k)) for k in SUMMARY_COLUMNS) for row in rows]
    atomic_write_text(path, "\n".join(lines) + "\n")


def read_summary(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    """Read a summary TSV written by ``write_summary``; error if its header is not SUMMARY_COLUMNS."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    older = tuple(c for c in SUMMARY_COLUMNS if c not in LATER_SUMMARY_COLUMNS)
    header = tuple(lines[0].split("\t")) if lines else ()
    if header not in (SUMMARY_COLUMNS, older):
        raise StoreError(
            f"{path}: header is not the zbench summary header ({', '.join(SUMMARY_COLUMNS[:4])}, ...)"
        )
    blank = dict.fromkeys(SUMMARY_COLUMNS, "")
    return [{**blank, **dict(zip(header, line.split("\t"), strict=False))} for line in lines[1:] if line]


# ---------------------------------------------------------------- the run root


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
    ) -> RunRoot:
        """Create ``<results_dir>/<tag>_<YYYYmmdd_HHMMSS>/`` with its manifest and one directory per case.

        ``environment`` defaults to ``collect_environment()``; ``command`` to ``sys.argv``.
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
            raise StoreError(f"{results}: could not create a fresh run root for tag {tag!r}")
        env = dict(environment) if environment is not None else collect_environment()
        manifest = {
            "zbench_version": zbench.__version__,
            "matrix": matrix,
            "matrix_file": matrix_file,
            "tag": tag,
            "seed": seed,
            "steps": steps,
            "command": list(command) if command is not None else list(sys.argv),
            "cases": [{"name": c.name, "dir": c.name, "overrides": dict(c.overrides)} for c in cases],
            "git": env.get("git", {"commit": None, "dirty": None}),
            "versions": env.get("versions", {}),
            "gpus": env.get("gpus", []),
            "host": env.get("host", socket.gethostname()),
            "runner": runner,
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
        """Open an existing run root; StoreError if ``path`` is missing or holds no readable manifest.json."""
        p = Path(path)
        if not p.is_dir():
            raise StoreError(
                f"run root {p} does not exist (expected a directory like results/<tag>_<YYYYmmdd_HHMMSS>)"
            )
        if not (p / MANIFEST).is_file():
            raise StoreError(f"{p} is not a run root: it has no {MANIFEST}")
        manifest = read_json(p / MANIFEST)
        if manifest is None or not isinstance(manifest.get("cases"), list):
            raise StoreError(
                f"{p / MANIFEST}: not a zbench manifest (needs a JSON object with a 'cases' list)"
            )
        return cls(p)

    @property
    def manifest(self) -> dict[str, Any]:
        """The parsed manifest.json."""
        manifest = read_json(self.path / MANIFEST)
        if manifest is None:
            raise StoreError(f"{self.path / MANIFEST}: missing or not a JSON object")
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

    def case_configs(self) -> list[tuple[str, str]]:
        """(name, config.yaml text) of every case in matrix order, as ``launch.run_cases`` takes them (resume)."""
        out = []
        for name in self.case_names():
            path = self.case_dir(name) / CONFIG
            try:
                out.append((name, path.read_text(encoding="utf-8")))
            except FileNotFoundError:
                raise StoreError(f"{path} is missing: this run root cannot be resumed case by case") from None
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


class RunLock:
    """An exclusive lock file (pid, host, start time) guarding a run root against two concurrent runs.

    A lock left by a dead process on this host is taken over; one held by a live process is refused.
    """

    def __init__(self, path: Path, command: str = "run") -> None:
        self.path = path
        self.command = command
        self.held = False

    def _holder_alive(self, info: Mapping[str, Any]) -> bool:
        if info.get("host") != socket.gethostname():
            return True  # cannot check another host's process: assume it is alive
        pid = info.get("pid")
        if not isinstance(pid, int) or not psutil.pid_exists(pid):
            return False
        try:
            created = psutil.Process(pid).create_time()
        except psutil.Error:
            return False
        # A pid reused by a process started after the lock was written is not the holder.
        started = info.get("started_unix")
        return not isinstance(started, (int, float)) or created <= started + 1.0

    def acquire(self) -> RunLock:
        """Take the lock or raise LockError naming the holder's pid and host."""
        info = {
            "pid": os.getpid(), "host": socket.gethostname(), "started_at": utc_now(),
            "started_unix": psutil.Process().create_time(), "command": self.command,
        }  # fmt: skip
        payload = json.dumps(info) + "\n"
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = read_json(self.path)
                if holder is None:
                    # Torn or foreign content: a writer crashed between create and write.
                    atomic_write_text(self.path, payload)
                elif self._holder_alive(holder):
                    raise LockError(
                        f"{self.path.parent} is in use by pid {holder.get('pid')} on host {holder.get('host')} "
                        f"({holder.get('command', 'run')} started {holder.get('started_at')}); wait for it to "
                        f"finish or stop it; delete {self.path} only if that process is gone"
                    ) from None
                else:
                    atomic_write_text(self.path, payload)  # stale lock: take it over
                if read_json(self.path) == info:
                    self.held = True
                    return self
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(payload)
            self.held = True
            return self
        raise LockError(f"{self.path}: could not take the lock; another process keeps replacing it")

    def release(self) -> None:
        """Remove the lock file if this process holds it."""
        if self.held:
            holder = read_json(self.path)
            if holder is not None and holder.get("pid") == os.getpid():
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
            self.held = False

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# ---------------------------------------------------------------- merge


@dataclass(frozen=True)
class MergeResult:
    """Where merge wrote its table, the rows, and warnings (conflicts overridden by ``force``)."""

    path: Path
    rows: list[dict[str, str]]
    warnings: list[str]


def _ended_at(root: RunRoot, case_dir: str) -> str:
    status = read_status(root.path / case_dir) or {}
    return str(status.get("ended_at") or "")


def merge(
    run_roots: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str] | None = None,
    mixed_configs: bool = False,
    overwrite: bool = False,
) -> MergeResult:
    """Combine the cases of several run roots into one summary (default ``<first root>/summary_complete.tsv``).

    For each case the latest completed attempt wins (by status ``ended_at``, later run roots winning ties); a
    case never completed keeps the attempt that recorded the most steps (the latest of those), so the table
    shows what is missing and the most that was measured. Rows are ordered by the first run root's matrix order,
    then cases only other roots have. ``case_dir`` is rewritten relative to the output file's directory. A case
    whose config_hash differs between run roots is an error naming both roots, unless ``mixed_configs`` (then the
    winner's row is kept and a warning returned). An existing output file (an earlier merge, perhaps of more run
    roots) is an error unless ``overwrite``.
    """
    if not run_roots:
        raise ValueError("merge needs at least one run root")
    roots = [RunRoot.open(p) for p in run_roots]
    out_path = Path(out) if out is not None else roots[0].path / SUMMARY_COMPLETE
    if out_path.is_dir():
        raise StoreError(f"--out {out_path} is a directory; give the path of the TSV file to write")
    if out_path.exists() and not overwrite:
        try:
            earlier = read_summary(out_path)
            roots_in = sorted({Path(r["case_dir"]).parent.name or out_path.parent.name for r in earlier})
            what = f"a summary of {len(earlier)} case(s) from {', '.join(roots_in) or 'no run root'}"
        except (StoreError, OSError, UnicodeDecodeError):
            what = "not a zbench summary"
        raise StoreError(f"{out_path} already exists ({what}); pass --force to replace it, or --out FILE to "
                         "write this merge elsewhere")
    order: list[str] = []
    candidates: dict[str, list[tuple[int, RunRoot, dict[str, str]]]] = {}
    for idx, root in enumerate(roots):
        for row in root.summary_rows():
            if row["case"] not in candidates:
                order.append(row["case"])
                candidates[row["case"]] = []
            candidates[row["case"]].append((idx, root, row))
    warnings: list[str] = []
    rows: list[dict[str, str]] = []
    for name in order:
        cands = candidates[name]
        hashes = {(row["config_hash"], root.path) for _, root, row in cands if row["config_hash"]}
        distinct = sorted({h for h, _ in hashes})
        if len(distinct) > 1:
            where = "; ".join(f"{p} (config_hash {h})" for h, p in sorted(hashes, key=lambda x: str(x[1])))
            msg = f"case {name!r} has different configs in {where}"
            if not mixed_configs:
                raise StoreError(f"{msg}; rerun it with the same config, or pass --mixed-configs to merge anyway")
            warnings.append(msg)

        def key(c: tuple[int, RunRoot, dict[str, str]]) -> tuple[str, int]:
            return (_ended_at(c[1], c[2]["case_dir"]), c[0])

        def furthest(c: tuple[int, RunRoot, dict[str, str]]) -> tuple[int, str, int]:
            return (int(c[2].get("steps_completed") or 0), *key(c))

        completed = [c for c in cands if c[2]["status"] == "completed"]
        _, root, row = max(completed, key=key) if completed else max(cands, key=furthest)
        row = dict(row)
        out_dir = out_path.parent.resolve()
        row["case_dir"] = os.path.relpath((root.path / row["case_dir"]).resolve(), out_dir)
        rows.append(row)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_summary(out_path, rows)
    return MergeResult(out_path, rows, warnings)


# ---------------------------------------------------------------- environment


def package_version(package: str) -> str | None:
    """A package's installed version, or None (without importing it)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git_info() -> dict[str, Any]:
    """Commit and dirty flag: as stated by ``ZBENCH_GIT_COMMIT`` (a copy shipped to another machine, whose .git
    may be missing or stale, says where it came from), else of the zbench source checkout, else of the cwd."""
    if os.environ.get("ZBENCH_GIT_COMMIT"):
        return {"commit": os.environ["ZBENCH_GIT_COMMIT"], "dirty": os.environ.get("ZBENCH_GIT_DIRTY") == "1",
                "source": "ZBENCH_GIT_COMMIT"}
    source = Path(zbench.__file__).resolve().parent.parent
    for where in (source, Path.cwd()):
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10
            )
            if commit.returncode != 0:
                continue
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=where, capture_output=True, text=True, timeout=20,
            )  # fmt: skip
            return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
        except (OSError, subprocess.TimeoutExpired):
            continue
    return {"commit": None, "dirty": None}


def _gpus(probe_torch: bool) -> list[dict[str, Any]]:
    """GPU names and memory; torch.cuda when torch is already loaded (or ``probe_torch``), else nvidia-smi."""
    if "torch" in sys.modules or probe_torch:
        try:
            import torch

            if torch.cuda.is_available():
                return [
                    {
                        "name": torch.cuda.get_device_name(i),
                        "memory_gb": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 2),
                    }
                    for i in range(torch.cuda.device_count())
                ]
            if probe_torch:
                return []
        except ImportError:
            pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return []
    gpus = []
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        name, _, mib = line.rpartition(",")
        with contextlib.suppress(ValueError):
            gpus.append({"name": name.strip(), "memory_gb": round(float(mib) / 1024, 2)})
    return gpus


def collect_environment(probe_torch: bool = False) -> dict[str, Any]:
    """Python and package versions, GPUs, host, git commit + dirty flag: what a manifest or bug report needs.

    Versions come from package metadata, so nothing heavy is imported; pass ``probe_torch`` to ask torch.cuda
    for GPUs even where nvidia-smi is absent (imports torch).
    """
    versions: dict[str, str | None] = {"python": sys.version.split()[0]}
    versions.update({p: package_version(p) for p in VERSIONED_PACKAGES})
    return {
        "versions": versions,
        "gpus": _gpus(probe_torch),
        "host": socket.gethostname(),
        "platform": sys.platform,
        "git": _git_info(),
    }


def deepspeed_op_compatibility() -> dict[str, bool]:
    """Whether each DeepSpeed op builder (cpu_adam, fused_adam, ...) can be built here (imports deepspeed)."""
    try:
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
    except ImportError:
        return {}
    compat: dict[str, bool] = {}
    for name, builder in sorted(ALL_OPS.items()):
        if name == "deepspeed_not_implemented" or builder is None:
            continue
        try:
            compat[name] = bool(builder.is_compatible(verbose=False))
        except Exception:  # a builder probing a missing toolchain may raise anything
            compat[name] = False
    return compat


def ray_cluster_status(address: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """Connect to the Ray cluster at ``address`` in a subprocess and report its nodes and resources."""
    probe = (
        "import json, ray\n"
        "ray.init(address=ADDRESS, logging_level='ERROR', log_to_driver=False)\n"
        "nodes = [n for n in ray.nodes() if n.get('Alive')]\n"
        "print(json.dumps({'address': ADDRESS, 'alive_nodes': len(nodes),\n"
        "    'resources': ray.cluster_resources(), 'available': ray.available_resources()}))\n"
    ).replace("ADDRESS", json.dumps(address))
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"address": address, "error": f"no answer within {timeout_s:.0f} s"}
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        err = (out.stderr.strip().splitlines() or ["unknown error"])[-1]
        return {"address": address, "error": err}
    return json.loads(lines[-1])


def environment_report(ray_address: str | None = None) -> dict[str, Any]:
    """Everything ``zbench env`` prints: collect_environment (GPUs via torch), DeepSpeed ops, Ray cluster."""
    report = collect_environment(probe_torch=True)
    # DeepSpeed's logger writes to the stdout of its import ("Setting accelerator to CPU ..."): send it to stderr,
    # so that stdout holds only the report (`zbench env --json | jq`)
    with contextlib.redirect_stdout(sys.stderr):
        report["deepspeed_ops"] = deepspeed_op_compatibility()
    if ray_address:
        report["ray"] = ray_cluster_status(ray_address)
    return report
