"""Faults that are not crashes: a failing generation worker, a failing reward function, a NaN
loss, a full disk, and a run dir that needs --restart or --force-config. Each stops (or
recovers) with a clear message and loses nothing."""

from __future__ import annotations

import errno
import json

import pytest
import torch
from helpers import read_records, small_config

import asyncrl.checkpoint.store as store_module
from asyncrl.algos import grpo
from asyncrl.algos.update import NonFiniteLoss
from asyncrl.checkpoint.store import CheckpointError
from asyncrl.cli.audit import audit_run_dir
from asyncrl.rollout.collector import GenerationFailed
from asyncrl.rollout.torch_engine import TorchGenerationEngine
from asyncrl.train.rundir import RunDirError
from asyncrl.train.trainer import train


def flaky_generate(monkeypatch, fail_calls: set[int], error: BaseException) -> None:
    real = TorchGenerationEngine.generate
    calls = {"n": 0}

    def generate(self, requests, version=None, max_tokens=None):
        calls["n"] += 1
        if calls["n"] in fail_calls:
            raise error
        return real(self, requests, version, max_tokens)

    monkeypatch.setattr(TorchGenerationEngine, "generate", generate)


def test_failed_generation_batches_are_redispatched_and_counted(tmp_path, monkeypatch):
    flaky_generate(monkeypatch, {2, 3, 6}, RuntimeError("engine hiccup"))
    run = tmp_path / "run"
    train(small_config("run.max_num_steps=6", "rollout.max_generation_failures=3"), run)
    metrics = read_records(run / "metrics.jsonl")
    assert metrics[-1]["generation_failures"] == 3
    assert audit_run_dir(run).ok  # every ordinal trained once, at its own step


def failing_admission(monkeypatch, fail_calls: set[int] | None) -> None:
    """Admission (outside a batch's retry) raises on those calls (None: on every call): the
    generation thread dies."""
    from asyncrl.core.ledger import Ledger

    real, calls = Ledger.admit, {"n": 0}

    def admit(self, *args, **kwargs):
        calls["n"] += 1
        if fail_calls is None or calls["n"] in fail_calls:
            raise RuntimeError("admission broke")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Ledger, "admit", admit)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_worker_thread_is_restarted(tmp_path, monkeypatch):
    failing_admission(monkeypatch, {2})  # escapes the batch retry: the thread dies
    run = tmp_path / "run"
    train(small_config("run.max_num_steps=5"), run)
    assert read_records(run / "metrics.jsonl")[-1]["generation_failures"] == 1
    assert audit_run_dir(run).ok


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_that_keeps_dying_stops_the_run_within_the_failure_limit(tmp_path, monkeypatch):
    """Restarts count against `rollout.max_generation_failures` (they were restarted forever:
    the run hung with a busy CPU and printed nothing)."""
    failing_admission(monkeypatch, None)
    config = small_config("run.max_num_steps=5", "rollout.max_generation_failures=3")
    with pytest.raises(GenerationFailed, match="3 times in a row; last: the generation thread"):
        train(config, tmp_path / "run")


def test_a_batch_whose_engine_raises_system_exit_is_a_counted_failure(
    tmp_path, monkeypatch, capsys
):
    flaky_generate(monkeypatch, {2}, SystemExit("a helper called sys.exit"))
    run = tmp_path / "run"
    train(small_config("run.max_num_steps=5"), run)
    out = capsys.readouterr().out  # a reported batch failure, not a thread that died
    assert "generation failed (1 in a row): a helper called sys.exit" in out, out
    assert "generation thread died" not in out
    assert read_records(run / "metrics.jsonl")[-1]["generation_failures"] == 1
    assert audit_run_dir(run).ok


def test_too_many_failures_in_a_row_stop_the_run_with_a_checkpoint_that_loses_nothing(
    tmp_path, monkeypatch
):
    flaky_generate(monkeypatch, {5, 6}, RuntimeError("GPU fell off the bus"))
    run = tmp_path / "run"
    config = small_config("run.max_num_steps=8", "rollout.max_generation_failures=2")
    with pytest.raises(GenerationFailed, match="2 times in a row; last: GPU fell off the bus"):
        train(config, run)
    monkeypatch.undo()
    train(config, run)  # fixed: the same command resumes and finishes
    assert audit_run_dir(run).ok
    (resume,) = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert resume["reissued_ordinals"], "the failed batch was saved as in flight"


def jsonl_task(tmp_path, reward: str) -> list[str]:
    path = tmp_path / "data.jsonl"
    rows = [{"prompt": f"{d}=", "answer": str(d)} for d in range(10)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return ["data.task=jsonl", f"data.path={path}", f"data.reward_fn=failing_rewards:{reward}"]


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ("raises_on_7", "raised ValueError('cannot score answer 7')"),
        ("nan_on_7", "returned nan"),
        ("exits_on_7", "raised SystemExit('a reward helper exited')"),  # hung the run before
    ],
)
def test_a_failing_reward_function_stops_the_run_naming_the_ordinal(tmp_path, reward, message):
    config = small_config(*jsonl_task(tmp_path, reward), "run.max_num_steps=6")
    with pytest.raises(GenerationFailed) as err:
        train(config, tmp_path / "run")
    text = str(err.value)
    assert f"failing_rewards:{reward} on ordinal" in text and message in text
    assert "data.jsonl:8" in text  # the row whose answer is 7
    # control: the same data with a reward that works trains to the end
    ok = small_config(*jsonl_task(tmp_path, reward)[:2], "run.max_num_steps=6")
    train(ok, tmp_path / "ok")
    assert len(read_records(tmp_path / "ok" / "metrics.jsonl")) == 6


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_nan_loss_stops_the_run_and_is_never_checkpointed(tmp_path, monkeypatch, algo):
    real = grpo.ClippedPolicyLoss.__call__
    calls = {"n": 0}

    def poisoned(self, *args, **kwargs):
        calls["n"] += 1
        loss, stats = real(self, *args, **kwargs)
        return (loss * torch.nan if calls["n"] == 4 else loss), stats

    monkeypatch.setattr(grpo.ClippedPolicyLoss, "__call__", poisoned)
    run = tmp_path / "run"
    with pytest.raises(NonFiniteLoss, match="loss is nan; the step was not applied"):
        train(
            small_config("run.max_num_steps=8", "checkpoint.save_period=2", f"algo.name={algo}"),
            run,
        )
    steps = sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*"))
    assert steps == [2]  # nothing saved at or after the poisoned step 3
    assert len(read_records(run / "metrics.jsonl")) == 3


def test_a_full_disk_during_a_save_stops_the_run_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch
):
    real = store_module._write_synced
    calls = {"n": 0}

    def write(path, data):
        calls["n"] += 1
        if calls["n"] == 7:  # the second checkpoint's second file (5 files a checkpoint)
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data)

    monkeypatch.setattr(store_module, "_write_synced", write)
    run = tmp_path / "run"
    with pytest.raises(CheckpointError) as err:
        train(small_config("run.max_num_steps=8", "checkpoint.save_period=2"), run)
    text = str(err.value)
    assert "state.safetensors: writing the checkpoint of step 4 failed" in text
    assert "No space left on device" in text and "the previous checkpoint is untouched" in text
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000002"]  # no temp left
    monkeypatch.undo()
    train(small_config("run.max_num_steps=8", "checkpoint.save_period=2"), run)
    assert audit_run_dir(run).ok


def test_history_without_a_verified_checkpoint_needs_restart(tmp_path):
    run = tmp_path / "run"
    train(small_config("run.max_num_steps=2"), run)
    for manifest in (run / "checkpoints").glob("step_*/manifest.json"):
        manifest.write_text("{}")
    with pytest.raises(RunDirError, match="no verified checkpoint to resume from") as err:
        train(small_config("run.max_num_steps=2"), run)
    assert "rejected:" in str(err.value) and "--restart" in str(err.value)
    train(small_config("run.max_num_steps=2"), run, restart=True)
    assert [r["attempt"] for r in read_records(run / "metrics.jsonl")] == [0, 0, 1, 1]


def test_force_config_resumes_with_a_changed_key_and_records_it(tmp_path):
    run = tmp_path / "run"
    train(small_config("run.max_num_steps=2"), run)
    changed = small_config("run.max_num_steps=4", "algo.lr=0.001")
    with pytest.raises(RunDirError, match="pass --force-config"):
        train(changed, run)
    train(changed, run, force_config=True)
    (resume,) = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert resume["forced_config_changes"] == ["algo.lr: checkpoint=0.0003, now=0.001"]
    # and it takes effect: the lr schedule's base is the config's, not the saved optimizer's
    assert [r["lr"] for r in read_records(run / "metrics.jsonl")] == [3e-4, 3e-4, 1e-3, 1e-3]
    wider = small_config("run.max_num_steps=6", "algo.lr=0.001", "rollout.num_prompts_per_step=2")
    with pytest.raises(RunDirError, match="can never change in a run"):
        train(wider, run, force_config=True)
