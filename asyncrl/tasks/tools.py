"""Built-in tool environment (`env.name=calculator`): arithmetic word problems with a
calculator, for the real-model example (`configs/calculator_tool.yaml`).

The episode opens with the example's chat messages and a line saying how to call the tool.
Each assistant turn either calls the calculator — `<calc>EXPRESSION</calc>`, answered with
`<result>VALUE</result>` (or the error) — or answers: a turn with a `\\boxed{}` ends the episode
with the `math` reward on that turn (`correct + format_weight * format`); a turn with neither
gets a reminder. The calculator evaluates `+ - * / ( )` and numbers, nothing else (a parsed
AST, never `eval`).

Every tool call is made at most once per step: the environment keeps a journal
(`RUN_DIR/env/calculator.jsonl`: per call an intent row fsynced before the calculator runs and
a result row fsynced before the result is used, each with the run id, the step id and the hash
of the assistant text that made it), and a step whose result is in it returns the recorded
result instead of calling again, since the step in flight at a kill is asked again, with the
same id and text, after it. The same id with other text is an error, never a stale answer.
What a tool with real side effects can get from such a journal, and what it needs besides (the
outside service's idempotency key): `Journal`. It restores by `replay`.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from asyncrl.core.episodes import text_sha256
from asyncrl.tasks.environments import RestoreKind, StepResult, Turn, idempotency_key
from asyncrl.tasks.examples import Example, Message

CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
INSTRUCTION = (
    "You may use a calculator: write <calc>EXPRESSION</calc> (numbers and + - * / and "
    "parentheses) and wait for the result. Give the final answer in \\boxed{}."
)
REMINDER = "Give the final answer in \\boxed{}, or use <calc>EXPRESSION</calc>."
FORMAT_WEIGHT = 0.2

_OPS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, as text (an integer when whole), or `error: ...`."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        value = _value(tree.body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as err:
        return f"error: {err.__class__.__name__}"
    if abs(value) > 1e15:
        return "error: too large"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return float(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return float(_OPS[type(node.op)](_value(node.left), _value(node.right)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("not arithmetic")


class Journal:
    """Tool calls by idempotency key (`idempotency_key`: the run's id and the step id): a
    JSON-lines file with two rows a call, each fsynced before the next move: the *intent*
    (what is about to be done, written before the tool acts) and the *result* (written before
    it is used). A step whose result is journaled is answered from it, never called again.

    What this can promise: a tool that acts only inside this process (the calculator) is
    called once per step, except where a kill lands between its intent and its result; then
    the journal holds an intent alone, and the step's next call acts again. A tool that acts
    on the outside world (a paid API, a write) cannot learn from here whether it acted: for
    at most once it must pass the key to the service as its idempotency key, so the service
    answers a repeat with its first answer. One journal per file per process (the collector's
    thread makes the steps)."""

    _lock = threading.Lock()

    def __init__(self, path: Path, run_id: str = "") -> None:
        self.path = path
        self.run_id = run_id
        self.results: dict[str, str] = {}  # key -> the result
        self.texts: dict[str, str] = {}  # key -> the text hash it was called for
        self.interrupted: set[str] = set()  # keys with an intent and no result
        if not path.exists():
            return
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):  # torn by a kill mid-write: never used
            data = data[: data.rfind(b"\n") + 1]
            with open(path, "r+b") as f:
                f.truncate(len(data))
                os.fsync(f.fileno())
        for line in data.decode().splitlines():
            row = json.loads(line)
            # rows of older versions have no run id: this run's own (the journal is in its dir)
            key = idempotency_key(str(row.get("run_id", run_id)), str(row["step_id"]))
            if "text_sha256" in row:  # journals of older versions have no hash
                self.texts.setdefault(key, row["text_sha256"])
            if "result" in row:
                self.results.setdefault(key, row["result"])
                self.interrupted.discard(key)
            elif key not in self.results:
                self.interrupted.add(key)

    def call(
        self, step_id: str, expression: str, text_hash: str, act: Callable[[str], str] | None = None
    ) -> str:
        """The journaled result of `step_id`, or `act(expression)`'s (the calculator's by
        default), its intent journaled before it acts and its result before it returns. The
        same id asked with other text (`text_sha256`) is an error, never the other text's
        answer."""
        key = idempotency_key(self.run_id, step_id)
        with self._lock:
            known = self.texts.get(key, text_hash)
            if known != text_hash:
                raise ValueError(
                    f"step {step_id} was journaled for a text with hash {known}, and is "
                    f"asked again with other text (hash {text_hash}): one id, one request"
                )
            if key in self.results:
                return self.results[key]
            row = {"step_id": step_id, "run_id": self.run_id, "text_sha256": text_hash,
                   "expression": expression}  # fmt: skip
            self._write({**row, "intent": True})
            self.texts[key] = text_hash
            result = (act or calculate)(expression)
            self._write({**row, "result": result})
            self.results[key] = result
            self.interrupted.discard(key)
            return result

    def _write(self, row: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())


_JOURNALS: dict[tuple[Path, str], Journal] = {}
"""One journal per file and run in a process, read once (not once per episode)."""


class Calculator:
    restore: ClassVar[RestoreKind] = "replay"
    alphabet: ClassVar[str] = ""
    journal_file: ClassVar[str] = "calculator.jsonl"

    def __init__(self) -> None:
        self.answer = ""
        self.journal: Journal | None = None
        self.run_id = ""

    def set_run_id(self, run_id: str) -> None:
        """The run's id (before `set_workdir`): the journal's keys carry it."""
        self.run_id = run_id

    def set_workdir(self, workdir: Path) -> None:
        """The run's environment directory (`RUN_DIR/env/`): the journal lives there."""
        path = Path(workdir) / self.journal_file
        if (path, self.run_id) not in _JOURNALS:
            _JOURNALS[(path, self.run_id)] = Journal(path, self.run_id)
        self.journal = _JOURNALS[(path, self.run_id)]

    def reset(self, example: Example, seed: int) -> list[Message]:
        self.answer = example.answer
        opening = example.messages or ({"role": "user", "content": example.prompt},)
        messages = [dict(m) for m in opening]
        messages[-1]["content"] = f"{messages[-1]['content']}\n{INSTRUCTION}"
        return messages

    def step(self, assistant_text: str, step_id: str) -> StepResult:
        calls = CALL.findall(assistant_text)
        if calls and "\\boxed" not in assistant_text:
            expression = calls[-1]
            result = (
                self.journal.call(step_id, expression, text_sha256(assistant_text))
                if self.journal
                else calculate(expression)
            )
            return StepResult([{"role": "user", "content": f"<result>{result}</result>"}], None,
                              False)  # fmt: skip
        if "\\boxed" in assistant_text:
            from asyncrl.tasks.rewards import math_reward

            scores = math_reward(assistant_text, self.answer, format_reward=FORMAT_WEIGHT)
            return StepResult([], float(scores["reward"]), True)
        return StepResult([{"role": "user", "content": REMINDER}], None, False)

    def replay(self, turns: list[Turn]) -> None:
        """Nothing to rebuild: the calculator keeps no state between turns (its journal is on
        disk)."""
