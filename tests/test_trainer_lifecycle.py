"""What one launch starts, it ends: no generation for steps that will never train, no collector
thread outliving `train()`, no log file left open by a launch that failed to start."""

from __future__ import annotations

import os
import threading
import time

import pytest
from helpers import read_records, small_config

from asyncrl.checkpoint.snapshot import read_parts
from asyncrl.checkpoint.store import CheckpointStore
from asyncrl.config import ConfigError
from asyncrl.rollout.torch_engine import TorchGenerationEngine
from asyncrl.train.trainer import train


def test_generation_stops_at_the_last_step_of_the_run(tmp_path):
    # A=3 lets generation run three steps ahead; with 4 steps, targets 4-7 would never train
    run = tmp_path / "run"
    train(small_config("run.max_num_steps=4", "rollout.max_trajectory_age_steps=3"), run)
    generated = [
        t for span in read_records(run / "timeline.jsonl") if span["kind"] == "generate"
        for t in span["targets"]
    ]  # fmt: skip
    assert sorted(set(generated)) == [0, 1, 2, 3]
    run_id = read_records(run / "run.json")[0]["run_id"]
    final, _ = CheckpointStore(run / "checkpoints", run_id).latest()
    assert final is not None and final.step == 4
    parts, _ = read_parts(final)
    assert parts["buffer"]["groups"] == [] and parts["ledger"]["in_flight"] == []


def collector_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "asyncrl-collector" and t.is_alive()]


@pytest.mark.slow
def test_the_collector_thread_has_ended_when_train_returns(tmp_path, monkeypatch):
    real = TorchGenerationEngine.generate

    # a batch that outlasts any short join timeout
    def slow(self, requests, version=None, max_tokens=None):
        time.sleep(1.5)
        return real(self, requests, version, max_tokens)

    monkeypatch.setattr(TorchGenerationEngine, "generate", slow)
    assert collector_threads() == []
    config = small_config("run.max_num_steps=2", "rollout.groups_per_batch=2")
    train(config, tmp_path / "run")
    assert collector_threads() == []


def open_files_under(path) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)):
            found.append(target)
    return found


def test_a_launch_that_fails_while_building_leaves_no_log_file_open(tmp_path):
    run = tmp_path / "run"
    broken = small_config("data.task=jsonl", f"data.path={tmp_path / 'missing.jsonl'}")
    with pytest.raises(ConfigError) as err:
        train(broken, run)
    assert "missing.jsonl" in str(err.value)
    # the traceback (held by `err`) keeps the half-built trainer alive: its files must be closed
    assert open_files_under(run) == []
    assert (run / "events.jsonl").exists(), "the logs were opened before building failed"
