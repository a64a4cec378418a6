"""A profile of one training step (`trainer.profile_step`): per phase, how long it took and how much of that time
the GPU was busy.

When the trainer reaches that step, every worker starts `torch.profiler` and labels each phase it runs
(`zbench/<phase>`, e.g. `zbench/update_critic`). After the step each worker writes, under `<case>/profile/`:

- `step<K>-<role>-rank<R>.txt`: one line per phase (wall time; GPU busy time, the union of the kernels and copies
  running inside the phase's window; how many ran there), then the operators that took the most time;
- `step<K>-<role>-rank<R>.json.gz`: the full trace, for Perfetto or chrome://tracing.

A phase whose GPU is busy for most of its wall time is bound by its kernels; one with a low busy share waits on
the CPU (Python, launches, optimizer steps on the host) or on synchronisation. Backward kernels are launched from
autograd's own thread, so busy time is taken from the device timeline, not from the phase's call tree.
Profiling slows the step it covers, writing the files included (it counts against `--step-timeout`); the step
is marked `perf/profiled`, and step means and peaks leave it out.
"""

from __future__ import annotations

import contextlib
import gzip
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PHASE_PREFIX = "zbench/"


@dataclass(frozen=True)
class PhaseProfile:
    """What one labelled phase did on one rank."""

    phase: str
    wall_ms: float
    gpu_busy_ms: float
    device_ops: int  # kernels, copies and sets running on the device during the phase's window (queued earlier too)

    @property
    def busy_share(self) -> float:
        return self.gpu_busy_ms / self.wall_ms if self.wall_ms > 0 else 0.0


def busy_within(intervals: list[tuple[int, int]], start: int, end: int) -> int:
    """Length of the union of `intervals` (start, end) clipped to [start, end]: overlapping kernels on several
    streams count once."""
    clipped = sorted((max(s, start), min(e, end)) for s, e in intervals if e > start and s < end)
    total, cur_s, cur_e = 0, None, None
    for s, e in clipped:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def phase_profiles(events: list[Any]) -> list[PhaseProfile]:
    """Phases (CPU ranges labelled `zbench/...`) with the device activity inside each, from kineto events."""
    device = [(e.start_ns(), e.end_ns()) for e in events
              if e.device_type() != torch.autograd.DeviceType.CPU and not e.is_user_annotation()]
    out = []
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CPU and e.name().startswith(PHASE_PREFIX):
            start, end = e.start_ns(), e.end_ns()
            n_ops = sum(1 for s, f in device if s < end and f > start)
            out.append(PhaseProfile(e.name()[len(PHASE_PREFIX):], (end - start) / 1e6,
                                    busy_within(device, start, end) / 1e6, n_ops))
    return sorted(out, key=lambda p: p.wall_ms, reverse=True)


def render(phases: list[PhaseProfile], table: str, title: str) -> str:
    """The text report: the phase lines, then the operator table."""
    lines = [title, "", f"{'phase':<22}{'wall ms':>12}{'GPU busy ms':>14}{'busy':>8}{'device ops':>12}"]
    for p in phases:
        lines.append(f"{p.phase:<22}{p.wall_ms:>12.1f}{p.gpu_busy_ms:>14.1f}{p.busy_share:>8.0%}{p.device_ops:>12}")
    return "\n".join([*lines, "", table, ""])


class StepProfiler:
    """Starts and stops `torch.profiler` around one step of one worker, and writes what it saw."""

    def __init__(self, on_cuda: bool):
        self.on_cuda = on_cuda
        self._prof: Any = None

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_cuda else [])
        prof = profile(activities=activities, record_shapes=False, with_stack=False)
        prof.__enter__()
        self._prof = prof  # only once it runs: a failed start leaves nothing to stop

    def stop(self, out_dir: Path, stem: str, title: str) -> list[PhaseProfile]:
        """Stop profiling; write `<stem>.txt` and `<stem>.json.gz` into `out_dir`; return the phase lines."""
        prof, self._prof = self._prof, None
        if prof is None:
            return []
        if self.on_cuda:
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        phases = phase_profiles(list(prof.profiler.kineto_results.events()))
        sort_by = "self_device_time_total" if self.on_cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=70)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{stem}.txt").write_text(render(phases, table, title))
        trace = out_dir / f"{stem}.json"
        prof.export_chrome_trace(str(trace))
        with trace.open("rb") as src, gzip.open(out_dir / f"{stem}.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()
        return phases

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label what runs inside as phase `name` while profiling (nothing otherwise)."""
        if self._prof is None:
            yield
            return
        from torch.profiler import record_function

        with record_function(PHASE_PREFIX + name):
            yield
