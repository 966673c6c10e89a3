"""Word problems asked the standard zero-shot way, for the real model's recipe (issue #66):
GSM8K-style problems of one to three steps from templates of their own (none is one of
`asyncrl.examples.smol_math`'s), each a single user turn ending in the instruction most math
data uses, "Please reason step by step, and put your final answer within \\boxed{}.", with no
solved example in front.

Two families of templates, disjoint: `search`, the ones a recipe search may train and evaluate
on, and `heldout`, the ones it never looks at, kept for the final check that a recipe learns
problems it was not tuned on.

    python -m asyncrl.examples.word_problems data/word_problems --family search
    python -m asyncrl.examples.word_problems data/word_problems_heldout --family heldout

writes `train.parquet` and `test.parquet` (rows `{"messages": [{"role": "user", ...}],
"answer": "42", "solution": "6 * 7 = 42. The answer is \\boxed{42}.", "template": ...,
"steps": n}`, the solution a worked answer for `data.fewshot_key`; no question in both; 256
test rows by default), which `configs/smol_math.yaml` reads with `data.path=... eval.path=...`
(its `messages_key` and `answer_key` are these). Same files for the same arguments; existing
files are kept.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
"""The standard zero-shot math instruction (Qwen2.5-Math's and most evaluation harnesses')."""

NAMES = ["Aiko", "Bruno", "Carla", "Dev", "Esme", "Femi", "Greta", "Hugo", "Isla", "Jonas",
         "Kira", "Luca", "Mira", "Nils", "Olga", "Pablo"]  # fmt: skip

Problem = tuple[str, int, int, str]
"""(question, answer, steps, solution): the solution a worked answer, as GSM8K's and MATH's
rows have one, ending in the boxed answer (`data.fewshot_key=solution` puts it in
demonstrations)."""


def _solved(work: str, answer: int) -> str:
    return f"{work} The answer is \\boxed{{{answer}}}."


Template = Callable[[random.Random, str], Problem]


def _bakery(rng: random.Random, name: str) -> Problem:
    a, b = rng.randint(10, 60), rng.randint(10, 60)
    c = rng.randint(5, a + b - 1)
    return (
        f"A bakery bakes {a} loaves of bread in the morning and {b} in the afternoon. By the "
        f"evening it has sold {c} loaves. How many loaves are left?",
        a + b - c,
        2,
        _solved(
            f"{a} + {b} = {a + b} loaves were baked, and {a + b} - {c} = {a + b - c} are left.",
            a + b - c,
        ),
    )


def _train(rng: random.Random, name: str) -> Problem:
    cars, seats = rng.randint(3, 9), rng.randint(10, 40)
    empty = rng.randint(1, cars * seats - 1)
    return (
        f"A train has {cars} cars with {seats} seats in each car. {empty} seats are empty. How "
        "many passengers are sitting on the train?",
        cars * seats - empty,
        2,
        _solved(
            f"{cars} * {seats} = {cars * seats} seats, "
            f"and {cars * seats} - {empty} = {cars * seats - empty} are taken.",
            cars * seats - empty,
        ),
    )


def _savings(rng: random.Random, name: str) -> Problem:
    weekly, weeks = rng.randint(3, 20), rng.randint(2, 10)
    spent = rng.randint(1, weekly * weeks - 1)
    return (
        f"{name} saves {weekly} dollars every week for {weeks} weeks, then spends {spent} "
        f"dollars on a gift. How many dollars does {name} have left?",
        weekly * weeks - spent,
        2,
        _solved(
            f"{weekly} * {weeks} = {weekly * weeks} dollars saved, "
            f"and {weekly * weeks} - {spent} = {weekly * weeks - spent} are left.",
            weekly * weeks - spent,
        ),
    )


def _garden(rng: random.Random, name: str) -> Problem:
    rows, per, more = rng.randint(2, 9), rng.randint(3, 15), rng.randint(1, 30)
    return (
        f"A garden has {rows} rows of tulips with {per} tulips in each row. {name} plants "
        f"{more} more tulips. How many tulips are in the garden now?",
        rows * per + more,
        2,
        _solved(
            f"{rows} * {per} = {rows * per} tulips, "
            f"and {rows * per} + {more} = {rows * per + more}.",
            rows * per + more,
        ),
    )


def _pages(rng: random.Random, name: str) -> Problem:
    a, b = rng.randint(5, 80), rng.randint(5, 80)
    return (
        f"{name} read {a} pages on Monday and {b} pages on Tuesday. How many pages did {name} "
        "read in all?",
        a + b,
        1,
        _solved(f"{a} + {b} = {a + b}.", a + b),
    )


def _buses(rng: random.Random, name: str) -> Problem:
    seats = rng.randint(10, 40)
    buses = rng.randint(2, 9)
    classes = rng.choice([d for d in range(2, 10) if (seats * buses) % d == 0])
    students = seats * buses // classes
    return (
        f"{name}'s school takes {classes} classes of {students} students each on a trip. They "
        f"ride in buses with {seats} seats, and every seat is taken. How many buses do they "
        "need?",
        buses,
        2,
        _solved(
            f"{classes} * {students} = {classes * students} students, "
            f"and {classes * students} / {seats} = {buses} buses.",
            buses,
        ),
    )


def _flour(rng: random.Random, name: str) -> Problem:
    per, cakes = rng.randint(50, 300), rng.randint(2, 6)
    left = rng.randint(10, 500)
    return (
        f"A cake needs {per} grams of flour. {name} has {per * cakes + left} grams of flour and "
        f"bakes {cakes} cakes. How many grams of flour are left?",
        left,
        2,
        _solved(
            f"{cakes} * {per} = {per * cakes} grams are used, "
            f"and {per * cakes + left} - {per * cakes} = {left} are left.",
            left,
        ),
    )


def _parking(rng: random.Random, name: str) -> Problem:
    levels, spaces = rng.randint(2, 6), rng.randint(20, 60)
    cars = rng.randint(1, levels * spaces - 1)
    return (
        f"A car park has {levels} levels with {spaces} spaces on each level. {cars} cars are "
        "parked there. How many spaces are free?",
        levels * spaces - cars,
        2,
        _solved(
            f"{levels} * {spaces} = {levels * spaces} spaces, "
            f"and {levels * spaces} - {cars} = {levels * spaces - cars} are free.",
            levels * spaces - cars,
        ),
    )


def _oranges(rng: random.Random, name: str) -> Problem:
    daily, days = rng.randint(3, 25), rng.randint(2, 7)
    given = rng.randint(1, daily * days - 1)
    return (
        f"{name} picks {daily} oranges every day for {days} days and gives {given} of them to "
        f"the neighbours. How many oranges does {name} keep?",
        daily * days - given,
        2,
        _solved(
            f"{daily} * {days} = {daily * days} oranges picked, "
            f"and {daily * days} - {given} = {daily * days - given} are kept.",
            daily * days - given,
        ),
    )


def _tickets(rng: random.Random, name: str) -> Problem:
    adult, child = rng.randint(8, 20), rng.randint(3, 9)
    adults, children = rng.randint(1, 4), rng.randint(1, 5)
    return (
        f"A museum ticket costs {adult} dollars for an adult and {child} dollars for a child. "
        f"{name}'s family buys {adults} adult tickets and {children} child tickets. How many "
        "dollars do they pay?",
        adult * adults + child * children,
        3,
        _solved(
            f"{adults} * {adult} = {adult * adults} and {children} * {child} = {child * children}, "
            f"so {adult * adults} + {child * children} = "
            f"{adult * adults + child * children} dollars.",
            adult * adults + child * children,
        ),
    )


def _crayons(rng: random.Random, name: str) -> Problem:
    per, boxes = rng.randint(6, 48), rng.randint(2, 30)
    return (
        f"A box holds {per} crayons. {name} buys {boxes} boxes. How many crayons does {name} buy?",
        per * boxes,
        1,
        _solved(f"{boxes} * {per} = {per * boxes}.", per * boxes),
    )


def _tank(rng: random.Random, name: str) -> Problem:
    bucket = rng.randint(2, 10)
    tanks = rng.randint(2, 5)
    liters = bucket * rng.randint(3, 12)
    return (
        f"A water tank holds {liters} liters. {name} fills tanks with a bucket that holds "
        f"{bucket} liters. How many buckets does {name} pour to fill {tanks} tanks?",
        liters * tanks // bucket,
        2,
        _solved(
            f"{tanks} * {liters} = {liters * tanks} liters, "
            f"and {liters * tanks} / {bucket} = {liters * tanks // bucket} buckets.",
            liters * tanks // bucket,
        ),
    )


FAMILIES: dict[str, dict[str, Template]] = {
    "search": {
        "bakery": _bakery,
        "train": _train,
        "savings": _savings,
        "garden": _garden,
        "pages": _pages,
        "buses": _buses,
    },
    "heldout": {
        "flour": _flour,
        "parking": _parking,
        "oranges": _oranges,
        "tickets": _tickets,
        "crayons": _crayons,
        "tank": _tank,
    },
}
"""The template families: `search` for a recipe search, `heldout` never looked at by one."""


def problems(family: str, count: int, seed: int = 0) -> Iterator[tuple[str, Problem]]:
    """`count` distinct (template, problem) of `family`, the templates in turn, in an order
    fixed by `seed`."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, not {family!r}")
    templates = list(FAMILIES[family].items())
    rng = random.Random(f"{family}:{seed}")
    seen: set[str] = set()
    tries = 0
    while len(seen) < count:
        tries += 1
        if tries > 100 * count:
            raise ValueError(f"{family}: fewer than {count} distinct problems")
        name, template = templates[len(seen) % len(templates)]
        problem = template(rng, rng.choice(NAMES))
        if problem[0] not in seen:
            seen.add(problem[0])
            yield name, problem


def chat_row(template: str, problem: Problem) -> dict[str, Any]:
    """One row: the question and the instruction as the only user turn (zero-shot)."""
    question, answer, steps, solution = problem
    return {
        "messages": [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}],
        "answer": str(answer),
        "solution": solution,
        "template": template,
        "steps": steps,
    }


def prepare(
    out: str | Path, family: str = "search", train_rows: int = 4096, test_rows: int = 256,
    seed: int = 0,
) -> dict[str, Path]:  # fmt: skip
    """Writes `train.parquet` and `test.parquet` of `family` into `out` (kept if already
    there with these rows); returns their paths."""
    import datasets

    from asyncrl.examples.smol_math import write_splits

    datasets.disable_progress_bars()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / "train.parquet", "test": out / "test.parquet"}
    rows = [chat_row(t, p) for t, p in problems(family, train_rows + test_rows, seed)]
    write_splits(paths, rows, test_rows)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m asyncrl.examples.word_problems",
        description="Write zero-shot word problems (train.parquet, test.parquet), offline.",
    )
    parser.add_argument("out", help="output directory, e.g. data/word_problems")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="search")
    parser.add_argument("--train-rows", type=int, default=4096)
    parser.add_argument("--test-rows", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = prepare(args.out, args.family, args.train_rows, args.test_rows, args.seed)
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
