"""An OpenAI Agents SDK agent from outside the package: one function tool, journaled through
`ctx.tool`, whose body records every execution in its own journal (`AGENT_TOOL_JOURNAL`)."""

from __future__ import annotations

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from loop_agent import record_execution

set_tracing_disabled(True)


def evaluate(expression: str, idempotency_key: str = "") -> str:
    record_execution(idempotency_key)
    allowed = set("0123456789+-*/(). ")
    if not expression or set(expression) - allowed:
        return "error"
    try:
        return str(eval(expression, {"__builtins__": {}}))  # digits and operators only
    except Exception:
        return "error"


async def run(client, example, ctx):
    @function_tool
    async def calculate(expression: str) -> str:
        """Evaluates an arithmetic expression."""
        return await ctx.tool("calculate", evaluate, expression)

    agent = Agent(
        name="calculator",
        instructions="Use the calculate tool, then answer in \\boxed{}.",
        tools=[calculate],
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
        model_settings=ModelSettings(temperature=1.0),
    )
    try:
        await Runner.run(agent, example.prompt, max_turns=3)
    except Exception as err:  # the SDK's MaxTurnsExceeded: the run ends, scored as it is
        if type(err).__name__ != "MaxTurnsExceeded":
            raise
    return None
