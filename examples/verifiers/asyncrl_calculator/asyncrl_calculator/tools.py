"""The calculator tool server. verifiers serves it in a process of its own, started as
`python -m asyncrl_calculator.tools` with its config in the VF_CONFIG environment variable, and
the agent's harness reaches it over MCP; the model sees the tool as `calc_calculate`.

When the config names a journal file, each execution of the tool appends one JSON line to it:
{"expression": ..., "result": ..., "pid": ..., "time": ...}, flushed and fsynced before the tool
answers. The journal is the record of how often the tool really ran."""

from __future__ import annotations

import json
import os
import time

import verifiers.v1 as vf

from asyncrl_calculator import arithmetic

TOOL_PREFIX = "calc"
TOOL_NAME = f"{TOOL_PREFIX}_calculate"
"""The name the model calls the tool by: verifiers prefixes a tool with its server's name."""


class CalculatorToolsConfig(vf.SharedToolsetConfig):
    """The calculator server's config: the SharedToolsetConfig fields (its runtime, default a
    local subprocess; or the url of a server already running) and the journal."""

    journal: str | None = None
    """A file each execution of the tool appends one JSON line to; None keeps no journal.
    A path the server's process can write (an absolute one for a subprocess runtime)."""


class CalculatorToolset(vf.Toolset[CalculatorToolsConfig]):
    """One tool, `calculate`, shared by every rollout of the taskset."""

    TOOL_PREFIX = TOOL_PREFIX

    @vf.tool
    async def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression of numbers, + - * / and ( ), e.g. "37 * 12 + 5"."""
        # The docstring's one line is the tool's description the model reads (as written).
        result = arithmetic.calculate(expression)
        if self.config.journal:
            record = {
                "expression": expression,
                "result": result,
                "pid": os.getpid(),
                "time": time.time(),
            }
            with open(self.config.journal, "a", encoding="utf-8") as journal:
                journal.write(json.dumps(record) + "\n")
                journal.flush()
                os.fsync(journal.fileno())
        return result


if __name__ == "__main__":
    CalculatorToolset.run()
