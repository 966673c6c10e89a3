"""The episode runner's own promises (`asyncrl.rollout.episodes.EpisodeRunner`), driven by hand
with environments of the tests' own: an ended episode is never stepped again, a restorable
state is the one of its step, environment failures name the environment, the method and the
step, and the steps log repairs a torn last line (issue 44)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from helpers import small_config

from asyncrl.core.partial import Partial
from asyncrl.rollout.episodes import EpisodeError

# --- an episode ended by a limit is ended (issue 44, defect 1)


class HalfPoint:
    """Never says done; each step is worth 0.5 and is counted, by step id."""

    restore = "replay"
    alphabet = ""
    steps: ClassVar[list[str]] = []

    def reset(self, example, seed):
        return [{"role": "user", "content": "1-5="}]

    def step(self, assistant_text, step_id):
        HalfPoint.steps.append(step_id)
        return [{"role": "user", "content": "+"}], 0.5, False

    def replay(self, turns):
        pass


@pytest.mark.parametrize("limit", ["max_turns", "max_episode_tokens"])
def test_an_episode_ended_by_a_limit_is_not_stepped_again_while_a_sibling_generates(limit):
    """Sample 0's turn ends in the first pass and its only allowed step ends the episode (one
    turn, or no room for another); sample 1 keeps generating for two more passes. Before the
    fix, every later pass stepped sample 0 again under a new id: 0:0:0, 0:0:1, 0:0:2, reward
    1.5 instead of 0.5."""
    from asyncrl.core.types import PromptTicket
    from asyncrl.models.policy import load_policy
    from asyncrl.rollout.episodes import EpisodeRunner
    from asyncrl.tasks.games import guess_number_examples

    policy = load_policy(small_config().model, 0, set("0123456789=-+"))
    max_turns, max_tokens = (1, 64) if limit == "max_turns" else (4, 3)
    runner = EpisodeRunner(
        HalfPoint, "half_point", guess_number_examples(4, 0), policy.tokenizer,
        policy.eos_id, 0, max_turns, 2, max_tokens,
    )  # fmt: skip
    HalfPoint.steps = []
    ticket = PromptTicket(0, 0, 0, 0, 0)
    partial = runner.start(ticket, 2)
    digit = policy.tokenizer.convert_tokens_to_ids("3")
    # per pass (tokens, mask, finished): sample 0 ends its turn in the first pass; sample 1
    # generates on and ends its own turn in the third
    d, eos = digit, policy.eos_id
    passes = [
        ([[d, eos], [d, d]], [[True, True], [True, True]], [True, False]),
        ([[0], [d]], [[False], [True]], [False, False]),
        ([[0], [eos]], [[False], [True]], [False, True]),
    ]
    saved = []
    for tokens, mask, finished in passes:
        t = torch.tensor(tokens)
        partial = partial.extend(
            t, torch.tensor(mask), torch.zeros(t.shape), 0, torch.tensor(finished)
        )
        partial = runner.advance(ticket, partial)
        saved.append(partial.state_dict())
    assert [s for s in HalfPoint.steps if s.startswith("0:1:")] == ["0:1:0"]
    HalfPoint.steps = [s for s in HalfPoint.steps if s.startswith("0:0:")]
    assert HalfPoint.steps == ["0:0:0"], HalfPoint.steps
    assert partial.episodes[0].ended and not partial.episodes[0].done
    assert bool(partial.finished[0])
    assert runner.scores(partial).rewards[0] == pytest.approx(0.5)
    # saved and read back (and as a format-5 state without the field), still ended
    back = Partial.from_state(partial.state_dict())
    assert back.episodes[0].ended
    for state in saved:  # as states of an older version, without the field: the same
        old = {**state, "episodes": [{k: v for k, v in e.items() if k != "ended"}
                                     for e in state["episodes"]]}  # fmt: skip
        read = [e.ended for e in Partial.from_state(old).episodes]
        assert read == [e["ended"] for e in state["episodes"]]
    assert [e["ended"] for e in saved[1]["episodes"]] == [True, False]  # 1 is mid-turn


class Counter:
    """Restorable; its state is one list it changes in place at every step."""

    restore = "restorable"
    alphabet = ""
    bad_state = False
    bad_load = False

    def __init__(self):
        self.seen = []

    def reset(self, example, seed):
        return [{"role": "user", "content": "1-5="}]

    def step(self, assistant_text, step_id):
        self.seen.append(step_id)
        return [{"role": "user", "content": "+"}], 0.5, False

    def state_dict(self):
        return {"seen": {1, 2}} if Counter.bad_state else {"seen": self.seen}

    def load_state_dict(self, state):
        if Counter.bad_load:
            raise KeyError("seen")
        self.seen = list(state["seen"])


def one_turn_each(runner, partial, ticket, eos):
    """One pass in which every sample ends its turn with one token, then the steps."""
    t = torch.full((partial.num_samples, 1), eos)
    ones = torch.ones_like(t, dtype=torch.bool)
    partial = partial.extend(t, ones, torch.zeros(t.shape), 0, ones[:, 0])
    return runner.advance(ticket, partial)


def test_a_restorable_state_is_copied_and_checked_when_its_step_returns(monkeypatch):
    from asyncrl.core.types import PromptTicket
    from asyncrl.models.policy import load_policy
    from asyncrl.rollout.episodes import EpisodeRunner
    from asyncrl.tasks.games import guess_number_examples

    policy = load_policy(small_config().model, 0, set("0123456789=-+"))
    runner = EpisodeRunner(Counter, "counter", guess_number_examples(4, 0), policy.tokenizer,
                           policy.eos_id, 0, 4, 2, 64)  # fmt: skip
    ticket = PromptTicket(0, 0, 0, 0, 0)
    partial = one_turn_each(runner, runner.start(ticket, 1), ticket, policy.eos_id)
    partial = one_turn_each(runner, partial, ticket, policy.eos_id)
    # each turn's saved state is the one after its own step, not the live list
    assert partial.episodes[0].env_state == {"seen": ["0:0:0", "0:0:1"]}
    assert runner._envs[(0, 0)].seen is not partial.episodes[0].env_state["seen"]
    monkeypatch.setattr(Counter, "bad_state", True)
    with pytest.raises(EpisodeError, match=r"env.name=counter: state_dict\(\) after step 0:0:2"):
        one_turn_each(runner, partial, ticket, policy.eos_id)
    monkeypatch.setattr(Counter, "bad_state", False)
    monkeypatch.setattr(Counter, "bad_load", True)
    with pytest.raises(EpisodeError, match=r"counter: load_state_dict\(\) for ordinal 0 sample 0 "
                                           r"after step 0:0:1 raised KeyError"):  # fmt: skip
        runner.resume(ticket, partial)


def test_the_steps_log_cuts_a_torn_last_line_and_keeps_a_whole_one(tmp_path):
    from asyncrl.checkpoint.torn import end_torn_line

    path = tmp_path / "env_steps.jsonl"
    path.write_text('{"step_id": "0:0:0", "attempt": 0}\n{"step_id": "0:1')  # killed mid-write
    end_torn_line(path)
    assert path.read_text() == '{"step_id": "0:0:0", "attempt": 0}\n'
    path.write_text('{"step_id": "0:0:0", "attempt": 0}')  # whole, killed before its newline
    end_torn_line(path)
    assert path.read_text() == '{"step_id": "0:0:0", "attempt": 0}\n'


# --- an environment that can only restart keeps a first turn that asked no step (defect 6)


class Restarter:
    """Can only start over; counts its steps, by step id."""

    restore = "restart"
    alphabet = ""
    steps: ClassVar[list[str]] = []

    def reset(self, example, seed):
        return [{"role": "user", "content": "1-5="}]

    def step(self, assistant_text, step_id):
        Restarter.steps.append(step_id)
        return [{"role": "user", "content": "+"}], 0.5, False


@pytest.mark.parametrize("policy", ["lossless", "restart_episode"])
def test_a_restart_environment_keeps_a_first_turn_that_asked_no_step(policy, tmp_path):
    """Sample 0 ended its first turn (step 0:0:0 asked), sample 1 is two tokens into its
    first: a resume starts sample 0 over under a new id and continues sample 1 at its token,
    as the resume plan says (`continued_samples`). Its step, asked after the checkpoint by the
    killed launch, gets a new id too. `restart_episode` (the control) starts both over."""
    from asyncrl.core.resume import SavedLedger, continued_samples
    from asyncrl.core.types import PromptTicket
    from asyncrl.models.policy import load_policy
    from asyncrl.rollout.episodes import EpisodeRunner
    from asyncrl.tasks.games import guess_number_examples

    policy_ = load_policy(small_config().model, 0, set("0123456789=-+"))

    def runner():
        return EpisodeRunner(
            Restarter, "restarter", guess_number_examples(4, 0), policy_.tokenizer,
            policy_.eos_id, 0, 4, 4, 64, steps_log=tmp_path / "env_steps.jsonl",
            restart_on_resume=policy == "restart_episode",
        )  # fmt: skip

    Restarter.steps = []
    ticket = PromptTicket(0, 0, 0, 0, 0)
    killed = runner()
    d, eos = policy_.tokenizer.convert_tokens_to_ids("3"), policy_.eos_id
    t = torch.tensor([[d, eos], [d, d]])
    ones = torch.ones_like(t, dtype=torch.bool)
    partial = killed.advance(ticket, killed.start(ticket, 2).extend(
        t, ones, torch.zeros(t.shape), 0, torch.tensor([True, False])))  # fmt: skip
    checkpoint = partial.state_dict()  # the cut: sample 1 has asked no step
    t = torch.tensor([[0], [eos]])
    killed.advance(
        ticket,
        partial.extend(
            t, torch.tensor([[False], [True]]), torch.zeros(t.shape), 0, torch.tensor([False, True])
        ),
    )
    assert Restarter.steps == ["0:0:0", "0:1:0"]  # then the kill

    saved = Partial.from_state(checkpoint)
    plan = continued_samples(
        SavedLedger(0, 1, 1, [(0, 0)], [], partial_samples={0: saved.saved_samples()}),
        policy, episodes_restart=True,
    )[0]  # fmt: skip
    resumed = runner()
    resumed.log.load(0, lambda ordinal: True)  # as a resume does, from the cut's offset
    back = resumed.resume(ticket, saved)
    assert (back.lengths, back.finished.tolist()) == plan
    if policy == "lossless":
        assert back.lengths == [0, 2] and back.prefixes()[1] == (d, d)
    else:
        assert back.lengths == [0, 0]
    assert [e.restarts for e in back.episodes] == [1, 1]  # ids the log has not asked
    Restarter.steps = []
    t = torch.tensor([[eos], [eos]])
    ones = torch.ones_like(t, dtype=torch.bool)
    resumed.advance(ticket, back.extend(t, ones, torch.zeros(t.shape), 0, ones[:, 0]))
    assert sorted(Restarter.steps) == ["0:0:0:1", "0:1:0:1"]
