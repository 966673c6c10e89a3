"""`data.task=hf`: rows read through Hugging Face `datasets` from JSONL, Parquet and saved
directories; chat prompts rendered by the tokenizer's chat template exactly as `transformers`
does; bad rows and keys named."""

from __future__ import annotations

import json

import datasets
import pytest

from asyncrl.config import ConfigError, DataConfig
from asyncrl.models.scratch import train_tokenizer
from asyncrl.tasks.hf_data import read_hf_examples
from asyncrl.tasks.prompts import encode_prompts, prompt_ids
from asyncrl.tasks.source import load_task

ROWS = [
    {"question": "What is 2 + 3?", "answer": "5"},
    {"question": "What is 4 + 4?", "answer": "8"},
]
CHAT = [
    {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "answer": 5},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 4 + 4?"},
        ],
        "answer": 8,
    },
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(300)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def hf(path, **keys) -> DataConfig:
    return DataConfig(task="hf", path=str(path), **keys)


def test_jsonl_parquet_and_saved_dataset_give_the_same_examples(tmp_path):
    jsonl = write_jsonl(tmp_path / "q.jsonl", ROWS)
    parquet = tmp_path / "q.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(parquet))
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(saved))
    read = [
        [
            (e.prompt, e.answer)
            for e in read_hf_examples(hf(p, prompt_key="question"), str(p), "train")
        ]
        for p in (jsonl, parquet, saved)
    ]
    assert read[0] == read[1] == read[2] == [("What is 2 + 3?", "5"), ("What is 4 + 4?", "8")]
    task = load_task(hf(jsonl, prompt_key="question", reward_fn="math"))
    assert task.reward_target == "asyncrl.tasks.rewards:math_reward"
    assert len(task.examples) == 2


def test_chat_rows_are_rendered_as_transformers_renders_them(tmp_path, tokenizer):
    path = tmp_path / "chat.parquet"
    datasets.Dataset.from_list(CHAT).to_parquet(str(path))
    config = hf(path, messages_key="messages", system_prompt="Answer with a number.")
    examples = read_hf_examples(config, str(path), "train")
    assert [e.answer for e in examples] == ["5", "8"]  # numbers become text
    first, second = examples
    # the system prompt goes first where a row has none; a row's own system message is kept
    assert first.messages == (
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 2 + 3?"},
    )
    assert second.messages is not None and second.messages[0]["content"] == "Be brief."
    for example in examples:
        expected = tokenizer.apply_chat_template(
            list(example.messages), add_generation_prompt=True, tokenize=True
        )["input_ids"]
        text = tokenizer.apply_chat_template(
            list(example.messages), add_generation_prompt=True, tokenize=False
        )
        assert text.endswith("<|im_start|>assistant\n")
        assert prompt_ids(example, tokenizer) == expected
        assert expected == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert encode_prompts(examples, tokenizer, 8, 512)[0] == prompt_ids(first, tokenizer)


def test_string_prompts_go_through_the_template_when_asked(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "q.jsonl", ROWS)
    plain = read_hf_examples(hf(path, prompt_key="question"), str(path), "train")[0]
    chat = read_hf_examples(
        hf(path, prompt_key="question", apply_chat_template=True), str(path), "train"
    )[0]
    assert plain.messages is None
    assert prompt_ids(plain, tokenizer) == tokenizer("What is 2 + 3?")["input_ids"]
    assert chat.messages == ({"role": "user", "content": "What is 2 + 3?"},)
    assert prompt_ids(chat, tokenizer) != prompt_ids(plain, tokenizer)


def test_a_conversational_prompt_column_is_read_as_messages(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "Hi?"}], "answer": "1"}]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    (example,) = read_hf_examples(hf(path), str(path), "train")
    assert example.messages == ({"role": "user", "content": "Hi?"},)


@pytest.mark.parametrize(
    ("rows", "keys", "message"),
    [
        (ROWS, {"prompt_key": "query"}, "data.prompt_key: column 'query' is not in"),
        (ROWS, {"prompt_key": "question", "answer_key": "solution"}, "column 'solution'"),
        (
            [*ROWS, {"question": "What?", "answer": None}],
            {"prompt_key": "question"},
            "q.jsonl:row 3: 'answer' is missing",
        ),
        ([{"question": "", "answer": "1"}], {"prompt_key": "question"},
         "row 1: 'question' is empty"),
        (
            [{"m": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
              "answer": "1"}],
            {"messages_key": "m"},
            "row 1: 'm' ends with an assistant message",
        ),
        ([{"m": [{"role": "user"}], "answer": "1"}], {"messages_key": "m"}, "'m' message 0 is not"),
        (ROWS, {"prompt_key": "question", "system_prompt": "x"}, "data.apply_chat_template=true"),
    ],
)  # fmt: skip
def test_bad_rows_and_keys_are_named(tmp_path, rows, keys, message):
    path = write_jsonl(tmp_path / "q.jsonl", rows)
    with pytest.raises(ConfigError) as err:
        read_hf_examples(hf(path, **keys), str(path), "train")
    assert message in str(err.value)


def test_missing_files_splits_and_templates_are_named(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "q.jsonl", ROWS)
    with pytest.raises(ConfigError, match="only split 'train'"):
        read_hf_examples(hf(path, prompt_key="question"), str(path), "test")
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(saved))
    with pytest.raises(ConfigError, match=r"has no split 'test' \(it has train\)"):
        read_hf_examples(hf(saved, prompt_key="question"), str(saved), "test")
    with pytest.raises(ConfigError, match=r"data\.path: cannot load"):
        read_hf_examples(hf(tmp_path / "nope"), str(tmp_path / "nope"), "train")
    chat = read_hf_examples(hf(path, prompt_key="question", apply_chat_template=True),
                            str(path), "train")  # fmt: skip
    plain_tokenizer = train_tokenizer(300, chat=False)
    with pytest.raises(ConfigError, match=r"q\.jsonl:row 1: a chat prompt, but the tokenizer"):
        prompt_ids(chat[0], plain_tokenizer)


def test_a_hub_dataset_is_loaded_at_the_pinned_revision(monkeypatch):
    """`data.revision` reaches `datasets.load_dataset` for a hub name (no network here: the
    loader is replaced by one that records its arguments), and only for `data.path`."""
    import datasets

    seen = []

    def load_dataset(path, split=None, revision=None, **kwargs):
        seen.append((path, split, revision))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    config = hf("org/dataset", prompt_key="question", revision="a1b2c3")
    read_hf_examples(config, "org/dataset", "train")
    read_hf_examples(config, "org/other", "test", key="eval.path")
    assert seen == [("org/dataset", "train", "a1b2c3"), ("org/other", "test", None)]
