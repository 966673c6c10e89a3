"""The second built-in example's files (`make math-demo`): arithmetic word problems as chat rows
in Parquet, and a tiny Qwen2-architecture model with a byte-level BPE tokenizer that has a
ChatML chat template, all generated offline.

    python -m asyncrl.examples.math_chat data/math_chat

writes `train.parquet` and `test.parquet` (rows `{"messages": [{"role": "user", ...}],
"answer": "7"}`, disjoint problems) and `model/` (`save_pretrained`), which
`configs/math_chat.yaml` trains with the `math` reward, evaluation, a cosine schedule,
TensorBoard and MLflow. Same files for the same arguments; existing files are kept.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncrl.models.scratch import IM_END, IM_START, save_scratch_model

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun"]
THINGS = ["apples", "books", "coins", "pens", "shells", "stamps", "marbles", "cards"]
TEMPLATES = [
    ("{n} has {a} {t} and gets {b} more. How many {t} does {n} have now?", "+"),
    ("{n} had {a} {t} and gave away {b}. How many {t} are left?", "-"),
    ("{n} buys {a} bags with {b} {t} in each. How many {t} is that?", "*"),
    ("What is {a} plus {b}?", "+"),
    ("What is {a} minus {b}?", "-"),
]
SYSTEM_PROMPT = "Give the final answer as a number in \\boxed{}."


def problems(seed: int = 0) -> Iterator[tuple[str, int]]:
    """Every (question, answer) of the generator once, in a shuffled order fixed by `seed`:
    answers are whole numbers from 0 to 9 (small: a model from scratch can find them)."""
    rows = []
    for template, op in TEMPLATES:
        for a in range(10):
            for b in range(10):
                answer = {"+": a + b, "-": a - b, "*": a * b}[op]
                if not 0 <= answer <= 9 or (op != "+" and b == 0):
                    continue
                rng = random.Random(f"{template}:{a}:{b}")
                text = template.format(n=rng.choice(NAMES), t=rng.choice(THINGS), a=a, b=b)
                rows.append((text, answer))
    random.Random(seed).shuffle(rows)
    yield from rows


def chat_row(question: str, answer: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": question}], "answer": str(answer)}


def corpus() -> Iterator[str]:
    """What the tokenizer is trained on: the problems in their ChatML form, boxed answers."""
    for question, answer in problems():
        yield f"{IM_START}system\n{SYSTEM_PROMPT}{IM_END}\n{IM_START}user\n{question}{IM_END}\n"
        yield f"{IM_START}assistant\nThe answer is \\boxed{{{answer}}}.{IM_END}\n"


def prepare(out: str | Path, test_rows: int = 64, seed: int = 0) -> dict[str, Path]:
    """Writes the example's files into `out` (kept if already there); returns their paths."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / "train.parquet", "test": out / "test.parquet", "model": out / "model"}
    rows = [chat_row(q, a) for q, a in problems(seed)]
    for split, part in (("test", rows[:test_rows]), ("train", rows[test_rows:])):
        if not paths[split].exists():
            datasets.Dataset.from_list(part).to_parquet(str(paths[split]))
    if not (paths["model"] / "config.json").exists():
        save_scratch_model(
            paths["model"],
            arch="qwen2",
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=192,
            vocab_size=400,
            max_position_embeddings=256,
            seed=seed,
            corpus=corpus(),
        )
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m asyncrl.examples.math_chat",
        description="Write the math chat example's Parquet data and tiny Qwen2 model, offline.",
    )
    parser.add_argument("out", help="output directory, e.g. data/math_chat")
    parser.add_argument("--test-rows", type=int, default=64)
    args = parser.parse_args(argv)
    for name, path in prepare(args.out, args.test_rows).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
