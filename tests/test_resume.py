"""Resume in process: continuing a finished run, config checks, what the resume event says."""

from __future__ import annotations

import pytest
from helpers import read_records, small_config, train_and_report

from asyncrl.cli.audit import audit_run_dir
from asyncrl.train.rundir import RunDirError
from asyncrl.train.trainer import train


def test_a_finished_run_extended_with_more_steps_resumes_from_its_final_checkpoint(tmp_path):
    run = tmp_path / "run"
    train(small_config("run.max_num_steps=4", "checkpoint.save_period=2"), run)
    summary = train_and_report(small_config("run.max_num_steps=7", "checkpoint.save_period=2"), run)
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


def test_a_corrupt_newest_checkpoint_falls_back_and_is_set_aside_when_training_passes_it(tmp_path):
    run = tmp_path / "run"
    train(small_config("run.max_num_steps=4", "checkpoint.save_period=2"), run)
    state = run / "checkpoints" / "step_000004" / "state.json"
    state.write_bytes(state.read_bytes().replace(b'"step": 4', b'"step": 5', 1))
    summary = train_and_report(small_config("run.max_num_steps=6", "checkpoint.save_period=2"), run)
    assert "6 steps in" in summary
    (resume,) = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert resume["from_step"] == 2
    assert "state.json: SHA-256" in resume["rejected_checkpoints"][0]
    assert list((run / "checkpoints").glob(".rejected-step_000004-*"))
    assert audit_run_dir(run).ok


def test_a_second_launch_on_a_run_dir_in_use_is_refused_naming_the_holder(tmp_path):
    import os

    from asyncrl.train.rundir import open_run_dir

    config = small_config()
    held = open_run_dir(tmp_path / "run", config)
    with pytest.raises(
        RunDirError, match=rf"in use by another asyncrl process \(pid {os.getpid()}\)"
    ):
        open_run_dir(tmp_path / "run", config)
    held.lock.close()
    open_run_dir(tmp_path / "run", config).lock.close()  # free again once the holder is gone


def test_a_launch_empties_the_scratch_an_earlier_killed_launch_left(tmp_path):
    """vLLM's model copy and the ranks' rendezvous live in `DIR/.scratch` (a SIGKILL runs no
    clean-up): the next launch removes them under the run dir's lock."""
    from asyncrl.train.rundir import SCRATCH_DIR, open_run_dir

    config = small_config()
    open_run_dir(tmp_path / "run", config).lock.close()
    left = tmp_path / "run" / SCRATCH_DIR / "asyncrl-vllm-x" / "model.safetensors"
    left.parent.mkdir(parents=True)
    left.write_bytes(b"weights of a killed launch")
    opened = open_run_dir(tmp_path / "run", config)
    try:
        assert not (tmp_path / "run" / SCRATCH_DIR).exists()
    finally:
        opened.lock.close()


def test_a_resume_decodes_the_checkpoint_once_and_keeps_no_copy_of_it(tmp_path, monkeypatch):
    import gc
    import weakref

    import asyncrl.checkpoint.snapshot as snapshot_module
    import asyncrl.train.resume as resume_module
    from asyncrl.train.rundir import open_run_dir
    from asyncrl.train.trainer import Trainer

    run = tmp_path / "run"
    train(small_config("run.max_num_steps=2"), run)
    files_read: list[int] = []
    read_tensors = snapshot_module.read_tensors

    def counting(f, num_bytes):
        files_read.append(num_bytes)
        return read_tensors(f, num_bytes)

    monkeypatch.setattr(snapshot_module, "read_tensors", counting)
    decoded: list[weakref.ref] = []
    decode = resume_module.decode

    def remembering(verified):
        snapshot = decode(verified)
        decoded.append(weakref.ref(snapshot))
        decoded.extend(weakref.ref(t) for t in snapshot.parts["model"].values())
        return snapshot

    monkeypatch.setattr(resume_module, "decode", remembering)
    config = small_config("run.max_num_steps=3")
    opened = open_run_dir(run, config)
    assert files_read == []  # the config comparison read state.json only
    trainer = Trainer(config, opened)
    try:
        trainer.resume()
        assert len(files_read) == 3  # model, state and rollout .safetensors, once each
        gc.collect()
        assert len(decoded) > 1 and all(ref() is None for ref in decoded)
    finally:
        trainer.close()
        trainer.parts.shutdown()
        opened.lock.close()
    (resume,) = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert resume["from_step"] == 2 and 0 < resume["load_s"] < 60


def test_a_resume_on_changed_data_is_refused_naming_the_file_and_both_counts(tmp_path):
    """I8: the ordinals of a checkpoint index its rows; appended or edited rows would make the
    resumed run train other prompts under the same ordinals (and audit could not tell)."""
    import json

    data = tmp_path / "rows.jsonl"
    rows = [{"prompt": f"{d}{d + 1}=", "answer": f"{d}{d + 1}"} for d in range(8)] * 8  # 64 rows

    def write(rows):
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def config(steps):
        return small_config("data.task=jsonl", f"data.path={data}", f"run.max_num_steps={steps}")

    run = tmp_path / "run"
    write(rows)
    train(config(2), run)
    # 20 rows appended, with a character the tiny preset's vocabulary lacks (before: a shape
    # traceback from the model's state dict, or with known characters a silent resume)
    write(rows + [{"prompt": "9x=", "answer": "x9"}] * 20)
    with pytest.raises(RunDirError) as err:
        train(config(4), run)
    message = str(err.value)
    assert f"cannot resume step 2 on other data (data.path={data})" in message
    assert "cut on 64 examples" in message and "the data now has 84" in message
    write([{**rows[0], "answer": "99"}, *rows[1:]])  # the same count, one answer edited
    with pytest.raises(RunDirError, match=r"cut on 64 examples .* the data now has 64"):
        train(config(4), run)
    assert len(read_records(run / "metrics.jsonl")) == 2  # nothing trained
    write(rows)  # negative control: the original rows resume and finish
    train(config(4), run)
    assert [r["step"] for r in read_records(run / "metrics.jsonl")] == [0, 1, 2, 3]
    write(rows + rows[:4])  # forced: trains on, the change on the record
    train(config(5), run, force_config=True)
    resume = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"][-1]
    (forced,) = resume["forced_config_changes"]
    assert forced.startswith("data: the checkpoint was cut on 64 examples")
    assert "the data now has 68" in forced
    # forced onto rows with a character the tiny preset's vocabulary lacks: an I6 message
    # with the shapes (it was a RuntimeError traceback from load_state_dict)
    write(rows + [{"prompt": "9x=", "answer": "x9"}] * 20)
    with pytest.raises(
        RunDirError,
        match=r"model.embed_tokens.weight is \[14, 128\] there, "
        r"\[16, 128\] here.*tiny preset's vocabulary is the data's characters",
    ):
        train(config(6), run, force_config=True)


def test_a_resume_reads_no_record_file_for_its_attempt_and_wall_clock(tmp_path, monkeypatch):
    """What a launch needs lives in `run.json` (launches so far) and in the checkpoint (the
    wall-clock offset): it used to read events.jsonl and metrics.jsonl whole every time."""
    import json

    import asyncrl.train.records as records_module
    import asyncrl.train.rundir as rundir_module

    run = tmp_path / "run"
    train(small_config("run.max_num_steps=2"), run)
    assert json.loads((run / "run.json").read_text())["launches"] == 1

    def no_reading(path):
        raise AssertionError(f"read {path}")

    monkeypatch.setattr(rundir_module, "iter_jsonl", no_reading)
    monkeypatch.setattr(records_module, "iter_jsonl", no_reading)
    train(small_config("run.max_num_steps=4"), run)
    records = {r["step"]: r for r in read_records(run / "metrics.jsonl")}
    assert records[2]["attempt"] == 1 and records[2]["wall_s"] > records[1]["wall_s"]
    assert json.loads((run / "run.json").read_text())["launches"] == 2
