"""The agent example's agents (`agent.name=asyncrl.examples.agents:sdk_calculator`,
`configs/agent_demo.yaml`): a word problem answered with a `calculate` tool, by real clients
against the run's own OpenAI-compatible endpoint, the one on the OpenAI Agents SDK and the other
a plain `openai` loop. Both send the same conversation (`agent_math.opening`: the instructions,
the question) and the same `tools` (`agent_math.TOOLS`), which the example's model was
warm-started on, and both run the tool through `ctx.tool`, so a run replayed after a kill gets
the logged results and the calculator does not run again.

Each returns None: `data.reward_fn` (`math`) scores the run's last completion's text (its
content; a tool call in it is not text), so a run that ends on a tool call scores 0. Whatever the
model writes, a run ends normally: no tool call is a final answer, a malformed call (not JSON,
no `calculate`, no expression) ends it, and so do the agent's own turn limits. Errors of the
endpoint (a run ended by `agent.max_calls` or `agent.max_tokens`, the run stopping) are left to
raise: the runtime knows what they mean.
"""

from __future__ import annotations

import contextlib
import json
from typing import TYPE_CHECKING, Any

import openai
from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from asyncrl.examples.agent_math import CALCULATE_DESCRIPTION, TOOLS, opening
from asyncrl.tasks.tools import calculate as evaluate

if TYPE_CHECKING:
    from asyncrl.agents.context import AgentContext

MAX_TURNS = 4
"""The SDK agent's turns (model calls) at most; `agent.max_calls` bounds both agents too."""
MAX_CALLS = 3
"""The loop agent's model calls at most."""


def conversation(example: Any) -> list[dict[str, Any]]:
    """The example's opening: its system message (the instructions; `agent_math`'s when it has
    none) and its last user message (or its prompt text)."""
    messages = list(example.messages or ())
    users = [str(m["content"]) for m in messages if m["role"] == "user"]
    opened = opening(users[-1] if users else str(example.prompt))
    systems = [str(m["content"]) for m in messages if m["role"] == "system"]
    if systems:
        opened[0] = {"role": "system", "content": systems[0]}
    return opened


async def sdk_calculator(client: openai.AsyncOpenAI, example: Any, ctx: AgentContext) -> None:
    """An Agents SDK agent with one function tool, `calculate(expression)`, run for at most
    `MAX_TURNS` turns; its tool runs `ctx.tool("calculate", evaluate, expression)`."""
    set_tracing_disabled(True)  # no trace export: runs are offline and many
    system, user = conversation(example)

    async def calculate(expression: str) -> str:
        return str(await ctx.tool("calculate", evaluate, expression))

    agent = Agent(
        name="calculator",
        instructions=str(system["content"]),
        tools=[
            function_tool(
                calculate,
                name_override="calculate",
                description_override=CALCULATE_DESCRIPTION,
                use_docstring_info=False,
                failure_error_function=None,  # a call it cannot run ends the run (raises)
            )
        ],
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
        model_settings=ModelSettings(tool_choice="auto"),
    )
    # a call to a tool it does not have, or no answer in time: the run ends there
    with contextlib.suppress(MaxTurnsExceeded, ModelBehaviorError):
        await Runner.run(agent, str(user["content"]), max_turns=MAX_TURNS)
    return None


async def loop_calculator(client: openai.AsyncOpenAI, example: Any, ctx: AgentContext) -> None:
    """Chat completions with `tools=TOOLS` in a loop of at most `MAX_CALLS` calls: each tool
    call of a completion is run (`ctx.tool`) and answered, until a completion calls none."""
    messages: list[dict[str, Any]] = conversation(example)
    for call in range(MAX_CALLS):
        response = await client.chat.completions.create(
            model="policy",
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
        )
        message = response.choices[0].message
        tool_calls = [c for c in message.tool_calls or [] if c.type == "function"]
        if not tool_calls or call == MAX_CALLS - 1:
            return None
        expressions = [_expression(c.function.name, c.function.arguments) for c in tool_calls]
        if None in expressions:
            return None  # a malformed call: the run ends on it
        messages.append(
            {
                "role": "assistant",
                "content": message.content or "",
                "tool_calls": [
                    c.model_dump(include={"id", "type", "function"}) for c in tool_calls
                ],
            }
        )
        for tool_call, expression in zip(tool_calls, expressions, strict=True):
            result = await ctx.tool("calculate", evaluate, expression)
            messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": result})
    return None


def _expression(name: str, arguments: str) -> str | None:
    """A `calculate` call's expression, or None where the call is not one."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return None
    if name != "calculate" or not isinstance(parsed, dict):
        return None
    expression = parsed.get("expression")
    return expression if isinstance(expression, str) else None
