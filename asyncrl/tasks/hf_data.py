"""Rows of a Hugging Face `datasets` dataset as examples (`data.task=hf`).

`data.path` is a local file (JSONL/JSON, CSV, Parquet, Arrow: one file is split `train`), a
directory written by `save_to_disk`, or anything `datasets.load_dataset` takes (a directory of
data files, a hub name where the network allows). A row's prompt is a string or a list of chat
messages; its answer is a string (a number is written as one). The row order is the dataset's:
the stream maps ordinals to row indices exactly as for any other task.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncrl.config import ConfigError, DataConfig
from asyncrl.config.data import BUILTIN_REWARDS
from asyncrl.tasks.examples import Example, Message
from asyncrl.tasks.fewshot import (
    Demonstration,
    default_response,
    demonstration,
    with_demonstrations,
)

FILE_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
"""A single file's suffix -> the `datasets` builder that reads it."""


def load_rows(path: str, split: str, key: str = "data.path", revision: str = "") -> Any:
    """The `datasets.Dataset` of `split` at `path` (a hub dataset at `revision`, if given);
    errors name `key` and what to fix."""
    import datasets

    datasets.disable_progress_bars()  # the trainer's own progress bar owns the terminal
    local = Path(path)
    try:
        if local.is_file():
            builder = FILE_BUILDERS.get(local.suffix.lower())
            if builder is None:
                raise ConfigError(
                    f"{key}: {path} is not a file type datasets reads here "
                    f"({', '.join(FILE_BUILDERS)})"
                )
            if split != "train":
                raise ConfigError(
                    f"{key}: {path} is one file, which has only split 'train' (asked for "
                    f"{split!r}); give the other split as a file of its own"
                )
            return datasets.load_dataset(builder, data_files=str(local), split="train")
        if local.is_dir() and any(
            (local / marker).exists() for marker in ("dataset_dict.json", "state.json")
        ):
            saved = datasets.load_from_disk(str(local))
            if isinstance(saved, datasets.DatasetDict):
                if split not in saved:
                    raise ConfigError(
                        f"{key}: {path} has no split {split!r} (it has {', '.join(saved)})"
                    )
                return saved[split]
            return saved
        return datasets.load_dataset(path, split=split, revision=revision or None)
    except ConfigError:
        raise
    except Exception as err:  # datasets' own: no such file, split or hub name, no network
        raise ConfigError(f"{key}: cannot load {path!r} split {split!r}: {err}") from None


def read_hf_examples(
    config: DataConfig, path: str, split: str, key: str = "data.path", limit: int = 0
) -> list[Example]:
    """Every row (the first `limit` if > 0) of `path`'s `split` as an example, read with
    `config`'s keys. A missing column names it and the columns there are; a bad row names
    `path:row N`, N counted from 1 (the first row is row 1: for a JSONL file, its line).
    Without `data.fewshot`: the rows as they are."""
    return _read(config, path, split, key, limit)[1]


def with_fewshot(config: DataConfig, examples: list[Example], label: str) -> list[Example]:
    """`examples` (split `label`'s rows: `train` or `eval`) with `data.fewshot`
    demonstrations each from the training split (`asyncrl.tasks.fewshot`); unchanged at 0."""
    if not config.fewshot:
        return examples
    return with_demonstrations(examples, read_demonstrations(config), config.fewshot, label)


def read_demonstrations(config: DataConfig) -> list[Demonstration]:
    """The training split's rows as solved examples: each answered by its `data.fewshot_key`
    column, or `default_response`. An empty or missing solution names its row."""
    rows, examples = _read(config, config.path, config.split, "data.path", 0)
    column = config.fewshot_key
    if column and column not in rows.column_names:
        raise ConfigError(
            f"data.fewshot_key: column {column!r} is not in {config.path} "
            f"(its columns: {', '.join(rows.column_names)})"
        )
    math = config.reward_target == BUILTIN_REWARDS["math"]
    pool = []
    for example, response in zip(
        examples, rows[column] if column else [None] * len(examples), strict=True
    ):
        if column and not (isinstance(response, str) and response.strip()):
            raise ConfigError(
                f"{example.origin}: {column!r} (data.fewshot_key) is empty or not text: "
                f"{response!r}"
            )
        pool.append(demonstration(example, response or default_response(example.answer, math)))
    return pool


def _read(
    config: DataConfig, path: str, split: str, key: str, limit: int
) -> tuple[Any, list[Example]]:
    rows = load_rows(path, split, key, config.revision if path == config.path else "")
    prompt_key = config.messages_key or config.prompt_key
    key_name = "data.messages_key" if config.messages_key else "data.prompt_key"
    for name, column in ((key_name, prompt_key), ("data.answer_key", config.answer_key)):
        if column not in rows.column_names:
            raise ConfigError(
                f"{name}: column {column!r} is not in {path} "
                f"(its columns: {', '.join(rows.column_names)})"
            )
    if limit:
        rows = rows.select(range(min(limit, len(rows))))
    if config.system_prompt and not (config.messages_key or config.apply_chat_template):
        _check_chat_column(rows, prompt_key, path)
    examples = [
        _example(config, row, prompt_key, f"{path}:row {i + 1}") for i, row in enumerate(rows)
    ]
    if not examples:
        raise ConfigError(f"{key}: {path} split {split!r} has no rows")
    return rows, examples


def _check_chat_column(rows: Any, prompt_key: str, path: str) -> None:
    if len(rows) and isinstance(rows[0][prompt_key], str):
        raise ConfigError(
            f"data.system_prompt: the prompts of {path} are strings; set "
            "data.apply_chat_template=true to send them as chat messages with this system prompt"
        )


def _example(config: DataConfig, row: dict[str, Any], prompt_key: str, where: str) -> Example:
    prompt, answer = row.get(prompt_key), row.get(config.answer_key)
    if answer is None:
        raise ConfigError(f"{where}: {config.answer_key!r} is missing (null)")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        raise ConfigError(f"{where}: {config.answer_key!r} is {type(answer).__name__}, not text")
    if isinstance(prompt, str):
        if not prompt:
            raise ConfigError(f"{where}: {prompt_key!r} is empty")
        if not config.apply_chat_template:
            return Example(prompt, answer, where)
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise ConfigError(
            f"{where}: {prompt_key!r} is missing or not a prompt (want a string or a list of "
            f"{{'role', 'content'}} messages, got {type(prompt).__name__})"
        )
    messages = _messages(prompt, prompt_key, where)
    if config.system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": config.system_prompt})
    text = "\n".join(m["content"] for m in messages)
    return Example(text, answer, where, tuple(messages))


def _messages(items: list[Any], prompt_key: str, where: str) -> list[Message]:
    messages = []
    for n, item in enumerate(items):
        if not (
            isinstance(item, dict)
            and isinstance(item.get("role"), str)
            and isinstance(item.get("content"), str)
        ):
            raise ConfigError(
                f"{where}: {prompt_key!r} message {n} is not {{'role': str, 'content': str}}: "
                f"{item!r}"
            )
        messages.append({"role": item["role"], "content": item["content"]})
    if messages[-1]["role"] == "assistant":
        raise ConfigError(
            f"{where}: {prompt_key!r} ends with an assistant message; a prompt is what the model "
            "sees before it answers (put the reference answer in data.answer_key's column)"
        )
    return messages
