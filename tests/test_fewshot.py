"""`data.fewshot=K`: K solved training rows in front of each chat prompt. Checked by hand on a
few rows (the turns' order, the row's own question never among its demonstrations, the same
draw on every call), through the real loader (`datasets`, parquet, the solution column, the
evaluation's demonstrations from the training split), and in a run: a resume with another
`data.fewshot` is refused as one on other rows (I8)."""

from __future__ import annotations

import datasets
import pytest
from helpers import small_config

from asyncrl.config import ConfigError, DataConfig
from asyncrl.config.keys import build_config
from asyncrl.models.scratch import save_scratch_model
from asyncrl.rollout.evaluation import eval_examples
from asyncrl.tasks.examples import Example, examples_sha256
from asyncrl.tasks.fewshot import demonstration, draw, with_demonstrations
from asyncrl.tasks.source import load_task
from asyncrl.train.rundir import RunDirError
from asyncrl.train.trainer import train


def chat(question: str, answer: str, system: str = "") -> Example:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}
    ]
    return Example("\n".join(m["content"] for m in messages), answer, f"rows:{question}",
                   tuple(messages))  # fmt: skip


POOL_ROWS = [chat("1+1?", "2"), chat("2+2?", "4"), chat("3+3?", "6")]


def pool():
    return [demonstration(e, f"so \\boxed{{{e.answer}}}") for e in POOL_ROWS]


def test_each_row_gets_k_other_rows_answered_after_the_system_message_and_before_its_turns():
    rows = [chat("1+1?", "2", system="Be brief."), chat("5+5?", "10")]
    out = with_demonstrations(rows, pool(), 2, "train")
    first = out[0].messages
    assert first is not None and len(first) == 1 + 2 * 2 + 1
    assert first[0] == {"role": "system", "content": "Be brief."}
    assert first[-1] == {"role": "user", "content": "1+1?"}
    assert [m["role"] for m in first[1:5]] == ["user", "assistant", "user", "assistant"]
    shown = {first[1]["content"], first[3]["content"]}
    assert shown == {"2+2?", "3+3?"}  # never its own question: the only other two rows
    for q, a in ((first[1], first[2]), (first[3], first[4])):
        answer = {"2+2?": "4", "3+3?": "6"}[q["content"]]
        assert a == {"role": "assistant", "content": f"so \\boxed{{{answer}}}"}
    # the answer and origin are the row's; the prompt text is every message's content
    assert (out[0].answer, out[0].origin) == ("2", "rows:1+1?")
    assert out[0].prompt == "\n".join(m["content"] for m in first)
    assert out[1].messages is not None and out[1].messages[-1]["content"] == "5+5?"
    assert with_demonstrations(rows, pool(), 0, "train") == rows


def test_the_draw_is_the_same_on_every_call_and_differs_by_row_and_split():
    big = [demonstration(chat(f"{i}?", str(i)), str(i)) for i in range(50)]
    draws = {(label, i): draw(label, i, f"{i}?", big, 3, 49) for label in ("train", "eval")
             for i in range(20)}  # fmt: skip
    assert draws == {
        (label, i): draw(label, i, f"{i}?", big, 3, 49) for label, i in draws
    }  # the same arguments, the same rows
    assert all(len(set(d)) == 3 and i not in d for (_, i), d in draws.items())
    assert len({tuple(d) for d in draws.values()}) > 30  # not one draw for every row
    assert draws[("train", 0)] != draws[("eval", 0)]


def test_a_row_whose_question_is_repeated_never_sees_a_copy_and_too_few_rows_are_named():
    twins = [chat("1+1?", "2"), chat("1+1?", "2"), chat("2+2?", "4")]
    pool_ = [demonstration(e, e.answer) for e in twins]
    for _ in range(3):
        out = with_demonstrations([twins[0]], pool_, 1, "eval")
        assert out[0].messages is not None and out[0].messages[0]["content"] == "2+2?"
    with pytest.raises(ConfigError, match=r"data.fewshot: 2 demonstrations a prompt, but the "
                       r"training split has only 1 rows with another prompt"):  # fmt: skip
        with_demonstrations([twins[0]], pool_, 2, "eval")
    with pytest.raises(ConfigError, match=r"data.fewshot: plain:3 is not a chat prompt"):
        with_demonstrations([Example("3=", "3", "plain:3")], pool_, 1, "eval")


def write_rows(path, questions, solutions=True):
    rows = [
        {"messages": [{"role": "user", "content": q}], "answer": str(a)}
        | ({"solution": f"{q} is {a}, so \\boxed{{{a}}}."} if solutions else {})
        for q, a in questions
    ]
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def test_the_loader_answers_demonstrations_from_the_solution_column_and_evaluation_draws_from_train(
    tmp_path,
):
    train_rows = write_rows(tmp_path / "train.parquet", [(f"{a} + 1?", a + 1) for a in range(8)])
    test_rows = write_rows(tmp_path / "test.parquet", [(f"{a} + 2?", a + 2) for a in range(4)],
                           solutions=False)  # fmt: skip
    keys = ["data.task=hf", f"data.path={train_rows}", "data.messages_key=messages",
            "data.reward_fn=math", f"eval.path={test_rows}"]  # fmt: skip
    config = build_config({}, [*keys, "data.fewshot=2", "data.fewshot_key=solution"])
    examples = load_task(config.data).examples
    assert len(examples) == 8
    for i, e in enumerate(examples):
        assert e.messages is not None and len(e.messages) == 5
        assert e.messages[-1]["content"] == f"{i} + 1?" and e.answer == str(i + 1)
        for q, a in ((e.messages[0], e.messages[1]), (e.messages[2], e.messages[3])):
            n = int(q["content"].split(" ")[0])
            assert n != i and a["content"] == f"{n} + 1? is {n + 1}, so \\boxed{{{n + 1}}}."
    held_out = eval_examples(config)
    assert [e.messages[-1]["content"] for e in held_out] == [f"{a} + 2?" for a in range(4)]
    assert all(m["content"].endswith("+ 1?") for e in held_out for m in e.messages[:4:2])
    # without the column: the answer boxed as the math reward scores it
    plain = load_task(build_config({}, [*keys, "data.fewshot=1"]).data).examples
    assert plain[0].messages is not None
    n = int(plain[0].messages[0]["content"].split(" ")[0])
    assert plain[0].messages[1]["content"] == f"The answer is \\boxed{{{n + 1}}}."
    # the demonstrations are part of the rows' identity (I8)
    digests = {examples_sha256(x) for x in (examples, plain, load_task(
        build_config({}, keys).data).examples)}  # fmt: skip
    assert len(digests) == 3
    with pytest.raises(ConfigError, match=r"data.fewshot_key: column 'worked' is not in .*"
                       r"its columns: messages, answer, solution"):  # fmt: skip
        load_task(build_config({}, [*keys, "data.fewshot=1", "data.fewshot_key=worked"]).data)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (["data.fewshot=-1"], "data.fewshot: got -1, must be >= 0"),
        (["data.fewshot=1"], "data.fewshot: got 1, must be 0 with data.task=sort_digits"),
        (["data.fewshot_key=solution"], "data.fewshot_key: got 'solution', must be empty unless"),
        (
            [
                "data.task=hf",
                "data.path=x.parquet",
                "data.fewshot=1",
                "env.name=guess_number",
                "eval.every_steps=0",
            ],
            "data.fewshot: got 1, must be 0 with env.name set",
        ),
    ],
)
def test_keys_that_cannot_work_are_refused_naming_them(keys, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        build_config({}, keys)
    assert DataConfig().fewshot == 0


@pytest.mark.slow
def test_a_run_with_demonstrations_resumes_and_one_with_other_demonstrations_is_refused(tmp_path):
    model = save_scratch_model(tmp_path / "model", arch="qwen2", seed=1)
    data = write_rows(tmp_path / "sums.parquet", [(f"{a} + {b}?", a + b) for a in range(4)
                                                  for b in range(4)])  # fmt: skip

    def config(steps, *extra):
        return small_config(
            f"model.path={model}", "data.task=hf", f"data.path={data}",
            "data.messages_key=messages", "data.reward_fn=math", "data.fewshot_key=solution",
            "rollout.max_new_tokens=8", f"run.max_num_steps={steps}", *extra,
        )  # fmt: skip

    run = tmp_path / "run"
    train(config(2, "data.fewshot=1"), run)
    changed = r"with a different config:\n  data.fewshot: checkpoint=1, now=2"
    with pytest.raises(RunDirError, match=changed):
        train(config(3, "data.fewshot=2"), run)
    # the same config, other demonstrations: the solutions edited in the file (I8's digest)
    rows = datasets.Dataset.from_parquet(str(data)).to_list()
    original = data.read_bytes()
    for row in rows:
        row["solution"] = row["solution"].replace(" is ", " makes ")
    datasets.Dataset.from_list(rows).to_parquet(str(data))
    with pytest.raises(RunDirError) as err:
        train(config(3, "data.fewshot=1"), run)
    assert f"cannot resume step 2 on other data (data.path={data})" in str(err.value)
    data.write_bytes(original)
    train(config(3, "data.fewshot=1"), run)  # the demonstrations it was cut on: it resumes
