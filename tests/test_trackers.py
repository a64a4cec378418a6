"""Experiment trackers (`trainer.logger`, verl's key): a real two-step case sends every step's metrics to
TensorBoard, W&B (offline) and MLflow (a file store), each read back with that tracker's own reader; a tracker
that cannot start never fails the case; a tracker name that does not exist is a config error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from zbench.config import dump_yaml, from_dict

pytest.importorskip("tensorboard", reason="pip install -e '.[trackers]' (make install does)")
pytest.importorskip("wandb", reason="pip install -e '.[trackers]' (make install does)")
pytest.importorskip("mlflow", reason="pip install -e '.[trackers]' (make install does)")

ALL = ["console", "tensorboard", "wandb", "mlflow"]


def make_case(root: Path, name: str, logger: list[str]) -> Path:
    case = root / name
    case.mkdir(parents=True)
    # one rank: half the worker processes to start (CI time); the trackers live in the trainer's process
    cfg = from_dict({"name": name, "seed": 3, "steps": 2, "zero": {"stage": 2},
                     "trainer": {"logger": logger, "world_size": 1}})
    (case / "config.yaml").write_text(dump_yaml(cfg))
    return case


def train(case: Path, env: dict[str, str]) -> str:
    """Run the case's engine process the way `zbench run` does (cwd: the case); returns its log."""
    res = subprocess.run([sys.executable, "-m", "zbench.engine", str(case)], capture_output=True, text=True,
                         timeout=900, cwd=case, env=env)
    log = res.stdout + res.stderr
    (case / "train.log").write_text(log)
    assert res.returncode == 0, log[-6000:]
    return log


def base_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    # wandb's own settings and caches stay in the test's directory
    env.update(WANDB_CONFIG_DIR=str(tmp / "wandb-config"), WANDB_CACHE_DIR=str(tmp / "wandb-cache"),
               WANDB_DATA_DIR=str(tmp / "wandb-data"), NETRC=str(tmp / "no-netrc"))
    return env


def steps_recorded(case: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (case / "metrics.jsonl").read_text().splitlines()]


def wandb_records(path: Path) -> list[Any]:
    """The records of a W&B run file (`run-<id>.wandb`): a 7-byte header, then a LevelDB-style log of 32 KiB
    blocks whose chunks (crc32, length, type) carry wandb's protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def test_every_step_reaches_tensorboard_wandb_and_mlflow(tmp_path: Path) -> None:
    env = base_env(tmp_path) | {"WANDB_MODE": "offline"}
    res = subprocess.run([sys.executable, "-m", "zbench", "run", "six-case", "--cases", "zero2_no_offload",
                          "--steps", "2", "--seed", "3", "--set", f"trainer.logger=[{','.join(ALL)}]",
                          "--results-dir", str(tmp_path / "results")],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    (root,) = (tmp_path / "results").iterdir()
    case = root / "zero2_no_offload"
    log = (case / "train.log").read_text()
    assert "warning: tracker" not in log, log[-4000:]
    assert "step:2 - " in log  # console: the step line
    records = steps_recorded(case)
    assert [r["step"] for r in records] == [1, 2]
    metrics = sorted(k for k in records[0] if k not in ("step", "time"))
    assert "critic/score/mean" in metrics and "actor/pg_loss" in metrics and "timing_s/gen" in metrics
    result = json.loads((case / "result.json").read_text())
    assert {name: t["ok"] for name, t in result["trackers"].items()} == \
        {"tensorboard": True, "wandb": True, "mlflow": True}, result["trackers"]

    # TensorBoard: every metric under its verl name, one scalar per step, equal to metrics.jsonl (float32)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(case / "tensorboard"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == metrics
    for key in metrics:
        events = acc.Scalars(key)
        assert [e.step for e in events] == [1, 2], key
        for e, r in zip(events, records, strict=True):
            assert e.value == pytest.approx(r[key], rel=1e-6, abs=1e-30), key
    assert "config" in " ".join(acc.Tags()["tensors"])

    # W&B offline: the run file under <case>/wandb holds the run (group = run root, name = case), its config and
    # a history row per step
    run_files = list((case / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1, list((case / "wandb").iterdir())
    recs = wandb_records(run_files[0])
    run = next(r.run for r in recs if r.WhichOneof("record_type") == "run")
    assert (run.run_group, run.display_name, run.project) == (root.name, case.name, "zbench")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["zero"]["stage"] == 2 and config["trainer"]["logger"] == ALL
    rows = [r.history for r in recs if r.WhichOneof("record_type") == "history"]
    assert [row.step.num for row in rows] == [1, 2]
    history = [{(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in row.item}
               for row in rows]
    for h, r in zip(history, records, strict=True):
        for key in metrics:
            assert h[key] == pytest.approx(r[key]), key

    # MLflow: a file store in the run root, experiment = run root, run = case, params = the dotted config
    from mlflow.tracking import MlflowClient

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 reads its file store only when asked to
    client = MlflowClient(tracking_uri=(root / "mlruns").as_uri())
    experiment = client.get_experiment_by_name(root.name)
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_name for r in runs] == [case.name] and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["zero.stage"] == "2" and runs[0].data.params["algorithm"] == "ppo"
    assert sorted(runs[0].data.metrics) == metrics
    for key in metrics:
        history = client.get_metric_history(runs[0].info.run_id, key)
        assert [(m.step, m.value) for m in history] == [(r["step"], r[key]) for r in records], key


def test_a_tracker_that_cannot_start_never_fails_the_case(tmp_path: Path) -> None:
    """TensorBoard's directory is a file, MLflow's store lies under a file, W&B online has no API key: three
    warnings in train.log, each naming its tracker; the case completes with every step, result.json says which
    trackers failed and why; without console in trainer.logger train.log has no step lines."""
    root = tmp_path / "run"
    case = make_case(root, "zero2", ["tensorboard", "wandb", "mlflow"])
    (case / "tensorboard").write_text("not a directory\n")
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    # a file: URI asks for MLflow 3's file store, which zbench allows (MLFLOW_ALLOW_FILE_STORE): it fails on the store
    env = base_env(tmp_path) | {"WANDB_MODE": "online", "MLFLOW_TRACKING_URI": (blocker / "mlruns").as_uri()}
    log = train(case, env)
    for name in ("tensorboard", "wandb", "mlflow"):
        assert f"[zbench] warning: tracker {name} did not start:" in log, log[-4000:]
    assert "the case goes on without it" in log
    assert not [line for line in log.splitlines() if line.startswith("step:")]
    assert [r["step"] for r in steps_recorded(case)] == [1, 2]
    trackers = json.loads((case / "result.json").read_text())["trackers"]
    assert {name: t["ok"] for name, t in trackers.items()} == {"tensorboard": False, "wandb": False, "mlflow": False}
    assert "API key" in trackers["wandb"]["error"]
    assert "NotADirectoryError" in trackers["mlflow"]["error"] and "blocker" in trackers["mlflow"]["error"]


@pytest.mark.parametrize("value", ["[console,tensorbord]", "[console,console]", "[1]"])
def test_unknown_tracker_is_a_config_error_at_dry_run(tmp_path: Path, value: str) -> None:
    res = subprocess.run([sys.executable, "-m", "zbench", "run", "six-case", "--dry-run", "--set",
                          f"trainer.logger={value}"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "trainer.logger" in res.stderr and "Traceback" not in res.stderr
    if "tensorbord" in value:
        assert "'tensorbord' is not one of 'console', 'tensorboard', 'wandb', 'mlflow'" in res.stderr


def test_trackers_are_accepted_at_dry_run(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "zbench", "run", "six-case", "--dry-run", "--set",
                          "trainer.logger=[console,tensorboard,wandb,mlflow]"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "trainer.logger=['console', 'tensorboard', 'wandb', 'mlflow']" in res.stdout
