"""A checkpoint's state is staged into one set of reused CPU buffers, the big parts in the
background while the next step runs: an optimizer step waits for that copy, so what is written
is the state at the cut."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_snapshot import assert_same, tiny_trainer

import asyncrl.checkpoint.staging as staging
from asyncrl.checkpoint.snapshot import MODEL_FILE, tensor_files
from asyncrl.checkpoint.staging import StagingArea


def buffers(cut) -> dict[str, int]:
    return {f"{f}:{n}": t.data_ptr() for f in tensor_files() for n, t in cut.tensors[f].items()}


def test_a_second_save_reuses_the_staging_buffers_of_the_first(tmp_path):
    trainer = tiny_trainer(tmp_path)
    trainer.staging = StagingArea(keep_buffers=True)  # what pinned (GPU-staging) buffers get
    first = trainer.capture()[0]
    first.wait_staged()
    with pytest.raises(RuntimeError, match="still reads the staging buffers"):
        trainer.capture()  # the first cut is not written yet: its buffers are not free
    first_buffers = buffers(first)
    first.release()
    second = trainer.capture()[0]
    second.wait_staged()
    model = [k for k in first_buffers if k.startswith(MODEL_FILE)]
    assert model and all(buffers(second)[k] == first_buffers[k] for k in model)
    optimizer = [k for k in first_buffers if "/optimizer/state/" in k]
    assert optimizer and all(buffers(second)[k] == first_buffers[k] for k in optimizer)
    live = trainer.parts.policy.model.state_dict()
    assert all(second.tensors[MODEL_FILE][n].data_ptr() != live[n].data_ptr() for n in live
               if n in second.tensors[MODEL_FILE])  # fmt: skip


def test_an_optimizer_step_waits_for_the_background_copy_and_the_cut_is_the_state_before_it(
    monkeypatch,
):
    release = threading.Event()
    real = staging._copy_all

    def slow_copy(copies):
        release.wait(timeout=30)
        real(copies)

    monkeypatch.setattr(staging, "_copy_all", slow_copy)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 64)).sum().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cut = StagingArea().stage({"model": model.state_dict()}, {}, background=("model",))
    stepped = threading.Event()
    thread = threading.Thread(target=lambda: (optimizer.step(), stepped.set()))
    thread.start()
    job = cut.job
    assert job is not None
    while not job._waiters:  # the step reached the hook and waits there (a state, not a time)
        assert thread.is_alive() and not stepped.is_set(), "the step did not wait for the copy"
        time.sleep(0.001)
    assert not stepped.is_set() and torch.equal(model.weight, before["weight"])
    release.set()
    assert stepped.wait(30)
    thread.join()
    assert job.hook_wait_s > 0
    assert_same(cut.snapshot().parts["model"], before)
    assert not torch.equal(model.weight, before["weight"])  # the control: the step did run
    waited = job.hook_wait_s
    optimizer.step()  # nothing is staging: no wait
    assert not staging._ACTIVE and job.hook_wait_s == waited


def test_a_failed_background_copy_frees_the_optimizer_and_fails_the_write(monkeypatch):
    def broken(copies):
        raise MemoryError("no room for the staging copy")

    monkeypatch.setattr(staging, "_copy_all", broken)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    cut = StagingArea().stage({"model": model.state_dict()}, {}, background=("model",))
    optimizer.step()  # does not hang
    with pytest.raises(MemoryError, match="no room"):
        cut.files()


def test_buffers_staging_cpu_tensors_are_given_back_once_their_cut_is_written(tmp_path):
    """By default a CPU run keeps no staging copy between saves (12 bytes per parameter it
    would otherwise hold for the whole run); the cut is unreadable after its release."""
    trainer = tiny_trainer(tmp_path)
    cut = trainer.capture()[0]
    cut.wait_staged()
    params = trainer.parts.policy.num_parameters()
    assert trainer.staging.num_bytes >= 12 * params  # fp32 weights and two AdamW moments
    cut.release()
    assert trainer.staging.num_bytes == 0 and cut.tensors[MODEL_FILE] == {}
    trainer.capture()[0].wait_staged()  # and the next save stages afresh
