"""How much of generation the async pipeline hides behind training.

Runs each shape synchronously (A=0) and asynchronously (A=1), one after the other in one
process, and prints steps/s of each, their ratio R, and the ideal ratio
I = (gen + train) / max(gen, train) from the phase times measured in the synchronous run
(gen: the collector's generation and scoring; train: the optimizer step and weight publish).
R close to I means the overlap is close to its physical limit.

    .venv/bin/python benchmarks/overlap.py [--steps 60] [--warmup 10] [--repeats 3]

It also runs A=1 with `run.deterministic=true` and prints its steps/s against the default
async run. Each figure is the median of `--repeats` alternating runs: a shared 2-core machine
is noisy, and alternating keeps slow spells from landing on one side.

Its last line reads `async/sync steps/s: R (ideal I)` for the demo's shape.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from asyncrl.config.keys import build_config
from asyncrl.train.records import read_jsonl
from asyncrl.train.trainer import train

SHAPES = {
    # name: overrides. "demo" is configs/demo.yaml's shape. "gen-heavy" samples 24-token
    # completions for a small batch, so generation weighs about as much as training.
    "gen-heavy": [
        "data.num_digits=24", "rollout.max_new_tokens=24", "rollout.num_prompts_per_step=4",
        "rollout.num_generations_per_prompt=4",
    ],
    "demo": [
        "data.num_digits=5", "rollout.max_new_tokens=5", "rollout.num_prompts_per_step=16",
        "rollout.num_generations_per_prompt=16",
    ],
}  # fmt: skip


def measure(
    overrides: list[str], age: int, steps: int, warmup: int, root: Path, deterministic: bool = False
) -> dict:
    """Trains `steps` steps; returns steady-state steps/s and mean phase seconds per step."""
    config = build_config(
        {},
        [
            *overrides,
            f"rollout.max_trajectory_age_steps={age}",
            f"run.deterministic={str(deterministic).lower()}",
            f"run.max_num_steps={steps}",
            "logging.progress=false",
            "logging.plot=false",
        ],
    )
    run_dir = root / f"A{age}{'-det' if deterministic else ''}"
    train(config, run_dir)
    records = read_jsonl(run_dir / "metrics.jsonl")[warmup:]
    span_s = records[-1]["wall_s"] - records[0]["wall_s"]
    return {
        "steps_per_s": (len(records) - 1) / span_s,
        "gen_s": statistics.mean(r["generation_s"] for r in records),
        "train_s": statistics.mean(r["train_s"] + r["sync_s"] for r in records),
    }


def median_of(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="alternating A=0/A=1 pairs")
    args = parser.parse_args()
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in SHAPES.items():
            runs: dict[str, list[dict]] = {"sync": [], "async": [], "det": []}
            modes = (("sync", 0, False), ("async", 1, False), ("det", 1, True))
            for repeat in range(args.repeats):
                for mode, age, det in modes:
                    print(f"[{name}] {mode} run {repeat + 1}/{args.repeats}", file=sys.stderr)
                    root = Path(tmp) / f"{name}-{repeat}"
                    runs[mode].append(measure(overrides, age, args.steps, args.warmup, root, det))
            sync, asyn, det = (median_of(runs[m]) for m in ("sync", "async", "det"))
            gen, trn = sync["gen_s"], sync["train_s"]
            ideal = (gen + trn) / max(gen, trn)
            ratio = asyn["steps_per_s"] / sync["steps_per_s"]
            print(
                f"[{name}] sync {sync['steps_per_s']:.2f} steps/s (generation {gen * 1e3:.0f} ms"
                f" + training {trn * 1e3:.0f} ms per step), async {asyn['steps_per_s']:.2f} "
                f"steps/s (generation {asyn['gen_s'] * 1e3:.0f} ms, training "
                f"{asyn['train_s'] * 1e3:.0f} ms per step); R/I = {ratio / ideal:.2f}"
            )
            print(
                f"[{name}] deterministic async {det['steps_per_s']:.2f} steps/s = "
                f"{det['steps_per_s'] / asyn['steps_per_s']:.2f} x default async"
            )
            lines.append(f"[{name}] async/sync steps/s: {ratio:.2f} (ideal {ideal:.2f})")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
