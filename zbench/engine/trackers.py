"""Experiment trackers of one case: each step's metrics, under verl's names and exactly as written to
metrics.jsonl, also go to TensorBoard, Weights & Biases and MLflow when `trainer.logger` names them (verl's key
and spelling: `--set 'trainer.logger=[console,tensorboard,wandb,mlflow]'`).

One tracker run per case attempt, grouped by the run root: the W&B group and the MLflow experiment are the run
root's name, the run name is the case's name, and the case's config is attached. Where the output goes, unless
the user's environment says otherwise:

    tensorboard   <case>/tensorboard/ event files          (tensorboard --logdir <run root>)
    wandb         <case>/wandb/ (or $WANDB_DIR), project $WANDB_PROJECT or "zbench"; online or offline as
                  wandb is set up ($WANDB_MODE=offline logs without an account; `wandb sync` uploads later)
    mlflow        file store <run root>/mlruns (or $MLFLOW_TRACKING_URI)

A tracker that cannot start or log is dropped with a warning in train.log; the case goes on without it.
A retried or resumed case starts a new tracker run of the same name (TensorBoard: a new event file beside the
first), so an attempt's steps are never merged into another's.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Protocol

from zbench.config import RunConfig, dump_yaml, to_dict

MLFLOW_STORE = "mlruns"  # the default MLflow file store, in the run root beside the cases
WANDB_PROJECT = "zbench"  # the W&B project when $WANDB_PROJECT is not set


class _Tracker(Protocol):
    where: str

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self, completed: bool) -> None: ...


def flat_config(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys (`zero.stage`), the form MLflow parameters take."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        out.update(flat_config(value, dotted) if isinstance(value, dict) else {dotted: value})
    return out


class _TensorBoard:
    def __init__(self, cfg: RunConfig, case_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.where = str(case_dir / "tensorboard")
        self.writer = SummaryWriter(log_dir=self.where)
        self.writer.add_text("config", "```yaml\n" + dump_yaml(cfg) + "```")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a case killed later still leaves its steps on disk

    def close(self, completed: bool) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, cfg: RunConfig, case_dir: Path):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or WANDB_PROJECT, group=case_dir.parent.name,
                              name=cfg.name, config=to_dict(cfg),
                              dir=None if os.environ.get("WANDB_DIR") else str(case_dir),
                              settings=wandb.Settings(console="off"))  # train.log already has the console
        self.where = self.run.url or str(Path(self.run.dir).parent)  # offline: the run's directory

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self, completed: bool) -> None:
        self.run.finish(exit_code=0 if completed else 1)


class _MLflow:
    def __init__(self, cfg: RunConfig, case_dir: Path):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (case_dir.parent / MLFLOW_STORE).resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 keeps its file store behind this switch: zbench's default store is one (in the run root), and
            # so is a folder or file: URI in $MLFLOW_TRACKING_URI, which asks for one
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self._experiment(case_dir.parent.name)
        self.run_id = self.client.create_run(experiment, run_name=cfg.name,
                                             tags={"zbench.case_dir": str(case_dir.resolve())}).info.run_id
        params = [Param(k, str(v)) for k, v in flat_config(to_dict(cfg)).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.where = f"{uri} (experiment {case_dir.parent.name}, run {self.run_id})"

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except Exception:  # another case of the run root created it first
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def close(self, completed: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if completed else "FAILED")


_KINDS: dict[str, type] = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow}
_INSTALL = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny"}


class Trackers:
    """The trackers `trainer.logger` asks for, started for one case; failures become warnings, never errors."""

    def __init__(self, cfg: RunConfig, case_dir: Path):
        self.running: dict[str, _Tracker] = {}
        # what result.json records per tracker: ok (every step logged, run finished), where, error
        self.state: dict[str, dict[str, Any]] = {}
        for name in cfg.trainer.logger:
            if name not in _KINDS:  # console is the step line of train.log, printed by Records
                continue
            try:
                tracker = _KINDS[name](cfg, case_dir)
            except ImportError as err:
                self._drop(name, f"not installed ({err}); pip install 'zbench[trackers]' or {_INSTALL[name]}",
                           "did not start")
                continue
            except Exception as err:  # any tracker failure: the case goes on without it
                self._drop(name, f"{type(err).__name__}: {err}", "did not start")
                continue
            self.running[name] = tracker
            self.state[name] = {"ok": True, "where": tracker.where}
            print(f"[zbench] tracker {name}: {tracker.where}", flush=True)

    def _drop(self, name: str, reason: str, what: str) -> None:
        reason = " ".join(reason.split())  # one line in train.log, however the tracker formats its error
        self.running.pop(name, None)
        self.state[name] = {**self.state.get(name, {}), "ok": False, "error": f"{what}: {reason}"}
        print(f"[zbench] warning: tracker {name} {what}: {reason}; the case goes on without it", flush=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Send one step's metrics to every running tracker."""
        for name, tracker in list(self.running.items()):
            try:
                tracker.log(step, metrics)
            except Exception as err:
                self._drop(name, f"{type(err).__name__}: {err}", f"failed to log step {step}")

    def close(self, completed: bool) -> dict[str, dict[str, Any]]:
        """Finish every tracker run (marked failed unless `completed`); returns what result.json records."""
        for name, tracker in list(self.running.items()):
            try:
                tracker.close(completed)
            except Exception as err:
                self._drop(name, f"{type(err).__name__}: {err}", "failed to finish")
        self.running.clear()
        return self.state
