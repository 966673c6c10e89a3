"""Resume in process: continuing a finished run, config checks, what the resume event says."""

from __future__ import annotations

import pytest
from helpers import read_records, small_config

from asyncrl.audit import audit_run_dir
from asyncrl.train.rundir import RunDirError
from asyncrl.train.trainer import train


def test_a_finished_run_extended_with_more_steps_resumes_from_its_final_checkpoint(tmp_path):
    run = tmp_path / "run"
    train(small_config("run.max_num_steps=4", "checkpoint.save_period=2"), run)
    summary = train(small_config("run.max_num_steps=7", "checkpoint.save_period=2"), run)
    assert "7 steps in" in summary
    metrics = read_records(run / "metrics.jsonl")
    assert [(r["step"], r["attempt"]) for r in metrics] == [
        (0, 0), (1, 0), (2, 0), (3, 0), (4, 1), (5, 1), (6, 1)
    ]  # fmt: skip
    (resume,) = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert resume["from_step"] == 4 and resume["policy"] == "lossless"
    assert resume["config_changes"] == {"run.max_num_steps": [4, 7]}
    assert audit_run_dir(run).ok
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept == ["step_000004", "step_000006", "step_000007"]  # keep_last=3


def test_a_resume_with_a_changed_semantic_key_is_refused_naming_it(tmp_path):
    run = tmp_path / "run"
    train(small_config("run.max_num_steps=2"), run)
    changed = small_config("run.max_num_steps=4", "rollout.num_prompts_per_step=5", "run.seed=3")
    with pytest.raises(RunDirError) as err:
        train(changed, run)
    message = str(err.value)
    assert "cannot resume step 2 with a different config" in message
    assert "rollout.num_prompts_per_step: checkpoint=4, now=5" in message
    assert "run.seed: checkpoint=0, now=3" in message
    assert len(read_records(run / "metrics.jsonl")) == 2  # nothing trained


def test_wall_time_keeps_counting_across_attempts(tmp_path):
    run = tmp_path / "run"
    train(small_config("run.max_num_steps=3"), run)
    train(small_config("run.max_num_steps=5"), run)
    wall = [r["wall_s"] for r in read_records(run / "metrics.jsonl")]
    assert wall == sorted(wall)
