"""The real-model example (`make smol-demo`): its word problems checked by an independent
solver, and its config on the real SmolLM2-135M-Instruct killed with SIGKILL after a
checkpoint, resumed, and audited."""

from __future__ import annotations

import os
import re
import signal
import sys

import datasets
import launcher
import pytest
from helpers import prepared_smollm2, read_records

from asyncrl.examples.smol_math import prepare, problems


def solve(question: str) -> int:
    """The answer, from the question's words alone (not from the generator's arithmetic)."""
    n = [int(x) for x in re.findall(r"\d+", question)]
    if "times as many" in question:
        return n[0] + n[0] * n[1]
    if "dollars of change" in question:
        count, price, paid = n
        return paid - count * price
    if "already had" in question:
        return n[0] * n[1] + n[2]
    if "gives away" in question:
        return n[0] + n[1] - n[2]
    if "equally among" in question:
        assert n[0] % n[1] == 0
        return n[0] // n[1]
    if "in each box" in question:
        return n[0] * n[1]
    if "gave" in question:
        return n[0] - n[1]
    assert "finds" in question, question
    return n[0] + n[1]


def test_every_problem_is_distinct_and_its_answer_is_what_the_words_say():
    rows = list(problems(2000, seed=3))
    assert len({q for q, _, _ in rows}) == 2000
    assert sum(steps == 2 for _, _, steps in rows) == 1000
    for question, answer, _ in rows:
        assert answer == solve(question) and answer >= 0, question
    assert rows == list(problems(2000, seed=3))  # the same files for the same arguments


@pytest.mark.slow
def test_the_smol_config_trains_the_real_model_killed_and_resumed_exactly(
    tmp_path, tmp_path_factory, repo_root
):
    files = prepare(tmp_path / "data", train_rows=64, test_rows=4, with_model=False)
    files["model"] = prepared_smollm2(tmp_path_factory)  # what prepare's model is, once a session
    train = datasets.load_dataset("parquet", data_files=str(files["train"]), split="train")
    test = datasets.load_dataset("parquet", data_files=str(files["test"]), split="train")
    assert (len(train), len(test)) == (64, 4)
    assert not {r["messages"][-1]["content"] for r in train} & {
        r["messages"][-1]["content"] for r in test
    }
    run = tmp_path / "run"
    command = [
        sys.executable, "-m", "asyncrl.cli", "train", str(repo_root / "configs/smol_math.yaml"),
        "--run-dir", str(run), f"model.path={files['model']}", f"data.path={files['train']}",
        f"eval.path={files['test']}", "run.max_num_steps=4", "rollout.num_prompts_per_step=1",
        "rollout.num_generations_per_prompt=4", "rollout.max_new_tokens=12",
        "eval.every_steps=4", "checkpoint.save_period=2", "logging.progress=false",
        "logging.plot=false",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    killed = launcher.run(
        command,
        env={**env, "ASYNCRL_FAULT": "checkpoint.parent_fsynced[step=2]"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert "eval of the initial weights" in killed.stderr  # 4 held-out problems, before step 0
    done = launcher.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resumed at step 2" in done.stdout + done.stderr
    final = {r["step"]: r for r in read_records(run / "metrics.jsonl")}
    assert sorted(final) == [0, 1, 2, 3]
    assert final[3]["eval/num_examples"] == 4
    audit = launcher.run(
        [sys.executable, "-m", "asyncrl.cli", "audit", str(run)], capture_output=True, text=True
    )
    assert audit.returncode == 0 and "I1 ok" in audit.stdout, audit.stdout
