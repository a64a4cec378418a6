"""One case at a time through `python -m zbench.engine <case_dir>`: exact resume from a checkpoint, RL that
learns, and the records a case leaves (metric names, step lines, result)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from zbench.config import dump_yaml, from_dict
from zbench.runroot import casedir

# names DESIGN promises every PPO step records (memory on GPU only; MFU only with a known GPU)
PPO_METRICS = {
    "critic/score/mean", "critic/score/max", "critic/score/min", "critic/rewards/mean", "critic/advantages/mean",
    "critic/returns/mean", "critic/values/mean", "critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm",
    "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr",
    "response_length/mean", "response_length/max", "response_length/clip_ratio", "prompt_length/mean",
    "timing_s/gen", "timing_s/old_log_prob", "timing_s/ref", "timing_s/values", "timing_s/adv",
    "timing_s/update_critic", "timing_s/update_actor", "timing_s/update_weights", "timing_s/step",
    "perf/total_num_tokens", "perf/throughput", "perf/cpu_memory_used_gb", "perf/gc_pause_s", "actor/kl_loss",
    "perf/rollout_engine_s",
}


def make_case(root: Path, name: str, **overrides: Any) -> Path:
    """A case directory holding a resolved config.yaml."""
    data: dict[str, Any] = {"name": name, "seed": 11}
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    case = root / name
    case.mkdir(parents=True)
    (case / "config.yaml").write_text(dump_yaml(from_dict(data)))
    return case


def train(case: Path, timeout: int = 900) -> None:
    res = subprocess.run([sys.executable, "-m", "zbench.engine", str(case)], capture_output=True, text=True,
                         timeout=timeout)
    (case / "train.log").write_text(res.stdout + res.stderr)
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    assert not casedir.ray_tmpdir(case).exists()  # its private Ray's folder went with it, launcher or not


def records(case: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (case / "metrics.jsonl").read_text().splitlines()]


def set_steps(case: Path, steps: int) -> None:
    text = (case / "config.yaml").read_text()
    (case / "config.yaml").write_text(text.replace("steps: 2\n", f"steps: {steps}\n", 1))


def test_resume_from_checkpoint_continues_exactly(tmp_path: Path) -> None:
    """Step 3 after a resume from the step-2 checkpoint equals that of an uninterrupted run (ZeRO-3 + CPU offload,
    PPO: actor, critic, optimizer states, data position and sampling all restored). The uninterrupted run profiles
    step 3, which must change none of its numbers and must leave a profile per worker. The resumed case updates
    its critic beside its actor (`trainer.critic_update` concurrent), which must change none of them either: every
    step of it equals the serial run's. So must a critic update behind the next step's rollout (overlap), where a
    step's record waits for its critic update: a crash before step 4 still records step 3, whose update is in."""
    knobs = dict(algorithm="ppo", zero__stage=3, zero__offload="cpu", trainer__save_freq=2,
                 actor__use_kl_loss=True, actor__recompute_old_log_prob="always")  # every phase runs
    full = make_case(tmp_path, "full", steps=3, trainer__profile_step=3, **knobs)
    train(full)
    check_profiles(full, step=3)
    part = make_case(tmp_path, "part", steps=2, trainer__critic_update="concurrent", **knobs)
    train(part)
    assert json.loads((part / "ckpt" / "state.json").read_text())["step"] == 2
    set_steps(part, 3)
    train(part)
    assert "[ckpt] resumed from step_2" in (part / "train.log").read_text()
    a, b = records(full), records(part)
    assert [r["step"] for r in b] == [1, 2, 3]
    result = json.loads((part / "result.json").read_text())
    assert result["resumed_from_step"] == 2 and result["old_log_prob_pass"] is True
    ds_checks = "deepspeed (no ZeRO-1/2 optimizer: DeepSpeedZeroOptimizer_Stage3)"  # zero.fused_grad_checks
    assert result["grad_checks"] == result["critic_grad_checks"] == ds_checks
    for ra, rb in zip(a, b, strict=True):
        for key in ra:
            if key.startswith(("timing_s/", "perf/")) or key == "time":
                continue
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), (ra["step"], key)
    missing = PPO_METRICS - set(a[-1])
    assert not missing, missing
    # the rollout engine's own time is inside the gen phase; hf's generate has no sleep to report
    assert all(0 < r["perf/rollout_engine_s"] < r["timing_s/gen"] and "perf/rollout_sleep_s" not in r for r in a + b)
    # concurrent: the critic's own time, and the wait for it after the actor's update and weight push
    assert all(r["timing_s/update_critic"] > 0 and r["timing_s/critic_wait"] >= 0 for r in b)
    assert all("timing_s/critic_wait" not in r for r in a)

    behind = make_case(tmp_path, "behind", steps=4, trainer__critic_update="overlap", trainer__fault="crash@4",
                       **{**knobs, "trainer__save_freq": 0})
    res = subprocess.run([sys.executable, "-m", "zbench.engine", str(behind)], capture_output=True, text=True,
                         timeout=900)
    assert res.returncode != 0 and "injected fault: crash at step 4" in res.stdout + res.stderr
    c = records(behind)
    assert [r["step"] for r in c] == [1, 2, 3]
    for ra, rc in zip(a, c, strict=True):
        for key in ra:
            if key.startswith(("timing_s/", "perf/")) or key == "time":
                continue
            assert rc[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), (ra["step"], key)
    # steps 2 and 3 updated their critic behind the next rollout (a run's first step never does): the critic's own
    # time in their records; critic_wait is what of any critic update a step waited for, so the phases add up
    assert all(r["timing_s/update_critic"] > 0 for r in c)
    assert c[0]["timing_s/critic_wait"] == c[0]["timing_s/update_critic"]  # in turns
    assert c[1]["timing_s/critic_wait"] == 0.0  # nothing before it to wait for, its own behind it
    assert c[2]["timing_s/critic_wait"] >= 0 and "not recorded" not in res.stdout


def check_profiles(case: Path, step: int) -> None:
    """Every worker of a PPO case wrote its step profile, each naming the phases that worker ran."""
    phases = {"actor": ("gen", "old_log_prob", "ref", "update_actor", "update_weights"),
              "critic": ("values", "update_critic")}
    for role, names in phases.items():
        for rank in (0, 1):
            text = (case / "profile" / f"step{step}-{role}-rank{rank}.txt").read_text()
            rows = {line.split()[0]: line.split() for line in text.splitlines()[3:] if line.strip()}
            for name in names:
                assert float(rows[name][1]) > 0, (role, rank, name, text[:2000])  # wall ms
            assert (case / "profile" / f"step{step}-{role}-rank{rank}.json.gz").stat().st_size > 0
    log = (case / "train.log").read_text()
    assert f"[profile] step {step} CriticWorker rank 1 update_critic: wall" in log
    marked = [r["step"] for r in records(case) if r.get("perf/profiled")]
    assert marked == [step]


def test_grpo_raises_the_score(tmp_path: Path) -> None:
    """GRPO on the embedded default: the mean score of the last ten steps clearly exceeds the first ten's. A step's
    score (8 prompts x 4 samples) moves by about 0.08 from step to step, a ten-step mean by about 0.025: a rise of
    0.1 is nearly three times the spread of the difference, which sits near 0 where nothing is learnt (with the packages of
    2026-11-29: 0.28 to 0.40, 0.46 over steps 21-30)."""
    steps = 40
    case = make_case(tmp_path, "grpo", steps=steps, algorithm="grpo", rollout__n=4, zero__stage=2,
                     actor__micro_batch_size_per_gpu=8)
    train(case, timeout=1200)
    scores = [r["critic/score/mean"] for r in records(case)]
    assert len(scores) == steps
    first, last = sum(scores[:10]) / 10, sum(scores[-10:]) / 10
    print(f"GRPO score: first ten {first:.3f}, last ten {last:.3f}")
    assert last > first + 0.1, (first, last, scores)
    lines = [line for line in (case / "train.log").read_text().splitlines() if line.startswith("step:")]
    assert len(lines) == steps and lines[0].startswith("step:1 - actor/")
    result = json.loads((case / "result.json").read_text())
    assert result["steps_completed"] == steps and result["rollout_backend"] == "hf"
    assert result["rollout_engine"] == "hf-generate"
    assert result["device"] == "cpu" and result["versions"]["deepspeed"]
    assert result["grad_checks"] == "fused" and "critic_grad_checks" not in result


def test_ppo_raises_the_score(tmp_path: Path) -> None:
    """PPO with a critic (one sample per prompt) on the embedded default, the six-case matrix's algorithm."""
    steps = 60
    case = make_case(tmp_path, "ppo", steps=steps, seed=7777, algorithm="ppo", zero__stage=2)
    train(case, timeout=1200)
    scores = [r["critic/score/mean"] for r in records(case)]
    first, last = sum(scores[:10]) / 10, sum(scores[-10:]) / 10
    print(f"PPO score: first ten {first:.3f}, last ten {last:.3f}")
    assert last > first + 0.15, (first, last, scores)


def test_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    case = tmp_path / "bad"
    case.mkdir()
    (case / "config.yaml").write_text("name: bad\nzero:\n  stage: 5\n")
    res = subprocess.run([sys.executable, "-m", "zbench.engine", str(case)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2
    assert "zero.stage: 5 is not one of 0, 1, 2, 3" in res.stdout


def test_zbench_resume_continues_a_case_from_its_checkpoint(tmp_path: Path) -> None:
    """Interrupted after a checkpoint, `zbench resume` continues the case from it: steps 1..N, unbroken."""
    import signal
    import time

    results = tmp_path / "results"
    steps = 6  # interrupted at the first checkpoint (step 2), a step or two later at most
    proc = subprocess.Popen([sys.executable, "-m", "zbench", "run", "grpo-six-case", "--cases", "zero2_no_offload",
                             "--steps", str(steps), "--set", "trainer.save_freq=2", "--set", "trainer.world_size=1",
                             "--results-dir", str(results)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 600
    state = None
    while time.time() < deadline and proc.poll() is None:
        found = list(results.glob("*/zero2_no_offload/ckpt/state.json"))
        if found:
            state = found[0]
            break
        time.sleep(0.2)
    assert state is not None, proc.communicate()[0][-3000:]
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    case = state.parents[1]
    assert json.loads((case / "status.json").read_text())["status"] == "interrupted"
    res = subprocess.run([sys.executable, "-m", "zbench", "resume", str(case.parent)], capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert "[ckpt] resumed from step_" in (case / "train.log").read_text()
    assert [r["step"] for r in records(case)] == list(range(1, steps + 1))
    assert json.loads((case / "result.json").read_text())["resumed_from_step"] >= 2
