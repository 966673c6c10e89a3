"""Zero-shot word problems (`asyncrl.examples.word_problems`): each template's answer recomputed
from the numbers its question states, the families and splits disjoint, the rows one user
turn ending in the standard instruction, and the files read by configs/smol_math.yaml's keys
with the `math` reward."""

from __future__ import annotations

import random
import re

import pytest

from asyncrl.examples import smol_math, word_problems
from asyncrl.tasks.rewards import math_reward

# each template's answer from its question's numbers, in the order the question states them
ORACLES = {
    "bakery": lambda a, b, c: a + b - c,
    "train": lambda cars, seats, empty: cars * seats - empty,
    "savings": lambda weekly, weeks, spent: weekly * weeks - spent,
    "garden": lambda rows, per, more: rows * per + more,
    "pages": lambda a, b: a + b,
    "buses": lambda classes, students, seats: classes * students // seats,
    "flour": lambda per, have, cakes: have - per * cakes,
    "parking": lambda levels, spaces, cars: levels * spaces - cars,
    "oranges": lambda daily, days, given: daily * days - given,
    "tickets": lambda adult, child, adults, children: adult * adults + child * children,
    "crayons": lambda per, boxes: per * boxes,
    "tank": lambda liters, bucket, tanks: liters * tanks // bucket,
}


@pytest.mark.parametrize("template", sorted(ORACLES))
def test_each_templates_answer_is_what_its_question_asks(template):
    family = next(f for f, ts in word_problems.FAMILIES.items() if template in ts)
    make = word_problems.FAMILIES[family][template]
    rng = random.Random(template)
    for _ in range(300):
        question, answer, steps, solution = make(rng, "Ana")
        numbers = [int(n) for n in re.findall(r"\d+", question)]
        assert ORACLES[template](*numbers) == answer, question
        assert answer >= 0 and 1 <= steps <= 3
        # the worked solution: each of its equations true, its last the boxed answer
        equations = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", solution)
        assert len(equations) == steps, solution
        for a, op, b, c in equations:
            assert eval(f"{a} {op} {b}") == int(c), solution
        assert solution.endswith(f"The answer is \\boxed{{{answer}}}."), solution
        assert math_reward(solution, str(answer))["correct"] == 1.0
        if template == "buses":  # every seat taken: the division is exact
            classes, students, seats = numbers
            assert classes * students % seats == 0


def test_the_families_are_disjoint_and_none_is_smol_maths():
    search, heldout = (set(word_problems.FAMILIES[f]) for f in ("search", "heldout"))
    assert search and heldout and not search & heldout
    # no question of either family is one of smol_math's templates (numbers and names aside)
    names = "|".join(smol_math.NAMES + word_problems.NAMES)

    def skeleton(question: str) -> str:
        return re.sub(rf"\b({names})\b", "X", re.sub(r"\d+", "N", question))

    theirs = {skeleton(q) for q, _, _ in smol_math.problems(400)}
    for family in ("search", "heldout"):
        ours = {skeleton(q) for _, (q, *_) in word_problems.problems(family, 300)}
        assert len(ours) >= 6 and not ours & theirs


def test_rows_are_one_user_turn_zero_shot_and_the_splits_share_no_question(tmp_path):
    paths = word_problems.prepare(tmp_path, "heldout", train_rows=300, test_rows=60)
    import pyarrow.parquet as pq

    test = pq.read_table(paths["test"]).to_pylist()
    train = pq.read_table(paths["train"]).to_pylist()
    assert (len(train), len(test)) == (300, 60)
    for row in test + train:
        [turn] = row["messages"]
        assert turn["role"] == "user"
        assert turn["content"].endswith(
            "\nPlease reason step by step, and put your final answer within \\boxed{}."
        )
        assert row["template"] in word_problems.FAMILIES["heldout"]
        assert row["solution"].endswith(f"\\boxed{{{row['answer']}}}.")  # data.fewshot_key
    questions = lambda rows: {r["messages"][0]["content"] for r in rows}  # noqa: E731
    assert not questions(train) & questions(test)
    assert len(questions(train)) == 300
    # the same arguments, the same files (kept); another seed, other problems
    again = word_problems.prepare(tmp_path, "heldout", train_rows=300, test_rows=60)
    assert pq.read_table(again["test"]).to_pylist() == test
    other = word_problems.prepare(tmp_path / "other", "heldout", 300, 60, seed=1)
    assert pq.read_table(other["test"]).to_pylist() != test
    with pytest.raises(ValueError, match="family must be one of"):
        list(word_problems.problems("gsm8k", 1))


def test_the_smol_math_config_reads_them_and_the_math_reward_scores_a_boxed_answer(tmp_path):
    from asyncrl.config.keys import build_config
    from asyncrl.tasks.hf_data import read_hf_examples

    paths = word_problems.prepare(tmp_path, "search", train_rows=40, test_rows=8)
    config = build_config({}, ["data.task=hf", f"data.path={paths['train']}",
                               "data.messages_key=messages", "data.answer_key=answer",
                               "data.reward_fn=math"])  # fmt: skip
    examples = read_hf_examples(config.data, str(paths["train"]), config.data.split)
    assert len(examples) == 40
    first = examples[0]
    assert (
        math_reward(f"... so the answer is \\boxed{{{first.answer}}}.", first.answer)["correct"]
        == 1.0
    )
    assert math_reward("no box", first.answer)["correct"] == 0.0
