"""How much of generation the async pipeline hides behind training.

Runs the same shape synchronously (A=0) and asynchronously (A=1), one after the other in one
process, and prints steps/s of each, their ratio R, and the ideal ratio
I = (gen + train) / max(gen, train) from the phase times measured in the synchronous run.
R close to I means the overlap is close to its physical limit.

    .venv/bin/python benchmarks/overlap.py [--steps 60] [--warmup 10]

Its last line reads `async/sync steps/s: R (ideal I)` for the demo's shape.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from asyncrl.config import build_config
from asyncrl.train.records import read_jsonl
from asyncrl.train.trainer import train

SHAPES = {
    # name: overrides. "demo" is configs/demo.yaml's shape; "long" generates 12-token
    # completions for 16 samples per prompt, so generation weighs more.
    "long": [
        "data.num_digits=12", "rollout.max_new_tokens=12", "rollout.num_prompts_per_step=16",
        "rollout.num_generations_per_prompt=16",
    ],
    "demo": [
        "data.num_digits=5", "rollout.max_new_tokens=5", "rollout.num_prompts_per_step=16",
        "rollout.num_generations_per_prompt=16",
    ],
}  # fmt: skip


def measure(overrides: list[str], age: int, steps: int, warmup: int, root: Path) -> dict:
    """Trains `steps` steps; returns steady-state steps/s and mean phase seconds per step."""
    config = build_config(
        {},
        [
            *overrides,
            f"rollout.max_trajectory_age_steps={age}",
            f"run.max_num_steps={steps}",
            "logging.progress=false",
            "logging.plot=false",
        ],
    )
    run_dir = root / f"{abs(hash(tuple(overrides)))}-A{age}"
    train(config, run_dir)
    records = read_jsonl(run_dir / "metrics.jsonl")[warmup:]
    span_s = records[-1]["wall_s"] - records[0]["wall_s"]
    return {
        "steps_per_s": (len(records) - 1) / span_s,
        "gen_s": statistics.mean(r["generation_s"] for r in records),
        "train_s": statistics.mean(r["train_s"] + r["sync_s"] for r in records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in SHAPES.items():
            print(f"[{name}] running A=0 then A=1, {args.steps} steps each ...", file=sys.stderr)
            sync = measure(overrides, 0, args.steps, args.warmup, Path(tmp))
            asyn = measure(overrides, 1, args.steps, args.warmup, Path(tmp))
            gen, trn = sync["gen_s"], sync["train_s"]
            ideal = (gen + trn) / max(gen, trn)
            ratio = asyn["steps_per_s"] / sync["steps_per_s"]
            print(
                f"[{name}] sync {sync['steps_per_s']:.2f} steps/s, async "
                f"{asyn['steps_per_s']:.2f} steps/s; per step: generation {gen * 1000:.0f} ms, "
                f"training {trn * 1000:.0f} ms; R/I = {ratio / ideal:.2f}"
            )
            lines.append(f"[{name}] async/sync steps/s: {ratio:.2f} (ideal {ideal:.2f})")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
