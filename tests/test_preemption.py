"""Preemption notices and deadlines (`asyncrl.core.preemption`, issue 43): the pure rules, by
hand-computed cases."""

from __future__ import annotations

import pytest

from asyncrl.core.preemption import (
    RAY_DRAIN,
    Drain,
    DrainPlan,
    Measured,
    Notice,
    estimate_s,
    first_deadline,
    new_drains,
    notice_deadline,
    outcome,
    plan_drain,
    plan_stop,
)
from asyncrl.train.signals import StopRequest


def test_each_signal_announces_its_deadline():
    assert notice_deadline("SIGTERM", 30.0, 90.0) == 30.0
    assert notice_deadline("SIGUSR1", 30.0, 90.0) == 90.0
    assert notice_deadline("SIGUSR2", 30.0, 90.0) == 90.0
    assert notice_deadline("SIGINT", 30.0, 90.0) is None


def test_the_first_deadline_wins_and_a_deadline_beats_none():
    usr1 = Notice("SIGUSR1", received_s=100.0, deadline_s=90.0)  # at 190
    term = Notice("SIGTERM", received_s=150.0, deadline_s=30.0)  # at 180
    stop = Notice("SIGINT", received_s=10.0, deadline_s=None)
    assert first_deadline([usr1, term, stop]) is term
    assert first_deadline([stop, usr1]) is usr1
    assert first_deadline([stop]) is stop
    assert first_deadline([]) is None


def test_a_checkpoint_is_estimated_at_the_slowest_rate_measured():
    measured = [Measured(1000, 2.0), Measured(1000, 4.0), Measured(2000, 2.0)]  # 500, 250, 1000 B/s
    assert estimate_s(measured) == pytest.approx(8.0)  # the last one's 2000 B at 250 B/s
    assert estimate_s(measured, 500) == pytest.approx(2.0)
    assert estimate_s([]) is None


def test_the_plan_says_whether_the_checkpoint_fits_before_the_deadline():
    notice = Notice("SIGTERM", received_s=100.0, deadline_s=10.0)
    fits = plan_stop(notice, now_s=101.0, estimate=8.5)
    assert (fits.left_s, fits.fits) == (pytest.approx(9.0), True)
    assert "it fits" in fits.line(notice, 12, 10)
    late = plan_stop(notice, now_s=103.0, estimate=8.5)
    assert late.fits is False
    assert "does NOT fit" in late.line(notice, 12, 10) and "step 10's" in late.line(notice, 12, 10)
    unknown = plan_stop(notice, now_s=101.0, estimate=None)
    assert unknown.fits is None and "no checkpoint of this run measured" in unknown.line(
        notice, 0, None
    )
    ctrl_c = Notice("SIGINT", received_s=100.0, deadline_s=None)
    assert plan_stop(ctrl_c, 101.0, 3.0).fits is None


def test_the_outcome_is_measured_from_the_notice_to_verified():
    notice = Notice("SIGTERM", received_s=100.0, deadline_s=10.0)
    assert outcome(notice, 107.5) == {
        "notice_to_durable_s": pytest.approx(7.5), "deadline_s": 10.0, "met": True,
    }  # fmt: skip
    assert outcome(notice, 110.5)["met"] is False
    assert outcome(Notice("SIGINT", 100.0, None), 101.0)["met"] is None


def test_a_stop_request_keeps_every_notice_and_the_configs_deadlines():
    from asyncrl.train.signals import StopRequest

    stop = StopRequest()
    assert not stop.requested and stop.notice is None
    stop.receive("SIGUSR1", now_s=100.0)  # before the config was read: the defaults
    assert stop.notice.deadline_s == 60.0
    stop.configure(grace_s=10.0, signal_warning_s=90.0)  # then the config's
    assert stop.notice.deadline_s == 90.0  # at 190
    stop.receive("SIGTERM", now_s=150.0)  # Slurm's end of job: at 160, earlier
    assert stop.requested and stop.signal_name == "SIGUSR1"
    assert (stop.notice.source, stop.notice.deadline_at) == ("SIGTERM", 160.0)
    assert [n.source for n in stop.notices] == ["SIGUSR1", "SIGTERM"]


def test_the_benchmarks_last_line_names_each_time_and_the_deadlines_met():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from preemption import Result, result_line

    results = [Result("25M", "full", 25, 4, 1.25, True, True, 10),
               Result("300M", "full", 300, 5, 31.0, False, False, 10)]  # fmt: skip
    assert result_line("preemption", results, 30.0) == (
        "preemption: notice_to_durable_s=1.2,31.0 deadline_s=30 met=1/2"
    )


def test_each_drain_is_new_once_and_again_after_ray_stops_listing_it():
    seen: set[str] = set()
    assert new_drains({"b": 5000, "a": 0}, seen) == [Drain("a", 0), Drain("b", 5000)]
    assert new_drains({"b": 5000, "a": 0}, seen) == []  # the same drains, looked at again
    assert new_drains({"a": 0}, seen) == []  # b was killed (or its drain cancelled)
    assert new_drains({"a": 0, "b": 9000}, seen) == [Drain("b", 9000)]  # b drained again
    assert seen == {"a", "b"}


def test_a_drain_deadline_is_rays_unix_milliseconds_or_none():
    drain = Drain("n1", deadline_ms=1_000_030_000)
    assert drain.left_s(1_000_000_000) == pytest.approx(30.0)
    assert drain.left_s(1_000_040_000) == 0.0  # past: no time left, never negative
    assert Drain("n1", 0).left_s(1_000_000_000) is None
    notice = drain.notice(received_s=7.0, now_ms=1_000_010_000)
    assert notice == Notice(RAY_DRAIN, 7.0, 20.0, "n1")
    assert notice.deadline_at == pytest.approx(27.0)


def test_a_drain_asks_the_trainer_or_the_generation_workers_on_its_node():
    workers = ["w", "t", "w", ""]  # worker 3: a replacement Ray has not placed yet
    assert plan_drain(Drain("w", 0), "t", workers) == DrainPlan(False, (0, 2))
    assert plan_drain(Drain("t", 0), "t", workers) == DrainPlan(True, ())  # the run stops
    assert plan_drain(Drain("x", 0), "t", workers) == DrainPlan(False, ())
    assert plan_drain(Drain("", 0), "t", workers) == DrainPlan(False, ())


def test_a_drain_notice_keeps_rays_deadline_when_the_config_is_read():
    stop = StopRequest()
    stop.add(Notice(RAY_DRAIN, 1.0, 12.0, "n1"))
    stop.receive("SIGTERM", now_s=2.0)
    stop.configure(grace_s=5.0, signal_warning_s=60.0)
    assert [(n.source, n.deadline_s) for n in stop.notices] == [(RAY_DRAIN, 12.0), ("SIGTERM", 5.0)]
    assert stop.notice is not None and stop.notice.source == "SIGTERM"  # at 7.0, before 13.0
    assert stop.signal_name == RAY_DRAIN  # the first notice names the stop


def test_inspect_names_the_newest_kept_rollouts_after_the_last_notice(tmp_path):
    """A notice may keep rollouts beside step 3 while step 6's write is in flight, then again
    beside 6 once it is verified (whose retain deletes the file beside 3): `inspect` names
    the one on disk, the newest, not the first (stop 60's CI failure)."""
    import json

    from asyncrl.cli.inspect import last_preemption, preemption_line

    def kept(step, tokens):
        return {"event": "rollouts_kept", "source": "SIGTERM", "step": step, "cut_step": 7,
                "groups": 4, "partial_groups": 0, "tokens": tokens}  # fmt: skip

    events = [
        {"event": "preemption_notice", "source": "SIGTERM", "step": 2, "deadline_s": 0},
        kept(1, 10),  # an older notice's: not this one's
        {"event": "preemption_notice", "source": "SIGTERM", "step": 7, "deadline_s": 0},
        kept(3, 76),
        kept(6, 77),
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    preempted = last_preemption(tmp_path)
    assert preempted is not None and preempted["kept"]["step"] == 6
    line = preemption_line(preempted)
    assert line.startswith("last preemption: SIGTERM at step 7 (deadline 0 s)")
    assert line.endswith(
        "; kept 4 finished and 0 partial groups (77 tokens) beside step 6's checkpoint"
    )
    del events[-1]  # one keep only: that one
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert preemption_line(last_preemption(tmp_path)).endswith("beside step 3's checkpoint")


def test_a_repeated_signal_never_aborts_the_notices_checkpoint_and_a_third_aborts(monkeypatch):
    """The handler's rules (issue 63): a second same signal before the notice's checkpoint is
    verified is noted, not obeyed (Slurm with torchrun may deliver SIGTERM twice); another
    kind is one more notice; the third same signal aborts by raising `Aborted` in the main
    thread, so the run's cleanup (`finally`, close) still runs. Once the checkpoint is
    verified, a repeat only ends the waits left (`hurry`)."""
    import signal

    from asyncrl.train import signals

    def exits(code):
        raise AssertionError(f"os._exit({code}): no cleanup runs")

    monkeypatch.setattr(signals.os, "_exit", exits)
    stop = StopRequest()
    stop._handle(signal.SIGTERM, None)
    stop._handle(signal.SIGTERM, None)  # the checkpoint goes on
    stop._handle(signal.SIGUSR1, None)
    assert [n.source for n in stop.notices] == ["SIGTERM", "SIGUSR1"]
    assert not stop.hurry.is_set()
    with pytest.raises(signals.Aborted):
        stop._handle(signal.SIGTERM, None)
    # an abort waits for nothing (generation, the shutdown: the review found a wedged call
    # held a thrice-signalled run), and what is left running is not joined at exit
    assert stop.hurry.is_set() and stop.abandoned
    verified = StopRequest()
    verified._handle(signal.SIGINT, None)
    verified.checkpoint_verified()
    verified._handle(signal.SIGINT, None)  # nothing left to lose: the waits end
    assert verified.hurry.is_set() and verified.cut_short_by == "SIGINT"


def test_after_a_notice_the_runs_shutdown_is_given_up_at_the_deadline(capsys):
    """Issue 63, defect 4: every wait until exit is bounded by the deadline, the run's shutdown
    too (an attached server that does not answer its release, a Ray slow to stop). A shutdown
    that never ends is given up once the deadline (less a reserve) comes, and the exit goes on
    (`abandoned`); without a notice the same shutdown is simply run. The blocked shutdown
    never returns by itself, so a wait without a bound would hang this test (its timeout)."""
    import threading
    import time
    from types import SimpleNamespace

    from asyncrl.train.preemption import SHUTDOWN_RESERVE_S, Deadlines, shutdown_by_deadline

    released = threading.Event()
    calls = []

    def shutdown():
        calls.append(threading.current_thread().name)
        released.wait()  # wedged until the test ends

    def trainer(stop):
        return SimpleNamespace(stop=stop, deadlines=Deadlines.__new__(Deadlines),
                               parts=SimpleNamespace(shutdown=shutdown))  # fmt: skip

    stop = StopRequest(grace_s=SHUTDOWN_RESERVE_S + 0.3)
    stop.receive("SIGTERM", now_s=time.monotonic())
    try:
        shutdown_by_deadline(trainer(stop))
        assert stop.abandoned and calls == ["asyncrl-shutdown"]
        assert "given up at the notice's deadline" in capsys.readouterr().out
        # a notice with no deadline (Ctrl-C) or none at all: the shutdown runs to its end
        done = StopRequest()
        released.set()
        shutdown_by_deadline(trainer(done))
        assert not done.abandoned and calls[-1] == threading.current_thread().name
    finally:
        released.set()


def test_the_exit_handlers_are_waited_for_no_longer_than_the_deadline(monkeypatch):
    """`end_now` (a thread was given up): the exit handlers run (Ray's shutdown is one), in a
    thread waited for at most until the notice's deadline; a handler that never returns does
    not hold the exit code back. `os._exit` is recorded instead of ending the test."""
    import atexit
    import os
    import threading
    import time

    from asyncrl.cli import main

    released, ran = threading.Event(), []

    def wedged():
        ran.append(True)
        released.wait()

    class Exited(BaseException):
        pass

    def exits(code):
        raise Exited(code)

    monkeypatch.setattr(atexit, "_run_exitfuncs", wedged)  # not this process's own handlers
    monkeypatch.setattr(os, "_exit", exits)
    stop = StopRequest(grace_s=0.5)
    stop.receive("SIGTERM", now_s=time.monotonic())
    try:
        with pytest.raises(Exited) as ended:
            main.end_now(75, stop)
        assert ended.value.args == (75,) and ran == [True]
    finally:
        released.set()
