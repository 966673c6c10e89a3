"""Built-in task, JSONL source, reward functions and prompt encoding: clear errors on bad input."""

import json

import pytest

from asyncrl.config import ConfigError, DataConfig
from asyncrl.models.tokenizer import build_char_tokenizer
from asyncrl.tasks.prompts import encode_prompts
from asyncrl.tasks.rewards import exact_match, partial_match
from asyncrl.tasks.source import load_task, read_jsonl_examples, sort_digits_examples


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("12345", "12345", 1.0),
        ("12355", "12345", 0.8),
        ("1234", "12345", 0.8),  # a missing character costs its position
        ("123456", "12345", 5 / 6),  # an extra character costs too
        ("", "12345", 0.0),
        ("", "", 1.0),
    ],
)
def test_partial_match_gives_credit_per_position(completion, answer, reward):
    assert partial_match(completion, answer) == pytest.approx(reward)


def test_exact_match_ignores_surrounding_whitespace():
    assert exact_match(" 42\n", "42") == 1.0
    assert exact_match("43", "42") == 0.0


def test_sort_digits_examples_are_sorted_answers_and_fixed_by_size():
    examples = sort_digits_examples(num_digits=5, num_examples=50)
    assert examples == sort_digits_examples(num_digits=5, num_examples=50)
    for example in examples:
        digits = example.prompt.removesuffix("=")
        assert len(digits) == 5 and digits.isdigit()
        assert example.answer == "".join(sorted(digits))


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_source_reads_prompts_answers_and_a_named_reward_function(tmp_path):
    path = write_lines(
        tmp_path / "data.jsonl",
        [
            json.dumps({"prompt": "2+2=", "answer": "4"}),
            "",
            json.dumps({"prompt": "1+2=", "answer": "3"}),
        ],
    )
    task = load_task(
        DataConfig(task="jsonl", path=str(path), reward_fn="asyncrl.tasks.rewards:exact_match")
    )
    assert [(e.prompt, e.answer) for e in task.examples] == [("2+2=", "4"), ("1+2=", "3")]
    assert task.examples[1].origin == f"{path}:3"
    assert task.reward_fn is exact_match


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "1+1=", "answer": "2"', "not valid JSON"),
        ('["1+1=", "2"]', "expected an object with prompt and answer"),
        ('{"prompt": "1+1="}', "field 'answer' is missing or not a string"),
        ('{"prompt": 5, "answer": "2"}', "field 'prompt' is missing or not a string"),
        ('{"prompt": "", "answer": "2"}', "empty prompt"),
    ],
)
def test_a_bad_jsonl_line_is_refused_naming_file_and_line(tmp_path, line, message):
    path = write_lines(tmp_path / "data.jsonl", ['{"prompt": "ok=", "answer": "1"}', line])
    with pytest.raises(ConfigError) as err:
        read_jsonl_examples(path)
    assert f"{path}:2: {message}" in str(err.value)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("asyncrl.tasks.rewards:nope", "asyncrl.tasks.rewards has no function 'nope'"),
    ],
)
def test_an_unresolvable_reward_function_is_refused(tmp_path, spec, message):
    path = write_lines(tmp_path / "d.jsonl", ['{"prompt": "a", "answer": "b"}'])
    with pytest.raises(ConfigError, match=message):
        load_task(DataConfig(task="jsonl", path=str(path), reward_fn=spec))


def test_prompts_the_model_cannot_take_are_refused_naming_the_example(tmp_path):
    tokenizer = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz")
    path = write_lines(
        tmp_path / "d.jsonl",
        ['{"prompt": "short", "answer": "b"}', '{"prompt": "caf\\u00e9", "answer": "b"}'],
    )
    task = load_task(DataConfig(task="jsonl", path=str(path)))
    with pytest.raises(ConfigError, match=r"d\.jsonl:2: the prompt has characters the tokenizer"):
        encode_prompts(task, tokenizer, max_new_tokens=4, max_seq_len=64)
    path = write_lines(tmp_path / "d.jsonl", ['{"prompt": "' + "x" * 60 + '", "answer": "b"}'])
    task = load_task(DataConfig(task="jsonl", path=str(path)))
    with pytest.raises(
        ConfigError, match=r"d\.jsonl:1: prompt is 60 tokens; with rollout.max_new_tokens=8"
    ):
        encode_prompts(task, tokenizer, max_new_tokens=8, max_seq_len=64)
