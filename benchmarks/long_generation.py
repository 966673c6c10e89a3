"""The long-generation shape shared by the partial-generation benchmarks and crash tests:
completions of up to 128 tokens generated 16 at a time, from a tiny model whose tokenizer
has ~200 symbols, so that an untrained model samples EOS rarely (about 1 token in 200) and
completions are long and of varied length, as reasoning rollouts are.

    write_task(path)  # the JSONL the shape's `data.path` names
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ALPHABET = [chr(0x100 + i) for i in range(200)]
"""Latin Extended letters: one character-tokenizer symbol each."""


def write_task(path: Path, rows: int = 64, seed: int = 0) -> Path:
    """`rows` prompts of 8 random symbols; the answer is the prompt repeated to 128 symbols
    (scored by the default `partial_match`)."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as out:
        for _ in range(rows):
            prompt = "".join(rng.choice(ALPHABET) for _ in range(8))
            out.write(json.dumps({"prompt": prompt, "answer": prompt * 16}) + "\n")
    return path


def shape(task_path: Path, chunk_tokens: int = 16) -> list[str]:
    """Config overrides of the shape (on top of `configs/demo.yaml`)."""
    return [
        "model.max_seq_len=160",
        "data.task=jsonl",
        f"data.path={task_path}",
        "rollout.max_new_tokens=128",
        f"rollout.chunk_tokens={chunk_tokens}",
        "rollout.num_prompts_per_step=4",
        "rollout.num_generations_per_prompt=4",
        "rollout.groups_per_batch=4",
        "rollout.max_trajectory_age_steps=1",
        "checkpoint.save_period=2",
    ]
