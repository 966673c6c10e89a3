"""The calculator tool environment (`env.name=calculator`) and episodes through a chat
template: the calculator's arithmetic, its journal (a step id is called at most once, across
processes and kills), and a chat model's episodes whose tokens decode to exactly what the
tokenizer's chat template renders for the same conversation, turn by turn."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import small_config

from asyncrl.examples.math_chat import prepare
from asyncrl.tasks import tools
from asyncrl.tasks.examples import Example
from asyncrl.tasks.tools import Calculator, Journal, calculate


def test_the_calculator_does_arithmetic_and_nothing_else():
    assert calculate("2 + 3 * 4") == "14"
    assert calculate("(7 - 1) / 4") == "1.5"
    assert calculate("-3*-3") == "9"
    assert calculate("1/0").startswith("error")
    assert calculate("__import__('os').getcwd()").startswith("error")
    assert calculate("2 ** 10").startswith("error")  # not one of + - * /
    assert calculate("9" * 20 + "*" + "9" * 20).startswith("error")


def test_a_step_id_is_called_at_most_once_even_by_another_process(tmp_path, monkeypatch):
    path = tmp_path / "calculator.jsonl"
    assert Journal(path).call("3:1:0", "6*7", "aa") == "42"

    def must_not_run(expression: str) -> str:
        raise AssertionError(f"called again: {expression}")

    monkeypatch.setattr(tools, "calculate", must_not_run)
    again = Journal(path)  # what a resumed process reads
    assert again.call("3:1:0", "6*7", "aa") == "42"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    row = {"step_id": "3:1:0", "run_id": "", "text_sha256": "aa", "expression": "6*7"}
    assert rows == [{**row, "intent": True}, {**row, "result": "42"}]  # the intent, then it
    with open(path, "a") as f:
        f.write('{"step_id": "3:1:1", "expr')  # a line torn by a kill was never used
    assert "3:1:1" not in Journal(path).results
    assert path.read_text().endswith("}\n")  # cut off, so the next call's line is whole


def test_one_id_one_request_the_same_id_with_other_text_is_an_error(tmp_path):
    """The defect it guards: `call('3:1:0', '6*7')` then `call('3:1:0', '1+1')` answered 42
    twice, so a turn regenerated after a kill was trained on another turn's result."""
    path = tmp_path / "calculator.jsonl"
    journal = Journal(path)
    assert journal.call("3:1:0", "6*7", "aa") == "42"
    with pytest.raises(ValueError, match=r"3:1:0.*other text"):
        journal.call("3:1:0", "1+1", "bb")
    with pytest.raises(ValueError, match="3:1:0"):
        Journal(path).call("3:1:0", "1+1", "bb")  # a resumed process knows it too
    with open(path, "a") as f:  # a journal of an older version: no hash, answered by id
        f.write(json.dumps({"step_id": "4:0:0", "expression": "1+2", "result": "3"}) + "\n")
    assert Journal(path).call("4:0:0", "1+2", "cc") == "3"


def test_the_journal_records_its_intent_durably_before_the_tool_acts(tmp_path, monkeypatch):
    """Issue 63, defect 8: `Journal.call` ran the tool and journaled it after, so a kill
    between the two left no trace of an action taken. Now the intent is fsynced first; a kill
    inside the tool leaves it alone, and the next call acts again (the calculator is pure; a
    tool acting outside passes the key to its service: `idempotency_key`)."""
    import os

    path = tmp_path / "calculator.jsonl"
    synced = {"bytes": 0}
    real_fsync = os.fsync

    def fsync(fd):
        real_fsync(fd)
        synced["bytes"] = os.fstat(fd).st_size

    monkeypatch.setattr(os, "fsync", fsync)

    def tool(expression: str) -> str:
        rows = [json.loads(x) for x in path.read_bytes()[: synced["bytes"]].splitlines()]
        assert rows and rows[-1]["intent"] and rows[-1]["step_id"] == "0:0:0", "no intent"
        raise KeyboardInterrupt("killed inside the tool")

    with pytest.raises(KeyboardInterrupt):
        Journal(path, "run-a").call("0:0:0", "6*7", "aa", act=tool)
    again = Journal(path, "run-a")  # the next launch
    assert again.interrupted == {"run-a/0:0:0"} and not again.results
    assert again.call("0:0:0", "6*7", "aa") == "42"  # acted again, once more, then journaled
    assert Journal(path, "run-a").results == {"run-a/0:0:0": "42"}


def test_a_journal_shared_by_two_runs_keeps_their_steps_apart(tmp_path):
    """Issue 63, defect 9: step ids carry no run id, so a journal or service shared by two
    runs answered run B's `0:0:0` with run A's result. Keys are `RUN_ID/STEP_ID`
    (`idempotency_key`); a journal of an older version (no run id) is its own run's."""
    from asyncrl.tasks.environments import idempotency_key

    path = tmp_path / "shared.jsonl"
    assert Journal(path, "run-a").call("0:0:0", "6*7", "aa") == "42"
    assert Journal(path, "run-b").call("0:0:0", "1+1", "bb") == "2"  # not an error, not 42
    assert Journal(path, "run-a").call("0:0:0", "6*7", "aa") == "42"
    assert idempotency_key("run-b", "0:0:0") == "run-b/0:0:0"
    env = Calculator()  # the episode runner hands the environment the run's id
    env.set_run_id("run-c")
    env.set_workdir(tmp_path)
    env.reset(Example("q", "12", "x", ({"role": "user", "content": "3 times 4?"},)), 0)
    env.step("<calc>3*4</calc>", "0:0:0")
    row = json.loads((tmp_path / "calculator.jsonl").read_text().splitlines()[-1])
    assert (row["run_id"], row["step_id"], row["result"]) == ("run-c", "0:0:0", "12")


def test_the_environment_journals_the_hash_of_the_text_it_was_asked_with(tmp_path):
    from asyncrl.core.episodes import text_sha256

    env = Calculator()
    env.set_workdir(tmp_path)
    env.reset(Example("q", "12", "x", ({"role": "user", "content": "3 times 4?"},)), 0)
    env.step("I compute <calc>3*4</calc>", "0:0:0")
    row = json.loads((tmp_path / "calculator.jsonl").read_text().splitlines()[-1])
    assert row["text_sha256"] == text_sha256("I compute <calc>3*4</calc>")
    with pytest.raises(ValueError, match="0:0:0"):
        env.step("I compute <calc>3*5</calc>", "0:0:0")


def test_audit_finds_an_environment_step_executed_twice(tmp_path):
    from asyncrl.cli.audit import AuditReport, _audit_journals

    folder = tmp_path / "env"
    Journal(folder / "calculator.jsonl").call("0:0:0", "1+1", "aa")
    Journal(folder / "calculator.jsonl").call("0:1:0", "2+2", "bb")
    report = AuditReport(1, 4, 0)
    _audit_journals(folder, report)
    assert report.ok and report.num_env_steps == 2
    with open(folder / "calculator.jsonl", "a") as f:  # what a journal-less retry would do
        f.write(json.dumps({"step_id": "0:1:0", "expression": "2+2", "result": "4"}) + "\n")
    _audit_journals(folder, report)
    assert not report.ok and "0:1:0" in report.violations[0]
    # another run's rows in a shared journal are not this run's executions
    shared = tmp_path / "shared"
    Journal(shared / "tool.jsonl", "run-a").call("0:0:0", "1+1", "aa")
    Journal(shared / "tool.jsonl", "run-b").call("0:0:0", "1+1", "aa")
    for run_id, ok in (("run-a", True), ("", False)):
        report = AuditReport(1, 4, 0)
        _audit_journals(shared, report, run_id)
        assert report.ok == ok, report.violations
    # a call begun twice (intent, a kill inside the tool, intent, result) is an execution the
    # result rows cannot show: at most one a resume (a kill) is allowed
    begun = tmp_path / "begun"
    with pytest.raises(KeyboardInterrupt):
        Journal(begun / "tool.jsonl", "r").call("0:0:0", "1+1", "aa", act=interrupted)
    Journal(begun / "tool.jsonl", "r").call("0:0:0", "1+1", "aa")
    for resumes, ok in ((1, True), (0, False)):
        report = AuditReport(1, 4, resumes)
        _audit_journals(begun, report, "r")
        assert report.ok == ok, report.violations


def interrupted(expression: str) -> str:
    raise KeyboardInterrupt("killed inside the tool")


def test_a_turn_calls_the_tool_answers_or_is_reminded(tmp_path):
    env = Calculator()
    env.set_workdir(tmp_path)
    example = Example("q", "12", "x", ({"role": "user", "content": "What is 3 times 4?"},))
    opening = env.reset(example, 0)
    assert "<calc>" in opening[-1]["content"] and opening[-1]["content"].startswith("What is")
    out = env.step("I compute <calc>3*4</calc>", "0:0:0")
    assert out.messages == [{"role": "user", "content": "<result>12</result>"}] and not out.done
    assert env.step("hmm", "0:0:1").messages[0]["content"] == tools.REMINDER
    done = env.step("So \\boxed{12}.", "0:0:2")
    assert done.done and done.reward == pytest.approx(1.2)  # correct + 0.2 format
    rows = [json.loads(x) for x in (tmp_path / "calculator.jsonl").open()]
    assert [(r["step_id"], "result" in r) for r in rows] == [("0:0:0", False), ("0:0:0", True)]


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("math_chat"))


def test_chat_episodes_are_the_chat_templates_tokens_turn_by_turn(chat_files, tmp_path):
    """Oracle: the tokenizer's own rendering of each conversation so far. At every turn
    boundary, prompt + episode tokens decode to `apply_chat_template(history,
    add_generation_prompt=True)`: the replies were appended as the template continues, and the
    history was never re-tokenized differently."""
    from transformers import AutoTokenizer

    from asyncrl.train.components import build_components

    config = small_config(
        f"model.path={chat_files['model']}", "data.task=hf", f"data.path={chat_files['train']}",
        "data.messages_key=messages", "env.name=calculator", "env.max_turns=3",
        "env.max_episode_tokens=96", "rollout.max_new_tokens=6",
    )  # fmt: skip
    parts = build_components(config, run_dir=str(tmp_path))
    parts.weights.publish(0, parts.algo.policy_weights())
    parts.collector.publish_version(0)
    tickets = parts.ledger.admit(0, 1, config.rollout.num_prompts_per_step, 10)
    parts.collector._generate(tickets)
    groups = parts.buffer.sample(0)
    tok = AutoTokenizer.from_pretrained(chat_files["model"])
    special = set(tok.all_special_ids)
    checked = replies = 0
    for g in groups:
        example = parts.task.examples[g.ticket.dataset_index]
        for i in range(g.num_generations):
            real = g.completion_mask[i]
            ids = g.completion_ids[i][real].tolist()
            mine = g.loss_mask[i][real].tolist()
            # split into turns: (assistant ids, reply ids)
            turns: list[tuple[list[int], list[int]]] = []
            for token, is_policy in zip(ids, mine, strict=True):
                if is_policy and (not turns or turns[-1][1]):
                    turns.append(([], []))
                (turns[-1][0] if is_policy else turns[-1][1]).append(token)
            if any(t in special for a, _ in turns for t in a[:-1]):
                continue  # a special token mid-turn: its text is not the template's to render
            env = Calculator()
            history = env.reset(example, 0)
            at = list(g.prompt_ids)
            assert tok.decode(at) == tok.apply_chat_template(
                history, add_generation_prompt=True, tokenize=False
            )
            for assistant, reply in turns:
                at += assistant + reply
                if not reply:
                    break  # the episode's last turn
                text = tok.decode(assistant, skip_special_tokens=True)
                history += [{"role": "assistant", "content": text}, *env.step(text, "x").messages]
                expected = tok.apply_chat_template(
                    history, add_generation_prompt=True, tokenize=False
                )
                assert tok.decode(at) == expected
                replies += 1
            checked += 1
    assert checked >= 4 and replies >= 4, (checked, replies)
    # the environment's tokens are not trained, and the batch the trainer builds is these ids
    from asyncrl.algos.update import stack_groups

    batch = stack_groups(groups, parts.policy.pad_id)
    assert torch.equal(batch["token_mask"][0, : groups[0].completion_mask.shape[1]],
                       groups[0].completion_mask[0])  # fmt: skip


def test_audit_counts_repeated_steps_against_the_resume_and_turns_against_max_turns(tmp_path):
    """I9 exactly: a resume that declared 1 repeat may ask for 1 recorded step again, not 2;
    an episode's turns stay below env.max_turns (step ids count turns from 0)."""
    from asyncrl.cli.audit import AuditReport, _audit_steps

    def write(name, rows):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    steps = [{"step_id": s, "attempt": 0} for s in ("0:0:0", "0:0:1", "0:1:0")]
    events = [
        {"event": "checkpoint", "step": 1, "recorded_steps": ["0:0:0", "0:0:1", "0:1:0"]},
        {"event": "resume", "attempt": 1, "from_step": 1, "tool_calls_repeated": 1},
    ]
    write("events.jsonl", events)

    def audit(again, max_turns=2):
        write("env_steps.jsonl", steps + [{"step_id": s, "attempt": 1} for s in again])
        report = AuditReport(2, 8, 1)
        _audit_steps(tmp_path, report, max_turns)
        return report.violations

    assert audit(["0:1:0"]) == []
    (found,) = audit(["0:1:0", "0:0:0"])  # one more than the resume declared
    assert found.startswith("I9: attempt 1 asked again for 2") and "declared 1" in found
    assert audit(["0:1:0"], max_turns=3) == []
    (found,) = audit(["0:1:0", "0:1:1", "0:1:2"], max_turns=2)  # turn 2 is a third turn
    assert "past env.max_turns=2" in found and found.endswith("0:1")
