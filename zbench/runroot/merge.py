"""`zbench merge`: the cases of several run roots (a first run and reruns of its failed cases) in one summary."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from zbench.runroot import casedir
from zbench.runroot.casedir import RunRootError
from zbench.runroot.root import RunRoot
from zbench.runroot.summary import SUMMARY_COMPLETE, read_summary, write_summary


@dataclass(frozen=True)
class MergeResult:
    """Where merge wrote its table, the rows, and warnings (mixed configs let through by ``mixed_configs``)."""

    path: Path
    rows: list[dict[str, str]]
    warnings: list[str]


def _ended_at(root: RunRoot, case_dir: str) -> str:
    status = casedir.read_status(root.path / case_dir) or {}
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
        raise RunRootError(f"--out {out_path} is a directory; give the path of the TSV file to write")
    if out_path.exists() and not overwrite:
        try:
            earlier = read_summary(out_path)
            roots_in = sorted({Path(r["case_dir"]).parent.name or out_path.parent.name for r in earlier})
            what = f"a summary of {len(earlier)} case(s) from {', '.join(roots_in) or 'no run root'}"
        except (RunRootError, OSError, UnicodeDecodeError):
            what = "not a zbench summary"
        raise RunRootError(f"{out_path} already exists ({what}); pass --force to replace it, or --out FILE to "
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
                raise RunRootError(f"{msg}; rerun it with the same config, or pass --mixed-configs to merge anyway")
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


