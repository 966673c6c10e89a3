"""The second built-in example (`make math-demo`): its generated files, and its config run end
to end through the CLI with every piece on — chat rows from Parquet, the math reward in worker
processes, evaluation, TensorBoard and MLflow — then audited and exported."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
from helpers import read_records, run_cli
from transformers import AutoTokenizer

from asyncrl.examples.math_chat import SYSTEM_PROMPT, prepare, problems
from asyncrl.tasks.rewards import math_reward


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return prepare(tmp_path_factory.mktemp("math_chat"))


def test_the_problems_are_right_and_the_splits_disjoint(files):
    rows = list(problems())
    assert len({q for q, _ in rows}) == len(rows)
    for question, answer in rows:
        numbers = [int(w.strip("?.")) for w in question.split() if w.strip("?.").isdigit()]
        a, b = numbers
        if "plus" in question or "more" in question:
            assert answer == a + b
        elif "minus" in question or "gave away" in question:
            assert answer == a - b
        else:
            assert answer == a * b
    train = datasets.load_dataset("parquet", data_files=str(files["train"]), split="train")
    test = datasets.load_dataset("parquet", data_files=str(files["test"]), split="train")
    assert len(test) == 64 and len(train) == len(rows) - 64
    questions = lambda ds: {r["messages"][0]["content"] for r in ds}  # noqa: E731
    assert not questions(train) & questions(test)
    row = train[0]
    assert math_reward(f"\\boxed{{{row['answer']}}}", row["answer"])["correct"] == 1.0


def test_the_model_directory_has_a_chat_template(files):
    tokenizer = AutoTokenizer.from_pretrained(files["model"])
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert len(tokenizer("\\boxed{7}")["input_ids"]) <= 5  # learnt merges: a short answer


@pytest.mark.slow
def test_the_math_chat_config_runs_every_piece_end_to_end(files, tmp_path, repo_root):
    run = tmp_path / "run"
    overrides = [
        f"model.path={files['model']}",
        f"data.path={files['train']}",
        f"eval.path={files['test']}",
        "run.max_num_steps=12",
        "eval.every_steps=6",
        "algo.warmup_steps=2",
        "eval.max_examples=16",
        "logging.progress=false",
    ]
    done = run_cli("train", str(repo_root / "configs/math_chat.yaml"), "--run-dir", str(run),
                   *overrides)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "eval of the initial weights:" in done.stderr  # eval.at_start
    assert "eval after step 5:" in done.stderr and "eval after step 11:" in done.stderr
    # the summary's before (the initial weights) and last evaluation
    assert "before training  ->  reward" in done.stdout and "after step 11\n" in done.stdout
    assert "checkpoints/ tensorboard/ mlruns/" in done.stdout
    records = read_records(run / "metrics.jsonl")
    assert len(records) == 12
    assert all({"reward/correct", "reward/format"} <= set(r) for r in records)
    assert [r["step"] for r in records if "eval/pass@4" in r] == [5, 11]
    assert any((run / "tensorboard").iterdir())
    assert (run / "mlruns").is_dir() and (run / "trackers.json").is_file()
    assert (run / "plots" / "eval.png").is_file()
    assert run_cli("audit", str(run)).returncode == 0
