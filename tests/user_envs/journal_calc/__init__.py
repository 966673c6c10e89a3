"""A verifiers environment from outside the package, for the crash tests (tests/
test_verifiers_crash.py): the calculator questions `asyncrl.examples.agent_math` writes, as a
taskset whose one tool, `calculate`, appends a line to a journal file on every execution (the
oracle of how often the tool really ran). The tool's name and its argument are the ones the
example's tiny model was warm-started to call.

Settings (`agent.args`): `path` (the example's train parquet), `num_tasks`, `journal`. With
JOURNAL_CALC_RAISE_AFTER=K in the environment, the rubric raises from the (K+1)-th episode it
scores in a process on.
"""

from __future__ import annotations

import os
import re

import verifiers.v1 as vf

from journal_calc.tools import JournalToolsConfig, JournalToolset


class JournalData(vf.TaskData):
    answer: str


SCORED = [0]


class JournalTask(vf.Task[JournalData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        SCORED[0] += 1
        if SCORED[0] > int(os.environ.get("JOURNAL_CALC_RAISE_AFTER", "-1")) >= 0:
            raise RuntimeError("the rubric is broken")
        numbers = re.findall(r"-?\d+", trace.last_reply or "")
        return float(bool(numbers) and numbers[-1] == self.data.answer)

    @vf.reward(weight=0.0)
    async def answered(self, trace: vf.Trace) -> float:
        return float(bool(re.search(r"\d", trace.last_reply or "")))


class JournalConfig(vf.TasksetConfig):
    path: str = ""
    num_tasks: int = 64
    journal: str | None = None


class JournalTaskset(vf.Taskset[JournalTask, JournalConfig]):
    def load(self):
        import datasets

        rows = datasets.Dataset.from_parquet(self.config.path).select(range(self.config.num_tasks))
        for i, row in enumerate(rows):
            yield JournalTask(
                JournalData(idx=i, prompt=row["messages"], answer=str(row["answer"])),
                self.config.task,
            )

    @classmethod
    def toolsets(cls, config: JournalConfig):
        return [JournalToolset(JournalToolsConfig(journal=config.journal))]


__all__ = ["JournalTaskset"]
