"""The steps log is a write-ahead log (issue 44): a turn whose environment step was asked after
the last checkpoint comes back on resume exactly as it was sampled, not generated again.

Driven by hand: one runner plays a pass, as the collector does (`mark`, the engine's tokens,
`advance`), after the state a checkpoint would have saved; a second runner, a new launch,
reads the log from the checkpoint's offset and recovers. The oracle is the first runner's own
partial after its step; the environment counts what it is asked, by id and text.
"""

from __future__ import annotations

import json
import os
from typing import ClassVar

import pytest
import torch
from helpers import small_config

from asyncrl.core.partial import Partial
from asyncrl.core.types import PromptTicket
from asyncrl.rollout.episodes import EpisodeError, EpisodeRunner

TICKET = PromptTicket(0, 0, 0, 0, 0)


class Tally:
    """Never done; records every step it is asked, as (id, text); replays without acting."""

    restore = "replay"
    alphabet = ""
    asked: ClassVar[list[tuple[str, str]]] = []

    def reset(self, example, seed):
        return [{"role": "user", "content": "1-5="}]

    def step(self, assistant_text, step_id):
        Tally.asked.append((step_id, assistant_text))
        return [{"role": "user", "content": f"+{len(Tally.asked)}"}], 0.5, False

    def replay(self, turns):
        pass


class Restarting(Tally):
    restore = "restart"


@pytest.fixture(scope="module")
def policy():
    from asyncrl.models.policy import load_policy

    return load_policy(small_config().model, 0, set("0123456789=-+"))


def runner(policy, log, env=Tally):
    from asyncrl.tasks.games import guess_number_examples

    return EpisodeRunner(env, "tally", guess_number_examples(4, 0), policy.tokenizer,
                         policy.eos_id, 0, 3, 3, 64, steps_log=log)  # fmt: skip


def first_pass(policy, run, partial):
    """Sample 0 ends its turn ("33" then the turn's end), sample 1 is mid-turn ("33"); each
    token with a log-prob and version of its own."""
    d, eos = policy.tokenizer.convert_tokens_to_ids("3"), policy.eos_id
    tokens = torch.tensor([[d, d, eos], [d, d, 0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    logprobs = torch.tensor([[-0.125, -0.3, -1.7], [-0.5, -0.25, 0.0]])
    partial = partial.extend(tokens, mask, logprobs, 3, torch.tensor([True, False]))
    return run.advance(TICKET, partial)


def checkpoint_then_step(policy, tmp_path, env=Tally):
    """A launch: its episodes start, a checkpoint's cut (the partial and the log's offset,
    as the collector marks it before the pass), then one pass with a step after it."""
    Tally.asked = []
    log = tmp_path / "env_steps.jsonl"
    first = runner(policy, log, env)
    saved = first.start(TICKET, 2)
    first.log.mark()
    offset = first.log.log_mark
    after = first_pass(policy, first, saved)
    return log, Partial.from_state(saved.state_dict()), offset, after


def rows(partial, sample):
    n = partial.lengths[sample]
    return [t[sample, :n].tolist() for t in (partial.tokens, partial.logprobs, partial.versions,
                                            partial.policy_mask)]  # fmt: skip


def test_a_turn_stepped_after_the_checkpoint_comes_back_exactly_and_is_not_asked_again(
    policy, tmp_path
):
    log, saved, offset, oracle = checkpoint_then_step(policy, tmp_path)
    assert Tally.asked == [("0:0:0", "33")]
    second = runner(policy, log)  # the next launch
    second.log.load(offset, lambda k: True)
    recovered, count = second.recover(TICKET, saved, 2)
    assert count == 1
    assert rows(recovered, 0) == rows(oracle, 0)  # tokens, log-probs, versions, reply
    assert recovered.episodes[0] == oracle.episodes[0]
    assert not bool(recovered.finished[0])  # the next turn is open
    assert recovered.lengths[1] == 0  # sample 1's turn was never asked: generated again
    opened = second.open(TICKET, saved, 2)  # what the collector dispatches
    assert rows(opened, 0) == rows(oracle, 0)
    assert Tally.asked == [("0:0:0", "33")], "the step was asked again"
    # the control: the same launch without the log would generate the turn again
    fresh = runner(policy, tmp_path / "none.jsonl")
    assert fresh.recover(TICKET, saved, 2) == (saved, 0)


def test_a_step_whose_result_was_not_logged_is_asked_again_with_the_same_text(policy, tmp_path):
    log, saved, offset, oracle = checkpoint_then_step(policy, tmp_path)
    lines = log.read_text().splitlines()
    assert [json.loads(x)["kind"] for x in lines] == ["request", "result"]
    log.write_text(lines[0] + "\n" + lines[1][:9])  # killed in the step, mid-result
    second = runner(policy, log)
    second.log.load(offset, lambda k: True)
    recovered, count = second.recover(TICKET, saved, 2)
    assert count == 1 and bool(recovered.finished[0]) and not recovered.episodes[0].turns
    opened = second.open(TICKET, saved, 2)
    assert Tally.asked == [("0:0:0", "33"), ("0:0:0", "33")]  # same id, same text
    assert rows(opened, 0)[0][:3] == rows(oracle, 0)[0][:3]  # the turn; its reply is new
    assert opened.episodes[0].turns[0].step_id == "0:0:0"
    kinds = [json.loads(x).get("kind") for x in log.read_text().splitlines() if x.endswith("}")]
    assert kinds == ["request", "request", "result"]  # the torn result was cut off first


def test_an_environment_that_can_only_restart_recovers_nothing(policy, tmp_path):
    log, saved, offset, _ = checkpoint_then_step(policy, tmp_path, Restarting)
    second = runner(policy, log, Restarting)
    second.log.load(offset, lambda k: True)
    assert second.recover(TICKET, saved, 2) == (saved, 0)


def test_a_request_that_does_not_continue_the_saved_tokens_is_an_error(policy, tmp_path):
    log, saved, offset, _ = checkpoint_then_step(policy, tmp_path)
    eos = policy.eos_id
    one = torch.tensor([[eos], [0]])
    other = saved.extend(one, one == eos, torch.zeros(2, 1), 0, torch.tensor([False, False]))
    second = runner(policy, log)
    second.log.load(offset, lambda k: True)
    with pytest.raises(EpisodeError, match="0:0:0 does not continue"):
        second.recover(TICKET, other, 2)


def test_a_group_with_no_saved_samples_is_recovered_from_its_start(policy, tmp_path):
    log, _, offset, oracle = checkpoint_then_step(policy, tmp_path)
    second = runner(policy, log)
    second.log.load(offset, lambda k: True)
    recovered, count = second.recover(TICKET, None, 2)
    assert count == 1 and rows(recovered, 0) == rows(oracle, 0)
    second.log.load(log.stat().st_size, lambda k: True)  # from the end: nothing to recover
    assert second.recover(TICKET, None, 2) == (None, 0)


# --- audit checks I9 against the log's texts (issue 44, item 4)


def audit_log(tmp_path, requests, journal=()):
    """audit's I9 over a steps log of `requests` ((step id, attempt, text hash), each with its
    result), one resume of attempt 1 from a cut that held step 0:0:0, and a journal."""
    from asyncrl.cli.audit import AuditReport, _audit_journals, _audit_steps

    rows = []
    for sid, attempt, sha, *answered in requests:  # answered: False for a kill inside the step
        rows.append({"kind": "request", "step_id": sid, "attempt": attempt, "text_sha256": sha})
        if answered != [False]:
            rows.append({"kind": "result", "step_id": sid, "attempt": attempt})
    (tmp_path / "env_steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    events = [
        {"event": "checkpoint", "step": 1, "recorded_steps": ["0:0:0"]},
        {"event": "resume", "attempt": 1, "from_step": 1, "tool_calls_repeated": 0},
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "env").mkdir(exist_ok=True)
    (tmp_path / "env" / "tool.jsonl").write_text(
        "".join(json.dumps({"step_id": s, "text_sha256": h}) + "\n" for s, h in journal)
    )
    report = AuditReport(2, 8, 1)
    _audit_steps(tmp_path, report, 3)
    _audit_journals(tmp_path / "env", report)
    return report.violations


def test_audit_passes_the_one_step_in_flight_at_a_kill_asked_again_with_its_text(tmp_path):
    steps = [("0:0:0", 0, "a"), ("0:0:1", 0, "b"), ("0:0:2", 0, "c", False), ("0:0:2", 1, "c")]
    assert audit_log(tmp_path, steps, journal=[("0:0:1", "b"), ("0:0:2", "c")]) == []


def test_audit_names_a_step_asked_with_two_texts(tmp_path):
    (found,) = audit_log(tmp_path, [("0:0:0", 0, "a"), ("0:0:1", 0, "b", False), ("0:0:1", 1, "x")])
    assert found.startswith("I9: step 0:0:1 asked with two different texts")


def test_audit_names_more_than_one_step_past_the_cut_asked_again(tmp_path):
    steps = [("0:0:0", 0, "a"), ("0:0:1", 0, "b"), ("0:1:0", 0, "c")]
    (found,) = audit_log(tmp_path, [*steps, ("0:0:1", 1, "b"), ("0:1:0", 1, "c")])
    assert "attempt 1 asked again for 2 environment steps whose results an earlier" in found


def test_audit_passes_requests_a_kill_left_without_results_asked_again(tmp_path):
    """A pass's requests are written ahead together (a group commit), so a kill may leave
    several without results; asking those again is no repeat (the environment was asked at
    most the one it was inside). One with a logged result asked again is."""
    from asyncrl.cli.audit import AuditReport, _audit_steps

    rows = [{"kind": "request", "step_id": "0:0:0", "attempt": 0, "text_sha256": "a"},
            {"kind": "result", "step_id": "0:0:0", "attempt": 0}]  # fmt: skip
    for sid in ("0:1:0", "0:2:0", "0:3:0"):  # written ahead, then the kill
        rows.append({"kind": "request", "step_id": sid, "attempt": 0, "text_sha256": "b"})
    for sid in ("0:1:0", "0:2:0", "0:3:0"):
        rows.append({"kind": "request", "step_id": sid, "attempt": 1, "text_sha256": "b"})
        rows.append({"kind": "result", "step_id": sid, "attempt": 1})
    events = [{"event": "resume", "attempt": 1, "from_step": 1, "recorded_steps": []}]

    def violations(extra=()):
        (tmp_path / "env_steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in
                                                          [*rows, *extra]))  # fmt: skip
        (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        report = AuditReport(2, 8, 1)
        _audit_steps(tmp_path, report, 3)
        return report.violations

    assert violations() == []
    (found,) = violations([{"kind": "request", "step_id": "0:0:0", "attempt": 1,
                            "text_sha256": "a"}])  # fmt: skip
    assert "whose results an earlier attempt had logged" in found and "0:0:0" in found


def test_audit_names_steps_asked_under_new_ids_by_episodes_that_do_not_start_over(tmp_path):
    """Defect 1 as audit sees it: the steps past the cut asked again under `:1` ids were new
    ids to every check by id. An attempt whose resume says its episodes do not start over
    must keep the log's ids; one that says they do (`restart_episode`) may not."""
    from asyncrl.cli.audit import AuditReport, _audit_steps

    rows = []
    for sid, attempt in (("5:0:0", 0), ("5:0:1", 0), ("5:0:0:1", 1), ("5:0:1:1", 1)):
        rows.append({"kind": "request", "step_id": sid, "attempt": attempt, "text_sha256": "a"})
        rows.append({"kind": "result", "step_id": sid, "attempt": attempt})
    (tmp_path / "env_steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for start_over, expected in ((False, 1), (True, 0)):
        event = {"event": "resume", "attempt": 1, "from_step": 1, "recorded_steps": [],
                 "episodes_start_over": start_over}  # fmt: skip
        (tmp_path / "events.jsonl").write_text(json.dumps(event) + "\n")
        report = AuditReport(2, 8, 1)
        _audit_steps(tmp_path, report, 3)
        assert len(report.violations) == expected, report.violations
        if expected:
            assert "5:0:0:1, 5:0:1:1" in report.violations[0]


def test_audit_names_a_journaled_call_for_a_text_the_log_did_not_ask(tmp_path):
    (found,) = audit_log(tmp_path, [("0:0:0", 0, "a")], journal=[("0:0:0", "z")])
    assert "tool.jsonl executed step 0:0:0 for a text (hash z)" in found


def test_a_torn_last_line_does_not_move_the_offset_past_the_next_record(policy, tmp_path):
    """A resume's log ends in a line torn by the kill, which its first append cuts off: the
    offset a checkpoint then saves must be where that append starts, not past it."""
    log, _, _, _ = checkpoint_then_step(policy, tmp_path)
    whole = log.read_bytes()
    log.write_bytes(whole + b'{"kind": "requ')  # killed mid-write
    second = runner(policy, log)
    second.log.load(len(whole), lambda k: True)
    second.log.mark()
    assert second.log.log_mark == len(whole)
    first_pass(policy, second, second.start(TICKET, 2))  # asks 0:0:0: appended after the cut
    third = runner(policy, log)
    third.log.load(second.log.log_mark, lambda k: True)
    assert third.logged_steps() == {"0:0:0"}


# --- one rule in every mode and for every state (issue 63, defects 1, 2 and 8)


def det_runner(policy, log, env=Tally):
    from asyncrl.tasks.games import guess_number_examples

    return EpisodeRunner(env, "tally", guess_number_examples(4, 0), policy.tokenizer,
                         policy.eos_id, 0, 3, 3, 64, steps_log=log,
                         deterministic=True)  # fmt: skip


def test_a_deterministic_resume_answers_a_group_it_starts_again_from_the_log(policy, tmp_path):
    """Defect 1: in deterministic mode a group with no saved samples (handed out after the
    cut) is generated again, bitwise the same; its steps keep the ids the log holds them by
    and are answered from it. Before, the group took restart count 1 and its steps were asked
    again under new ids (`0:0:0:1`), which no journal keyed by id could tell."""
    log, _, offset, oracle = checkpoint_then_step(policy, tmp_path)
    assert Tally.asked == [("0:0:0", "33")]
    second = det_runner(policy, log)
    second.log.load(offset, lambda k: True)
    opened = second.open(TICKET, None, 2)  # not in the checkpoint: started again
    assert [e.restarts for e in opened.episodes] == [0, 0]
    again = first_pass(policy, second, opened)  # the same tokens, as deterministic mode makes
    assert Tally.asked == [("0:0:0", "33")], "a logged step was asked again"
    assert rows(again, 0) == rows(oracle, 0) and again.episodes[0] == oracle.episodes[0]
    # the control: an episode that starts over (restart_episode) asks under a new id
    third = EpisodeRunner(Tally, "tally", second.examples, policy.tokenizer, policy.eos_id, 0,
                          3, 3, 64, steps_log=log, restart_on_resume=True)  # fmt: skip
    third.log.load(offset, lambda k: True)
    first_pass(policy, third, third.open(TICKET, None, 2))
    assert Tally.asked[-1] == ("0:0:0:1", "33")


class TensorTally(Tally):
    """Restorable, its state a tensor (the protocol allows tensors in a state)."""

    restore = "restorable"

    def reset(self, example, seed):
        self.total = torch.zeros(2, dtype=torch.float64)
        return super().reset(example, seed)

    def step(self, assistant_text, step_id):
        self.total += torch.tensor([len(assistant_text), 0.1])
        return super().step(assistant_text, step_id)

    def state_dict(self):
        return {"total": self.total, "note": ("a", 1)}

    def load_state_dict(self, state):
        self.total = state["total"].clone()


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_a_step_whose_state_holds_a_tensor_is_answered_from_the_log(
    policy, tmp_path, deterministic
):
    """Defect 2: the result record held a `restorable` environment's state only where it was
    JSON, so a state with a tensor made recovery ask the step again. Now the state is logged
    as the checkpoint's codec writes it (a JSON tree, its tensors a safetensors file), and
    comes back bit for bit."""
    log, saved, offset, oracle = checkpoint_then_step(policy, tmp_path, TensorTally)
    make = det_runner if deterministic else runner
    second = make(policy, log, TensorTally)
    second.log.load(offset, lambda k: True)
    opened = second.open(TICKET, saved, 2)
    if deterministic:  # the turn generated again, its step answered from the log
        opened = first_pass(policy, second, opened)
    assert Tally.asked == [("0:0:0", "33")], "a logged step was asked again"
    state = opened.episodes[0].env_state
    want = oracle.episodes[0].env_state
    assert torch.equal(state["total"], want["total"]) and state["total"].dtype == torch.float64
    assert state["note"] == ("a", 1)
    assert rows(opened, 0) == rows(oracle, 0)
    result = json.loads(log.read_text().splitlines()[1])
    assert result["kind"] == "result" and "state_tensors" in result  # safetensors, no pickle


def test_every_request_is_durable_before_any_environment_acts(policy, tmp_path, monkeypatch):
    """Defect 8: the steps log was flushed, not fsynced, while a tool's journal is: after a
    host crash the journal could be ahead of the log. Each fsync of the log is recorded (the
    bytes durable at that moment); the environment, when asked, checks that its request is
    among them. One fsync covers a pass's requests, of all its groups (a group commit)."""
    log = tmp_path / "env_steps.jsonl"
    durable = {"bytes": 0, "syncs": 0}
    real_fsync = os.fsync

    def fsync(fd):
        real_fsync(fd)
        if os.readlink(f"/proc/self/fd/{fd}") == str(log):
            durable["bytes"] = os.fstat(fd).st_size
            durable["syncs"] += 1

    monkeypatch.setattr(os, "fsync", fsync)

    class Checking(Tally):
        def step(self, assistant_text, step_id):
            lines = log.read_bytes()[: durable["bytes"]].decode().splitlines()
            assert any(json.loads(x)["step_id"] == step_id for x in lines), "not durable"
            return super().step(assistant_text, step_id)

    Tally.asked = []
    run = runner(policy, log, Checking)
    partial = run.start(TICKET, 2)
    d, eos = policy.tokenizer.convert_tokens_to_ids("3"), policy.eos_id
    both = torch.tensor([[d, eos], [d, eos]])
    partial = partial.extend(both, both == both, torch.zeros(2, 2), 0, torch.tensor([True, True]))
    run.advance(TICKET, partial)
    assert [sid for sid, _ in Tally.asked] == ["0:0:0", "0:1:0"]
    assert durable["syncs"] == 1  # the two requests at once (the results: the next pass's)
