"""The agent example (`make agent-demo`): its generated files (the tools template, a model
warm-started to call the calculator in part of its runs, measured by sampling), its two agents
driven by real clients (the Agents SDK, `openai`) against a scripted OpenAI-compatible endpoint,
and the report on a hand-written `metrics.jsonl`."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from helpers import read_records, run_cli
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.examples import agent_report
from asyncrl.examples.agent_math import (
    MAX_POSITIONS,
    TOOLS,
    conversation_tokens,
    expression,
    prepare,
    tool_call_share,
)
from asyncrl.examples.agents import loop_calculator, sdk_calculator
from asyncrl.examples.math_chat import SYSTEM_PROMPT, problems
from asyncrl.models.scratch import TOOL_CHAT_TEMPLATE
from asyncrl.tasks.examples import Example
from asyncrl.tasks.tools import calculate

AGENTS = [sdk_calculator, loop_calculator]


def test_every_problem_has_an_expression_the_calculator_answers_right():
    for question, answer in problems():
        assert calculate(expression(question)) == str(answer), question


# -- the agents, against a scripted endpoint ------------------------------------------------


class ScriptedEndpoint:
    """Chat completions over `httpx.MockTransport`: each request is answered with the next of
    `texts` as the model's completion, its `<tool_call>` blocks parsed as the run's hermes
    parser does (a block that is not a JSON object with a name is text). Past the script: 500."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = list(texts)
        self.requests: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(json.loads(request.content))
        if not self.texts:
            error = {"message": "past the script", "type": "x", "param": None, "code": None}
            return httpx.Response(500, json={"error": error})
        text = self.texts.pop(0)
        calls = []
        for block in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S):
            try:
                parsed = json.loads(block)
            except ValueError:
                continue
            if isinstance(parsed, dict) and isinstance(parsed.get("name"), str):
                function = {"name": parsed["name"], "arguments": json.dumps(parsed["arguments"])}
                number = len(self.requests)
                calls.append({"id": f"call_{number}", "type": "function", "function": function})
        message: dict[str, Any] = {"role": "assistant", "content": None if calls else text}
        if calls:
            message["tool_calls"] = calls
        choice = {
            "index": 0,
            "message": message,
            "finish_reason": "tool_calls" if calls else "stop",
        }
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        body = {"id": "c", "object": "chat.completion", "created": 0, "model": "policy"}
        return httpx.Response(200, json={**body, "choices": [choice], "usage": usage})

    def client(self) -> openai.AsyncOpenAI:
        transport = httpx.AsyncClient(transport=httpx.MockTransport(self))
        return openai.AsyncOpenAI(
            api_key="k", base_url="http://endpoint/v1", max_retries=0, http_client=transport
        )


@dataclass
class Journal:
    """A `ctx` that runs each tool and keeps what it ran."""

    seed: int = 0
    calls: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)

    async def tool(self, name: str, fn: Any, *args: Any) -> Any:
        self.calls.append((name, args))
        return fn(*args)


def run(agent: Any, texts: list[str]) -> tuple[Any, ScriptedEndpoint, Journal]:
    endpoint, ctx = ScriptedEndpoint(texts), Journal()
    example = Example(
        prompt="What is 7 times 8?",
        answer="56",
        origin="test",
        messages=({"role": "user", "content": "What is 7 times 8?"},),
    )
    returned = asyncio.run(agent(endpoint.client(), example, ctx))
    return returned, endpoint, ctx


def call(name: str, arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.mark.parametrize("agent", AGENTS, ids=lambda a: a.__name__)
def test_an_agent_runs_the_calculator_through_ctx_and_sends_its_answer_back(agent):
    returned, endpoint, ctx = run(agent, [call("calculate", {"expression": "7*8"}), "\\boxed{56}"])
    assert returned is None  # the math reward scores the last answer
    assert ctx.calls == [("calculate", ("7*8",))]
    first, second = endpoint.requests
    assert first["messages"] == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "What is 7 times 8?"},
    ]
    assert first["tools"] == second["tools"] == TOOLS  # what the model was warm-started on
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "56"}


@pytest.mark.parametrize("agent", AGENTS, ids=lambda a: a.__name__)
@pytest.mark.parametrize(
    "text",
    [
        "\\boxed{3}",
        "some garbage",
        "<tool_call>{not json</tool_call>",
        call("search", {"query": "7*8"}),
        call("calculate", {}),
        call("calculate", {"expression": 7}),
    ],
    ids=["answer", "garbage", "not-json", "unknown-tool", "no-expression", "not-a-string"],
)
def test_an_agent_ends_without_error_on_an_answer_or_a_malformed_call(agent, text):
    returned, endpoint, ctx = run(agent, [text])
    assert returned is None
    assert len(endpoint.requests) == 1
    assert ctx.calls == []


@pytest.mark.parametrize(("agent", "num_requests"), [(sdk_calculator, 4), (loop_calculator, 3)])
def test_an_agent_that_only_calls_tools_ends_at_its_turn_limit(agent, num_requests):
    returned, endpoint, _ = run(agent, [call("calculate", {"expression": "1+1"})] * 5)
    assert returned is None
    assert len(endpoint.requests) == num_requests


# -- the generated files ------------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return prepare(tmp_path_factory.mktemp("agent_math"))


@pytest.mark.slow
def test_the_tokenizer_has_the_tools_template_and_a_conversation_fits_twice(files):
    tokenizer = AutoTokenizer.from_pretrained(files["model"])
    assert tokenizer.chat_template == TOOL_CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tools=TOOLS, tokenize=False
    )
    assert '"name": "calculate"' in text
    longest = max(conversation_tokens(tokenizer, q, a) for q, a in problems())
    assert 2 * longest <= MAX_POSITIONS
    call_text = call("calculate", {"expression": "7*8"})  # what the hermes parser reads
    arguments = {"expression": "7*8"}
    tool_call = {"type": "function", "function": {"name": "calculate", "arguments": arguments}}
    assert call_text in tokenizer.apply_chat_template(
        [{"role": "user", "content": "?"}, {"role": "assistant", "tool_calls": [tool_call]}],
        tools=TOOLS,
        tokenize=False,
    )
    assert len(tokenizer(call_text)["input_ids"]) <= 30  # learnt merges: a compact call


@pytest.mark.slow
def test_the_warm_started_model_calls_the_tool_in_a_fifth_to_a_half_of_fresh_runs(files):
    """A real measurement: 256 fresh runs (the 64 held-out problems, 4 each) sampled at
    temperature 1 with a fixed seed. Calling the tool must pay: RL has that to learn."""
    tokenizer = AutoTokenizer.from_pretrained(files["model"])
    model = AutoModelForCausalLM.from_pretrained(files["model"])
    test = list(problems())[:64]
    measured = tool_call_share(model, tokenizer, test * 4, seed=0)
    assert 0.2 <= measured["tool_call_share"] <= 0.5, measured
    assert measured["correct_calling"] >= measured["correct_direct"] + 0.4, measured


# -- the report -----------------------------------------------------------------------------


def test_the_report_compares_the_first_and_last_quarter_of_the_steps(tmp_path, capsys):
    """8 steps of 2 prompts with 2 runs each: quarters of 2 steps, 4 runs a step. Step 3 is
    recorded twice (a resume trained it again: the last record counts) and step 6's counter
    started again from 0 (a resumed process). Runs calling tools per step: 1, 1 | 1, 2, 2, 3 |
    3, 3, so the first quarter's share is 2/8, the last's 6/8; rewards 0.1, 0.3 -> 0.8, 1.0.
    `agent/runs` (runs started, a step ahead) is not the denominator."""
    rows = [
        (0, 0.1, 1),
        (1, 0.3, 2),
        (2, 0.5, 3),
        (3, 0.0, 99),  # replaced by the next record
        (3, 0.5, 5),
        (4, 0.5, 7),
        (5, 0.6, 10),
        (6, 0.8, 3),  # the counter from 0 again
        (7, 1.0, 6),
    ]
    lines = [
        json.dumps(
            {
                "step": step,
                "prompt_ordinals": [2 * step, 2 * step + 1],
                "reward_mean": reward,
                "agent/runs": 4 * step + 8,
                "agent/runs_calling_tools": calling,
            }
        )
        for step, reward, calling in rows
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "config.yaml").write_text("rollout:\n  num_generations_per_prompt: 2\n")
    agent_report.main([str(tmp_path)])
    assert "reward: 0.200 -> 0.900, tool calls: 25% -> 75% of runs" in capsys.readouterr().out
    assert (tmp_path / "plots" / "agent.png").stat().st_size > 0
    points = agent_report.read_points(tmp_path)
    assert [p.num_calling for p in points] == [1, 1, 1, 2, 2, 3, 3, 3]
    assert [p.num_runs for p in points] == [4] * 8


@pytest.mark.slow
@pytest.mark.parametrize("agent", AGENTS, ids=lambda a: a.__name__)
def test_the_demo_config_trains_each_agent_end_to_end(files, tmp_path, repo_root, agent):
    run = tmp_path / "run"
    overrides = [
        f"model.path={files['model']}",
        f"data.path={files['train']}",
        f"agent.name=asyncrl.examples.agents:{agent.__name__}",
        "run.max_num_steps=3",
        "logging.progress=false",
    ]
    done = run_cli("train", str(repo_root / "configs/agent_demo.yaml"), "--run-dir", str(run),
                   *overrides)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_records(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[-1]["agent/runs_failed"] == 0 and records[-1]["agent/prefix_breaks"] == 0
    assert records[-1]["agent/runs_calling_tools"] > 0
    assert records[-1]["agent/tools_executed"] > 0
    assert run_cli("audit", str(run)).returncode == 0
    points = agent_report.read_points(run)
    assert [p.num_runs for p in points] == [16, 16, 16]  # 4 prompts, 4 runs each
    assert "tool calls:" in agent_report.summary(points)
