"""The calculator taskset: arithmetic questions with two operands ("What is 37 * 12? Use the
calculator tool, then give the final answer as a number."), generated from the config alone,
each answered by an agent that may call the `calc_calculate` tool (see `tools`).

Rewards on each trace: `correct` (weight 1.0) is 1.0 when the last number of the final reply is
the answer; `used_tool` (weight 0.1) is 1.0 when the model called the calculator. The metric
`tool_calls` counts those calls. The harness must speak MCP (the `null` harness does)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import verifiers.v1 as vf
from pydantic import Field

from asyncrl_calculator.arithmetic import QUESTION, is_correct, questions
from asyncrl_calculator.tools import TOOL_NAME, CalculatorToolsConfig, CalculatorToolset


class CalculatorData(vf.TaskData):
    """One question: `id` is "<split>-<position>", `prompt` the question."""

    expression: str
    """The arithmetic asked about, e.g. "37 * 12"."""
    answer: int
    """Its value."""


def calculator_calls(trace: vf.Trace) -> int:
    """How many calls of the calculator tool the model made in `trace` (the tool calls of its
    replies, whatever their results)."""
    return sum(
        call.name == TOOL_NAME
        for message in trace.assistant_messages
        for call in message.tool_calls or []
    )


class CalculatorTask(vf.Task[CalculatorData]):
    """One question, scored on its trace."""

    @property
    def key(self) -> str:
        """The task's durable id ("train-17"): the same for the same config, run after run."""
        assert self.data.id is not None
        return self.data.id

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1.0 when the last number of the final reply equals the answer, else 0.0."""
        return float(is_correct(trace.last_reply, self.data.answer))

    @vf.reward(weight=0.1)
    async def used_tool(self, trace: vf.Trace) -> float:
        """1.0 when the model called the calculator at least once, else 0.0."""
        return float(calculator_calls(trace) > 0)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        """The number of calculator calls the model made."""
        return float(calculator_calls(trace))


class CalculatorConfig(vf.TasksetConfig):
    """Which questions load (`--env.taskset.*`), and the calculator server's config."""

    num_tasks: int = Field(200, ge=1)
    """How many questions the taskset holds."""
    split: Literal["train", "test"] = "train"
    """The split: each draws from its own seed, and no question is in both."""
    journal: str | None = None
    """A file the calculator server appends one JSON line to per execution (see `tools`);
    it overrides `tools.journal`. A relative path is resolved against the current directory
    when the server is built."""
    tools: CalculatorToolsConfig = CalculatorToolsConfig()
    """The calculator server's config (its runtime, url and journal)."""


class CalculatorTaskset(vf.Taskset[CalculatorTask, CalculatorConfig]):
    """`num_tasks` questions of `split`, the same for the same config."""

    def load(self) -> list[CalculatorTask]:
        split = self.config.split
        return [
            CalculatorTask(
                CalculatorData(
                    id=f"{split}-{i}",
                    prompt=QUESTION.format(expression=expression),
                    expression=expression,
                    answer=answer,
                ),
                self.config.task,
            )
            for i, (expression, answer) in enumerate(questions(split, self.config.num_tasks))
        ]

    @classmethod
    def toolsets(cls, config: CalculatorConfig) -> list[vf.Toolset]:
        """The calculator server, shared by all the taskset's rollouts, with the taskset's
        `journal` (made absolute) in its config when one is set."""
        tools = config.tools
        if config.journal is not None:
            journal = str(Path(config.journal).resolve())
            tools = tools.model_copy(update={"journal": journal})
        return [CalculatorToolset(tools)]
