"""Agent runs as samples (`asyncrl.agents.runs`), driven in process over real HTTP (the run's
endpoint, `openai.AsyncOpenAI` clients) with a fake engine whose every output is recorded:
the oracle for "the trained tokens are the generated ones". Agents live outside the package
(`tests/user_agents/`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from asyncrl.agents.agent_log import AgentLog
from asyncrl.agents.context import load_agent
from asyncrl.agents.runs import AgentLimits, AgentRuns
from asyncrl.cli.audit_agents import audit_agent_log
from asyncrl.core.types import PromptTicket
from asyncrl.models.scratch import train_tokenizer
from asyncrl.rollout.engine import GenerationOutput
from asyncrl.rollout.reward_pool import RewardPool
from asyncrl.rollout.rollouts import RolloutFatal
from asyncrl.tasks.examples import Example

sys.path.insert(0, str(Path(__file__).parent / "user_agents"))


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(400, chat=True)


class RecordingEngine:
    """Samples from each request's own noise seed; records each pass's size and every
    completion by (prompt, seed)."""

    def __init__(self, eos: int) -> None:
        self.eos = eos
        self.passes: list[int] = []
        self.outputs: list[list[int]] = []

    def generate(self, requests, version=None, max_tokens=None):
        self.passes.append(len(requests))
        outs = []
        for r in requests:
            g = torch.Generator().manual_seed(r.noise_seed)
            n = min(r.limits[0], 6)
            ids = torch.randint(5, 300, (1, n), generator=g)
            if r.noise_seed % 2:
                ids[0, -1] = self.eos
            self.outputs.append(ids[0].tolist())
            mask = torch.ones(1, n, dtype=torch.bool)
            outs.append(GenerationOutput(ids, mask, -torch.rand(1, n, generator=g), 3, mask[:, 0]))
        return outs

    def metrics(self):
        return {}


class Landing:
    stopping = False

    def __init__(self) -> None:
        self.groups, self.chunks = [], []

    def saved(self, tickets):
        return {}

    def land(self, chunk, progress, groups):
        if chunk is not None:
            self.chunks.append(chunk)
        self.groups += groups

    def version_for(self, ticket, partial):
        return 3

    def newest(self):
        return 3


EXAMPLES = [
    Example(f"What is {i} plus 2?", str(i + 2), f"x[{i}]",
            ({"role": "user", "content": f"What is {i} plus 2?"},))
    for i in range(4)
]  # fmt: skip
TICKETS = [PromptTicket(i, 0, 0, i, i) for i in range(2)]


def agent_runs(tok, name, log, engine=None, retries=1, max_calls=8, pool=None):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    engine = engine or RecordingEngine(eos)
    limits = AgentLimits(max_calls, 64, 8, 30.0, retries, 4096)
    return AgentRuns(load_agent(name), name, EXAMPLES, tok, eos, engine, 3, 0, limits, log, pool)


def policy_tokens(group, sample):
    rows = range(len(group.completion_ids)) if group.row_samples is None else (
        group.row_samples == sample).nonzero().flatten().tolist()  # fmt: skip
    out = []
    for r in rows:
        out += group.completion_ids[r][group.loss_mask[r]].tolist()
    return out


def test_agent_runs_land_as_groups_of_exactly_the_generated_tokens_and_replay_from_the_log(
    tok, tmp_path, monkeypatch
):
    journal = tmp_path / "tool.journal"
    monkeypatch.setenv("AGENT_TOOL_JOURNAL", str(journal))
    log_path = tmp_path / "agent_calls.jsonl"
    runs = agent_runs(tok, "loop_agent:run", AgentLog(log_path))
    landing = Landing()
    try:
        runs.generate(TICKETS, landing)
    finally:
        runs.close()
    engine = runs.engine
    assert sorted(g.ordinal for g in landing.groups) == [0, 1]
    # concurrent runs share passes: 6 runs x 3 calls in fewer than 18 passes
    assert sum(engine.passes) == 18 and len(engine.passes) < 18, engine.passes
    generated = {tuple(o) for o in engine.outputs}
    for g in landing.groups:
        # each run rewrote its history once: two segments (rows) per sample
        assert g.row_samples is not None and g.row_samples.tolist() == [0, 0, 1, 1, 2, 2]
        for sample in range(3):
            assert policy_tokens(g, sample)
            # the trained tokens are the engine's, call by call, never re-tokenized
            rows = (g.row_samples == sample).nonzero().flatten().tolist()
            for r in rows:
                policy = g.loss_mask[r]
                ids = g.completion_ids[r]
                runs_of_true = []
                for i, p in enumerate(policy.tolist()):
                    if p and (i == 0 or not policy[i - 1]):
                        runs_of_true.append([])
                    if p:
                        runs_of_true[-1].append(int(ids[i]))
                assert all(tuple(c) in generated for c in runs_of_true)
    assert runs.counts.prefix_breaks == 6 and runs.counts.tools.executed == 18
    assert len(journal.read_text().splitlines()) == 18
    assert audit_agent_log(tmp_path, violations := []) == 18 and not violations

    # a launch after a kill: the log answers every call, the tool is not run again
    log = AgentLog(log_path)
    log.load(0, lambda ordinal: True)
    again = agent_runs(tok, "loop_agent:run", log)
    landing2 = Landing()
    try:
        again.generate(TICKETS, landing2)
    finally:
        again.close()
    assert again.engine.passes == [] and again.counts.calls_replayed == 18
    assert again.counts.tools.replayed == 18 and again.counts.tools.executed == 0
    assert len(journal.read_text().splitlines()) == 18
    for a, b in zip(sorted(landing.groups, key=lambda g: g.ordinal),
                    sorted(landing2.groups, key=lambda g: g.ordinal), strict=True):  # fmt: skip
        assert a.prompt_ids == b.prompt_ids and torch.equal(a.completion_ids, b.completion_ids)
        assert torch.equal(a.behaviour_logprobs, b.behaviour_logprobs)
        assert torch.equal(a.rewards, b.rewards)


def test_a_run_that_diverges_from_the_log_goes_live_from_there_and_is_counted(
    tok, tmp_path, monkeypatch
):
    log_path = tmp_path / "agent_calls.jsonl"
    first = agent_runs(tok, "odd_agents:wavering", AgentLog(log_path))
    try:
        first.generate(TICKETS[:1], Landing())
    finally:
        first.close()
    monkeypatch.setenv("ODD_AGENT_DIVERGE", "1")
    log = AgentLog(log_path)
    log.attempt = 1
    log.load(0, lambda ordinal: True)
    second = agent_runs(tok, "odd_agents:wavering", log)
    try:
        second.generate(TICKETS[:1], Landing())
    finally:
        second.close()
    c = second.counts
    assert (c.calls_replayed, c.calls_diverged, c.calls_generated) == (3, 3, 3)
    assert audit_agent_log(tmp_path, violations := []) == 6 and not violations
    # the launch's own account (its agent_replay event) is checked against the log
    said = {"event": "agent_replay", "attempt": 1, "tool_calls_repeated": 0}
    audit_agent_log(tmp_path, violations := [], events=[{**said, "agent_calls_diverged": 3}])
    assert not violations
    audit_agent_log(tmp_path, violations := [], events=[{**said, "agent_calls_diverged": 2}])
    assert violations == [
        "I11: attempt 1's agent_replay says agent_calls_diverged=2, the agent log 3"
    ]
    # negative control: a completion generated again without a divergence is a violation
    lines = log_path.read_text().splitlines()
    log_path.write_text(
        "\n".join([*lines, lines[-1].replace('"diverged":true', '"diverged":false')]) + "\n"
    )
    audit_agent_log(tmp_path, violations := [])
    assert any("generated again" in v for v in violations), violations


def test_a_failing_agent_is_tried_again_then_stops_the_run_naming_it(tok, tmp_path):
    runs = agent_runs(tok, "odd_agents:raises", AgentLog(None), retries=1)
    try:
        with pytest.raises(RolloutFatal, match=r"ordinal 0 sample \d .*2 tries.*broken agent"):
            runs.generate(TICKETS[:1], Landing())
    finally:
        runs.close()
    assert runs.counts.runs_failed >= 2
    silent = agent_runs(tok, "odd_agents:silent", AgentLog(None), retries=0)
    try:
        with pytest.raises(RolloutFatal, match="never called the model"):
            silent.generate(TICKETS[:1], Landing())
    finally:
        silent.close()


def test_an_agent_returning_named_parts_trains_its_reward_entry_and_logs_each_part(
    tok, monkeypatch
):
    runs = agent_runs(tok, "odd_agents:named_parts", AgentLog(None))
    landing = Landing()
    try:
        runs.generate(TICKETS[:1], landing)
    finally:
        runs.close()
    (group,) = landing.groups
    assert group.rewards.tolist() == [0.5, 1.5, 2.5]
    assert {k: v.tolist() for k, v in group.reward_components.items()} == {
        "correct": [0.0, 1.0, 2.0],
        "format": [1.0, 1.0, 1.0],
    }
    monkeypatch.setenv("ODD_AGENT_BAD_PARTS", "1")
    bad = agent_runs(tok, "odd_agents:named_parts", AgentLog(None), retries=0)
    try:
        with pytest.raises(RolloutFatal, match=r"'correct'.*not numbers"):
            bad.generate(TICKETS[:1], Landing())
    finally:
        bad.close()


def test_a_limit_ends_a_run_once_and_data_reward_fn_scores_it(tok, tmp_path):
    pool = RewardPool("asyncrl.tasks.rewards:exact_match", {})
    runs = agent_runs(tok, "odd_agents:greedy", AgentLog(None), max_calls=2, pool=pool)
    landing = Landing()
    try:
        runs.generate(TICKETS[:1], landing)
    finally:
        runs.close()
    (group,) = landing.groups
    assert runs.counts.runs_ended_by_limit == 3 and runs.counts.runs_failed == 0
    assert runs.counts.calls == 6  # two calls each, the third refused
    assert group.rewards.tolist() == [0.0, 0.0, 0.0]


class ScriptedEngine(RecordingEngine):
    """Answers a request whose prompt holds no tool answer yet with a hermes tool call for
    the example's sum, and one that does with a boxed answer."""

    def __init__(self, tok, eos: int) -> None:
        super().__init__(eos)
        self.tok = tok

    def generate(self, requests, version=None, max_tokens=None):
        self.passes.append(len(requests))
        outs = []
        for r in requests:
            prompt = self.tok.decode(r.prompt_ids)
            if "<tool_response>" in prompt:
                text = "The answer is \\boxed{4}."
            else:
                call = '{"name": "calculate", "arguments": {"expression": "2+2"}}'
                text = f"<tool_call>\n{call}\n</tool_call>"
            ids = [*self.tok(text, add_special_tokens=False)["input_ids"], self.eos]
            self.outputs.append(ids)
            mask = torch.ones(1, len(ids), dtype=torch.bool)
            outs.append(
                GenerationOutput(
                    torch.tensor([ids]), mask, torch.full((1, len(ids)), -0.5), 3, mask[:, 0]
                )
            )
        return outs


@pytest.mark.slow
def test_an_agents_sdk_agent_calls_its_journaled_tool_and_replays_it_after_a_kill(
    tok, tmp_path, monkeypatch
):
    from asyncrl.models.scratch import TOOL_CHAT_TEMPLATE

    tools_tok = train_tokenizer(400, chat=True)
    tools_tok.chat_template = TOOL_CHAT_TEMPLATE
    eos = tools_tok.convert_tokens_to_ids("<|im_end|>")
    journal = tmp_path / "tool.journal"
    monkeypatch.setenv("AGENT_TOOL_JOURNAL", str(journal))
    log_path = tmp_path / "agent_calls.jsonl"
    pool = RewardPool("asyncrl.tasks.rewards:math_reward", {})
    limits = AgentLimits(4, 256, 64, 60.0, 0, 4096)

    def runs_with(log):
        engine = ScriptedEngine(tools_tok, eos)
        return AgentRuns(load_agent("sdk_agent:run"), "sdk_agent:run", EXAMPLES, tools_tok, eos,
                         engine, 2, 0, limits, log, pool)  # fmt: skip

    first = runs_with(AgentLog(log_path))
    landing = Landing()
    try:
        first.generate(TICKETS[1:2], landing)  # "What is 1 plus 2?" answered 4: reward 0
    finally:
        first.close()
    (group,) = landing.groups
    assert first.counts.runs_calling_tools == 2 and first.counts.tools.executed == 2
    assert first.counts.prefix_breaks == 0 and group.row_samples is None  # one sequence each
    assert len(journal.read_text().split()) == 2
    # the second call continued the first: tool call, tool answer, final answer in one row
    text = tools_tok.decode(group.completion_ids[0][group.completion_mask[0]].tolist())
    assert text.index("<tool_call>") < text.index("<tool_response>\n4\n") < text.index("boxed{4}")
    # a relaunch answers the calls and the tool from the log
    log = AgentLog(log_path)
    log.load(0, lambda ordinal: True)
    again = runs_with(log)
    landing2 = Landing()
    try:
        again.generate(TICKETS[1:2], landing2)
    finally:
        again.close()
    assert again.engine.passes == [] and again.counts.tools.replayed == 2
    assert len(journal.read_text().split()) == 2
    assert torch.equal(landing2.groups[0].completion_ids, group.completion_ids)
