"""Phase busy time from a profile: the interval union that turns device activity into a phase's busy share, and a
real `torch.profiler` run labelled by phase; the python profiler's per-phase functions, alone and in a real case."""

from __future__ import annotations

import copy
import itertools
import re
import time
from pathlib import Path

import pytest
import torch
from test_engine_case import make_case, records, train

from zbench.config import ConfigError, from_dict
from zbench.engine.profiling import (
    IDLE_EDGES_NS,
    DeviceTimeline,
    StepProfiler,
    busy_within,
    idle_within,
    operator_times,
    phase_profiles,
    phase_rows,
    render,
    render_operators,
    window_operators,
)


def test_busy_within_counts_overlaps_once_and_clips_to_the_window() -> None:
    spans = [(0, 10), (5, 15), (20, 30), (40, 50), (-5, 2)]
    assert busy_within(spans, 0, 100) == 15 + 10 + 10  # [0,15) [20,30) [40,50)
    assert busy_within(spans, 8, 25) == 7 + 5  # [8,15) [20,25)
    assert busy_within(spans, 15, 20) == 0
    assert busy_within([], 0, 10) == 0
    assert busy_within([(2, 3), (2, 3)], 0, 10) == 1


def test_profiler_labels_phases_and_writes_its_files(tmp_path: Path) -> None:
    prof = StepProfiler(on_cuda=False)
    with prof.phase("not_profiled"):  # no profiler running: nothing is recorded, nothing breaks
        pass
    assert not prof.active
    prof.start()
    with prof.phase("fast"):
        torch.ones(4).sum()
    with prof.phase("slow"):
        a = torch.randn(256, 256, requires_grad=True)
        for _ in range(20):
            (a @ a).sum().backward()
    phases = prof.stop(tmp_path, "step3-actor-rank0", "title line")
    assert not prof.active and prof.stop(tmp_path, "again", "") == []
    assert [p.phase for p in phases] == ["slow", "fast"]  # longest first
    slow = phases[0]
    assert slow.wall_ms > phases[1].wall_ms > 0
    assert slow.gpu_busy_ms == 0 and slow.device_ops == 0 and slow.busy_share == 0  # CPU: no device activity
    text = (tmp_path / "step3-actor-rank0.txt").read_text()
    assert text.startswith("title line") and "aten::mm" in text
    assert (tmp_path / "step3-actor-rank0.json.gz").stat().st_size > 0
    assert not (tmp_path / "step3-actor-rank0.json").exists()


PROFILER_MODULES = ("torch.profiler", "torch.autograd.profiler", "torch._C._profiler", "torch._C._autograd")


@pytest.mark.parametrize("fails", [False, True])
def test_profile_leaves_no_garbage_to_the_next_step(tmp_path: Path, fails: bool) -> None:
    """torch.profiler's profile sits in reference cycles, holding every event it recorded: it is collected when the
    profile stops, not in a later step's pauses; also when writing the profile fails (a file where its folder
    should be), whose traceback would otherwise hold it past the collection. Only the profiler's objects count:
    other garbage can turn up meanwhile (the graphs of an earlier test's torch.compile, released late)."""
    import gc

    gc.collect()  # what earlier tests left
    prof = StepProfiler(on_cuda=False)
    prof.start("torch")
    with prof.phase("work"):
        a = torch.randn(64, 64)
        for _ in range(500):
            a = (a @ a).tanh()
    out = tmp_path / "profile"
    if fails:
        out.write_text("a file, not a folder")
    gc.disable()  # only the profiler's own collection may run until the check
    try:
        if fails:
            with pytest.raises(OSError):
                prof.stop(out, "step1-actor-rank0", "title")
        else:
            prof.stop(out, "step1-actor-rank0", "title")
        gc.set_debug(gc.DEBUG_SAVEALL)  # what is unreachable now stays in gc.garbage, to be looked at
        gc.collect()
        left = sorted({type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith(PROFILER_MODULES)})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []  # without the collection: profile, _ProfilerStats, ... (the profile and what it holds)


class _Event:
    """What `phase_profiles` and `operator_times` read from a kineto event."""

    def __init__(self, name: str, device: torch.autograd.DeviceType, start: int, end: int, annotation: bool = False,
                 thread: int = 1, is_async: bool = False, end_thread: int | None = None):
        self._name, self._device, self._start, self._end, self._annotation = name, device, start, end, annotation
        self._thread, self._async = thread, is_async
        self._end_thread = thread if end_thread is None else end_thread

    def start_thread_id(self) -> int:
        return self._thread

    def end_thread_id(self) -> int:
        return self._end_thread

    def is_async(self) -> bool:
        return self._async

    def name(self) -> str:
        return self._name

    def device_type(self) -> torch.autograd.DeviceType:
        return self._device

    def start_ns(self) -> int:
        return self._start

    def end_ns(self) -> int:
        return self._end

    def is_user_annotation(self) -> bool:
        return self._annotation


def test_phase_busy_time_comes_from_the_device_timeline() -> None:
    """Kernels count towards the phase whose window they run in, whichever CPU thread launched them (backward runs
    on autograd's thread); the GPU-side copy of a phase's label is not a kernel."""
    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = [
        _Event("zbench/update_critic", cpu, 0, 10_000_000),  # 10 ms
        _Event("zbench/update_critic", gpu, 0, 10_000_000, annotation=True),
        _Event("aten::mm", cpu, 100, 200),
        _Event("kernel_a", gpu, 1_000_000, 3_000_000),
        _Event("kernel_b", gpu, 2_000_000, 4_000_000),  # overlaps kernel_a on another stream
        _Event("kernel_c", gpu, 9_000_000, 12_000_000),  # runs past the phase's end
        _Event("zbench/update_actor", cpu, 12_000_000, 14_000_000),
        _Event("kernel_d", gpu, 12_500_000, 13_000_000),
    ]
    critic, actor = phase_profiles(events)
    assert (critic.phase, critic.wall_ms, critic.gpu_busy_ms, critic.device_ops) == ("update_critic", 10, 4, 3)
    assert critic.busy_share == 0.4
    assert (actor.phase, actor.wall_ms, actor.gpu_busy_ms, actor.device_ops) == ("update_actor", 2, 0.5, 1)
    assert "update_critic" in render([critic, actor], "", "t").splitlines()[3]


def test_idle_gaps_say_how_long_the_device_waited_and_on_what() -> None:
    """A phase's GPU idle: the stretches of its window no device op covers (overlaps once, clipped to the window),
    counted and summed by length class, the longest listed at their start in the window with the innermost CPU
    operator the phase's own thread was running then (none: Python between operators; another thread's operators
    do not count); the report prints both. A profile without device activity (a CPU run) has no idle section."""
    assert idle_within([(2, 5), (4, 6), (8, 9)], 0, 10) == [(0, 2), (6, 8), (9, 10)]
    assert idle_within([(-3, 12)], 0, 10) == [] and idle_within([], 3, 7) == [(3, 7)]
    assert idle_within([(2, 2), (10, 12)], 0, 10) == [(0, 10)]  # an op of no length, or one past the end: no split
    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    us = 1_000
    assert (10 * us, 100 * us, 1000 * us) == IDLE_EDGES_NS
    events = [
        _Event("zbench/gen", cpu, 0, 10_000 * us, thread=7),
        _Event("kernel_a", gpu, 0, 1_000 * us),
        _Event("kernel_b", gpu, 1_005 * us, 3_000 * us),  # 5 us after a: a short gap
        _Event("kernel_c", gpu, 3_050 * us, 3_500 * us),  # 50 us
        _Event("kernel_d", gpu, 4_000 * us, 6_000 * us),  # 500 us, in which the host launched a graph
        _Event("kernel_e", gpu, 8_000 * us, 9_990 * us),  # 2 ms, in which the host waited on a sync
        _Event("cudaGraphLaunch", cpu, 3_400 * us, 3_600 * us, thread=7),
        _Event("aten::item", cpu, 5_900 * us, 8_010 * us, thread=7),
        _Event("cudaStreamSynchronize", cpu, 5_950 * us, 8_005 * us, thread=7),  # inside aten::item: the innermost
        _Event("aten::mm", cpu, 3_000 * us, 9_000 * us, thread=8),  # another thread's: not the phase's host
    ]
    [gen] = phase_profiles(events)
    assert gen.idle is not None
    # 10 us after kernel_e too, to the window's end: a gap of the second class
    assert gen.idle.classes == ((1, 0.005), (2, 0.06), (1, 0.5), (1, 2.0)) and gen.idle.ms == pytest.approx(2.565)
    assert gen.gpu_busy_ms + gen.idle.ms == pytest.approx(gen.wall_ms)
    assert [(g.offset_ms, g.length_us, g.after, g.host) for g in gen.idle.longest] == [
        (6.0, 2000.0, "kernel_d", "cudaStreamSynchronize"), (3.5, 500.0, "kernel_c", "cudaGraphLaunch"),
        (3.0, 50.0, "kernel_b", ""), (9.99, 10.0, "kernel_e", ""), (1.0, 5.0, "kernel_a", "")]
    text = render([gen], "", "t")
    assert "GPU idle inside each phase" in text
    assert ("gen:\n  +6.0 ms 2000 us after kernel_d, host in cudaStreamSynchronize\n"
            "  +3.5 ms 500 us after kernel_c, host in cudaGraphLaunch\n"
            "  +3.0 ms 50 us after kernel_b, host in (no operator on its thread; another thread in aten::mm)\n"
            "  +10.0 ms 10 us after kernel_e, host in (no operator)\n") in text
    # a window that begins idle: no op before its first gap; any thread's operator where none is named
    timeline = DeviceTimeline(events)
    assert timeline.span == (0, 9_990 * us)
    early = timeline.idle(-20 * us, 1_000 * us, None)
    assert [(g.length_us, g.after) for g in early.longest] == [(20.0, "")] and early.classes[1] == (1, 0.02)
    assert timeline.host_at(3_450 * us, None) == "cudaGraphLaunch"  # thread 7's innermost beats thread 8's aten::mm
    assert timeline.host_at(8_500 * us, None) == "aten::mm" and timeline.host_at(8_500 * us, 7) == ""
    # of operators starting together, the one inside the other; one that ends on another thread is no operator here
    nested = DeviceTimeline([_Event("kernel", gpu, 0, 1_000), _Event("outer", cpu, 2_000, 9_000, thread=3),
                             _Event("inner", cpu, 2_000, 5_000, thread=3),
                             _Event("handed_over", cpu, 2_500, 4_000, thread=3, end_thread=4)])
    assert nested.host_at(3_000, 3) == "inner" and nested.host_at(6_000, None) == "outer"
    # the gaps of 10 us or more by the host's stack as each began: the phase's thread, else another's
    assert [(w.host, w.gaps, w.ms) for w in gen.idle.waits] == [
        ("aten::item > cudaStreamSynchronize", 1, 2.0), ("cudaGraphLaunch", 1, 0.5),
        ("aten::mm (another thread)", 1, 0.05), ("(no operator)", 1, 0.01)]
    assert "gen:\n       2.0       1  aten::item > cudaStreamSynchronize\n" in text
    idle_line = next(line for line in text.splitlines() if line.startswith("gen ") and "2.6" in line)
    assert idle_line.split() == ["gen", "2.6", "1", "0.0", "2", "0.1", "1", "0.5", "1", "2.0"]
    assert "GPU idle" not in render(phase_profiles(events[:1] + events[6:]), "", "t")  # no device: no section


def test_waits_on_the_host_add_up_by_its_stack() -> None:
    """Where a backward's GPU waits on host work: gaps of 10 us or more that began under the same outermost and
    innermost operators add up, on autograd's thread where the phase's own runs none (it waits in the engine),
    most idle first; gaps under 10 us (between a launch's kernels) are not counted there."""
    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    us = 1_000
    events = [_Event("zbench/update_actor", cpu, 0, 1_000 * us, thread=1)]
    at = 0
    for i in range(6):  # six parameters' gradients: the hook copies each into a bucket, the GPU waits 40 us
        events += [_Event(f"kernel_{i}", gpu, at, at + 100 * us),
                   _Event("torch::autograd::AccumulateGrad", cpu, at + 90 * us, at + 150 * us, thread=2),
                   _Event("aten::copy_", cpu, at + 95 * us, at + 145 * us, thread=2)]
        at += 140 * us
    events += [_Event("kernel_end", gpu, at, at + 2 * us), _Event("kernel_tail", gpu, at + 5 * us, 1_000 * us)]
    [update] = phase_profiles(events)
    assert update.idle is not None
    assert update.idle.classes[0] == (1, pytest.approx(0.003))  # the 3 us gap: no wait on the host
    assert [(w.host, w.gaps, w.ms) for w in update.idle.waits] == [
        ("torch::autograd::AccumulateGrad > aten::copy_ (another thread)", 6, pytest.approx(0.24))]
    assert "0.2       6  torch::autograd::AccumulateGrad > aten::copy_ (another thread)" in render([update], "", "t")


def test_parts_of_a_phase_follow_it_with_what_lies_outside_them() -> None:
    """`gen/cache`, `gen/prefill`, `gen/decode` inside `gen`'s window: listed under it in the order they ran, then
    `gen`'s wall and busy time less theirs (`gen/(rest)`, its device ops not counted); a `gen/decode` outside any
    `gen` window (a rollout called outside a step's phases) stands as a phase of its own."""
    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    ms = 1_000_000
    events = [
        _Event("zbench/gen", cpu, 0, 100 * ms),
        _Event("zbench/gen/cache", cpu, 1 * ms, 4 * ms),
        _Event("zbench/gen/prefill", cpu, 4 * ms, 20 * ms),
        _Event("zbench/gen/decode", cpu, 20 * ms, 90 * ms),
        _Event("prefill_kernel", gpu, 5 * ms, 15 * ms),
        _Event("decode_kernel", gpu, 21 * ms, 88 * ms),
        _Event("late_kernel", gpu, 92 * ms, 95 * ms),  # after the parts, inside the phase
        _Event("zbench/update_actor", cpu, 100 * ms, 130 * ms),
        _Event("zbench/gen/decode", cpu, 140 * ms, 150 * ms),  # a rollout outside the gen phase
    ]
    rows = phase_rows(phase_profiles(events))
    assert [label for label, _ in rows] == ["gen", "  gen/cache", "  gen/prefill", "  gen/decode",
                                            "  gen/(rest)", "update_actor", "gen/decode"]
    outside = rows[4][1]
    assert (outside.wall_ms, outside.gpu_busy_ms, outside.device_ops) == (100 - 3 - 16 - 70, 3, None)
    assert (rows[3][1].wall_ms, rows[3][1].gpu_busy_ms) == (70, 67)
    text = render(phase_profiles(events), "", "t").splitlines()
    assert text[3].startswith("gen ") and text[4].startswith("  gen/cache ")
    assert text[7].split() == ["gen/(rest)", "11.0", "3.0", "27%", "–"]
    # what each window ran: clipped to it, most first; no row for the time outside the parts, none for a window
    # that ran nothing (gen/cache)
    events.append(_Event("decode_kernel", gpu, 89 * ms, 91 * ms))  # across decode's end into gen's rest
    events.append(_Event("queued_kernel", gpu, 18 * ms, 22 * ms))  # queued in prefill, running into decode
    inside = {label: (wall, total, [(o.name, o.calls, o.ns) for o in ops])
              for label, wall, total, ops in window_operators(events, phase_rows(phase_profiles(events)))}
    assert inside["gen"] == (100, 86, [("decode_kernel", 2, 69 * ms), ("prefill_kernel", 1, 10 * ms),
                                       ("queued_kernel", 1, 4 * ms), ("late_kernel", 1, 3 * ms)])
    assert inside["gen/prefill"] == (16, 12, [("prefill_kernel", 1, 10 * ms), ("queued_kernel", 1, 2 * ms)])
    assert inside["gen/decode"] == (70, 70, [("decode_kernel", 2, 68 * ms), ("queued_kernel", 1, 2 * ms)])
    assert set(inside) == {"gen", "gen/prefill", "gen/decode"}
    report = render(phase_profiles(events), "", "t", events)
    assert "device ops inside each phase and part" in report
    assert "gen/prefill: 12.0 ms of device ops in 16.0 ms" in report


def test_graph_loop_labels_the_parts_of_its_rollout(tiny_loaded, tmp_path: Path) -> None:
    """A real rollout of the graph loop (eager on the CPU, its KV cache released after it) under a profiled `gen`
    phase: the report lists the cache, prefill, decode, copy to the host and release under `gen`, in that order,
    with the rest of the phase; the parts' windows lie one after another inside the phase's."""
    from zbench.engine.rollout import HFRollout

    model, pad_id, eos_ids, input_ids, mask = tiny_loaded
    rollout = HFRollout(copy.deepcopy(model), pad_id=pad_id, eos_ids=eos_ids, max_new_tokens=6, temperature=1.0,
                        top_p=1.0, static_cache=False, device=torch.device("cpu"), cuda_graph=True,
                        release_kv_cache=True)
    prof = StepProfiler(on_cuda=False)
    prof.start()
    with prof.phase("gen"):
        rollout.generate(input_ids, mask, seed=3)
    phases = prof.stop(tmp_path, "step1-actor-rank0", "t")
    rows = phase_rows(phases)
    assert [label for label, _ in rows] == ["gen", "  gen/cache", "  gen/prefill", "  gen/decode", "  gen/to_host",
                                            "  gen/sleep", "  gen/(rest)"]
    gen, parts = rows[0][1], [p for _, p in rows[1:6]]
    windows = [(gen.start_ns, gen.start_ns), *((p.start_ns, p.end_ns) for p in parts), (gen.end_ns, gen.end_ns)]
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(windows))  # one after another, inside gen's window
    assert rows[3][1].wall_ms > rows[4][1].wall_ms  # six tokens' decode, one copy
    text = (tmp_path / "step1-actor-rank0.txt").read_text()
    assert "  gen/decode " in text and "  gen/(rest) " in text


def test_steady_steps_leave_out_warm_up_and_the_profiled_step() -> None:
    """The one steady-state rule, used by summary.tsv's means and the report's phase tables alike."""
    from zbench.runroot.summary import steady_records

    recs = [{"step": 1, "t": 9.0}, {"step": 2, "t": 2.0}, {"step": 3, "t": 40.0, "perf/profiled": 1.0},
            {"step": 4, "t": 4.0}]
    assert [r["step"] for r in steady_records(recs)] == [2, 4]
    assert [r["step"] for r in steady_records([{k: v for k, v in r.items() if k != "perf/profiled"} for r in recs])] \
        == [2, 3, 4]
    assert [r["step"] for r in steady_records(recs[2:3])] == [3]  # only the profiled step: kept
    assert [r["step"] for r in steady_records(recs[:1])] == [1]  # only the warm-up step: kept


def test_profile_step_past_the_last_step_is_refused() -> None:
    assert from_dict({"steps": 4, "trainer": {"profile_step": 4}}).trainer.profile_step == 4
    with pytest.raises(ConfigError, match=r"trainer.profile_step: 5 is past the last step \(4\); choose 1..4, or 0"):
        from_dict({"steps": 4, "trainer": {"profile_step": 5}})


def test_update_benchmark_profiles_its_variant(tmp_path: Path) -> None:
    """`benchmarks/actor_update.py --profile-dir` (the GPU sessions' update profile) on the CPU, tiny model, under
    both profilers: one JSON line naming the update phase of each, and each profile's files."""
    import json
    import subprocess
    import sys

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "actor_update.py"
    res = subprocess.run([sys.executable, str(bench), "--repeats", "1", "--profile-dir", str(tmp_path),
                          "--profiler", "torch", "python", "--variant", "mb4:actor.micro_batch_size_per_gpu=4"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    line = json.loads(next(x for x in res.stdout.splitlines() if x.startswith("{")))
    assert line["variant"] == "mb4" and line["update_s_median"] > 0
    assert [p["phase"] for p in line["profile_torch"]] == [p["phase"] for p in line["profile_python"]] == ["update_actor"]
    assert (tmp_path / "mb4.txt").is_file() and (tmp_path / "mb4.json.gz").is_file()
    assert "phase update_actor: wall" in (tmp_path / "mb4-python.txt").read_text()


def _spin(n: int) -> int:
    return sum(i * i for i in range(n))


def test_python_profiler_lists_each_phases_functions(tmp_path: Path) -> None:
    prof = StepProfiler(on_cuda=False)
    with pytest.raises(ValueError, match="profiler 'perf': choose one of torch, python"):
        prof.start("perf")
    assert not prof.active
    prof.start("python")
    assert prof.active
    outside = 0.0
    for _ in range(2):  # a phase that runs twice adds up
        start = time.perf_counter()
        with prof.phase("gen"):
            _spin(200_000)
        outside += time.perf_counter() - start
    with prof.phase("update_actor"):
        time.sleep(0.01)
    phases = prof.stop(tmp_path, "step2-actor-rank0", "title line")
    assert not prof.active and prof.stop(tmp_path, "again", "") == []
    assert [p.phase for p in phases] == ["gen", "update_actor"]
    gen, update = phases
    assert 0.8 * outside < gen.wall_ms / 1e3 <= outside
    spin = next(f for f in gen.top if f.function.startswith("_spin (tests/test_profiling.py:"))
    assert spin.calls == 2 and spin.cumulative_s > 0  # its time is its generator's and sum's
    assert gen.top[0].own_s > 0 and [f.own_s for f in gen.top] == sorted((f.own_s for f in gen.top), reverse=True)
    assert any(f.function.startswith("<built-in method time.sleep>") for f in update.top)
    assert gen.line().startswith(f"wall {gen.wall_ms:.1f} ms under cProfile, most own time: ")
    text = (tmp_path / "step2-actor-rank0.txt").read_text()
    assert text.startswith("title line") and "phase gen: wall" in text and "phase update_actor: wall" in text
    assert "_spin (tests/test_profiling.py:" in text
    assert not (tmp_path / "step2-actor-rank0.json.gz").exists()  # no trace: cProfile keeps none


def test_python_profiler_times_a_nested_or_failing_phase(tmp_path: Path) -> None:
    """A phase inside another is timed, not profiled (one cProfile at a time); the outer one keeps its functions.
    A phase that raises is recorded, and its exception goes on."""
    prof = StepProfiler(on_cuda=False)
    prof.start("python")
    with prof.phase("update_weights"):
        _spin(100_000)
        with prof.phase("gen"):
            time.sleep(0.02)
        _spin(100_000)
    with pytest.raises(ZeroDivisionError), prof.phase("values"):
        _spin(50_000)
        _ = 1 / 0
    phases = {p.phase: p for p in prof.stop(tmp_path, "step1-actor-rank0", "title")}
    outer, inner, failed = phases["update_weights"], phases["gen"], phases["values"]
    assert outer.wall_ms > inner.wall_ms >= 20
    assert next(f for f in outer.top if f.function.startswith("_spin (")).calls == 2  # before and after the inner
    assert inner.top == () and inner.line().endswith("none recorded (inside another phase)")
    assert any(f.function.startswith("_spin (") for f in failed.top)
    assert "phase gen: wall" in (tmp_path / "step1-actor-rank0.txt").read_text()


def test_python_profiler_needs_a_step_to_profile() -> None:
    with pytest.raises(ConfigError, match=r"trainer.profiler: 'python' profiles only the step trainer.profile_step "
                                          r"names: set it \(1..steps\), or leave profiler at 'torch'"):
        from_dict({"steps": 4, "trainer": {"profiler": "python"}})
    with pytest.raises(ConfigError, match=r"trainer.profiler: 'cprofile' is not one of 'torch', 'python'"):
        from_dict({"steps": 4, "trainer": {"profile_step": 1, "profiler": "cprofile"}})


def test_case_profiles_its_host_per_phase(tmp_path: Path) -> None:
    """A real GRPO case whose second step runs under the python profiler: each worker's file lists the phases it ran
    with their functions (the rollout's sampling in its gen phase), the log says so, and only that step is marked
    profiled."""
    case = make_case(tmp_path, "host", steps=2, algorithm="grpo", rollout__n=2, trainer__profile_step=2,
                     trainer__profiler="python")
    train(case)
    for rank in (0, 1):
        text = (case / "profile" / f"step2-actor-rank{rank}.txt").read_text()
        assert "phase gen: wall" in text and "phase update_actor: wall" in text, text[:2000]
        gen = text.split("phase gen: wall", 1)[1].split("\nphase ", 1)[0]
        assert "  <built-in method torch.multinomial>" in gen, gen  # the rollout's sampling, in its phase
        assert re.search(r"^ +[0-9.]+ +[0-9.]+ +[0-9]+ +\S", text, re.M)  # a function row: own, cumulative, calls
    log = (case / "train.log").read_text()
    assert re.search(r"\[profile\] step 2 PolicyWorker rank 1 gen: wall [0-9.]+ ms under cProfile, most own time: "
                     r"\S", log), log[-3000:]
    assert [r["step"] for r in records(case) if r.get("perf/profiled")] == [2]


def test_operator_times_give_device_time_and_cpu_self_time() -> None:
    """Device ops add up by name; a CPU operator's self time leaves out the operators wholly inside it on its own
    thread (not another thread's, not one that starts at its end or outlasts it); an operator whose one child has
    its name is one call; an asynchronous one has no self time; a phase label is a CPU operator, its copy on the
    device's timeline no device op."""
    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = [
        _Event("zbench/gen", cpu, 0, 200, annotation=True),
        _Event("aten::linear", cpu, 0, 50),
        _Event("aten::mm", cpu, 10, 30),  # inside linear
        _Event("cudaLaunchKernel", cpu, 12, 14),  # inside mm
        _Event("aten::mm", cpu, 35, 45),  # inside linear, after the first
        _Event("aten::mm", cpu, 20, 60, thread=2),  # another thread: its own, not linear's
        _Event("aten::add", cpu, 50, 70),  # starts at linear's end: not its child
        _Event("aten::copy_", cpu, 65, 90),  # outlasts add: not its child, gen's
        _Event("aten::mean", cpu, 100, 120),
        _Event("aten::mean", cpu, 101, 119),  # autograd's second record of the same call
        _Event("aten::sum", cpu, 102, 110),
        _Event("aten::to", cpu, 130, 190, is_async=True),  # no self time, nothing inside it
        _Event("aten::empty", cpu, 140, 150),
        _Event("gemm_kernel", gpu, 15, 40),
        _Event("gemm_kernel", gpu, 40, 45),
        _Event("memcpy", gpu, 50, 52),
        _Event("zbench/gen", gpu, 0, 200, annotation=True),
    ]
    device, host = operator_times(events)
    assert [(o.name, o.calls, o.ns) for o in device] == [("gemm_kernel", 2, 30), ("memcpy", 1, 2)]
    assert {o.name: (o.calls, o.ns) for o in host} == {
        "aten::mm": (3, 18 + 10 + 40), "aten::linear": (1, 50 - 20 - 10), "aten::add": (1, 20),
        "aten::copy_": (1, 25), "cudaLaunchKernel": (1, 2), "aten::mean": (1, 2 + 18 - 8), "aten::sum": (1, 8),
        "aten::to": (1, 0), "aten::empty": (1, 10),
        "zbench/gen": (1, 200 - 50 - 20 - 25 - 20 - 10)}
    text = render_operators(device, host, top=1)
    assert "by device time: 0.0 ms in all, 2 kinds" in text
    assert text.splitlines()[2].endswith("gemm_kernel") and "memcpy" not in text  # top 1 of each
    assert text.splitlines()[-1].endswith("zbench/gen")
    assert "device ops" not in render_operators([], host, top=5)  # a CPU profile has no device table


def test_operator_times_match_torch_key_averages_on_a_real_profile() -> None:
    """On a real torch.profiler profile, the calls and self CPU time per operator are key_averages' own."""
    from torch.profiler import ProfilerActivity, profile, record_function

    x, w = torch.ones(4), torch.randn(32, 32, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("zbench/gen"):
            for _ in range(200):
                x = x + 1
        with record_function("zbench/update_actor"):
            for _ in range(3):  # autograd records some operators twice (aten::mean in aten::mean)
                (torch.nn.functional.linear(torch.randn(8, 32), w).mean() / 2).backward()
    _device, host = operator_times(list(prof.profiler.kineto_results.events()))
    ours = {o.name: (o.calls, o.ns / 1e3) for o in host}
    theirs = {k.key: (k.count, k.self_cpu_time_total) for k in prof.key_averages()}
    assert ours.keys() == theirs.keys()
    assert {"aten::add", "aten::mean", "zbench/gen", "zbench/update_actor"} <= ours.keys()
    for name, (calls, self_us) in theirs.items():
        assert ours[name][0] == calls, name
        assert ours[name][1] == pytest.approx(self_us, abs=0.01), name


def test_loop_benchmark_runs_as_a_run_would_give_it_its_ids_and_cache() -> None:
    """`benchmarks/graph_decode_profile.py` on the CPU, tiny model (the loop eager): `--stop model` gives the loop the
    model's pad and EOS ids, as a run does, `--release-cache on` gives its cache back after each rollout; every
    combination is one measured variant, and each line says what ran."""
    import json
    import subprocess
    import sys

    from zbench.models import resolve_model, special_ids

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "graph_decode_profile.py"
    res = subprocess.run([sys.executable, str(bench), "--model", "tiny", "--batch", "4", "--width", "16",
                          "--new-tokens", "6", "--repeats", "1", "--stop", "none", "model", "--release-cache", "off",
                          "on"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    ran = [(r["what"], r["stop"], r["pad_id"], r["eos_ids"], r["release_cache"]) for r in rows]
    pad, eos = special_ids(resolve_model("tiny"))
    assert eos and ran == [(what, stop, *ids, release)
                           for stop, ids in (("none", (0, [])), ("model", (pad, eos)))
                           for release in (False, True) for what in ("generate", "profile")]
    assert all(r["median_s"] > 0 for r in rows if r["what"] == "generate")
    # a profile lists the host's operators by self time too (on a CPU, the eager loop's own), and the tokens its
    # longest response took (with no EOS given, every one)
    for r in (r for r in rows if r["what"] == "profile"):
        assert 1 <= r["tokens"] <= 6 and (r["tokens"] == 6 or r["stop"] == "model")
        assert r["host_top"] and all(op["self_ms"] > 0 and op["calls"] > 0 for op in r["host_top"])
        assert any(op["op"].startswith("aten::") for op in r["host_top"])


def test_loop_benchmark_builds_what_a_run_holds_beside_the_loop() -> None:
    """`--beside none dist engine` on the CPU (tiny model, the loop eager): each variant is measured again once the
    process holds a one-rank process group, then a trained ZeRO-2 DeepSpeed engine, and each line says which."""
    import json
    import subprocess
    import sys

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "graph_decode_profile.py"
    res = subprocess.run([sys.executable, str(bench), "--model", "tiny", "--batch", "4", "--width", "16",
                          "--new-tokens", "6", "--repeats", "1", "--beside", "none", "dist", "engine",
                          "--train-micro", "2", "--train-len", "32"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert [(r["what"], r.get("beside")) for r in rows] == [
        ("generate", "none"), ("profile", "none"), ("generate", "dist"), ("profile", "dist"),
        ("engine", None), ("generate", "engine"), ("profile", "engine")]
    engine = rows[4]
    assert engine["micro"] == 2 and engine["length"] == 32 and len(engine["step_s"]) == 2
