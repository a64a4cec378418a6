"""Live progress of a run: a rich table on a terminal, one plain line per event otherwise.

Both displays follow each case's metrics.jsonl as it grows (reading only the new complete lines) and show
step/steps, the last ``critic/score/mean`` and ``perf/throughput``, the peak of the leading memory figure
(zbench.runroot.memory_figures: device-wide on a GPU, RSS on CPU, named as such), elapsed time and an ETA.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.live import Live
from rich.table import Table

from zbench.runroot import casedir
from zbench.runroot.memory_figures import MemoryFigure, leading_in_record

_STYLE = {
    "completed": "green", "running": "cyan", "failed": "red", "oom": "magenta", "timeout": "yellow",
    "interrupted": "yellow", "pending": "dim",
}  # fmt: skip


@dataclass
class CaseView:
    """What the display knows about one case."""

    name: str
    steps_target: int | None
    status: str = "pending"
    attempt: int = 0
    step: int = 0
    score: float | None = None
    throughput: float | None = None
    peak_memory_gb: float | None = None  # of the leading memory figure (zbench.runroot.memory_figures)
    memory_figure: MemoryFigure | None = None
    started: float | None = None
    ended: float | None = None
    metrics: Path | None = None
    offset: int = 0
    reason: str = ""
    new_records: list[dict[str, Any]] = field(default_factory=list)

    def elapsed(self) -> float | None:
        if self.started is None:
            return None
        return (self.ended or time.monotonic()) - self.started

    def eta(self) -> float | None:
        elapsed = self.elapsed()
        if self.status != "running" or not self.step or not self.steps_target or elapsed is None:
            return None
        return max(self.steps_target - self.step, 0) * elapsed / self.step

    def read_new(self) -> None:
        """Consume complete lines appended to metrics.jsonl since the last read (a torn tail waits)."""
        if self.metrics is None:
            return
        try:
            with self.metrics.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n")
        if end < 0:
            return
        self.offset += end + 1
        for rec in casedir.parse_metrics(chunk[: end + 1]).records:
            self._apply(rec)
            self.new_records.append(rec)

    def _apply(self, rec: Mapping[str, Any]) -> None:
        if isinstance(rec.get("step"), int):
            self.step = max(self.step, rec["step"])
        if isinstance(rec.get("critic/score/mean"), (int, float)):
            self.score = float(rec["critic/score/mean"])
        if isinstance(rec.get("perf/throughput"), (int, float)):
            self.throughput = float(rec["perf/throughput"])
        figure = leading_in_record(rec)
        if figure is not None:
            if figure != self.memory_figure:  # a record leading with another figure starts its own peak
                self.memory_figure, self.peak_memory_gb = figure, None
            self.peak_memory_gb = max(self.peak_memory_gb or 0.0, float(rec[figure.metric]))


def _num(value: float | None, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return ""
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class RunProgress:
    """Base for the two displays: tracks cases; subclasses decide how to show them."""

    def __init__(self, cases: Sequence[tuple[str, int | None]]) -> None:
        self.views = {name: CaseView(name, steps) for name, steps in cases}
        self._lock = threading.Lock()

    def _view(self, name: str) -> CaseView:
        if name not in self.views:
            self.views[name] = CaseView(name, None)
        return self.views[name]

    def case_started(self, name: str, case_dir: Path, attempt: int, steps_target: int | None) -> None:
        """A case (attempt) starts running."""
        with self._lock:
            v = self._view(name)
            v.status, v.attempt, v.step, v.started, v.ended = "running", attempt, 0, time.monotonic(), None
            v.score = v.throughput = v.peak_memory_gb = v.memory_figure = None
            v.steps_target = steps_target if steps_target is not None else v.steps_target
            v.metrics, v.offset, v.reason = case_dir / casedir.METRICS, 0, ""
            self._on_start(v)

    def poll(self) -> None:
        """Read new metrics lines of running cases."""
        with self._lock:
            for v in self.views.values():
                if v.status == "running":
                    v.read_new()
                    self._on_records(v)

    def case_finished(self, name: str, status: Mapping[str, Any]) -> None:
        """A case (attempt) ended, or was found completed by an earlier run."""
        with self._lock:
            v = self._view(name)
            v.read_new()
            self._on_records(v)
            v.status = str(status.get("status", "failed"))
            v.reason = str(status.get("reason") or "")
            v.step = max(v.step, int(status.get("last_step") or 0))
            v.attempt = int(status.get("attempt") or v.attempt)
            if v.started is not None:
                v.ended = time.monotonic()
            self._on_end(v, status)

    def _on_start(self, v: CaseView) -> None:
        """A case started (nothing to show by default)."""

    def _on_records(self, v: CaseView) -> None:
        v.new_records.clear()

    def _on_end(self, v: CaseView, status: Mapping[str, Any]) -> None:
        """A case ended (nothing to show by default)."""

    def __enter__(self) -> RunProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        """Nothing to tear down by default."""


class PlainProgress(RunProgress):
    """One line per event (case start, every step, case end) for logs and CI."""

    def __init__(self, cases: Sequence[tuple[str, int | None]], stream: TextIO | None = None) -> None:
        super().__init__(cases)
        self.stream = stream or sys.stdout

    def _say(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def _on_start(self, v: CaseView) -> None:
        self._say(f"[{v.name}] started (attempt {v.attempt})")

    def _on_records(self, v: CaseView) -> None:
        for rec in v.new_records:
            parts = [f"step {rec.get('step')}/{v.steps_target or '?'}"]
            for key, label, fmt in (
                ("critic/score/mean", "score", ".3f"), ("perf/throughput", "throughput", ".1f"),
                ("timing_s/step", "step_s", ".2f"),
            ):  # fmt: skip
                if isinstance(rec.get(key), (int, float)):
                    parts.append(f"{label} {rec[key]:{fmt}}")
            if v.memory_figure is not None and v.peak_memory_gb is not None:
                parts.append(f"peak {v.memory_figure.short} {v.peak_memory_gb:.2f} GB")
            self._say(f"[{v.name}] " + " ".join(parts))
        v.new_records.clear()

    def _on_end(self, v: CaseView, status: Mapping[str, Any]) -> None:
        if v.started is None:
            self._say(f"[{v.name}] already {v.status} (attempt {v.attempt}): skipped")
            return
        tail = f": {v.reason}" if v.reason else ""
        warn = "; ".join(status.get("warnings") or [])
        self._say(
            f"[{v.name}] {v.status} (step {v.step}/{v.steps_target or '?'}, attempt {v.attempt}, "
            f"{_dur(v.elapsed())}){tail}" + (f" [warning: {warn}]" if warn else "")
        )


class LiveProgress(RunProgress):
    """A rich Live table of every case, refreshed as metrics arrive."""

    def __init__(self, cases: Sequence[tuple[str, int | None]], console: Console | None = None) -> None:
        super().__init__(cases)
        self.console = console or Console()
        self.live = Live(
            console=self.console, get_renderable=self.table, refresh_per_second=2, transient=False
        )

    def table(self) -> Table:
        """The current table of cases."""
        t = Table(title="zbench", expand=False)
        figures = {v.memory_figure.short for v in self.views.values() if v.memory_figure is not None}
        mixed = len(figures) > 1  # cases leading with different figures: each value names its own
        memory = f"peak {next(iter(figures))} GB" if len(figures) == 1 else "peak memory GB"
        for col in ("case", "status", "step", "score", "throughput", memory, "elapsed", "ETA"):
            t.add_column(col, justify="left" if col in ("case", "status") else "right")
        for v in list(self.views.values()):
            status = v.status + (f" #{v.attempt}" if v.attempt > 1 else "")
            t.add_row(
                v.name, f"[{_STYLE.get(v.status, '')}]{status}[/]", f"{v.step}/{v.steps_target or '?'}",
                _num(v.score, ".3f"), _num(v.throughput, ".1f"),
                _num(v.peak_memory_gb, ".2f") + (f" ({v.memory_figure.short})" if mixed and
                                                 v.memory_figure and v.peak_memory_gb is not None else ""),
                _dur(v.elapsed()), _dur(v.eta()),
            )  # fmt: skip
        return t

    def _on_end(self, v: CaseView, status: Mapping[str, Any]) -> None:
        if v.reason and v.status != "completed":
            self.live.console.print(f"[{_STYLE.get(v.status, '')}]{v.name}: {v.status}: {v.reason}[/]")

    def __enter__(self) -> LiveProgress:
        self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.stop()


def make_progress(cases: Sequence[tuple[str, int | None]], stream: TextIO | None = None) -> RunProgress:
    """A LiveProgress when ``stream`` (default stdout) is a terminal, else a PlainProgress."""
    stream = stream or sys.stdout
    if stream.isatty():
        return LiveProgress(cases, Console(file=stream))
    return PlainProgress(cases, stream)
