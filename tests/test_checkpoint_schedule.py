"""When checkpoints are written: `checkpoint.save_period`, `checkpoint.every_s`, and a due
checkpoint deferred (not waited for) while the previous write is still in progress."""

from __future__ import annotations

import shutil
import threading

import pytest
from helpers import read_records, small_config
from test_determinism import fingerprint

from asyncrl.checkpoint.schedule import CheckpointSchedule
from asyncrl.checkpoint.store import CheckpointStore
from asyncrl.checkpoint.writer import CheckpointWriter
from asyncrl.cli.audit import audit_run_dir
from asyncrl.config.base import ConfigError
from asyncrl.train import trainer as trainer_module
from asyncrl.train.trainer import train


def schedule(save_period: int = 3, every_s: float = 0.0, when_busy: str = "defer"):
    return CheckpointSchedule(save_period, every_s, when_busy, last_saved_s=0.0)  # type: ignore[arg-type]


def test_a_checkpoint_falls_due_every_save_period_steps():
    s = schedule(save_period=3)
    assert [s.decide(t, now_s=0.0, writing=False)[0] for t in range(1, 8)] == [
        "none", "none", "save", "none", "none", "save", "none",
    ]  # fmt: skip


def test_every_s_counts_wall_time_from_the_last_checkpoint_whatever_saved_it():
    s = schedule(save_period=1000, every_s=60.0)
    assert s.decide(1, now_s=59.9, writing=False)[0] == "none"
    assert s.decide(2, now_s=60.0, writing=False)[0] == "save"
    assert s.due(2, now_s=60.0) == "every_s"
    s.saved(now_s=60.0)
    assert s.decide(3, now_s=100.0, writing=False)[0] == "none"  # 40 s since the last
    s.saved(now_s=100.0)  # e.g. the save_period's: the wall-clock period restarts
    assert s.decide(4, now_s=150.0, writing=False)[0] == "none"
    assert s.decide(5, now_s=160.0, writing=False)[0] == "save"


def test_a_checkpoint_due_during_a_write_is_deferred_once_and_written_when_the_write_ends():
    s = schedule(save_period=3)
    assert s.decide(3, 0.0, writing=False)[0] == "save"
    assert s.saved(0.0) == {}
    assert s.decide(6, 0.0, writing=True) == ("defer", "save_period")  # the caller says so, once
    assert (s.deferred_step, s.deferred_reason) == (6, "save_period")
    assert s.decide(7, 0.0, writing=True)[0] == "none"  # still deferred, not said again
    assert s.decide(8, 0.0, writing=False)[0] == "save"  # the first boundary after the write
    assert s.saved(0.0) == {"deferred_from": 6, "folded_periods": 0}
    assert s.decide(9, 0.0, writing=False)[0] == "save"  # the period itself is unchanged


def test_a_period_passed_while_a_checkpoint_is_deferred_is_folded_into_it_and_counted():
    s = schedule(save_period=2)
    assert s.decide(2, 0.0, writing=True) == ("defer", "save_period")
    assert [s.decide(t, 0.0, writing=True)[0] for t in (3, 4, 5, 6)] == ["none"] * 4
    assert s.decide(7, 0.0, writing=False)[0] == "save"
    assert s.saved(0.0) == {"deferred_from": 2, "folded_periods": 2}  # steps 4 and 6
    assert s.decide(8, 0.0, writing=True) == ("defer", "save_period")  # counted afresh
    assert s.saved(0.0) == {"deferred_from": 8, "folded_periods": 0}


def test_an_every_s_checkpoint_due_during_a_write_is_deferred_too():
    s = schedule(save_period=1000, every_s=10.0)
    assert s.decide(1, now_s=11.0, writing=True) == ("defer", "every_s")
    assert s.decide(2, now_s=12.0, writing=False) == ("save", "every_s")


def test_with_when_busy_wait_a_due_checkpoint_is_written_at_its_step_even_during_a_write():
    s = schedule(save_period=3, when_busy="wait")
    assert s.decide(6, 0.0, writing=True)[0] == "save"
    assert s.saved(0.0) == {}


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("checkpoint.every_s=-1", "checkpoint.every_s"),
        ("checkpoint.when_busy=never", "checkpoint.when_busy"),
    ],
)
def test_bad_schedule_keys_are_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        small_config(override).validate()


DET = (
    "run.deterministic=true", "run.max_num_steps=10", "checkpoint.save_period=3",
    "checkpoint.keep_last=10", "rollout.groups_per_batch=2", "rollout.max_trajectory_age_steps=1",
)  # fmt: skip


def hold_step_3s_write_until_step_7(monkeypatch) -> list[int]:
    """The write of step 3's checkpoint does not end before the trainer has trained step 7 (or
    until anything waits for the writer: `when_busy=wait` and the final checkpoint do), and it
    has ended when the trainer reaches the boundary of step 7: a disk slower than training,
    placed by state. Returns the list to which each wait for a write still running adds the
    trainer's step then (the state that says whether the trainer waited for the disk)."""
    release = threading.Event()
    waited: list[int] = []
    trainers: list = []
    save, train_step, wait = (
        CheckpointStore.save,
        trainer_module.Trainer.train_step,
        CheckpointWriter.wait,
    )

    def held_save(self, step, *args, **kwargs):
        if step == 3:
            assert release.wait(timeout=300), "step 7 was never trained"
        return save(self, step, *args, **kwargs)

    def released_after_step_7(self):
        if not trainers:
            trainers.append(self)
        record = train_step(self)
        if self.step == 7:
            release.set()
            if self.writer._thread is not None:
                self.writer._thread.join()  # (not `wait`: its error is for the trainer)
        return record

    def released_when_waited_for(self):
        if self._thread is not None:  # a write is in progress (else: `submit`'s own check)
            if self._thread.is_alive():
                waited.append(trainers[0].step if trainers else -1)
            release.set()
        return wait(self)

    monkeypatch.setattr(CheckpointStore, "save", held_save)
    monkeypatch.setattr(trainer_module.Trainer, "train_step", released_after_step_7)
    monkeypatch.setattr(CheckpointWriter, "wait", released_when_waited_for)
    return waited


def events(run_dir, kind):
    return [e for e in read_records(run_dir / "events.jsonl") if e["event"] == kind]


def test_a_slow_write_defers_the_next_checkpoint_and_the_run_and_its_resume_stay_bitwise(
    tmp_path, monkeypatch
):
    reference = tmp_path / "reference"
    train(small_config(*DET), reference)  # every write quick: checkpoints at 3, 6, 9, 10
    reasons = [(e["step"], e["reason"]) for e in events(reference, "checkpoint")]
    assert reasons == [(3, "save_period"), (6, "save_period"), (9, "save_period"), (10, "final")]

    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        waited = hold_step_3s_write_until_step_7(patch)
        train(small_config(*DET, "checkpoint.when_busy=defer"), run)
    deferrals = events(run, "checkpoint_deferred")
    first = deferrals[0]
    assert first == {**first, "step": 6, "writing_step": 3, "reason": "save_period"}
    saved = {e["step"]: e for e in events(run, "checkpoint")}
    late = [e for e in saved.values() if "deferred_from" in e]
    # every deferral ends in one checkpoint (a later one may be deferred too, on a busy machine)
    assert [e["deferred_from"] for e in late] == [d["step"] for d in deferrals], saved.keys()
    assert 6 not in saved
    assert late[0] == {**late[0], "step": 7, "reason": "save_period", "folded_periods": 0}
    # it was released at step 7; only the final checkpoint (step 10) waits for the writer
    assert [s for s in waited if s < 10] == [], "the trainer waited for step 3's write"
    # what was trained does not depend on when the checkpoints were written
    assert fingerprint(run) == fingerprint(reference)
    assert audit_run_dir(run).ok

    # the deferred checkpoint is a whole cut: resumed from it, the run ends bitwise the same
    for later in (run / "checkpoints").glob("step_*"):
        if int(later.name.split("_")[1]) > late[0]["step"]:
            shutil.rmtree(later)
    shutil.rmtree(run / "final_model")
    train(small_config(*DET), run)
    (resume,) = events(run, "resume")
    assert resume["from_step"] == late[0]["step"]
    assert fingerprint(run) == fingerprint(reference)
    assert audit_run_dir(run).ok


def test_with_when_busy_wait_the_same_slow_write_is_waited_for_and_nothing_is_deferred(
    tmp_path, monkeypatch
):
    run = tmp_path / "run"
    waited = hold_step_3s_write_until_step_7(monkeypatch)
    train(small_config(*DET, "run.max_num_steps=7", "checkpoint.when_busy=wait"), run)
    assert waited, "the trainer never waited for the write"  # the negative control of `defer`
    assert not events(run, "checkpoint_deferred")
    assert [e["step"] for e in events(run, "checkpoint")] == [3, 6, 7]


def test_every_s_writes_checkpoints_by_wall_time_between_the_save_periods(tmp_path):
    run = tmp_path / "run"
    train(
        small_config(
            "run.max_num_steps=3", "checkpoint.save_period=100", "checkpoint.every_s=1e-9"
        ),
        run,
    )
    assert [(e["step"], e["reason"]) for e in events(run, "checkpoint")] == [
        (1, "every_s"), (2, "every_s"), (3, "every_s"),
    ]  # fmt: skip
