"""A profile of one training step (`trainer.profile_step`): per phase, how long it took and how much of that time
the GPU was busy.

When the trainer reaches that step, every worker starts `torch.profiler` and labels each phase it runs
(`zbench/<phase>`, e.g. `zbench/update_critic`). After the step each worker writes, under `<case>/profile/`:

- `step<K>-<role>-rank<R>.txt`: one line per phase (wall time; GPU busy time, the union of the kernels and copies
  running inside the phase's window; how many ran there), each followed by its parts where the code labels them
  (`part`: the graph loop's `gen/cache`, `gen/prefill`, `gen/decode`, `gen/to_host`, `gen/memory`, `gen/sleep`; the
  worker's `gen/record`) and what of the phase lies outside them (`gen/(rest)`); then where each phase's GPU idled
  (its gaps between device ops by length, and the longest, each with the device op it followed and the CPU operator
  the phase's thread was running as it began: a sync, a launch, a copy; where none, Python or a wait that records
  none, and then what another thread ran, such as autograd's during a backward); the idle in gaps of 10 us or more
  summed by the host's stack as each began (its outermost and innermost operators: which host work the GPU waited
  on, such as a hook inside autograd's `AccumulateGrad`); the device ops with the most device time inside each
  phase and part; then those of the whole step and the CPU operators with the most self time;
- `step<K>-<role>-rank<R>.json.gz`: the full trace, for Perfetto or chrome://tracing.

A phase whose GPU is busy for most of its wall time is bound by its kernels; one with a low busy share waits on
the CPU (Python, launches, optimizer steps on the host) or on synchronisation. Backward kernels are launched from
autograd's own thread, so busy time is taken from the device timeline, not from the phase's call tree.

Where the host holds a phase up (a vLLM rollout at a small batch), `trainer.profiler=python` says where its time
goes instead: each phase runs under `cProfile`, and `step<K>-<role>-rank<R>.txt` lists, per phase, the Python
functions with the most own time. Before Python 3.12 cProfile sees the worker's own thread; from 3.12 on it sees
every thread of the process (through `sys.monitoring`), so a thread that competes for the interpreter shows there
too. The two profilers do not run together: cProfile's overhead would change the busy shares the other measures.

Profiling slows the step it covers, writing the files included (it counts against `--step-timeout`); the step
is marked `perf/profiled`, and step means and peaks leave it out.
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import gzip
import itertools
import pstats
import shutil
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zbench.config import PROFILERS

PHASE_PREFIX = "zbench/"
HOST_TOP = 25  # functions listed per phase by the python profiler
OPERATORS_TOP = 30  # rows of each operator table of torch.profiler's text report
OPERATOR_NAME_WIDTH = 100  # characters of an operator's name shown there (kernel names run to thousands)
HOST_NAME_WIDTH = 60  # characters of an operator's name beside an idle gap


# the lengths that split a window's GPU idle into classes: gaps under 10 us (between the kernels of one launch or graph),
# to 100 us, to 1 ms (a launch or a host step the device waited for), and longer (a sync, a copy to the host, Python)
IDLE_EDGES_NS = (10_000, 100_000, 1_000_000)
IDLE_LISTED = 5  # the longest gaps listed per phase, each with what the host was running as it began
WAITS_LISTED = 8  # per phase, the host stacks under which the most idle of 10 us or more began
WINDOW_OPS_LISTED = 8  # per phase and part, the device ops with the most device time inside its window


@dataclass(frozen=True)
class IdleGap:
    """One stretch of a phase's window in which the device ran nothing."""

    offset_ms: float  # from the window's start
    length_us: float
    after: str  # the device op whose end began the gap; "" where the window began idle
    host: str  # the innermost CPU operator running on the phase's thread as the gap began; "" where none was
    # the innermost running on the profile's other threads then (autograd's, where a backward holds the phase's
    # thread in a wait that records no operator); "" where none was, or where the gap's window has no thread
    elsewhere: str = ""


@dataclass(frozen=True)
class IdleWait:
    """The gaps of 10 us or more (past `IDLE_EDGES_NS[0]`, the GPU waiting on the host, not between the kernels of
    one launch) that began while the host ran one stack: its outermost and innermost CPU operators, on the phase's
    thread or, where that ran none, on another (autograd's during a backward)."""

    # "outer > inner" (one name where they are one operator), "... (another thread)" where the phase's thread ran
    # none, "(no operator)" where no thread ran one
    host: str
    gaps: int
    ms: float


@dataclass(frozen=True)
class IdleProfile:
    """A window's GPU idle time: per class of `IDLE_EDGES_NS` the gaps' count and summed length, the longest, and
    the gaps of 10 us or more summed by what the host ran as each began (`IdleWait`), most idle first."""

    classes: tuple[tuple[int, float], ...]  # (gaps, ms), shortest class first
    longest: tuple[IdleGap, ...]  # longest first
    waits: tuple[IdleWait, ...] = ()

    @property
    def ms(self) -> float:
        return sum(ms for _, ms in self.classes)


@dataclass(frozen=True)
class PhaseProfile:
    """What one labelled phase did on one rank."""

    phase: str
    wall_ms: float
    gpu_busy_ms: float
    # kernels, copies and sets running on the device during the phase's window (queued earlier too); None for the
    # time outside a phase's parts, where one running across a part's edge would be counted twice
    device_ops: int | None
    start_ns: int = 0  # the window on the profiler's clock, which places a part (`gen/decode`) inside its phase
    end_ns: int = 0
    # where in the window the device ran nothing, in classes of gap length; None where the profile saw no device
    # (a CPU run) and for the time outside a phase's parts
    idle: IdleProfile | None = None

    @property
    def busy_share(self) -> float:
        return self.gpu_busy_ms / self.wall_ms if self.wall_ms > 0 else 0.0

    def line(self) -> str:
        ops = "" if self.device_ops is None else f", {self.device_ops} device ops"
        return f"wall {self.wall_ms:.1f} ms, GPU busy {self.gpu_busy_ms:.1f} ms ({self.busy_share:.0%}){ops}"


@dataclass(frozen=True)
class HostFunction:
    """One Python function's share of a phase under cProfile."""

    function: str  # name (file:line)
    calls: int
    own_s: float  # in the function itself
    cumulative_s: float  # with what it called


@dataclass(frozen=True)
class HostPhase:
    """What one labelled phase's Python did on one rank (`trainer.profiler=python`)."""

    phase: str
    wall_ms: float
    top: tuple[HostFunction, ...]  # by own time, most first
    why_none: str = ""  # why `top` is empty, where it is

    def line(self) -> str:
        hottest = ", ".join(f"{f.function} {f.own_s:.3f} s" for f in self.top[:3])
        return (f"wall {self.wall_ms:.1f} ms under cProfile, most own time: "
                f"{hottest or 'none recorded (' + (self.why_none or 'no Python ran') + ')'}")


def host_functions(stats: pstats.Stats, top: int) -> tuple[HostFunction, ...]:
    """The `top` functions by own time in `stats`, named `name (file:line)` with the file's last two parts."""
    rows = []
    for (file, line, name), (_cc, calls, own, cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = "/".join(Path(file).parts[-2:]) if file not in ("~", "") else "~"
        rows.append(HostFunction(f"{name} ({where}:{line})", calls, round(own, 4), round(cum, 4)))
    rows.sort(key=lambda f: -f.own_s)
    return tuple(rows[:top])


def render_host(phases: list[HostPhase], title: str) -> str:
    """The python profiler's text report: per phase, its wall time, then its functions by own time."""
    lines = [title]
    for p in phases:
        lines += ["", f"phase {p.phase}: wall {p.wall_ms:.1f} ms under cProfile; the functions with the most own "
                      f"time:", f"{'own s':>10}{'cumulative s':>14}{'calls':>10}  function"]
        lines += [f"{f.own_s:>10.4f}{f.cumulative_s:>14.4f}{f.calls:>10}  {f.function}" for f in p.top]
        if not p.top:
            lines.append(f"  none recorded ({p.why_none or 'no Python ran'})")
    return "\n".join([*lines, ""])


def union_within(intervals: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The union of `intervals` (start, end) clipped to [start, end], as disjoint intervals in order: overlapping
    kernels on several streams count once."""
    merged: list[tuple[int, int]] = []
    for s, e in sorted((max(s, start), min(e, end)) for s, e in intervals if min(e, end) > max(s, start)):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def busy_within(intervals: list[tuple[int, int]], start: int, end: int) -> int:
    """Length of the union of `intervals` clipped to [start, end] (`union_within`)."""
    return sum(e - s for s, e in union_within(intervals, start, end))


def idle_within(intervals: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The stretches of [start, end] that no interval covers, in order: where the device ran nothing."""
    return _between(union_within(intervals, start, end), start, end)


def _between(merged: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The stretches of [start, end] outside `merged` (disjoint, in order, within it)."""
    gaps, at = [], start
    for s, e in merged:
        if s > at:
            gaps.append((at, s))
        at = e
    if end > at:
        gaps.append((at, end))
    return gaps


class DeviceTimeline:
    """A profile's device ops (kernels, copies, sets) and each thread's CPU operators, from kineto events: how long
    the device was busy within a window, and where in it, and on what, it waited."""

    def __init__(self, events: list[Any]):
        import numpy as np

        cpu, device = torch.autograd.DeviceType.CPU, []
        spans: dict[int, list[tuple[int, int, str]]] = {}
        for e in events:
            if e.device_type() != cpu:
                if not e.is_user_annotation():
                    device.append((e.start_ns(), e.end_ns(), e.name()))
            elif (not e.is_async() and e.start_thread_id() == e.end_thread_id()
                  and not e.name().startswith(PHASE_PREFIX)):  # a phase label is no operator
                spans.setdefault(e.start_thread_id(), []).append((e.start_ns(), e.end_ns(), e.name()))
        device.sort()
        self.ops = [(s, e) for s, e, _ in device]
        self._ended: dict[int, str] = {}  # the op that ended at a moment (the last listed, where several did)
        for _, e, name in device:
            self._ended[e] = name
        self._np = np
        # looked up only beside idle gaps: a profile without device ops (a CPU run) has none to look up for
        self._threads: dict[int, tuple[Any, Any, Any, list[str]]] = {}
        for t, ops in spans.items() if device else ():
            ops.sort()
            starts = np.array([s for s, _, _ in ops], dtype=np.int64)
            ends = np.array([e for _, e, _ in ops], dtype=np.int64)
            # the latest end among the spans up to each: none before the first whose value passes a moment is running
            # then, so a lookup scans from there (the operators open at that moment and their earlier children)
            self._threads[t] = (starts, ends, np.maximum.accumulate(ends), [n for _, _, n in ops])

    @property
    def span(self) -> tuple[int, int]:
        """From the first device op's start to the last one's end; (0, 0) where there was none."""
        return (self.ops[0][0], max(e for _, e in self.ops)) if self.ops else (0, 0)

    def host_at(self, ns: int, thread: int | None, *, skip: int | None = None) -> str:
        """The innermost CPU operator running at `ns` on `thread`, or on any thread (but `skip`) where None: the
        latest to start among those running, of those the first to end; "" where none was (Python between
        operators, a wait that records none, or a thread that records none)."""
        return self.stack_at(ns, thread, skip=skip)[1]

    def stack_at(self, ns: int, thread: int | None, *, skip: int | None = None) -> tuple[str, str]:
        """The outermost and innermost CPU operators running at `ns` on one thread: `thread`, or where None the one
        (but `skip`) whose innermost started latest (`host_at`); ("", "") where none was. The outermost is the
        earliest to start among those running, of those the last to end."""
        np = self._np
        best: tuple[int, int] | None = None  # (start, -end) of the innermost so far
        stack = ("", "")
        for t, (starts, ends, reach, names) in self._threads.items():
            if (thread is not None and t != thread) or t == skip:
                continue
            began = int(np.searchsorted(starts, ns, side="right"))  # spans are in order of start
            open_from = int(np.searchsorted(reach, ns, side="right"))  # every span before it ended by `ns`
            running = open_from + np.flatnonzero(ends[open_from:began] > ns)
            if running.size:
                inner = running[starts[running] == starts[running].max()]
                k = int(inner[ends[inner].argmin()])
                outer = running[starts[running] == starts[running].min()]
                j = int(outer[ends[outer].argmax()])
                key = (int(starts[k]), -int(ends[k]))
                if best is None or key > best:
                    best, stack = key, (names[j], names[k])
        return stack

    def wait_label(self, ns: int, thread: int | None) -> str:
        """What the host ran as a gap began at `ns`, for `IdleWait`: "outer > inner" on `thread`, or where that ran
        none, on another thread; "(no operator)" where none ran one."""
        outer, inner = self.stack_at(ns, thread)
        where = ""
        if not inner and thread is not None:
            (outer, inner), where = self.stack_at(ns, None, skip=thread), " (another thread)"
        if not inner:
            return "(no operator)"
        stack = inner[:HOST_NAME_WIDTH] if outer == inner else f"{outer[:HOST_NAME_WIDTH]} > {inner[:HOST_NAME_WIDTH]}"
        return stack + where

    def idle(self, start: int, end: int, thread: int | None, listed: int = IDLE_LISTED,
             busy: list[tuple[int, int]] | None = None) -> IdleProfile:
        """The gaps of [start, end] in which the device ran nothing, in classes of `IDLE_EDGES_NS`; the `listed`
        longest, each with the device op it followed and the host's operator (`host_at` on `thread`) as it began;
        and the gaps of 10 us or more summed by the host's stack as each began (`wait_label`), the `WAITS_LISTED`
        with the most idle. `busy`: the window's `union_within`, where the caller has it."""
        gaps = _between(union_within(self.ops, start, end) if busy is None else busy, start, end)
        classes = [[0, 0] for _ in range(len(IDLE_EDGES_NS) + 1)]
        waits: dict[str, list[int]] = {}
        for s, e in gaps:
            row = classes[sum(e - s >= edge for edge in IDLE_EDGES_NS)]
            row[0] += 1
            row[1] += e - s
            if e - s >= IDLE_EDGES_NS[0]:
                wait = waits.setdefault(self.wait_label(s, thread), [0, 0])
                wait[0] += 1
                wait[1] += e - s
        longest = sorted(gaps, key=lambda g: g[0] - g[1])[:listed]
        ranked = sorted(waits.items(), key=lambda w: (-w[1][1], w[0]))[:WAITS_LISTED]
        return IdleProfile(tuple((n, ns / 1e6) for n, ns in classes),
                           tuple(IdleGap((s - start) / 1e6, (e - s) / 1e3, self._ended.get(s, ""),
                                         self.host_at(s, thread),
                                         self.host_at(s, None, skip=thread) if thread is not None else "")
                                 for s, e in longest),
                           tuple(IdleWait(host, n, ns / 1e6) for host, (n, ns) in ranked))


def phase_profiles(events: list[Any]) -> list[PhaseProfile]:
    """Phases (CPU ranges labelled `zbench/...`) with the device activity inside each, from kineto events; where the
    profile holds device activity at all, each phase's idle gaps too (the host's operators from its own thread)."""
    timeline = DeviceTimeline(events)
    device = timeline.ops
    out = []
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CPU and e.name().startswith(PHASE_PREFIX):
            start, end = e.start_ns(), e.end_ns()
            n_ops = sum(1 for s, f in device if s < end and f > start)
            busy = union_within(device, start, end)
            idle = timeline.idle(start, end, e.start_thread_id(), busy=busy) if device else None
            out.append(PhaseProfile(e.name()[len(PHASE_PREFIX):], (end - start) / 1e6,
                                    sum(f - s for s, f in busy) / 1e6, n_ops, start, end, idle))
    return sorted(out, key=lambda p: p.wall_ms, reverse=True)


@contextlib.contextmanager
def part(name: str) -> Iterator[None]:
    """Label what runs inside as `name`, a part of the phase it runs in (`gen/prefill` of `gen`), for a step profile
    by torch.profiler: its text report lists the part under the phase, with what of the phase lies outside its
    parts. Without a profiler running, the label costs a few microseconds."""
    from torch.profiler import record_function

    with record_function(PHASE_PREFIX + name):
        yield


def phase_rows(phases: list[PhaseProfile]) -> list[tuple[str, PhaseProfile]]:
    """The report's rows: each phase, longest first, then its parts (`<phase>/<part>` inside its window) in the order
    they ran, indented, each with its own parts, and the phase's time outside them (`<phase>/(rest)`): wall and GPU
    busy time less the parts' (windows one after another on one thread, so their times add up; a kernel queued in
    one part that runs in the next counts in the next), its device ops not counted. A part labelled where no phase
    was (a rollout outside a step's phases) stands as a phase."""
    def inside(q: PhaseProfile, p: PhaseProfile) -> bool:  # q a part of p
        rest = q.phase[len(p.phase) + 1:]
        return (q.phase.startswith(p.phase + "/") and "/" not in rest and p.start_ns <= q.start_ns
                and q.end_ns <= p.end_ns)

    rows: list[tuple[str, PhaseProfile]] = []

    def add(p: PhaseProfile, indent: str) -> None:
        rows.append((indent + p.phase, p))
        parts = sorted((q for q in phases if inside(q, p)), key=lambda q: q.start_ns)
        for q in parts:
            add(q, indent + "  ")
        if parts:
            rest = PhaseProfile(f"{p.phase}/(rest)", max(p.wall_ms - sum(q.wall_ms for q in parts), 0.0),
                                max(p.gpu_busy_ms - sum(q.gpu_busy_ms for q in parts), 0.0), None)
            rows.append((indent + "  " + rest.phase, rest))

    for p in phases:
        if not any(inside(p, q) for q in phases):
            add(p, "")
    return rows


@dataclass(frozen=True)
class OperatorTime:
    """One operator's share of a profile: its calls and their time, on the device (a kernel, copy or set) or on the
    CPU (self time: less the operators it called)."""

    name: str
    calls: int
    ns: int


def operator_times(events: list[Any]) -> tuple[list[OperatorTime], list[OperatorTime]]:
    """The device ops by device time, and the CPU operators by self time, each most first, from kineto events in one
    pass, counted as torch's `key_averages` counts them. torch builds a Python object per event first: 20-71 s for
    500,000 CPU events on a 2-core CPU, where a GPU step with a vLLM rollout holds about 200,000 device ops a rank
    (results/reference/h200x2-v1-runner-20261127: that profile took about 47 s to write); this took 1.2-1.3 s there.

    As there: an operator's self time is its span less its direct children's on its thread, where a child lies
    wholly inside it (one that outlasts it is not its child); an operator whose one child has its own name (autograd
    records some twice, `aten::mean` in `aten::mean`) is one call; an asynchronous operator has no self time and no
    children. `record_function` ranges are CPU operators too, so a phase label (`zbench/gen`) shows the phase's time
    outside any operator (its Python); their copies on the device's timeline are not device ops."""
    device: dict[str, list[int]] = {}
    threads: dict[int, list[tuple[int, int, str]]] = {}
    cpu: dict[str, list[int]] = {}
    for e in events:
        name = e.name()
        if e.device_type() != torch.autograd.DeviceType.CPU:
            if not e.is_user_annotation():
                row = device.setdefault(name, [0, 0])
                row[0] += 1
                row[1] += e.end_ns() - e.start_ns()
        elif e.is_async() or e.start_thread_id() != e.end_thread_id():
            cpu.setdefault(name, [0, 0])[0] += 1
        else:
            threads.setdefault(e.start_thread_id(), []).append((e.start_ns(), e.end_ns(), name))
    for spans in threads.values():
        spans.sort(key=lambda span: (span[0], -span[1]))  # an operator before those it called
        own = [end - start for start, end, _ in spans]
        parent = [-1] * len(spans)
        children = [0] * len(spans)
        enclosing: list[int] = []  # the operators still open, innermost last
        for i, (start, end, _name) in enumerate(spans):
            while enclosing and (start >= spans[enclosing[-1]][1] or end > spans[enclosing[-1]][1]):
                enclosing.pop()
            if enclosing:
                parent[i] = enclosing[-1]
                own[parent[i]] -= end - start
                children[parent[i]] += 1
            enclosing.append(i)
        for i, (_start, _end, name) in enumerate(spans):
            row = cpu.setdefault(name, [0, 0])
            p = parent[i]
            if not (p >= 0 and children[p] == 1 and spans[p][2] == name):  # else its parent's call, recorded twice
                row[0] += 1
            row[1] += max(own[i], 0)  # children that overlap each other can add up to more than their parent

    def ranked(rows: dict[str, list[int]]) -> list[OperatorTime]:
        return sorted((OperatorTime(name, calls, ns) for name, (calls, ns) in rows.items()), key=lambda o: -o.ns)

    return ranked(device), ranked(cpu)


def window_operators(events: list[Any], rows: list[tuple[str, PhaseProfile]],
                     top: int = WINDOW_OPS_LISTED) -> list[tuple[str, float, float, list[OperatorTime]]]:
    """Per phase and part of `rows` (`phase_rows`; not the time outside the parts, which has no window of its own):
    its label, wall time, device time in all and the `top` device ops with the most of it, each op's time clipped to
    the window (what of the whole step's operator table a part, `gen/prefill`, spent where). An op running across
    two windows counts as a call in each."""
    import bisect

    device = sorted((e.start_ns(), e.end_ns(), e.name()) for e in events
                    if e.device_type() != torch.autograd.DeviceType.CPU and not e.is_user_annotation())
    starts = [s for s, _, _ in device]
    longest = max((e - s for s, e, _ in device), default=0)
    out = []
    for label, p in rows:
        if p.end_ns <= p.start_ns:
            continue
        ops: dict[str, list[int]] = {}
        for s, e, name in device[bisect.bisect_left(starts, p.start_ns - longest):bisect.bisect_left(starts, p.end_ns)]:
            ns = min(e, p.end_ns) - max(s, p.start_ns)
            if ns > 0:
                row = ops.setdefault(name, [0, 0])
                row[0] += 1
                row[1] += ns
        ranked = sorted((OperatorTime(name, calls, ns) for name, (calls, ns) in ops.items()), key=lambda o: -o.ns)
        if ranked:
            out.append((label.strip(), p.wall_ms, sum(o.ns for o in ranked) / 1e6, ranked[:top]))
    return out


def render_window_operators(listed: list[tuple[str, float, float, list[OperatorTime]]], top: int) -> str:
    """`window_operators` as the text report's section: per phase and part, its wall and device time, then its top
    ops (at most `top`, what `window_operators` was asked for)."""
    if not listed:
        return ""
    lines = ["device ops inside each phase and part, by device time inside its window (ops overlapping on streams "
             f"add up), the {top} with the most:", f"{'device ms':>12}{'calls':>10}  name"]
    for label, wall_ms, ms, ops in listed:
        lines.append(f"{label}: {ms:.1f} ms of device ops in {wall_ms:.1f} ms")
        lines += [f"{o.ns / 1e6:>12.2f}{o.calls:>10}  {o.name[:OPERATOR_NAME_WIDTH]}" for o in ops]
    return "\n".join(lines)


def render_operators(device: list[OperatorTime], cpu: list[OperatorTime], top: int) -> str:
    """The operator tables of the text report: the device's (where it ran any), then the CPU's, `top` rows each."""
    lines = []
    if device:
        total = sum(o.ns for o in device)
        lines += [f"device ops (kernels, copies, sets) by device time: {total / 1e6:.1f} ms in all, {len(device)} kinds",
                  f"{'device ms':>12}{'share':>8}{'calls':>10}{'avg us':>11}  name"]
        lines += [f"{o.ns / 1e6:>12.2f}{o.ns / total if total else 0:>8.1%}{o.calls:>10}{o.ns / o.calls / 1e3:>11.2f}  "
                  f"{o.name[:OPERATOR_NAME_WIDTH]}" for o in device[:top]]
        lines.append("")
    lines += ["CPU operators by self time (less the operators they called):",
              f"{'self CPU ms':>12}{'calls':>10}{'avg us':>11}  name"]
    lines += [f"{o.ns / 1e6:>12.2f}{o.calls:>10}{o.ns / o.calls / 1e3:>11.2f}  {o.name[:OPERATOR_NAME_WIDTH]}"
              for o in cpu[:top]]
    return "\n".join(lines)


def render(phases: list[PhaseProfile], table: str, title: str, events: list[Any] | None = None) -> str:
    """The text report: the phase lines (`phase_rows`), the GPU idle inside each (`render_idle`), with `events` the
    device ops inside each (`window_operators`), then the operator tables."""
    rows = phase_rows(phases)
    lines = [title, "", f"{'phase':<28}{'wall ms':>12}{'GPU busy ms':>14}{'busy':>8}{'device ops':>12}"]
    for label, p in rows:
        ops = "–" if p.device_ops is None else p.device_ops
        lines.append(f"{label:<28}{p.wall_ms:>12.1f}{p.gpu_busy_ms:>14.1f}{p.busy_share:>8.0%}{ops:>12}")
    idle = render_idle(rows)
    inside = render_window_operators(window_operators(events, rows), WINDOW_OPS_LISTED) if events else ""
    return "\n".join([*lines, "", *([idle, ""] if idle else []), *([inside, ""] if inside else []), table, ""])


def _host_label(gap: IdleGap) -> str:
    if gap.host:
        return gap.host[:HOST_NAME_WIDTH]
    if gap.elsewhere:
        return f"(no operator on its thread; another thread in {gap.elsewhere[:HOST_NAME_WIDTH]})"
    return "(no operator)"


def idle_class_names() -> list[str]:
    """The classes of `IDLE_EDGES_NS` as the reports name them: `< 10 us`, `10 us - 100 us`, ..., `>= 1 ms`."""
    edges = [f"{e / 1e3:g} us" if e < 1_000_000 else f"{e / 1e6:g} ms" for e in IDLE_EDGES_NS]
    return [f"< {edges[0]}", *(f"{a} - {b}" for a, b in itertools.pairwise(edges)), f">= {edges[-1]}"]


def render_idle(rows: list[tuple[str, PhaseProfile]]) -> str:
    """Where each phase's and part's GPU idled: the gaps between device ops by length (count and ms a class), then
    the longest, each at its start in the window with the host's innermost operator then (what the device waited
    for: a sync, a launch, a copy; where the phase's thread ran none, what another thread ran). Empty where no row
    has an idle profile."""
    rows = [(label, p) for label, p in rows if p.idle is not None]
    if not rows:
        return ""
    names = idle_class_names()
    lines = ["GPU idle inside each phase (no kernel, copy or set running), by gap length: gaps, ms",
             f"{'phase':<28}{'idle ms':>10}" + "".join(f"{n:>20}" for n in names)]
    for label, p in rows:
        assert p.idle is not None
        lines.append(f"{label:<28}{p.idle.ms:>10.1f}" + "".join(f"{n:>11}{ms:>9.1f}" for n, ms in p.idle.classes))
    lines += ["", f"the {IDLE_LISTED} longest gaps of each: start in the phase (ms), length (us), the device op it "
                  "followed, the host's operator as it began"]
    for label, p in rows:
        assert p.idle is not None
        if p.idle.longest:
            lines.append(f"{label.strip()}:")
            lines += [f"  +{g.offset_ms:.1f} ms {g.length_us:.0f} us after {g.after[:HOST_NAME_WIDTH] or '(none)'}, "
                      f"host in {_host_label(g)}" for g in p.idle.longest]
    if any(p.idle.waits for _, p in rows if p.idle is not None):
        lines += ["", f"idle in gaps of {IDLE_EDGES_NS[0] / 1e3:g} us or more, by what the host ran as each began "
                      f"(outermost > innermost operator; another thread's where the phase's ran none), the "
                      f"{WAITS_LISTED} with the most of each: ms, gaps"]
    for label, p in rows:
        assert p.idle is not None
        if p.idle.waits:
            lines.append(f"{label.strip()}:")
            lines += [f"{w.ms:>10.1f}{w.gaps:>8}  {w.host}" for w in p.idle.waits]
    return "\n".join(lines)


@dataclass
class _HostRecord:
    wall_s: float
    stats: pstats.Stats | None
    why: str  # why a run of the phase recorded no functions


class StepProfiler:
    """Starts and stops a profiler around one step of one worker, and writes what it saw: `torch.profiler`, or
    `cProfile` per phase (`kind` "python")."""

    def __init__(self, on_cuda: bool):
        self.on_cuda = on_cuda
        self._prof: Any = None
        self._host: dict[str, _HostRecord] | None = None  # per phase, under the python profiler
        self._host_depth = 0  # host phases running (one inside another is timed, not profiled)

    @property
    def active(self) -> bool:
        return self._prof is not None or self._host is not None

    def start(self, kind: str = "torch") -> None:
        if kind not in PROFILERS:
            raise ValueError(f"profiler {kind!r}: choose one of {', '.join(PROFILERS)}")
        if kind == "python":
            self._host = {}
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_cuda else [])
        prof = profile(activities=activities, record_shapes=False, with_stack=False)
        prof.__enter__()
        self._prof = prof  # only once it runs: a failed start leaves nothing to stop

    def stop(self, out_dir: Path, stem: str, title: str) -> list[PhaseProfile] | list[HostPhase]:
        """Stop profiling; write `<stem>.txt` (and, from torch.profiler, `<stem>.json.gz`) into `out_dir`; return
        the phases, longest first.

        Before returning, and before a failure propagates, the cyclic garbage the profile leaves is collected: the
        pause falls between the profiled step's timer and the next step, in the profiled step's record
        (`perf/gc_pause_s`). torch.profiler's profile sits in reference cycles, and holds every event it recorded.
        When the operator tables came from torch's `key_averages`, its event objects added about 130,000 more for
        a few thousand CPU ops. Left to the collector, a GPU step's profile cost the next, unprofiled step a
        1.9-2.7 s pause (results/reference/h200x2-trainer-rollout-20261127); with the collection here, 0.005 s
        (h200x2-v1-runner-20261127). A failure's traceback keeps its lines but lets go of the frames' locals (the
        profile), or they would outlive this collection."""
        try:
            return self._write(out_dir, stem, title)
        except BaseException as err:
            traceback.clear_frames(err.__traceback__)
            raise
        finally:
            gc.collect()

    def _write(self, out_dir: Path, stem: str, title: str) -> list[PhaseProfile] | list[HostPhase]:
        host, self._host = self._host, None
        if host is not None:
            phases = sorted((HostPhase(name, r.wall_s * 1e3, host_functions(r.stats, HOST_TOP) if r.stats else (),
                                       "" if r.stats else r.why) for name, r in host.items()),
                            key=lambda p: -p.wall_ms)
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / f"{stem}.txt").write_text(render_host(phases, title))
            return phases
        prof, self._prof = self._prof, None
        if prof is None:
            return []
        if self.on_cuda:
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        events = list(prof.profiler.kineto_results.events())
        phases = phase_profiles(events)
        table = render_operators(*operator_times(events), OPERATORS_TOP)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{stem}.txt").write_text(render(phases, table, title, events))
        trace = out_dir / f"{stem}.json"
        prof.export_chrome_trace(str(trace))
        # level 6, not gzip's default 9: 7x faster on a trace (0.75 against 5.3 s for 129 MB), 7 % larger
        with trace.open("rb") as src, gzip.open(out_dir / f"{stem}.json.gz", "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()
        return phases

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label what runs inside as phase `name` while profiling (nothing otherwise); under the python profiler,
        run it under cProfile (a phase that runs twice in a step adds up)."""
        if self._host is not None:
            with self._host_phase(name):
                yield
            return
        if self._prof is None:
            yield
            return
        from torch.profiler import record_function

        with record_function(PHASE_PREFIX + name):
            yield

    @contextlib.contextmanager
    def _host_phase(self, name: str) -> Iterator[None]:
        """Run a phase under its own cProfile; a phase inside another one (or beside another profiling tool) is
        timed but not profiled, as one profiler at a time can hold the interpreter."""
        prof: cProfile.Profile | None = None
        why = ""
        if self._host_depth:
            why = "inside another phase"
        else:
            prof = cProfile.Profile()
            try:
                prof.enable()
            except ValueError:  # Python 3.12+: another profiling tool is active
                prof, why = None, "another profiler was active"
        self._host_depth += 1
        start = time.perf_counter()
        try:
            yield
        finally:
            wall = time.perf_counter() - start
            self._host_depth -= 1
            # bookkeeping that fails must not fail the phase it measured
            with contextlib.suppress(Exception):
                stats = None
                if prof is not None:
                    prof.disable()
                    stats = pstats.Stats(prof)
                self._add_host(name, wall, stats, why)

    def _add_host(self, name: str, wall: float, stats: pstats.Stats | None, why: str) -> None:
        if self._host is None:  # stopped meanwhile
            return
        record = self._host.setdefault(name, _HostRecord(0.0, None, ""))
        record.wall_s += wall
        if stats is None:
            record.why = record.why or why
        elif record.stats is None:
            record.stats = stats
        else:
            record.stats.add(stats)
