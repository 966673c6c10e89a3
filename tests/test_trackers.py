"""Experiment trackers (`logging.wandb`, `logging.mlflow`): what a run logs is read back from
the trackers' own stores — W&B's offline `.wandb` file, MLflow's file store through its client
— and compared with `metrics.jsonl`, the oracle; a killed and resumed run continues the same
tracker runs."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import SMALL, read_records, run_cli, small_config

from asyncrl.config import ConfigError, LoggingConfig
from asyncrl.train.trackers import MlflowSink, WandbSink, mlflow_key, numeric_fields
from asyncrl.train.trainer import train

BOTH = ["logging.wandb=true", "logging.mlflow=true"]


@pytest.fixture(autouse=True)
def wandb_offline(monkeypatch):
    """W&B never reaches the network here; its files land in the run dir (`dir=RUN_DIR`).
    `wandb.init` puts its service's address in this process's `WANDB_SERVICE`: a child process
    would then log through this process's service, which keeps a SIGKILLed child's run open
    ("run ID ... is in use" on resume). Each test starts without it and leaves none behind."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SERVICE", "")  # empty: none; undone (deleted) after the test


# --- reading what the trackers stored -------------------------------------------------------


def wandb_records(path: Path) -> list[Any]:
    """The protobuf `Record`s of an offline `.wandb` file. W&B stores them in LevelDB's log
    format (github.com/google/leveldb doc/log_format.md): a 7-byte header (`:W&B`, magic
    0xBEE1, version), then 32 KiB blocks of chunks, each `crc32 u32, length u16, type u8`
    (1 FULL, 2 FIRST, 3 MIDDLE, 4 LAST) and its bytes; a block's tail of < 7 bytes is
    padding. wandb 0.31 ships no reader of its own (the Python `DataStore` is gone)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert struct.unpack("<4sH", data[:6]) == (b":W&B", 0xBEE1), "not a .wandb file"
    block, records, pending, pos = 32768, [], b"", 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block  # the block's zero trailer
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding up to the block's end
            pos += block - pos % block
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_launches(run_dir: Path) -> list[dict[str, Any]]:
    """Per launch (offline W&B writes one `offline-run-*` dir each), in order: its run id,
    config, metric definitions and history rows."""
    launches = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        launch: dict[str, Any] = {"config": {}, "rows": [], "metrics": []}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                launch["run_id"] = record.run.run_id
            elif kind == "config":
                launch["config"].update(
                    {u.key: json.loads(u.value_json) for u in record.config.update}
                )
            elif kind == "metric":
                launch["metrics"].append(record.metric)
            elif kind == "exit":
                launch["exited"] = True
            elif kind == "history":
                launch["rows"].append(
                    {
                        i.key or "/".join(i.nested_key): json.loads(i.value_json)
                        for i in record.history.item
                    }
                )
        launches.append(launch)
    return launches


def closed_wandb_launches(run_dir: Path, timeout_s: float = 60) -> list[dict[str, Any]]:
    """`wandb_launches` once the last launch's file holds its run's exit record: W&B's service
    process writes the file, and `finish()` was once seen to return (the whole suite running on
    both cores) before the history rows were in it. A wait for that state, bounded so that a
    file that never gets there fails the test instead of hanging it."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        launches = wandb_launches(run_dir)
        if (launches and launches[-1].get("exited")) or time.monotonic() > deadline:
            return launches
        time.sleep(0.05)


def mlflow_client(run_dir: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())


def tracker_ids(run_dir: Path) -> dict[str, str]:
    return json.loads((run_dir / "trackers.json").read_text())


# --- end to end -----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_logs_every_numeric_metric_of_every_step_to_wandb_and_mlflow(tmp_path):
    run = tmp_path / "run"
    train(small_config("run.max_num_steps=4", *BOTH), run)
    records = read_records(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    ids = tracker_ids(run)
    expected = [(r["step"], r["reward_mean"]) for r in records]

    (launch,) = closed_wandb_launches(run)
    assert launch["run_id"] == ids["wandb_run_id"]
    assert [(row["step"], row["reward_mean"]) for row in launch["rows"]] == expected
    for row, record in zip(launch["rows"], records, strict=True):
        assert {k: row[k] for k in numeric_fields(record)} == numeric_fields(record)
        assert "prompt_ordinals" not in row and "tokens_sha256" not in row  # not numbers
    assert any(m.glob_name == "*" and m.step_metric == "step" for m in launch["metrics"])
    assert launch["config"]["rollout.num_prompts_per_step"] == 4

    client = mlflow_client(run)
    history = client.get_metric_history(ids["mlflow_run_id"], "reward_mean")
    assert [(m.step, m.value) for m in history] == expected
    mlflow_run = client.get_run(ids["mlflow_run_id"])
    assert mlflow_run.info.status == "FINISHED"
    every_key = {mlflow_key(k) for r in records for k in numeric_fields(r)}  # some on some steps
    assert set(mlflow_run.data.metrics) == every_key
    assert mlflow_run.data.params["rollout.num_prompts_per_step"] == "4"


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_tracker_runs(tmp_path):
    """A finished run extended by a second launch (`run.max_num_steps` raised) logs its new
    steps into the same W&B run and MLflow run, and each tracker holds every step."""
    run = tmp_path / "run"
    train(small_config("run.max_num_steps=3", *BOTH), run)
    ids = tracker_ids(run)
    train(small_config("run.max_num_steps=5", *BOTH), run)

    assert tracker_ids(run) == ids
    records = read_records(run / "metrics.jsonl")
    logged = [(r["step"], r["reward_mean"]) for r in records]
    assert [s for s, _ in logged] == [0, 1, 2, 3, 4]
    launches = closed_wandb_launches(run)
    assert [launch["run_id"] for launch in launches] == [ids["wandb_run_id"]] * 2
    assert [launch["config"]["run.max_num_steps"] for launch in launches] == [3, 5]
    rows = [(row["step"], row["reward_mean"]) for launch in launches for row in launch["rows"]]
    assert rows == logged
    client = mlflow_client(run)
    history = client.get_metric_history(ids["mlflow_run_id"], "reward_mean")
    assert [(m.step, m.value) for m in history] == logged
    (experiment,) = [e for e in client.search_experiments() if e.name == "asyncrl"]
    assert len(client.search_runs([experiment.experiment_id])) == 1


@pytest.mark.slow
def test_a_killed_and_resumed_run_logs_its_retrained_steps_into_the_same_tracker_runs(
    tmp_path, repo_root, monkeypatch
):
    """SIGKILLed at step 5's optimizer step, steps 0-4 logged. Checkpoints are written in the
    background, one at a time: the one after step 1 is surely done (the one after step 3
    waited for it), the one after step 3 may be. The resume trains and logs again what
    follows the newest, into the same W&B and MLflow runs. MLflow writes each record through
    at once: it holds every record of both launches. W&B buffers its `.wandb` file (flushed
    every 15 s and at `finish`), so the killed launch's rows are lost with the process; the
    resumed launch's are all there, under the same run id."""
    run = tmp_path / "run"
    args = ["train", str(repo_root / "configs/demo.yaml"), "--run-dir", str(run), *SMALL]
    args += ["run.max_num_steps=7", "checkpoint.save_period=2", *BOTH]
    monkeypatch.setenv("ASYNCRL_FAULT", "train.optimizer_step[step=5]")
    killed = run_cli(*args)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    ids = tracker_ids(run)
    assert mlflow_client(run).get_run(ids["mlflow_run_id"]).info.status == "RUNNING"
    monkeypatch.delenv("ASYNCRL_FAULT")
    resumed = run_cli(*args)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr

    assert tracker_ids(run) == ids
    records = read_records(run / "metrics.jsonl")
    steps = [r["step"] for r in records]
    assert steps[:5] == [0, 1, 2, 3, 4] and steps[5] in (2, 4) and steps[-1] == 6  # premise:
    assert len(steps) > 7  # steps were retrained

    resumed_rows = [(r["step"], r["reward_mean"]) for r in records if r["attempt"] == 1]
    last = closed_wandb_launches(run)[-1]
    assert last["run_id"] == ids["wandb_run_id"]
    assert [(row["step"], row["reward_mean"]) for row in last["rows"]] == resumed_rows

    client = mlflow_client(run)
    history = client.get_metric_history(ids["mlflow_run_id"], "reward_mean")
    assert sorted((m.step, m.value) for m in history) == sorted(
        (r["step"], r["reward_mean"]) for r in records
    )
    assert client.get_run(ids["mlflow_run_id"]).info.status == "FINISHED"


# --- the sinks alone ------------------------------------------------------------------------

EVAL_STEPS = [
    {"step": 0, "reward_mean": 0.5, "eval/pass@4": 0.25, "reward/correct": 3, "done": True},
    {"step": 1, "reward_mean": 0.625, "tokens_sha256": "ab12", "prompt_ordinals": [4, 5]},
    {"step": 2, "reward_mean": 0.75, "eval/pass@4": 0.5, "reward/correct": 4},
]
"""`eval/...` keys on some steps only, keys with `/` and `@`, and fields no tracker logs."""


@pytest.mark.slow
def test_keys_with_slash_and_at_and_keys_on_some_steps_only_reach_both_trackers(tmp_path):
    logging = LoggingConfig(wandb=True, mlflow=True)
    for sink in (WandbSink(tmp_path, logging, {}), MlflowSink(tmp_path, logging, {})):
        for record in EVAL_STEPS:
            sink.write(record)
        sink.close()

    (launch,) = closed_wandb_launches(tmp_path)
    assert launch.get("exited"), "W&B never wrote the run's exit record"
    evals = [(r["step"], r["eval/pass@4"], r["reward/correct"]) for r in launch["rows"][::2]]
    assert evals == [(0, 0.25, 3), (2, 0.5, 4)]
    assert "eval/pass@4" not in launch["rows"][1]
    assert not {"done", "tokens_sha256", "prompt_ordinals"} & {k for r in launch["rows"] for k in r}

    client, run_id = mlflow_client(tmp_path), tracker_ids(tmp_path)["mlflow_run_id"]
    assert mlflow_key("eval/pass@4") == "eval/pass_at_4"  # MLflow refuses `@` in a name
    got = [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/pass_at_4")]
    assert got == [(0, 0.25), (2, 0.5)]
    got = [(m.step, m.value) for m in client.get_metric_history(run_id, "reward/correct")]
    assert got == [(0, 3.0), (2, 4.0)]
    assert set(client.get_run(run_id).data.metrics) == {
        "reward_mean",
        "eval/pass_at_4",
        "reward/correct",
    }


def test_mlflow_refuses_the_raw_at_sign_so_the_key_is_sanitized(tmp_path):  # the reason
    from mlflow.entities import Metric
    from mlflow.exceptions import MlflowException

    sink = MlflowSink(tmp_path, LoggingConfig(mlflow=True), {})
    with pytest.raises(MlflowException, match="pass@4"):
        sink._client.log_batch(sink._run_id, metrics=[Metric("eval/pass@4", 1.0, 0, 0)])
    sink.close()


def test_a_resumed_mlflow_run_keeps_its_params_and_adds_new_keys(tmp_path):
    logging = LoggingConfig(mlflow=True)
    MlflowSink(tmp_path, logging, {"run": {"max_num_steps": 3}}).close()
    MlflowSink(tmp_path, logging, {"run": {"max_num_steps": 5, "seed": 1}}).close()
    params = mlflow_client(tmp_path).get_run(tracker_ids(tmp_path)["mlflow_run_id"]).data.params
    assert params == {"run.max_num_steps": "3", "run.seed": "1"}  # MLflow params are immutable


def test_a_trackers_json_naming_a_run_the_store_lacks_is_refused_naming_the_key(tmp_path):
    (tmp_path / "trackers.json").write_text('{"mlflow_run_id": "0123456789abcdef"}')
    with pytest.raises(ConfigError, match=r"logging\.mlflow_tracking_uri.*0123456789abcdef"):
        MlflowSink(tmp_path, LoggingConfig(mlflow=True), {})


@pytest.mark.parametrize(
    ("module", "key", "install"),
    [
        ("wandb", "logging.wandb", "pip install wandb"),
        ("mlflow", "logging.mlflow", "pip install mlflow-skinny"),
    ],
)
def test_a_missing_tracker_package_fails_the_launch_naming_the_key_and_the_install(
    tmp_path, monkeypatch, module, key, install
):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    with pytest.raises(ConfigError) as err:
        train(small_config(f"{key}=true"), tmp_path / "run")
    assert key in str(err.value) and install in str(err.value)
    assert read_records(tmp_path / "run" / "metrics.jsonl") == []  # nothing was trained
    assert open_files_under(tmp_path) == []  # the JSON-lines files opened before it are closed


def open_files_under(path: Path) -> list[str]:
    """Files under `path` this process holds open (Linux: /proc/self/fd)."""
    fds = Path("/proc/self/fd")
    targets = []
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            targets.append(os.readlink(fd))
    return [t for t in targets if t.startswith(str(path))]


def test_a_failing_tracker_is_reported_and_training_goes_on(tmp_path, monkeypatch, capsys):
    def broken(self, record):
        raise ConnectionError("tracking server gone")

    monkeypatch.setattr(MlflowSink, "write", broken)
    run = tmp_path / "run"
    train(small_config("logging.mlflow=true", "run.max_num_steps=3"), run)
    assert len(read_records(run / "metrics.jsonl")) == 3
    failures = [e for e in read_records(run / "events.jsonl") if e["event"] == "tracker_failure"]
    assert len(failures) == 3 and "tracking server gone" in failures[0]["error"]
    assert capsys.readouterr().out.count("MlflowSink failed to log step 0") == 1
