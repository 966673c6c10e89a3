"""The fault spec the crash tests place their kills with: stages, pass counts and facts (pure,
milliseconds; the crash tests then kill real processes with it)."""

from __future__ import annotations

import threading

import pytest
import torch

from asyncrl.faults import POINTS, Stage, Trigger, cut_facts, fault_facts, parse


def walk(spec: str, passes: list[tuple[str, dict]]) -> list[int]:
    """The indices of `passes` at which `spec` would kill (at most one)."""
    trigger = Trigger(parse(spec))
    return [i for i, (name, facts) in enumerate(passes) if trigger.passed(name, facts)]


def test_a_plain_point_kills_at_its_first_pass_and_a_count_at_that_pass():
    passes = [("engine.decode_step", {})] * 5
    assert walk("engine.decode_step", passes) == [0]
    assert walk("engine.decode_step:4", passes) == [3]
    assert walk("engine.decode_step:6", passes) == []  # never reached: no kill at all


def test_a_condition_counts_only_the_passes_in_that_state():
    steps = [("train.weights_published", {"step": t}) for t in range(8)]
    assert walk("train.weights_published[step=5]", steps) == [5]
    cuts = [
        ("checkpoint.parent_fsynced", {"step": 2, "in_flight": 0, "partial_tokens": 0}),
        ("checkpoint.parent_fsynced", {"step": 4, "in_flight": 3, "partial_tokens": 0}),
        ("checkpoint.parent_fsynced", {"step": 6, "in_flight": 2, "partial_tokens": 40}),
        ("checkpoint.parent_fsynced", {"step": 8, "in_flight": 2, "partial_tokens": 9}),
    ]
    assert walk("checkpoint.parent_fsynced[in_flight]", cuts) == [1]
    assert walk("checkpoint.parent_fsynced[in_flight,partial_tokens]", cuts) == [2]
    assert walk("checkpoint.parent_fsynced[partial_tokens]:2", cuts) == [3]
    assert walk("checkpoint.parent_fsynced[step=6,partial_tokens=40]", cuts) == [2]


def test_a_later_stage_counts_only_after_the_earlier_one_was_reached():
    passes = [
        ("engine.decode_step", {}),
        ("engine.decode_step", {}),
        ("checkpoint.parent_fsynced", {"partial_tokens": 0}),
        ("engine.decode_step", {}),
        ("checkpoint.parent_fsynced", {"partial_tokens": 12}),
        ("engine.decode_step", {}),
        ("engine.decode_step", {}),
    ]
    spec = "checkpoint.parent_fsynced[partial_tokens]>engine.decode_step"
    assert walk(spec, passes) == [5]
    assert walk(spec + ":2", passes) == [6]


def test_facts_come_from_the_call_and_from_the_calling_threads_context(monkeypatch):
    from asyncrl import faults

    kills = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: kills.append(sig))
    monkeypatch.setattr(faults, "_TRIGGER", Trigger(parse("checkpoint.file_written[step=6]")))

    def write(step: int) -> None:  # as the checkpoint writer's thread does
        with fault_facts(step=step, in_flight=1):
            faults.fault_point("checkpoint.file_written")

    for step in (3, 9):
        thread = threading.Thread(target=write, args=(step,))
        thread.start()
        thread.join()
    with fault_facts(step=6):  # this thread's context, not another's
        thread = threading.Thread(target=faults.fault_point, args=("checkpoint.file_written",))
        thread.start()
        thread.join()
    assert kills == []
    faults.fault_point("checkpoint.file_written", step=6)  # a fact of the call itself
    assert kills == [faults.signal.SIGKILL]
    monkeypatch.setattr(faults, "_TRIGGER", Trigger(parse("checkpoint.file_written[step=6]")))
    thread = threading.Thread(target=write, args=(6,))  # a fact of the thread's context
    thread.start()
    thread.join()
    assert kills == [faults.signal.SIGKILL] * 2


def test_a_rank_above_zero_counts_only_the_rank_points(monkeypatch):
    """Every rank inherits ASYNCRL_FAULT: `train.backward[step=7]` (which ranks > 0 also pass)
    is for rank 0; `rank.step_done` is for the others."""
    from asyncrl import faults

    kills = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: kills.append(sig))
    for other_rank, expected in ((True, []), (False, [faults.signal.SIGKILL])):
        monkeypatch.setattr(faults, "_OTHER_RANK", other_rank)
        monkeypatch.setattr(faults, "_TRIGGER", Trigger(parse("train.backward[step=7]")))
        kills.clear()
        with fault_facts(step=7):
            faults.fault_point("train.backward")
        assert kills == expected
    monkeypatch.setattr(faults, "_OTHER_RANK", True)
    monkeypatch.setattr(faults, "_TRIGGER", Trigger(parse("rank.step_done[step=5]")))
    kills.clear()
    faults.fault_point("rank.step_done", step=5)
    assert kills == [faults.signal.SIGKILL]


def test_bad_specs_are_refused_naming_the_point_or_the_fact():
    with pytest.raises(ValueError, match=r"unknown point 'engine\.decode'"):
        parse("engine.decode")
    with pytest.raises(ValueError, match=r"decode_step knows no fact 'step'; it knows: none"):
        parse("engine.decode_step[step=3]")
    with pytest.raises(ValueError, match="knows no fact 'partials'; it knows: step, in_flight"):
        parse("checkpoint.parent_fsynced[partials]")
    with pytest.raises(ValueError, match="must be an integer"):
        parse("train.optimizer_step[step=x]")
    with pytest.raises(ValueError, match="starts at 1"):
        parse("train.optimizer_step:0")
    assert parse("") == ()
    assert parse(" train.optimizer_step[step=3]:2 ") == (
        Stage("train.optimizer_step", (("step", 3),), 2),
    )
    assert all(parse(point) for point in POINTS)


def test_the_facts_of_a_cut_are_read_off_the_ledger_and_buffer_states():
    mask = torch.tensor([[True, True, False], [True, True, True]])
    states = {
        "ledger": {
            "in_flight": [[5, 1], [6, 1], [7, 1]],
            "partial": {
                5: {
                    "mask": mask,
                    "finished": torch.tensor([False, True]),
                    "episodes": [
                        {"turns": [{"step_id": "5:0:0"}, {"step_id": "5:0:1"}]},
                        {"turns": []},
                    ],
                }
            },
        },
        "buffer": {"groups": [{}, {}]},
    }
    assert cut_facts(states) == {
        "in_flight": 3,
        "buffered": 2,
        "partial_tokens": 5,
        "finished_in_flight": 1,
        "episode_steps": 2,
        "first_turn_tokens": 3,  # sample 1 asked no step yet
    }
