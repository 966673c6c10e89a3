"""The verifiers environments of examples/verifiers/ (`asyncrl_calculator`, `asyncrl_guess`):
their pure parts (the safe calculator, the reading of answers and guesses, the tasks each split
generates), then whole episodes run by verifiers' own machinery (`load_environment`,
`env.serving()`, `env.run_episode`) with the `null` harness in subprocesses, against asyncrl's
OpenAI-compatible endpoint over a scripted backend. The calculator tool's journal says how often
the tool really ran; the backend's calls say what the model was shown."""

from __future__ import annotations

import asyncio
import json
import os
from fractions import Fraction
from types import SimpleNamespace
from typing import Any

import pytest
import verifiers.v1 as vf
from asyncrl_calculator import CalculatorTaskset
from asyncrl_calculator.arithmetic import (
    MAX_EXPRESSION_CHARS,
    CalculationError,
    calculate,
    evaluate,
    is_correct,
    last_number,
    questions,
    split_of,
)
from asyncrl_calculator.taskset import CalculatorConfig, CalculatorTask
from asyncrl_calculator.tools import TOOL_NAME, CalculatorToolset
from asyncrl_guess import GuessEnv, GuessTaskset
from asyncrl_guess.env import GuessConfig, GuessEnvConfig
from asyncrl_guess.game import feedback, parse_guess, secrets_of, verdict
from test_agent_endpoint import MODEL, SECRET, TOKENIZER, ScriptedBackend
from verifiers.v1.envs.single_agent import SingleAgentEnv
from verifiers.v1.types import AssistantMessage, ToolCall
from verifiers.v1.utils.loaders import environment_class, load_environment, resolve_env_config

from asyncrl.agents.endpoint import AgentEndpoint

KEY_VAR = "ASYNCRL_VERIFIERS_TEST_KEY"
"""The environment variable the episodes' client config reads the endpoint's key from."""

SEAT = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}
"""Every seat: the tool-less chat loop (it speaks MCP), in a local subprocess."""


# --- the calculator's pure parts -------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "shown"),
    [
        ("37 * 12 + 5", "449"),
        ("(2 + 3) * 4", "20"),
        ("7 / 2", "3.5"),
        ("1 / 3", "0.333333"),
        ("-3 - -4", "1"),
        ("+2.5 * 2", "5"),
        ("99 - 150", "-51"),
        ("  6/3 ", "2"),
    ],
)
def test_the_calculator_evaluates_arithmetic_exactly(expression, shown):
    assert calculate(expression) == shown
    assert evaluate("0.1 + 0.2") == Fraction(3, 10)  # exact, not 0.30000000000000004


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",
        "2 ** 10",
        "a + 1",
        "1; 2",
        "True + 1",
        "'7' * 3",
        "[1, 2]",
        "1 // 2",
        "(1",
        "1 / 0",
        "1 / (2 - 2)",
        "9" * (MAX_EXPRESSION_CHARS + 1),
    ],
)
def test_the_calculator_refuses_anything_else_with_an_error_message(expression):
    with pytest.raises(CalculationError):
        evaluate(expression)
    assert calculate(expression).startswith("error: ")


@pytest.mark.parametrize(
    ("reply", "number"),
    [
        ("The answer is 444.", 444),
        ("37 * 12 = 444, plus 5 gives 449", 449),
        ("It is -13", -13),
        ("3.5", Fraction(7, 2)),
        ("a total of 1,234 apples", 1234),
        ("first 3, then 4", 4),
        ("no number here", None),
        ("", None),
    ],
)
def test_the_last_number_of_a_reply_is_read_as_its_answer(reply, number):
    assert last_number(reply) == number


def test_an_answer_is_correct_only_when_its_last_number_is_the_answer():
    assert is_correct("I computed 2 + 2, so the answer is 4", 4)
    assert not is_correct("The answer is 4, not 5", 4)
    assert not is_correct("4.5", 4)
    assert not is_correct("I do not know", 4)


def test_the_questions_are_the_same_every_time_and_no_question_is_in_both_splits():
    train = list(questions("train", 2000))
    test = list(questions("test", 2000))
    assert train == list(questions("train", 2000)) and test == list(questions("test", 2000))
    assert not {e for e, _ in train} & {e for e, _ in test}
    assert all(split_of(e) == "train" for e, _ in train)
    assert all(split_of(e) == "test" for e, _ in test)
    for expression, answer in train + test:
        a, op, b = expression.split()
        assert op in "+-*" and answer == evaluate(expression) >= 0
        assert all(2 <= int(n) <= (30 if op == "*" else 99) for n in (a, b))
    assert {e.split()[1] for e, _ in train} == {"+", "-", "*"}
    with pytest.raises(ValueError, match="split"):
        next(questions("dev", 1))


def test_the_taskset_holds_num_tasks_questions_with_durable_keys():
    taskset = CalculatorTaskset(CalculatorConfig(num_tasks=5, split="test"))
    tasks = list(taskset)
    assert [t.key for t in tasks] == [f"test-{i}" for i in range(5)]
    assert [t.data.idx for t in tasks] == list(range(5))
    first = tasks[0].data
    assert first.prompt == (
        f"What is {first.expression}? Use the calculator tool, then give the final answer as "
        "a number."
    )
    assert first.answer == evaluate(first.expression)
    again = list(CalculatorTaskset(CalculatorConfig(num_tasks=5, split="test")))
    assert [t.data for t in again] == [t.data for t in tasks]


def test_the_taskset_hands_its_journal_to_the_shared_calculator_server(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (server,) = CalculatorTaskset.toolsets(CalculatorConfig(journal="calls.jsonl"))
    assert isinstance(server, CalculatorToolset)
    assert server.config.journal == str(tmp_path / "calls.jsonl")  # absolute: the server's cwd
    assert server.server_name == "calc" and TOOL_NAME == "calc_calculate"
    (plain,) = CalculatorTaskset.toolsets(CalculatorConfig())
    assert plain.config.journal is None


def _reply(content: str | None, *calls: str) -> AssistantMessage:
    return AssistantMessage(
        content=content,
        tool_calls=[ToolCall(id=f"c{i}", name=name, arguments="{}") for i, name in enumerate(calls)]
        or None,
    )


def test_the_rewards_read_the_final_reply_and_the_calculator_calls():
    task = CalculatorTask(next(iter(CalculatorTaskset(CalculatorConfig(num_tasks=1)))).data)
    answer = task.data.answer
    used = SimpleNamespace(
        last_reply=f"So it is {answer}.",
        assistant_messages=[_reply(None, TOOL_NAME, TOOL_NAME), _reply(f"So it is {answer}.")],
    )
    other_tool = SimpleNamespace(
        last_reply=str(answer + 1), assistant_messages=[_reply(None, "other_tool")]
    )

    async def score(trace: Any) -> tuple[float, float, float]:
        return (
            await task.correct(trace),
            await task.used_tool(trace),
            await task.tool_calls(trace),
        )

    assert asyncio.run(score(used)) == (1.0, 1.0, 2.0)
    assert asyncio.run(score(other_tool)) == (0.0, 0.0, 0.0)


# --- the guessing game's pure parts ----------------------------------------------------------


def test_a_guess_is_the_last_integer_of_the_reply():
    assert parse_guess("I guess 8") == 8
    assert parse_guess("Between 4 and 12, I say 6.") == 6
    assert parse_guess("no idea") is None


def test_the_feedback_points_at_the_secret():
    assert verdict(8, 8) == "correct"
    assert verdict(3, 8) == "higher" and verdict(12, 8) == "lower"
    assert feedback(3, 8, 16, 2) == "Higher: the number is higher than 3. You have 2 guesses left."
    assert feedback(12, 8, 16, 1) == "Lower: the number is lower than 12. You have 1 guess left."
    assert feedback(None, 8, 16, 3).startswith("I found no number in your reply. Reply with one")
    with pytest.raises(ValueError):
        feedback(8, 8, 16, 3)


def test_the_games_are_the_same_every_time_and_differ_between_splits():
    train = secrets_of("train", 200, 16)
    assert train == secrets_of("train", 200, 16) and train != secrets_of("test", 200, 16)
    assert set(train) == set(range(1, 17))
    tasks = list(GuessTaskset(GuessConfig(num_tasks=3, max_number=10, max_turns=5)))
    assert [t.key for t in tasks] == ["train-0", "train-1", "train-2"]
    assert [t.data.secret for t in tasks] == secrets_of("train", 3, 10)
    assert all(t.data.max_turns == 5 and t.data.prompt is None for t in tasks)


def test_verifiers_pairs_each_taskset_with_its_env():
    assert environment_class("asyncrl-guess") is GuessEnv
    assert environment_class("asyncrl-calculator") is SingleAgentEnv
    config = resolve_env_config({"taskset": {"id": "asyncrl-guess", "max_turns": 6}})
    assert isinstance(config, GuessEnvConfig) and config.taskset.max_turns == 6
    assert config.agent.harness.id == "null" and config.agent.runtime.type == "subprocess"


# --- whole episodes through verifiers --------------------------------------------------------


@pytest.fixture
def endpoint():
    """`endpoint(backend) -> AgentEndpoint` for sample key "s0", started; stopped after."""
    started: list[AgentEndpoint] = []

    def start(backend: ScriptedBackend) -> AgentEndpoint:
        served = AgentEndpoint(backend, TOKENIZER, SECRET)
        served.start()
        started.append(served)
        return served

    yield start
    for served in started:
        served.stop()


def play(env_config: dict, base_url: str, pick) -> list[vf.Episode]:
    """Load the env of `env_config` as verifiers does, serve it (its tool servers included)
    and run one episode for each task `pick(tasks)` returns, one after another."""
    env = load_environment(resolve_env_config(env_config))
    chosen = pick(list(env.taskset))
    ctx = vf.ModelContext(
        client=vf.EvalClientConfig(base_url=base_url, api_key_var=KEY_VAR), model=MODEL
    )

    async def run() -> list[vf.Episode]:
        async with env.serving():
            return [await env.run_episode(task, ctx) for task in chosen]

    episodes = asyncio.run(run())
    for episode in episodes:
        assert episode.ok, episode.errors
        assert all(trace.ok for trace in episode.traces), [t.errors for t in episode.traces]
    return episodes


def tool_call(expression: str) -> str:
    """A reply calling the calculator, as a Qwen-style model writes it."""
    arguments = json.dumps({"name": TOOL_NAME, "arguments": {"expression": expression}})
    return f"<tool_call>\n{arguments}\n</tool_call>"


def tool_results(call: Any) -> list[dict]:
    return [m for m in call.messages if m["role"] == "tool"]


@pytest.mark.slow
def test_calculator_episodes_run_the_tool_once_a_call_and_score_the_answer(
    endpoint, tmp_path, monkeypatch
):
    monkeypatch.setenv(KEY_VAR, SECRET)
    journal = tmp_path / "calculator.jsonl"
    tasks = list(CalculatorTaskset(CalculatorConfig(num_tasks=3)))
    first, second, third = (t.data for t in tasks)
    backend = ScriptedBackend(
        # 1: the tool on the question, then the right answer
        tool_call(first.expression),
        f"The calculator says {first.answer}, so the answer is {first.answer}.",
        # 2: two calls in one reply (one divides by zero), then a wrong answer
        tool_call("1 / 0") + "\n" + tool_call(second.expression),
        f"The answer is {second.answer + 1}.",
        # 3: no tool, the right answer
        f"{third.expression} = {third.answer}",
    )
    served = endpoint(backend)
    episodes = play(
        {
            "taskset": {"id": "asyncrl-calculator", "num_tasks": 3, "journal": str(journal)},
            "agent": SEAT,
        },
        served.base_url("s0"),
        lambda all_tasks: all_tasks,
    )
    traces = [episode.traces[0] for episode in episodes]
    assert [e.task.key for e in episodes] == ["train-0", "train-1", "train-2"]

    # the tool ran once for each call the model made, in its own process, and only then
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    assert [(r["expression"], r["result"]) for r in records] == [
        (first.expression, str(first.answer)),
        ("1 / 0", "error: division by zero"),
        (second.expression, str(second.answer)),
    ]
    assert len({r["pid"] for r in records}) == 1 and records[0]["pid"] != os.getpid()

    # what the model was shown: the tool on every call, each result in the next call
    assert len(backend.calls) == 5
    assert all(TOOL_NAME in [t["function"]["name"] for t in call.tools] for call in backend.calls)
    assert tool_results(backend.calls[0]) == []
    assert [(m["name"], m["content"]) for m in tool_results(backend.calls[1])] == [
        (TOOL_NAME, str(first.answer))
    ]
    assert [m["content"] for m in tool_results(backend.calls[3])] == [
        "error: division by zero",
        str(second.answer),
    ]
    assert tool_results(backend.calls[4]) == []

    def scores(trace: vf.Trace) -> tuple[float, float, float]:
        rewards = trace.rewards
        return rewards["correct"].score, rewards["used_tool"].score, trace.metrics["tool_calls"]

    assert [scores(t) for t in traces] == [(1.0, 1.0, 1.0), (0.0, 1.0, 2.0), (1.0, 0.0, 0.0)]
    assert traces[0].rewards["used_tool"].weight == 0.1
    assert [t.reward for t in traces] == pytest.approx([1.1, 0.1, 1.0])


def pick_secret(tasks: list) -> Any:
    """A game whose secret has numbers on both sides (a guess below and one above it exist)."""
    return next(t for t in tasks if 1 < t.data.secret < t.data.max_number)


@pytest.mark.slow
def test_the_guessing_game_points_at_the_secret_and_scores_a_hit(endpoint, monkeypatch):
    monkeypatch.setenv(KEY_VAR, SECRET)
    tasks = list(GuessTaskset(GuessConfig(num_tasks=20)))
    secret = pick_secret(tasks).data.secret
    backend = ScriptedBackend(
        # 1: below, no number, above, then the secret on the last turn
        f"My first guess is {secret - 1}.",
        "I am not sure.",
        f"Then {secret + 1}",
        f"It must be {secret}",
        # 2: the secret at once
        str(secret),
        # 3: four misses
        *[str(secret + 1)] * 4,
    )
    served = endpoint(backend)
    episodes = play(
        {"taskset": {"id": "asyncrl-guess", "num_tasks": 20}, "agent": SEAT},
        served.base_url("s0"),
        lambda all_tasks: [pick_secret(all_tasks)] * 3,
    )
    solved, at_once, missed = (episode.traces[0] for episode in episodes)

    # each turn's message: the rules, then what the guess before it earned
    told = [call.messages[-1]["content"] for call in backend.calls]
    assert len(told) == 4 + 1 + 4  # no call after a hit, none past the fourth turn
    assert told[0].startswith("I am thinking of a whole number between 1 and 16")
    assert told[1] == f"Higher: the number is higher than {secret - 1}. You have 3 guesses left."
    assert told[2].startswith("I found no number in your reply") and told[2].endswith(
        "2 guesses left."
    )
    assert told[3] == f"Lower: the number is lower than {secret + 1}. You have 1 guess left."
    assert told[4] == told[0] and told[5] == told[0]
    assert told[6:] == [
        f"Lower: the number is lower than {secret + 1}. You have {n} guess{'es' * (n > 1)} left."
        for n in (3, 2, 1)
    ]

    assert solved.info["guess"]["guesses"] == [secret - 1, None, secret + 1, secret]
    assert solved.info["guess"]["verdicts"] == ["higher", "none", "lower", "correct"]
    assert [t.rewards["solved"].score for t in (solved, at_once, missed)] == [1.0, 1.0, 0.0]
    assert [t.metrics["turns"] for t in (solved, at_once, missed)] == [4.0, 1.0, 4.0]
    assert missed.info["guess"]["secret"] == secret and missed.reward == 0.0
    assert all(t.agent.name == "agent" for t in (solved, at_once, missed))
    assert "secret" not in solved.task.data.model_dump()  # the seat's task does not carry it
