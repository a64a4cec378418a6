"""`zbench bench floor`: bare DeepSpeed on the tiny model, several stages in one set of rank processes."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest


def _floor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zbench", "bench", "floor", "--model", "tiny", "--seqs", "4",
                           "--micro", "2", "--seq-len", "24", "--steps", "2", "--warmup", "1", *args],
                          capture_output=True, text=True, timeout=600)


def test_floors_of_several_stages_and_heads_in_one_start():
    r = _floor("--stage", "1", "--stage", "3", "--offload", "cpu", "--head", "lm", "--head", "value")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    combos = [(1, "cpu"), (3, "cpu")]
    assert [(x["head"], x["stage"], x["offload"]) for x in rows] == [(h, *c) for h in ("lm", "value") for c in combos]
    for x in rows:
        assert len(x["step_s_all"]) == 2 and x["step_s_median"] > 0
        assert x["tokens_per_s_per_gpu"] == x["seqs"] * x["seq_len"] / x["step_s_median"]
        assert x["device"] == "cpu" and x["world_size"] == 1
        assert x["grad_checks"] == "deepspeed (off)"  # bare DeepSpeed's own step checks, unless --like a case
        # the critic's floor is the critic's model, built the way the critic builds it
        assert x["model_class"] == {"lm": "Qwen3ForCausalLM", "value": "Qwen3ForTokenClassification"}[x["head"]]
        # a rank takes its share of the cores (one rank here), as the engine's GPU ranks do
        assert x["cpu_threads"] == len(os.sched_getaffinity(0))


def test_a_failing_floor_keeps_the_ones_measured_before_it():
    """ZeRO-3 NVMe offload needs DeepSpeed's async-I/O op, which this kind of machine cannot build: the floors
    before it are still printed, and the failure is one clear line naming the floor."""
    r = _floor("--stage", "1", "--stage", "3", "--offload", "nvme")
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode == 0:
        pytest.skip("NVMe offload works on this machine: no failing floor to observe")
    assert r.returncode == 2, r.stderr[-3000:]
    assert [(x["stage"], x["offload"]) for x in rows] == [(1, "nvme")]
    assert "floor 2 of 2 (stage 3, offload nvme, head lm, micro 2) failed" in r.stderr
    assert "Traceback" not in r.stderr.split("error:")[-1]


def test_a_floor_that_runs_out_of_memory_is_recorded_and_the_next_one_tried():
    """Bare DeepSpeed that cannot train a shape (as ZeRO-3 at micro-batch 64 could not on an 80 GB GPU: HF's loss
    upcasts the whole micro-batch's logits) is a result, not the end of the floors: the floor is recorded as `oom`
    with the allocator's line, a warning names it, the same floor is tried again at half the micro-batch (here 2,
    then 1, noting the micro-batch asked), the floors after it are tried in fresh processes, and the command
    succeeds. Here a real allocation fails: 2**45 tokens of ids, more than any address space holds."""
    r = _floor("--stage", "1", "--stage", "2", "--seq-len", str(2**45))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [(x["stage"], x["status"], x["micro"], x["asked_micro"]) for x in rows] == [
        (1, "oom", 2, None), (1, "oom", 1, 2), (2, "oom", 2, None), (2, "oom", 1, 2)]
    assert all("allocate" in x["error"] and "step_s_median" not in x for x in rows)
    for stage in (1, 2):
        for micro in (2, 1):
            assert (f"warning: floor (stage {stage}, offload none, head lm, micro {micro} x {2**45} tokens) ran out "
                    "of memory: recorded as oom") in r.stderr
    # asked not to, it tries no smaller micro-batch
    r = _floor("--stage", "1", "--seq-len", str(2**45), "--no-halve-on-oom")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [(x["status"], x["micro"]) for x in rows] == [("oom", 2)]


def test_a_floor_measured_in_place_of_one_out_of_memory_says_so(capsys):
    from zbench.cli import _emit

    record = {"stage": 3, "offload": "none", "head": "lm", "micro": 32, "asked_micro": 64, "seq_len": 685,
              "tokens_per_s_per_gpu": 1.0}
    _emit([record], None)
    out, err = capsys.readouterr()
    assert json.loads(out) == record
    assert ("note: floor (stage 3, offload none, head lm) measured at micro 32 in place of micro 64, which ran out "
            "of memory") in " ".join(err.split())


def test_a_floor_out_of_memory_is_tried_again_at_the_largest_micro_batch_of_at_most_half():
    from zbench.bench import FloorSpec, halved

    spec = FloorSpec(seqs=12, micro=12)
    steps = [spec]
    while (smaller := halved(steps[-1])) is not None:
        steps.append(smaller)
    # the same 12 sequences a step, in micro-batches that divide them, each at most half the last
    assert [(s.micro, s.asked_micro, s.seqs) for s in steps] == [(12, None, 12), (6, 12, 12), (3, 12, 12),
                                                                  (1, 12, 12)]
    assert halved(FloorSpec(seqs=10, micro=8)).micro == 2  # 4 and 3 do not divide 10


def test_a_bad_combination_is_refused_before_anything_starts():
    r = _floor("--stage", "0", "--offload", "cpu")
    assert r.returncode != 0
    assert "offload" in r.stderr and "stage 0" in r.stderr
    assert "Traceback" not in r.stderr
    r = _floor("--head", "policy")
    assert r.returncode == 2 and "head='policy': expected one of lm, value" in r.stderr
    assert "Traceback" not in r.stderr


def test_floors_like_a_run_root(tmp_path):
    """`--like`: the floors of a run's cases, shaped from their configs and metrics, appended to the run root's
    floors.jsonl (what `zbench report` reads); a case that never recorded a step is left out with a warning."""
    from zbench.config import dump_yaml, from_dict

    root = tmp_path / "run"
    root.mkdir()
    (root / "manifest.json").write_text("{}")
    cases = {"zero1_no_offload": ("ppo", 1, "none", [30.0, 20.0, 22.0]),  # PPO: actor and critic floors
             "zero3_cpu_offload": ("grpo", 3, "cpu", [26.0, 18.0]),
             "zero2_no_offload": ("ppo", 2, "none", [])}  # stopped before its first step
    for name, (algorithm, stage, offload, responses) in cases.items():
        cdir = root / name
        cdir.mkdir()
        cfg = {"name": name, "algorithm": algorithm, "zero": {"stage": stage, "offload": offload},
               "trainer": {"world_size": 1, "train_batch_size": 4}, "actor": {"ppo_mini_batch_size": 4,
               "micro_batch_size_per_gpu": 2}, "critic": {"micro_batch_size_per_gpu": 4},
               "rollout": {"n": 2 if algorithm == "grpo" else 1},
               # the floor runs the case's own model code and checkpointing (GRPO's: its first layer only)
               "model": {"fused_ops": algorithm == "ppo", "gradient_checkpointing": algorithm == "grpo",
                         "checkpoint_layers": 1 if algorithm == "grpo" else None}}
        (cdir / "config.yaml").write_text(dump_yaml(from_dict(cfg)))
        (cdir / "metrics.jsonl").write_text("".join(
            json.dumps({"step": i + 1, "prompt_length/mean": 10.0, "response_length/mean": r}) + "\n"
            for i, r in enumerate(responses)))
    (root / "floors.jsonl").write_text(json.dumps({"stage": 2, "offload": "none", "seqs": 1, "seq_len": 1,
                                                   "tokens_per_s_per_gpu": 1.0}) + "\n")  # kept, appended to
    r = subprocess.run([sys.executable, "-m", "zbench", "bench", "floor", "--like", str(root), "--steps", "1",
                        "--warmup", "0"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warning: zero2_no_offload: left out: no step recorded" in r.stderr
    printed = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    saved = [json.loads(line) for line in (root / "floors.jsonl").read_text().splitlines()]
    assert saved[1:] == printed and saved[0]["seq_len"] == 1
    shapes = [(x["stage"], x["offload"], x["head"], x["seqs"], x["seq_len"], x["micro"], x["fused_ops"],
               x["gradient_checkpointing"], x["checkpoint_layers"]) for x in printed]
    # the step's gradient checks as the case's (`zero.fused_grad_checks`, on by default): fused at ZeRO-1, DeepSpeed's
    # own under ZeRO-3, saying why
    assert {(x["stage"], x["fused_grad_checks"], x["grad_checks"]) for x in printed} == {
        (1, True, "fused"), (3, True, "deepspeed (no ZeRO-1/2 optimizer: DeepSpeedZeroOptimizer_Stage3)")}
    # sequences per rank per optimizer step: 4 prompts x n; mean length of steps 2.. (prompt 10 + response)
    assert sorted(shapes, key=str) == sorted([(1, "none", "lm", 4, 31, 2, True, False, None),
                                              (1, "none", "value", 4, 31, 4, True, False, None),
                                              (3, "cpu", "lm", 8, 28, 2, False, True, 1)], key=str)
    clash = subprocess.run([sys.executable, "-m", "zbench", "bench", "floor", "--like", str(root), "--stage", "2"],
                           capture_output=True, text=True, timeout=300)
    assert clash.returncode == 2 and "--like takes the shape of every floor from the run root; drop --stage" in clash.stderr
    nothing = subprocess.run([sys.executable, "-m", "zbench", "bench", "floor", "--like", str(tmp_path)],
                             capture_output=True, text=True, timeout=300)
    assert nothing.returncode == 2 and "not a run root (no manifest.json)" in nothing.stderr


def test_an_interrupted_floor_run_keeps_the_floors_it_finished(tmp_path):
    """^C (or `timeout -s INT` bounding the floors after a GPU run) while a later floor runs: the floors already
    measured are printed and kept, and the interruption is one clear line; also where the command started with
    SIGINT ignored, as a background job of a script does (`gpu.sh`'s lanes)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "zbench", "bench", "floor", "--model", "tiny", "--seqs", "4", "--micro", "2",
         "--seq-len", "24", "--steps", "2", "--warmup", "1", "--stage", "1", "--stage", "2", "--stage", "3",
         "--offload", "none", "--offload", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # where the ranks write each floor as it finishes
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.monotonic() + 500
    while proc.poll() is None and time.monotonic() < deadline:
        if any(f.read_text().strip() for f in tmp_path.glob("*/floors.jsonl")):
            break
        time.sleep(0.1)
    assert proc.poll() is None, "the floors ended before the first one landed"
    os.kill(proc.pid, signal.SIGINT)  # the command only (the ranks ignore SIGINT, as inherited): it stops them
    out, err = proc.communicate(timeout=300)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert proc.returncode == 2, err[-3000:]
    assert 1 <= len(rows) < 6 and rows[0]["stage"] == 1 and rows[0]["offload"] == "none"
    assert f"floor {len(rows) + 1} of 6" in err and "failed: interrupted" in err
    assert not _processes_with_env("TMPDIR", str(tmp_path))  # no rank left running


def _processes_with_env(key: str, value: str) -> list[int]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(key) == value:
                found.append(p.pid)
        except (psutil.Error, OSError):
            pass
    return found
