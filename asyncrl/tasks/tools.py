"""Built-in tool environment (`env.name=calculator`): arithmetic word problems with a
calculator, for the real-model example (`configs/calculator_tool.yaml`).

The episode opens with the example's chat messages and a line saying how to call the tool.
Each assistant turn either calls the calculator — `<calc>EXPRESSION</calc>`, answered with
`<result>VALUE</result>` (or the error) — or answers: a turn with a `\\boxed{}` ends the episode
with the `math` reward on that turn (`correct + format_weight * format`); a turn with neither
gets a reminder. The calculator evaluates `+ - * / ( )` and numbers, nothing else (a parsed
AST, never `eval`).

Every tool call is made at most once per `step_id`: the environment keeps a journal
(`RUN_DIR/env/calculator.jsonl`, one JSON line per call with the hash of the assistant text
that made it, fsynced before the result is used), and a step whose id is in it returns the
recorded result instead of calling again — what an environment with real side effects (a paid
API, a write) needs, since the step in flight at a kill is asked again, with the same id and
text, after it. The same id with other text is an error, never a stale answer. It restores by
`replay`.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import re
import threading
from pathlib import Path
from typing import Any, ClassVar

from asyncrl.core.episodes import text_sha256
from asyncrl.tasks.environments import RestoreKind, StepResult, Turn
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
    """Tool calls made, by step id: a JSON-lines file, each line fsynced before it is used.
    One per file per process (the collector's thread makes the steps)."""

    _lock = threading.Lock()

    def __init__(self, path: Path) -> None:
        self.path = path
        self.results: dict[str, str] = {}
        self.texts: dict[str, str] = {}  # step id -> the text hash it was called for
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
            self.results.setdefault(row["step_id"], row["result"])
            if "text_sha256" in row:  # journals of older versions have no hash
                self.texts.setdefault(row["step_id"], row["text_sha256"])

    def call(self, step_id: str, expression: str, text_hash: str) -> str:
        """The recorded result of `step_id`, or the calculator's, journaled first. Keyed by
        the step id and the hash of the assistant text that asked (`text_sha256`): the same id
        asked with other text is an error, never the other text's answer."""
        with self._lock:
            if step_id in self.results:
                known = self.texts.get(step_id, text_hash)
                if known != text_hash:
                    raise ValueError(
                        f"step {step_id} was journaled for a text with hash {known}, and is "
                        f"asked again with other text (hash {text_hash}): one id, one request"
                    )
                return self.results[step_id]
            result = calculate(expression)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            row = {"step_id": step_id, "text_sha256": text_hash, "expression": expression,
                   "result": result}  # fmt: skip
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.results[step_id] = result
            self.texts[step_id] = text_hash
            return result


_JOURNALS: dict[Path, Journal] = {}


class Calculator:
    restore: ClassVar[RestoreKind] = "replay"
    alphabet: ClassVar[str] = ""
    journal_file: ClassVar[str] = "calculator.jsonl"

    def __init__(self) -> None:
        self.answer = ""
        self.journal: Journal | None = None

    def set_workdir(self, workdir: Path) -> None:
        """The run's environment directory (`RUN_DIR/env/`): the journal lives there."""
        path = Path(workdir) / self.journal_file
        self.journal = _JOURNALS.setdefault(path, Journal(path))

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
