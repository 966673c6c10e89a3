"""The journal environment's tool server: verifiers runs it as `python -m journal_calc.tools`."""

from __future__ import annotations

import json
import os

import verifiers.v1 as vf

from asyncrl.tasks.tools import calculate as evaluate


class JournalToolsConfig(vf.SharedToolsetConfig):
    journal: str | None = None


class JournalToolset(vf.Toolset[JournalToolsConfig]):
    TOOL_PREFIX = None

    @vf.tool
    async def calculate(self, expression: str) -> str:
        """Evaluates an arithmetic expression: numbers, + - * / and parentheses."""
        result = evaluate(expression)
        if self.config.journal:
            with open(self.config.journal, "a", encoding="utf-8") as journal:
                journal.write(json.dumps({"expression": expression, "pid": os.getpid()}) + "\n")
                journal.flush()
                os.fsync(journal.fileno())
        return result


if __name__ == "__main__":
    JournalToolset.run()
