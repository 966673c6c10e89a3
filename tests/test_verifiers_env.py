"""`agent.name=verifiers:MODULE` without processes (`asyncrl.agents.verifiers_env`): loading an
environment and what is refused, the rows it makes, the rubric's reward, and the tool journal's
request hook against hand-built requests. The runs themselves (episodes through the endpoint,
kills, replay) are tests/test_verifiers_crash.py's."""

from __future__ import annotations

import textwrap

import pytest
import verifiers.v1 as vf
from verifiers.v1.types import AssistantMessage, Request, ToolCall, ToolMessage, UserMessage

from asyncrl.agents.agent_log import AgentLog
from asyncrl.agents.context import AgentContext, ToolCounts
from asyncrl.agents.verifiers_env import (
    UNREAD,
    ToolJournal,
    episode_scores,
    journaled,
    load_env,
)
from asyncrl.config import ConfigError
from asyncrl.tasks.examples import examples_sha256


def test_a_module_that_is_not_installed_is_an_error_naming_it_and_how_to_install():
    with pytest.raises(ConfigError) as err:
        load_env("verifiers:no_such_environment", {}, 8)
    message = str(err.value)
    assert "no_such_environment" in message and "pip install -e" in message
    assert "prime env install" in message


def test_a_module_whose_own_import_is_missing_is_an_error_naming_that_import(tmp_path, monkeypatch):
    (tmp_path / "needs_more.py").write_text("import no_such_dependency_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="imports 'no_such_dependency_here'"):
        load_env("verifiers:needs_more", {}, 8)


def test_settings_the_taskset_does_not_take_are_an_error_naming_agent_args():
    with pytest.raises(ConfigError, match=r"agent\.args"):
        load_env("verifiers:asyncrl_calculator", {"split": "validation"}, 8)


def test_the_calculator_loads_on_this_host_its_tasks_the_rows():
    env = load_env("verifiers:asyncrl_calculator", {"num_tasks": 12, "split": "test"}, 3, 96)
    assert len(env.tasks) == 12
    spec = env.env.config.agent
    assert spec.harness.id == "null" and spec.runtime.type == "subprocess"
    # agent.max_calls and agent.max_tokens: verifiers ends and scores the episode first
    assert spec.max_turns == 3 and spec.max_output_tokens == 96
    examples = env.examples()
    assert [e.prompt for e in examples] == [t.data.prompt_text for t in env.tasks]
    assert all(env.task_of(e) is t for e, t in zip(examples, env.tasks, strict=True))
    again = load_env("verifiers:asyncrl_calculator", {"num_tasks": 12, "split": "test"}, 3)
    other = load_env("verifiers:asyncrl_calculator", {"num_tasks": 12, "split": "train"}, 3)
    assert examples_sha256(again.examples()) == examples_sha256(examples)  # I8: the identity
    assert examples_sha256(other.examples()) != examples_sha256(examples)


REFUSED = {
    "sandbox_seat": (
        """
        class Env(vf.Env[Config]):
            async def run(self, task, agents):
                await agents.agent.run(task)
        """,
        "class Config(vf.EnvConfig):\n    agent: vf.AgentConfig = "
        'vf.AgentConfig(harness={"id": "null"}, runtime={"type": "prime"})',
        "'prime' runtime",
    ),
    "shell_seat": (
        """
        class Env(vf.Env[Config]):
            async def run(self, task, agents):
                await agents.agent.run(task)
        """,
        "class Config(vf.EnvConfig):\n    agent: vf.AgentConfig = "
        'vf.AgentConfig(harness={"id": "bash"})',
        "harness 'bash' runs the model's commands",
    ),
    "remote_model": (
        """
        class Env(vf.Env[Config]):
            async def run(self, task, agents):
                await agents.agent.run(task)
        """,
        "class Config(vf.EnvConfig):\n    agent: vf.AgentConfig = "
        'vf.AgentConfig(harness={"id": "null"}, model="gpt-4.1-mini")',
        "pinned to another model or endpoint (gpt-4.1-mini)",
    ),
    "retried_seat": (
        """
        class Env(vf.Env[Config]):
            async def run(self, task, agents):
                await agents.agent.run(task)
        """,
        "class Config(vf.EnvConfig):\n    agent: vf.AgentConfig = "
        'vf.AgentConfig(harness={"id": "null"}, retries={"max_retries": 3})',
        "seat 'agent' sets retries",
    ),
    "two_seats": (
        """
        class Env(vf.Env[Config]):
            async def run(self, task, agents):
                await agents.agent.run(task)
                await agents.judge.run(task)
        """,
        "class Config(vf.EnvConfig):\n    agent: vf.AgentConfig = "
        'vf.AgentConfig(harness={"id": "null"})\n    judge: vf.AgentConfig = '
        'vf.AgentConfig(harness={"id": "null"})',
        "2 agent seats (agent, judge)",
    ),
    "image_task": ("", "", "container image 'ubuntu:24.04'"),
    "remote_tools": ("", "", "remote service (http://tools.example/mcp)"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_needs_a_sandbox_or_a_remote_service_is_refused_with_its_reason(
    name, tmp_path, monkeypatch
):
    env_class, env_config, reason = REFUSED[name]
    image = "'ubuntu:24.04'" if name == "image_task" else "None"
    url = "'http://tools.example/mcp'" if name == "remote_tools" else "None"
    source = textwrap.dedent(
        f"""
        import verifiers.v1 as vf

        class Tools(vf.Toolset[vf.SharedToolsetConfig]):
            @vf.tool
            async def echo(self, text: str) -> str:
                \"\"\"Echo.\"\"\"
                return text

        class Set(vf.Taskset[vf.Task, vf.TasksetConfig]):
            def load(self):
                return [vf.Task(vf.TaskData(idx=0, prompt="hi", image={image}), self.config.task)]

            @classmethod
            def toolsets(cls, config):
                return [Tools(vf.SharedToolsetConfig(url={url}))] if {url} else []
        """
    )
    source += "\n" + env_config + "\n" + textwrap.dedent(env_class)
    exports = ["Set"] + (["Env"] if env_class else [])
    source += f"\n__all__ = {exports!r}\n"
    (tmp_path / f"refused_{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as err:
        load_env(f"verifiers:refused_{name}", {}, 8)
    assert "refused" in str(err.value) and reason in str(err.value), str(err.value)


class _Trace:
    def __init__(self, rewards: dict[str, tuple[float, float]]) -> None:
        self.rewards = {n: vf.Reward(score=s, weight=w) for n, (s, w) in rewards.items()}
        self.reward = sum(r.value for r in self.rewards.values())


class _Episode:
    def __init__(self, *traces: _Trace) -> None:
        self.traces = list(traces)


def test_the_reward_is_the_rubrics_weighted_sum_and_each_function_is_logged():
    one = _Episode(_Trace({"correct": (1.0, 1.0), "used_tool": (1.0, 0.1)}))
    assert episode_scores(one) == {"correct": 1.0, "used_tool": 1.0, "reward": 1.1}
    two = _Episode(_Trace({"payoff": (2.0, 1.0)}), _Trace({"payoff": (-2.0, 1.0)}))
    assert episode_scores(two) == {"payoff": 0.0, "reward": 0.0}  # seats averaged


def _ctx(log: AgentLog, counts: ToolCounts) -> AgentContext:
    return AgentContext(seed=0, ordinal=3, sample=1, attempt=0, run_id="r", log=log, counts=counts)


def _branch(*results: tuple[str, str]) -> list:
    calls = [ToolCall(id=f"c{i}", name="calc", arguments=f'{{"e": "{i}"}}') for i in range(2)]
    messages = [UserMessage(content="2+2?"), AssistantMessage(content="", tool_calls=calls)]
    return messages + [ToolMessage(tool_call_id=i, content=c, name="calc") for i, c in results]


def test_the_journal_logs_a_tool_at_its_gate_and_its_result_from_the_next_request():
    log, counts = AgentLog(None), ToolCounts()
    journal = ToolJournal(_ctx(log, counts))
    # the gate: verifiers asks for each call of the turn (an empty result for it) as the turn
    # is committed, before the harness runs any
    assert journal.intercept(Request(messages=_branch(("c0", ""))), "tr") is None
    assert journal.intercept(Request(messages=_branch(("c1", ""))), "tr") is None
    assert log.tools_begun == {"3:1:0:t0", "3:1:0:t1"} and not log.tools
    # the next model request carries both results
    assert journal.intercept(Request(messages=_branch(("c0", "4"), ("c1", "9"))), "tr") is None
    assert {k: r["result"] for k, r in log.tools.items()} == {"3:1:0:t0": "4", "3:1:0:t1": "9"}
    assert counts.executed == 2 and counts.replayed == 0

    # the same run replayed: the gate answers from the log, the harness does not run the tool
    replay = ToolJournal(_ctx(log, counts))
    rewritten = replay.intercept(Request(messages=_branch(("c0", ""))), "tr")
    assert rewritten is not None and rewritten.messages[-1].content == "4"
    rewritten = replay.intercept(Request(messages=_branch(("c1", ""))), "tr")
    assert rewritten is not None and rewritten.messages[-1].content == "9"
    assert counts.replayed == 2 and counts.executed == 2


def test_a_replayed_call_with_other_arguments_runs_and_counts_as_diverged():
    log, counts = AgentLog(None), ToolCounts()
    journal = ToolJournal(_ctx(log, counts))
    journal.intercept(Request(messages=_branch(("c0", ""))), "tr")
    journal.intercept(Request(messages=_branch(("c0", "4"))), "tr")
    other = _branch(("c0", ""))
    other[1].tool_calls[0].arguments = '{"e": "other"}'
    assert ToolJournal(_ctx(log, counts)).intercept(Request(messages=other), "tr") is None
    assert counts.diverged == 1 and counts.replayed == 0


def test_a_tool_begun_without_a_result_runs_again_and_is_counted_as_repeated():
    log, counts = AgentLog(None), ToolCounts()
    ToolJournal(_ctx(log, counts)).intercept(Request(messages=_branch(("c0", ""))), "tr")  # killed
    assert (
        ToolJournal(_ctx(log, counts)).intercept(Request(messages=_branch(("c0", ""))), "tr")
        is None
    )
    assert counts.repeated == 1


def test_a_recorded_empty_result_is_replayed_as_a_verdict_that_renders_the_same():
    """An empty result equals the gate's probe, which verifiers would read as no decision (the
    harness would run the tool again): the replay gives it as one empty text part."""
    from asyncrl.agents.tool_calls import template_messages

    log, counts = AgentLog(None), ToolCounts()
    journal = ToolJournal(_ctx(log, counts))
    journal.intercept(Request(messages=_branch(("c0", ""))), "tr")
    journal.intercept(Request(messages=_branch(("c0", ""))), "tr")  # its result: ""
    assert log.tools["3:1:0:t0"]["result"] == ""
    rewritten = ToolJournal(_ctx(log, counts)).intercept(Request(messages=_branch(("c0", ""))), "x")
    assert rewritten is not None and rewritten.messages[-1] != _branch(("c0", ""))[-1]
    wire = rewritten.messages[-1].model_dump(exclude_none=True)  # what the harness sends on
    assert isinstance(wire["content"], list) and template_messages([wire])[0]["content"] == ""
    assert counts.replayed == 1


def test_the_same_call_id_in_two_traces_is_two_calls():
    log, counts = AgentLog(None), ToolCounts()
    journal = ToolJournal(_ctx(log, counts))
    for trace in ("a", "b"):
        journal.intercept(Request(messages=_branch(("c0", ""))), trace)
    assert log.tools_begun == {"3:1:0:t0", "3:1:0:t1"}
    journal.intercept(Request(messages=_branch(("c0", "4"))), "b")
    assert list(log.tools) == ["3:1:0:t1"]


def test_tools_run_after_the_last_allowed_turn_are_settled_unread():
    log, counts = AgentLog(None), ToolCounts()
    journal = ToolJournal(_ctx(log, counts))
    journal.intercept(Request(messages=_branch(("c0", ""))), "tr")
    journal.settle_unread()
    assert log.tools["3:1:0:t0"]["result"] == UNREAD and counts.executed == 1
    assert not journal.begun


def test_a_call_another_hook_already_decided_is_not_journaled():
    log, counts = AgentLog(None), ToolCounts()
    journal = ToolJournal(_ctx(log, counts))
    assert journal.intercept(Request(messages=_branch(("c0", "denied by policy"))), "tr") is None
    assert not log.tools_begun and not log.tools


def test_a_journaled_task_keeps_its_data_and_gets_the_hook_verifiers_calls():
    env = load_env("verifiers:asyncrl_calculator", {"num_tasks": 2}, 3)
    task = env.tasks[1]
    copy = journaled(task, ToolJournal(_ctx(AgentLog(None), ToolCounts())))
    assert copy.hash == task.hash and copy.key == task.key
    assert type(copy).__name__ == type(task).__name__ and isinstance(copy, type(task))
    from verifiers.v1.utils.decorators import discover_decorated

    hooks = [h.__name__ for h in discover_decorated(copy, "intercept")]
    assert "asyncrl_tool_journal" in hooks


def test_the_shared_routes_take_the_run_from_model():
    """`/v1/chat/completions` and `/v1/completions` name the agent run in `model`
    (`sample:KEY`): what `VerifiersAgent` sends, so verifiers' interception server keeps one
    client for the whole run rather than one per sample."""
    import openai
    from test_agent_endpoint import MODEL, SECRET, TOKENIZER, ScriptedBackend

    from asyncrl.agents.endpoint import AgentEndpoint

    backend = ScriptedBackend("Hello.", "Again.", keys=("s0", "s1"))
    with AgentEndpoint(backend, TOKENIZER, SECRET) as endpoint:
        client = openai.OpenAI(base_url=f"{endpoint.url}/v1", api_key=SECRET, max_retries=0)
        hello = [{"role": "user", "content": "hi"}]
        reply = client.chat.completions.create(model="sample:s1", messages=hello)
        assert reply.choices[0].message.content == "Hello." and reply.model == MODEL
        text = client.completions.create(model="sample:s0", prompt="Once", max_tokens=4)
        assert text.choices[0].text == "Again."
        assert [c.sample_key for c in backend.calls] == ["s1", "s0"]
        with pytest.raises(openai.NotFoundError, match="sample:KEY"):
            client.chat.completions.create(model="policy", messages=hello)
        with pytest.raises(openai.NotFoundError, match="no agent run 'gone'"):
            client.chat.completions.create(model="sample:gone", messages=hello)
        assert len(backend.calls) == 2


def test_a_verifiers_run_reads_no_data_keys():
    """Its rows are the environment's: a `data.path` that does not exist is never read."""
    from asyncrl.config.keys import build_config
    from asyncrl.train.components import load_run_task

    config = build_config(
        {},
        [
            "agent.name=verifiers:asyncrl_calculator",
            "agent.args={num_tasks: 5}",
            "data.task=jsonl",
            "data.path=/no/such/file.jsonl",
        ],
    )
    task = load_run_task(config)
    assert [e.origin for e in task.examples] == [
        f"verifiers:asyncrl_calculator[{i}]" for i in range(5)
    ]
