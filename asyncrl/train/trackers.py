"""Experiment trackers: Weights & Biases (`logging.wandb`) and MLflow (`logging.mlflow`) as
`MetricsSink`s of the step records, next to `metrics.jsonl` and TensorBoard.

Each logs every numeric field of a step record (bools and non-numbers skipped, as TensorBoard
does) against x = `step`, and the run's flattened config (`section.key`) as W&B config / MLflow
params. Both packages are optional extras, imported only when their key is on.

A run dir is one tracker run however many launches it takes: the tracker run ids live in
`RUN_DIR/trackers.json` (`{"wandb_run_id": ..., "mlflow_run_id": ...}`, replaced atomically),
and a resumed launch continues them. A step retrained after a resume is logged again, as in
`metrics.jsonl`: W&B's own step counter must only grow, so `step` is declared the x-axis of
every W&B metric and the records are logged without `step=`; MLflow takes `step=` and keeps
every value (its history of a retrained step holds both).

A tracker's run is marked finished when the launch ends normally, failed when it ends by an
exception (a preemption included: the resume marks it running again).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlparse

from asyncrl.config import ConfigError, LoggingConfig
from asyncrl.config.keys import flatten

TRACKERS_FILE = "trackers.json"
"""In the run dir: the ids of the tracker runs this run logs to."""


def numeric_fields(record: dict[str, Any]) -> dict[str, int | float]:
    """The fields a tracker logs: every int or float but `step` (the x-axis) and bools."""
    return {
        key: value
        for key, value in record.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step"
    }


def read_tracker_ids(run_dir: Path) -> dict[str, str]:
    """`trackers.json`'s ids; empty before any tracker run was created."""
    path = run_dir / TRACKERS_FILE
    if not path.exists():
        return {}
    try:
        ids = json.loads(path.read_text())
        if not isinstance(ids, dict):
            raise ValueError("not a JSON object")
    except ValueError as err:
        raise ConfigError(
            f"{path}: unreadable ({err}); it names the tracker runs a resume continues: restore "
            "it, or delete it to start new tracker runs"
        ) from None
    return {str(k): str(v) for k, v in ids.items()}


def save_tracker_id(run_dir: Path, key: str, run_id: str) -> None:
    """Adds `key: run_id` to `trackers.json` atomically (temp file, fsync, rename): a kill at
    any instant leaves the old file or the new one, never a torn one."""
    ids = {**read_tracker_ids(run_dir), key: run_id}
    tmp = run_dir / f".{TRACKERS_FILE}.tmp"
    tmp.write_text(json.dumps(ids, indent=1) + "\n")
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.rename(tmp, run_dir / TRACKERS_FILE)


def _optional(module: str, key: str, package: str) -> ModuleType:
    """Imports an optional extra, or says which key needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(
            f"{key}=true needs the `{module}` package, which is not importable ({err}): "
            f"`pip install {package}`, or set {key}=false"
        ) from None


def _launch_failed() -> bool:
    """True while an exception propagates: `RunLogs.close` runs in the trainer's `except`
    blocks on a failed launch and after the `end` event on a finished one."""
    return sys.exc_info()[0] is not None


class WandbSink:
    """Logs step records to one W&B run per run dir.

    `WANDB_MODE` (and the rest of W&B's environment) is honoured: `offline` writes
    `RUN_DIR/wandb/offline-run-*/` for `wandb sync`. W&B prints nothing and does not capture
    the console (`silent`, `console="off"`), so the progress bar stays whole. The run's id is
    chosen here and saved to `trackers.json` before `wandb.init`, so a launch killed inside
    `init` still resumes the same id (`resume="allow"` creates it if it never got there)."""

    def __init__(self, run_dir: Path, logging: LoggingConfig, config: dict[str, Any]) -> None:
        wandb = _optional("wandb", "logging.wandb", "wandb")
        run_id = read_tracker_ids(run_dir).get("wandb_run_id")
        if run_id is None:
            run_id = uuid.uuid4().hex[:16]
            save_tracker_id(run_dir, "wandb_run_id", run_id)
        self._run = wandb.init(
            project=logging.wandb_project,
            name=logging.wandb_run_name or run_dir.resolve().name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            reinit="create_new",  # a run object of its own, not the process-global `wandb.run`
            settings=wandb.Settings(silent=True, console="off"),
        )
        # a resume may change MAY_CHANGE keys: the config shows the newest launch's values
        self._run.config.update(flatten(config), allow_val_change=True)
        self._run.define_metric("*", step_metric="step")

    def write(self, record: dict[str, Any]) -> None:
        self._run.log({"step": record["step"], **numeric_fields(record)})

    def close(self) -> None:
        self._run.finish(exit_code=1 if _launch_failed() else 0)


_MLFLOW_BAD_CHARS = re.compile(r"[^/\w.\- :]")


def mlflow_key(key: str) -> str:
    """A metric name MLflow accepts: it allows only alphanumerics and `_-. :/`, so `@` (as in
    `eval/pass@4`) becomes `_at_` and any other character `_`."""
    return _MLFLOW_BAD_CHARS.sub("_", key.replace("@", "_at_"))


def is_local_store(uri: str) -> bool:
    """True for a path or a `file:` URI: MLflow's file store."""
    scheme = urlparse(uri).scheme
    return scheme in ("", "file") or len(scheme) == 1  # `C:\\...` parses as scheme `c`


class MlflowSink:
    """Logs step records to one MLflow run per run dir, through an `MlflowClient` with an
    explicit tracking URI (no process-global active run or tracking URI is set).

    An empty `logging.mlflow_tracking_uri` means a file store in `RUN_DIR/mlruns`. MLflow 3
    refuses to open a file store unless `MLFLOW_ALLOW_FILE_STORE=true` (the backend is in
    maintenance mode, but it is the only one that needs no server or database and keeps
    the run dir self-contained): for a local store it is set here, unless the user set it.
    Params are immutable in MLflow: a resume logs the keys the run lacks, and a changed value
    keeps its first launch's value there (the `resume` event in `events.jsonl` records it)."""

    def __init__(self, run_dir: Path, logging: LoggingConfig, config: dict[str, Any]) -> None:
        _optional("mlflow", "logging.mlflow", "mlflow-skinny")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        uri = logging.mlflow_tracking_uri or (run_dir / "mlruns").resolve().as_uri()
        if is_local_store(uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = MlflowClient(tracking_uri=uri)
        run_id = read_tracker_ids(run_dir).get("mlflow_run_id")
        if run_id is None:
            run_id = self._create_run(run_dir, logging)
            save_tracker_id(run_dir, "mlflow_run_id", run_id)
        else:
            self._reopen(run_dir, run_id, uri)
        self._run_id = run_id
        logged = self._client.get_run(run_id).data.params
        params = [Param(k, str(v)) for k, v in flatten(config).items() if k not in logged]
        for start in range(0, len(params), 100):  # MLflow's limit per batch
            self._client.log_batch(run_id, params=params[start : start + 100])

    def _create_run(self, run_dir: Path, logging: LoggingConfig) -> str:
        name = logging.mlflow_experiment
        experiment = self._client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id if experiment else self._client.create_experiment(name)
        )
        run = self._client.create_run(
            experiment_id,
            run_name=run_dir.resolve().name,
            tags={"asyncrl.run_dir": str(run_dir.resolve())},
        )
        return str(run.info.run_id)

    def _reopen(self, run_dir: Path, run_id: str, uri: str) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self._client.update_run(run_id, status="RUNNING")
        except MlflowException as err:
            raise ConfigError(
                f"logging.mlflow_tracking_uri: {run_dir / TRACKERS_FILE} names MLflow run "
                f"{run_id}, which {uri} cannot reopen ({err.message}): point the key at the "
                "store that holds it, or delete `mlflow_run_id` from that file to start a new "
                "MLflow run"
            ) from None

    def write(self, record: dict[str, Any]) -> None:
        now_ms, step = int(time.time() * 1000), record["step"]
        metrics = [
            self._metric(mlflow_key(k), float(v), now_ms, step)
            for k, v in numeric_fields(record).items()
        ]
        for start in range(0, len(metrics), 1000):  # MLflow's limit per batch
            self._client.log_batch(self._run_id, metrics=metrics[start : start + 1000])

    def close(self) -> None:
        self._client.set_terminated(self._run_id, "FAILED" if _launch_failed() else "FINISHED")
