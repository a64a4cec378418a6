"""Phase busy time from a profile: the interval union that turns device activity into a phase's busy share, and a
real `torch.profiler` run labelled by phase."""

from __future__ import annotations

from pathlib import Path

import torch

from zbench.engine.profiling import StepProfiler, busy_within, phase_profiles, render


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


class _Event:
    """The four things `phase_profiles` reads from a kineto event."""

    def __init__(self, name: str, device: torch.autograd.DeviceType, start: int, end: int, annotation: bool = False):
        self._name, self._device, self._start, self._end, self._annotation = name, device, start, end, annotation

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
    import pytest

    from zbench.config import ConfigError, from_dict

    assert from_dict({"steps": 4, "trainer": {"profile_step": 4}}).trainer.profile_step == 4
    with pytest.raises(ConfigError, match=r"trainer.profile_step: 5 is past the last step \(4\); choose 1..4, or 0"):
        from_dict({"steps": 4, "trainer": {"profile_step": 5}})


def test_update_benchmark_profiles_its_variant(tmp_path: Path) -> None:
    """`benchmarks/actor_update.py --profile-dir` (the GPU sessions' update profile) on the CPU, tiny model: one JSON
    line naming the update phase, and the profile's files."""
    import json
    import subprocess
    import sys

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "actor_update.py"
    res = subprocess.run([sys.executable, str(bench), "--repeats", "1", "--profile-dir", str(tmp_path),
                          "--variant", "mb4:actor.micro_batch_size_per_gpu=4"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    line = json.loads(next(x for x in res.stdout.splitlines() if x.startswith("{")))
    assert line["variant"] == "mb4" and line["update_s_median"] > 0
    assert [p["phase"] for p in line["profile"]] == ["update_actor"]
    assert (tmp_path / "mb4.txt").is_file() and (tmp_path / "mb4.json.gz").is_file()
