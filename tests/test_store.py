"""Run roots on disk: names, manifest, metrics reading, summary rows, atomic summary, lock, environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from zbench import env
from zbench.runroot import casedir, summary
from zbench.runroot.casedir import RunRootError
from zbench.runroot.root import LockError, RunRoot


class Case:
    def __init__(self, name: str, overrides: dict | None = None) -> None:
        self.name, self.overrides = name, overrides or {}


def make_root(tmp_path: Path, names=("zero2_cpu_offload", "zero3"), **kw) -> RunRoot:
    kw = {"matrix": "six-case", "matrix_file": "matrices/six-case.yaml", "seed": 7, "steps": 3,
          "environment": {}, **kw}  # fmt: skip
    return RunRoot.create(
        tmp_path / "results", "six-case_3_seed7", cases=[Case(n, {"zero.stage": 2}) for n in names], **kw
    )


@pytest.mark.parametrize(
    "bad", ["", ".", "..", "a/b", "/abs", "../up", "a..b", "a b", ".hidden", "-x", "é", "x" * 200]
)
def test_bad_tags_and_case_names_are_rejected(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError, match=r"invalid tag .* use 1-128 characters"):
        RunRoot.create(tmp_path, bad, matrix="m", matrix_file=None, seed=1, steps=1, cases=[], environment={})
    with pytest.raises(ValueError, match=r"invalid case name"):
        make_root(tmp_path, names=["ok", bad])
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").iterdir())


def test_create_and_open(tmp_path: Path) -> None:
    root = make_root(tmp_path, command=["zbench", "run", "six-case"])
    assert root.path.parent == tmp_path / "results"
    assert (
        root.path.name.startswith("six-case_3_seed7_")
        and len(root.path.name) == len("six-case_3_seed7_") + 15
    )
    m = root.manifest
    for key in ("zbench_version", "matrix", "matrix_file", "tag", "seed", "steps", "command", "cases", "git",
                "versions", "gpus", "host", "runner", "started_at", "ended_at"):  # fmt: skip
        assert key in m, key
    assert m["cases"][0] == {
        "name": "zero2_cpu_offload",
        "dir": "zero2_cpu_offload",
        "overrides": {"zero.stage": 2},
    }
    assert root.case_names() == ["zero2_cpu_offload", "zero3"] and (root.path / "zero3").is_dir()
    assert RunRoot.open(root.path).update_manifest(ended_at="x")["ended_at"] == "x"
    # the host's CPU goes into the manifest as collected, and into the report's hardware line; none is claimed
    # where the environment named none
    from zbench.analyze.report import environment_lines

    cpu = {"model": "Example CPU 9000", "logical_cores": 32, "usable_cores": 30}
    named = make_root(tmp_path, environment={"cpu": cpu, "gpus": [{"name": "G", "memory_gb": 80.0}]}).manifest
    assert named["cpu"] == cpu
    assert environment_lines(named)[1].startswith("1× G (80.0 GB) · CPU Example CPU 9000 (32 cores) · host ")
    assert m["cpu"] is None and environment_lines(m)[1].startswith("CPU only · host ")
    assert environment_lines({**m, "cpu": cpu})[1].startswith("no GPU · CPU Example CPU 9000 (32 cores) · host ")
    second = make_root(tmp_path)  # same second: a fresh directory, never a shared one
    assert second.path != root.path
    with pytest.raises(RunRootError, match="does not exist"):
        RunRoot.open(tmp_path / "nope")
    with pytest.raises(RunRootError, match=r"is not a run root: it has no manifest\.json"):
        RunRoot.open(tmp_path)
    with pytest.raises(ValueError, match="duplicate case names"):
        make_root(tmp_path, names=["a", "a"])


def test_read_metrics_skips_torn_last_line(tmp_path: Path) -> None:
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x": 2.0}\n{"step": 3, "x"')
    records, skipped, torn = casedir.read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2] and skipped == 1 and torn
    assert casedir.read_metrics(tmp_path / "absent") == ([], 0, False)


def write_case(cdir: Path, algorithm: str = "ppo", steps: int = 3, status: str = "completed", config_extra: str = "",
               ended_at: str = "2026-01-01T00:00:00Z", gpu: bool = False) -> None:  # fmt: skip
    cdir.mkdir(parents=True, exist_ok=True)
    (cdir / "config.yaml").write_text(
        f"name: {cdir.name}\nalgorithm: {algorithm}\nseed: 7\nsteps: {steps}\n"
        f"zero:\n  stage: 2\n  offload: cpu\nrollout:\n  backend: hf\n  n: {4 if algorithm == 'grpo' else 1}\n"
        f"{config_extra}"
    )
    with (cdir / "metrics.jsonl").open("w") as f:
        for n in range(1, steps + 1):
            rec = {"step": n, "time": 0.0, "critic/score/mean": [0.2, 0.5, 0.4][n - 1], "timing_s/step": [9.0, 2.0, 4.0][n - 1],
                   "perf/throughput": [1.0, 10.0, 20.0][n - 1], "critic/vf_loss": 3.0 / n, "actor/pg_loss": -1.0 / n,
                   "perf/cpu_memory_used_gb": 1.0 + n}  # fmt: skip
            if gpu:
                rec["perf/max_memory_allocated_gb"] = 10.0 * n
                # the device-wide figure by phase: generation sets the peak, training stays below it
                rec.update({"perf/device_memory_used_gb": 25.0 + n, "perf/device_memory_gen_gb": 25.0 + n,
                            "perf/device_memory_train_gb": 20.0 + n})
            f.write(json.dumps(rec) + "\n")
    casedir.write_status(cdir, {"status": status, "attempt": 1, "exit_code": 0, "reason": "", "last_step": steps,
                              "started_at": ended_at, "ended_at": ended_at, "warnings": []})  # fmt: skip
    if status == "completed":
        casedir.atomic_write_json(cdir / "result.json", {"steps_completed": steps, "steps_target": steps,
            "offload_effective": "optimizer", "rollout_backend": "hf", "rollout_engine": "hf-graph", "world_size": 2,
            "wall_s": 15.5})  # fmt: skip


def test_summary_rows(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    write_case(root.path / "zero2_cpu_offload", "ppo")
    write_case(root.path / "zero3", "grpo", gpu=True)
    status = casedir.read_status(root.path / "zero3")
    casedir.write_status(root.path / "zero3", {**status, "reason": 'ValueError: "x"\tin\nzero.stage'})
    with (root.path / "zero3" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "critic/sco')  # a torn line must not break the summary
    path = root.write_summary()
    lines = path.read_text().splitlines()
    assert lines[0].split("\t") == list(summary.SUMMARY_COLUMNS)
    assert lines[0] == (
        "case\talgorithm\tzero_stage\toffload\toffload_effective\trollout_backend\tworld_size\tseed\tstatus\t"
        "steps_completed\tsteps_target\twall_s\tstep_time_mean_s\tthroughput_mean\tmfu_mean\t"
        "max_memory_allocated_gb\tmax_memory_reserved_gb\tcpu_memory_used_gb\tscore_first\tscore_last\t"
        "score_max\tloss_last\tattempt\texit_code\treason\tcase_dir\tconfig_hash\tdevice_memory_used_gb\t"
        "step_time_sd_s\tdevice_memory_gen_gb\tdevice_memory_train_gb\trollout_engine"
    )
    ppo, grpo = summary.read_summary(path)
    assert ppo["case"] == "zero2_cpu_offload" and ppo["algorithm"] == "ppo" and ppo["zero_stage"] == "2"
    assert ppo["offload"] == "cpu" and ppo["offload_effective"] == "optimizer" and ppo["world_size"] == "2"
    assert ppo["rollout_backend"] == "hf" and ppo["rollout_engine"] == "hf-graph"
    assert ppo["step_time_mean_s"] == "3" and ppo["throughput_mean"] == "15"  # steps 2..N only
    assert ppo["step_time_sd_s"] == "1.41421"  # steps 2 and 3 (2 s, 4 s): one step strays this far
    assert ppo["score_first"] == "0.2" and ppo["score_last"] == "0.4" and ppo["score_max"] == "0.5"
    assert ppo["loss_last"] == "1" and grpo["loss_last"] == "-0.333333"  # vf_loss for PPO, pg_loss for GRPO
    assert ppo["max_memory_allocated_gb"] == "" and ppo["mfu_mean"] == "" and ppo["cpu_memory_used_gb"] == "4"
    assert grpo["max_memory_allocated_gb"] == "30" and grpo["reason"] == 'ValueError: "x" in zero.stage'
    assert (grpo["device_memory_used_gb"], grpo["device_memory_gen_gb"], grpo["device_memory_train_gb"]) == \
        ("28", "28", "23")
    assert ppo["device_memory_gen_gb"] == ppo["device_memory_train_gb"] == ""  # a CPU case has no device figure
    text = (root.path / "zero3" / "config.yaml").read_text()
    assert grpo["config_hash"] == summary.config_hash(text) and len(grpo["config_hash"]) == 12
    assert (
        ppo["case_dir"] == "zero2_cpu_offload"
        and ppo["steps_completed"] == "3"
        and ppo["status"] == "completed"
    )


def test_summary_of_unstarted_case_and_single_step(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    write_case(root.path / "zero3", "grpo", steps=1, status="failed")
    pending, one = root.summary_rows()
    assert pending["status"] == "pending" and pending["config_hash"] == "" and pending["reason"] == ""
    assert one["step_time_mean_s"] == "9" and one["steps_completed"] == "1" and one["steps_target"] == "1"
    assert one["step_time_sd_s"] == ""  # one step: no spread to tell


def test_step_means_leave_out_a_profiled_step(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    write_case(root.path / "zero3", "grpo")
    path = root.path / "zero3" / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    recs[2].update({"timing_s/step": 40.0, "perf/throughput": 0.5, "perf/profiled": 1.0,  # step 3, slowed
                    "perf/cpu_memory_used_gb": 99.0})  # and holding the profiler's buffers
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    _, row = root.summary_rows()
    assert row["step_time_mean_s"] == "2" and row["throughput_mean"] == "10"  # step 2 alone
    assert row["cpu_memory_used_gb"] == "3" and row["score_max"] == "0.5"  # peak of steps 1-2; scores all count
    recs = [{**r, "perf/profiled": 1.0} for r in recs[:1]]  # the only step was profiled: it still counts
    path.write_text(json.dumps(recs[0]) + "\n")
    _, row = root.summary_rows()
    assert row["step_time_mean_s"] == "9"


def test_summary_is_replaced_atomically(tmp_path: Path) -> None:
    root = make_root(tmp_path, names=[f"c{i}" for i in range(30)])
    for i in range(30):
        write_case(root.path / f"c{i}")
    path = root.write_summary()
    original = path.open()  # held open, so its inode cannot be reused by a later file
    complete = path.read_text()
    seen: list[str] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            seen.append(path.read_text())

    t = threading.Thread(target=reader)
    t.start()
    for _ in range(10):
        root.write_summary()
    done.set()
    t.join()
    assert seen and all(text == complete for text in seen)  # never a partial file
    with original:  # a new file was moved into place; the original was never rewritten in place
        assert os.fstat(original.fileno()).st_ino != path.stat().st_ino and original.read() == complete
    assert sorted(p.name for p in root.path.iterdir() if p.is_file()) == ["manifest.json", "summary.tsv"]


HOLDER = """
import sys, time
from zbench.runroot.root import RunRoot
with RunRoot.open(sys.argv[1]).lock("run"):
    print("locked", flush=True)
    time.sleep(60)
"""


def test_lock_refuses_live_holder_and_takes_over_stale(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root.path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(LockError, match=rf"in use by pid {holder.pid} on host"):
            root.lock("resume").acquire()
    finally:
        holder.kill()
        holder.wait()
    # The holder died without releasing: its lock is stale and is taken over.
    assert json.loads((root.path / "lock").read_text())["pid"] == holder.pid
    with root.lock("resume") as lock:
        info = json.loads(lock.path.read_text())
        assert info["pid"] == os.getpid() and info["command"] == "resume" and info["host"]
        with pytest.raises(LockError, match=f"pid {os.getpid()}"):
            root.lock().acquire()
    assert not (root.path / "lock").exists()


def test_write_status_rejects_unknown_status(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"status 'done' is not one of \('pending'"):
        casedir.write_status(tmp_path, {"status": "done"})
    assert casedir.read_status(tmp_path) is None


def test_collect_environment() -> None:
    t0 = time.monotonic()
    info = env.collect_environment()
    assert time.monotonic() - t0 < 10
    assert info["versions"]["python"] == sys.version.split()[0]
    assert set(info["versions"]) == {"python", "torch", "deepspeed", "ray", "transformers", "vllm", "triton"}
    assert isinstance(info["gpus"], list) and info["host"] and set(info["git"]) == {"commit", "dirty"}
    cpu = info["cpu"]  # what /proc/cpuinfo names, not a default standing in for it
    named = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.split(":", 1)[0].strip() in ("model name", "Model", "cpu model")] \
        if Path("/proc/cpuinfo").exists() else []
    assert cpu["model"] == (named[0] if named else None)
    assert cpu["logical_cores"] == os.cpu_count() and 1 <= cpu["usable_cores"] <= cpu["logical_cores"]
    probe = "import sys; from zbench.env import collect_environment; collect_environment(); print(sorted(sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60).stdout
    assert "'torch'" not in loaded and "'deepspeed'" not in loaded and "'ray'" not in loaded  # metadata only


def test_recorded_variables_name_what_changes_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest records the environment variables that change how a case runs: secrets stay out (by a word of
    their name), so do paths and logins in values (the name stays), and so do those zbench sets itself for the
    workers; the report prints them in a line."""
    environ = {"VLLM_USE_V2_MODEL_RUNNER": "0", "RAY_worker_niceness": "15", "NCCL_DEBUG_FILE": "/tmp/nccl.%h",
               "TORCHINDUCTOR_CACHE_DIR": "~/cache", "RAY_REDIS_ADDRESS": "user:pw@host:6379", "RAY_AUTH_MODE": "off",
               "RAY_REDIS_PASSWD": "pw", "RAY_AUTH_TOKEN": "t", "WANDB_API_KEY": "k", "HF_TOKEN": "hf_x",
               "TOKENIZERS_PARALLELISM": "true", "OMP_NUM_THREADS": "4", "OMP_PROC_BIND": "close",
               "CUDA_VISIBLE_DEVICES": "1", "HOME": "/root", "UNRELATED": "1"}
    assert env.recorded_variables(environ) == {
        "CUDA_VISIBLE_DEVICES": "1", "NCCL_DEBUG_FILE": env.HIDDEN_VALUE, "OMP_PROC_BIND": "close",
        "RAY_AUTH_MODE": "off", "RAY_REDIS_ADDRESS": env.HIDDEN_VALUE, "RAY_worker_niceness": "15",
        "TORCHINDUCTOR_CACHE_DIR": env.HIDDEN_VALUE, "VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert env.changed_variables({"A": "1", "B": "2"}, {"B": "3", "C": "4"}) == [
        ("A", "1", env.UNSET), ("B", "2", "3"), ("C", env.UNSET, "4")]
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
    manifest = RunRoot.create(tmp_path / "results", "t", matrix="m", matrix_file=None, seed=1, steps=1,
                              cases=[]).manifest  # the environment collected here
    assert manifest["variables"]["VLLM_USE_V2_MODEL_RUNNER"] == "0" and "RAY_AUTH_TOKEN" not in manifest["variables"]
    from zbench.analyze.report import environment_lines

    lines = environment_lines(manifest)
    assert len(lines) == 3 and "VLLM_USE_V2_MODEL_RUNNER=0" in lines[2].split("variables: ")[1].split(" · ")
    assert len(environment_lines({**manifest, "variables": {}})) == 2  # none set: no line


def test_a_runner_profile_adds_to_the_recorded_variables_and_says_how_far_they_reach(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What a profile's `env` gives the cases is recorded with the rest; on a Ray cluster, the record says the
    workers do not have it (they take their nodes' environment)."""
    from zbench.analyze.report import environment_lines
    from zbench.harness.runner_profile import RunnerProfile

    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    local = RunnerProfile(name="p", env={"NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "INFO"}).recorded_environment()
    assert local["variables"]["NCCL_SOCKET_IFNAME"] == "eth0" and local["variables"]["NCCL_DEBUG"] == "INFO"
    assert "private Ray" in local["variables_reach"]
    cluster = RunnerProfile(name="c", ray_address="auto").recorded_environment()
    line = environment_lines({**cluster, "versions": {}})[2]
    assert line.startswith("variables (the cases' drivers only: the Ray cluster's workers have their nodes' ")


def test_deepspeed_op_compatibility(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.setenv("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cpu"))
    pytest.importorskip("deepspeed")
    ops = env.deepspeed_op_compatibility()
    assert "cpu_adam" in ops and "fused_adam" in ops and all(isinstance(v, bool) for v in ops.values())


def test_a_stated_commit_wins_over_a_stale_checkout(monkeypatch):
    """A tree copied to another machine may carry an old .git; ZBENCH_GIT_COMMIT says what actually ran."""
    from zbench.env import _git_info

    monkeypatch.delenv("ZBENCH_GIT_COMMIT", raising=False)
    monkeypatch.delenv("ZBENCH_GIT_DIRTY", raising=False)
    assert _git_info().get("source") is None  # this checkout's own git
    monkeypatch.setenv("ZBENCH_GIT_COMMIT", "0123abcd")
    assert _git_info() == {"commit": "0123abcd", "dirty": False, "source": "ZBENCH_GIT_COMMIT"}
    monkeypatch.setenv("ZBENCH_GIT_DIRTY", "1")
    assert _git_info()["dirty"] is True


def test_a_summary_from_before_a_later_column_still_reads(tmp_path: Path) -> None:
    """summary.tsv files written before `device_memory_used_gb` existed read back with it empty (store and
    analysis readers alike); any other header is refused."""
    from zbench.runroot.read import read_summary as read_frame

    root = make_root(tmp_path, names=("zero3",))
    write_case(root.path / "zero3", "grpo", gpu=True)
    path = root.write_summary()
    lines = path.read_text().splitlines()
    later = len(summary.LATER_SUMMARY_COLUMNS)
    assert summary.SUMMARY_COLUMNS[-later:] == summary.LATER_SUMMARY_COLUMNS  # later columns go at the end
    older = [line.rsplit("\t", later)[0] for line in lines]  # a summary written before them
    old_path = tmp_path / "old_summary.tsv"
    old_path.write_text("\n".join(older) + "\n")
    (row,) = summary.read_summary(old_path)
    assert row["case"] == "zero3" and row["device_memory_used_gb"] == "" and row["step_time_sd_s"] == ""
    frame = read_frame(old_path)
    assert list(frame.columns) == list(summary.SUMMARY_COLUMNS) and frame["device_memory_used_gb"].isna().all()
    bad = tmp_path / "bad.tsv"
    bad.write_text("\n".join(line.split("\t", 1)[1] for line in lines) + "\n")
    with pytest.raises(RunRootError, match=r"missing summary column\(s\) case; expected the columns case, "):
        summary.read_summary(bad)


def test_config_hash_ignores_formatting_and_keys_added_later() -> None:
    """A case config written before a key existed hashes like today's with that key at the behaviour it ran with
    (its default, or `INTRODUCED_KEYS`' value); a real change does not; text the schema no longer accepts is hashed
    as written."""
    import yaml

    from zbench.config import dump_yaml, from_dict

    full = dump_yaml(from_dict({"name": "c", "zero": {"stage": 3}}))
    older = yaml.safe_load(full)
    del older["rollout"]["cuda_graph"]
    assert summary.config_hash(yaml.safe_dump(older, sort_keys=False, indent=4)) == summary.config_hash(full)
    changed = yaml.safe_load(full)
    changed["zero"]["stage"] = 2
    assert summary.config_hash(yaml.safe_dump(changed)) != summary.config_hash(full)
    assert summary.config_hash("zero: {stage: 9}") != summary.config_hash("zero: {stage: 8}")
    # a key whose default changed what a case does (the loss's token mean): a config written before it hashes as
    # what it ran, so a rerun at today's default does not merge with it
    before = yaml.safe_load(full)
    del before["actor"]["loss_agg"], before["critic"]["loss_agg"], before["trainer"]["sort_micro_batches"]
    legacy = dump_yaml(from_dict({"name": "c", "zero": {"stage": 3}, "actor": {"loss_agg": "micro-token-mean"},
                                  "critic": {"loss_agg": "micro-token-mean"},
                                  "trainer": {"sort_micro_batches": False}}))
    assert summary.config_hash(yaml.safe_dump(before)) == summary.config_hash(legacy) != summary.config_hash(full)
