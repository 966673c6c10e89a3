"""`run.share_cores`: a side running alone takes the other side's threads (models/threads.py).

The rule is plain arithmetic (`threads_for`); `CoreShare` is checked with real threads, each
asking torch its own count (`torch.get_num_threads` is the calling thread's), and in a real run,
whose collector thread must have been handed both cores while the trainer waited."""

from __future__ import annotations

import contextlib
import copy
import pickle
import threading

import pytest
import torch
from helpers import small_config

from asyncrl.models.threads import CoreShare, threads_for
from asyncrl.train.components import core_share
from asyncrl.train.trainer import train


def test_a_side_alone_takes_the_other_sides_threads_and_both_busy_split_them():
    assert threads_for(busy=1, per_side=1, sides=2, cores=2) == 2
    assert threads_for(busy=2, per_side=1, sides=2, cores=2) == 1
    assert threads_for(busy=1, per_side=4, sides=2, cores=6) == 6  # no more than the cores
    assert threads_for(busy=1, per_side=1, sides=2, cores=1) == 1
    assert threads_for(busy=2, per_side=8, sides=2, cores=16) == 8


def in_thread(work):
    """`work()`'s result, run in a new thread (its own torch thread count)."""
    out = []
    thread = threading.Thread(target=lambda: out.append(work()))
    thread.start()
    thread.join()
    return out[0]


@contextlib.contextmanager
def other_side_busy(share):
    """Another thread marked busy for the block; yields [its count once busy]."""
    busy, release, seen = threading.Event(), threading.Event(), []

    def other_side():
        with share.busy():
            seen.append(torch.get_num_threads())
            busy.set()
            release.wait()

    thread = threading.Thread(target=other_side)
    thread.start()
    busy.wait()
    try:
        yield seen
    finally:
        release.set()
        thread.join()


def test_the_count_follows_what_is_busy_in_each_thread():
    share = CoreShare(per_side=1, cores=2)

    def alone_then_shared():
        mine, others = [], []
        with share.busy():
            mine.append(torch.get_num_threads())  # alone: both cores
            with other_side_busy(share) as other:
                share.apply()  # what a forward pre-hook does at the next pass
                mine.append(torch.get_num_threads())
                others += other
            share.apply()
            mine.append(torch.get_num_threads())
            with share.idle(), other_side_busy(share) as other:  # a waiting side
                others += other
        return mine, others

    before = torch.get_num_threads()
    assert in_thread(alone_then_shared) == ([2, 1, 2], [1, 2])
    assert torch.get_num_threads() == before  # the main thread's count is its own


def test_without_sharing_a_busy_thread_keeps_its_own_count():
    share = CoreShare(per_side=1, sharing=False, cores=2)

    def alone():
        torch.set_num_threads(2)  # what a new thread's MKL products would take
        with share.busy():
            return torch.get_num_threads()

    assert in_thread(alone) == 1
    untouched = CoreShare(per_side=0, cores=2)  # run.torch_threads=0: torch's default

    def default():
        torch.set_num_threads(2)
        with untouched.busy():
            return torch.get_num_threads()

    assert in_thread(default) == 2


def test_the_hook_applies_the_share_before_each_pass_and_a_copy_keeps_it():
    share = CoreShare(per_side=1, cores=2)
    model = torch.nn.Linear(2, 2)
    share.watch(model)
    twin = copy.deepcopy(model)  # as the engine, the evaluator and the reference copy it

    def passes():
        with share.busy():
            alone = torch.get_num_threads()
            with other_side_busy(share):
                twin(torch.zeros(1, 2))
                return alone, torch.get_num_threads()

    assert in_thread(passes) == (2, 1)
    sent = pickle.loads(pickle.dumps(model))  # to another process (a Ray worker's spec)
    (hook,) = sent._forward_pre_hooks.values()
    assert hook.share is None  # that process's threads are its own
    sent(torch.zeros(1, 2))


def test_sharing_is_off_where_timing_or_other_processes_would_decide():
    assert core_share(small_config()).sharing
    assert not core_share(small_config("run.share_cores=false")).sharing
    assert not core_share(small_config("run.deterministic=true")).sharing


@pytest.mark.skipif(CoreShare(1).cores < 2, reason="needs 2 cores to hand over")
@pytest.mark.parametrize("sharing", [True, False])
def test_a_run_hands_the_waiting_trainers_core_to_generation(tmp_path, monkeypatch, sharing):
    """The trainer waits for step 0's rollouts: generation, alone then, must run some decode
    passes on both cores (the collector's thread applies its share at each pass, through the
    hook on the policy's copy in the engine). The control, `run.share_cores=false`: never."""
    seen: list[int] = []
    apply = CoreShare.apply

    def recorded(self):
        apply(self)
        if threading.current_thread().name == "asyncrl-collector":
            seen.append(torch.get_num_threads())

    monkeypatch.setattr(CoreShare, "apply", recorded)
    train(small_config("run.max_num_steps=3", f"run.share_cores={sharing}"), tmp_path / "run")
    assert len(seen) > 10  # a hook call per decode pass
    assert (2 in seen) is sharing
    assert 1 in seen or sharing
