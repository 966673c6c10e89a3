"""Prompt sources: the built-in `sort_digits` task, JSONL files and Hugging Face datasets.

A source is a list of `Example(prompt, answer)` plus a reward function; the prompt stream
only ever sees its length, so I1/I3 hold on any dataset. Every error names the file, the row
and what to fix.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from asyncrl.config import ConfigError, DataConfig
from asyncrl.tasks.examples import Example, Task
from asyncrl.tasks.reward_calls import resolve_reward_fn


def sort_digits_examples(
    num_digits: int, num_examples: int, held_out: bool = False
) -> list[Example]:
    """`31524=` -> `12345`. The dataset is fixed by its size, not by the run's seed, so runs
    with different seeds see the same rows in different orders. `held_out`: a set drawn from
    another generator, for evaluation (prompts may coincide with training's by chance: at 5
    digits there are only 10^5 of them)."""
    tag = "asyncrl-sort-digits-eval" if held_out else "asyncrl-sort-digits"
    rng = random.Random(f"{tag}:{num_digits}:{num_examples}")
    examples = []
    for i in range(num_examples):
        digits = "".join(rng.choice("0123456789") for _ in range(num_digits))
        origin = f"sort_digits_eval[{i}]" if held_out else f"sort_digits[{i}]"
        examples.append(Example(f"{digits}=", "".join(sorted(digits)), origin))
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


def task_examples(config: DataConfig) -> list[Example]:
    """The rows `config` trains on, in dataset order (the stream's ordinals index them)."""
    if config.task == "sort_digits":
        return sort_digits_examples(config.num_digits, config.num_examples)
    if config.task == "guess_number":
        from asyncrl.tasks.games import guess_number_examples

        return guess_number_examples(config.num_examples)
    if config.task == "jsonl":
        return read_jsonl_examples(config.path)
    from asyncrl.tasks.hf_data import read_hf_examples, with_fewshot  # `datasets` when used

    return with_fewshot(config, read_hf_examples(config, config.path, config.split), "train")


def load_task(config: DataConfig) -> Task:
    examples = task_examples(config)
    kwargs = {"format_reward": config.format_reward} if config.format_reward else {}
    resolve_reward_fn(config.reward_target)  # a bad name fails here, before any model loads
    return Task(
        name=config.task,
        examples=examples,
        reward_target=config.reward_target,
        reward_fn_name=config.reward_fn or "partial_match",
        reward_kwargs=kwargs,
    )
