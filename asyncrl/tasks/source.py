"""Prompt sources: the built-in `sort_digits` task and JSONL files.

A source is a list of `Example(prompt, answer)` plus a reward function; the prompt stream
only ever sees its length. Every error names the file, the line and what to fix.
"""

from __future__ import annotations

import importlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from asyncrl.config import ConfigError, DataConfig
from asyncrl.tasks.rewards import partial_match

RewardFn = Callable[[str, str], float]


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    origin: str
    """Where the example came from, for error messages: `file:line` or `sort_digits[i]`."""


@dataclass
class Task:
    name: str
    examples: list[Example]
    reward_fn: RewardFn
    reward_fn_name: str

    def alphabet(self) -> set[str]:
        """Every character of every prompt and answer: the `tiny` preset's vocabulary."""
        return {c for e in self.examples for c in e.prompt + e.answer}


def sort_digits_examples(num_digits: int, num_examples: int) -> list[Example]:
    """`31524=` -> `12345`. The dataset is fixed by its size, not by the run's seed, so runs
    with different seeds see the same rows in different orders."""
    rng = random.Random(f"asyncrl-sort-digits:{num_digits}:{num_examples}")
    examples = []
    for i in range(num_examples):
        digits = "".join(rng.choice("0123456789") for _ in range(num_digits))
        examples.append(Example(f"{digits}=", "".join(sorted(digits)), f"sort_digits[{i}]"))
    return examples


def read_jsonl_examples(path: str | Path) -> list[Example]:
    """Reads `{"prompt": str, "answer": str}` per line; blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"data.path: {path} is not a file")
    examples = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(
                    f"{where}: not valid JSON ({err.msg} at column {err.colno})"
                ) from None
            if not isinstance(row, dict):
                raise ConfigError(f"{where}: expected an object with prompt and answer")
            for key in ("prompt", "answer"):
                if not isinstance(row.get(key), str):
                    raise ConfigError(f"{where}: field {key!r} is missing or not a string")
            if not row["prompt"]:
                raise ConfigError(f"{where}: empty prompt")
            examples.append(Example(row["prompt"], row["answer"], where))
    if not examples:
        raise ConfigError(f"data.path: {path} has no examples")
    return examples


def resolve_reward_fn(spec: str) -> RewardFn:
    """Imports `module:function`; the error says which part could not be found."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"data.reward_fn: cannot import module {module_name!r}: {err}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"data.reward_fn: {module_name} has no function {attr!r}")
    return fn


def load_task(config: DataConfig) -> Task:
    spec = config.reward_fn or "asyncrl.tasks.rewards:partial_match"
    if config.task == "sort_digits":
        examples = sort_digits_examples(config.num_digits, config.num_examples)
        reward_fn: RewardFn = resolve_reward_fn(spec) if config.reward_fn else partial_match
    else:
        examples = read_jsonl_examples(config.path)
        reward_fn = resolve_reward_fn(spec)
    return Task(name=config.task, examples=examples, reward_fn=reward_fn, reward_fn_name=spec)
