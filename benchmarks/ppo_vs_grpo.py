"""Reward against wall time for GRPO, PPO and RLOO, synchronous (A=0) and asynchronous (A=1), on
the built-in task, in one run of this script.

Each of the six runs uses its algorithm's demo config (`configs/demo.yaml`,
`configs/ppo_demo.yaml`, `configs/rloo_demo.yaml`) with only `rollout.max_trajectory_age_steps`
and the step count changed (`--grpo-steps` for GRPO and RLOO, `--ppo-steps`: a PPO step costs
about twice a GRPO step, so the defaults give all about the same wall time), and is timed by
its own records. Prints a
table (steps/s, reward over the first and last 10% of steps, wall seconds until the 50-step
mean reward first reaches each threshold) and writes `docs/img/ppo_vs_grpo.png` (or `--plot
PATH`).

    .venv/bin/python benchmarks/ppo_vs_grpo.py [--grpo-steps 1200] [--ppo-steps 600] [--plot PATH]
    (`make bench-algos`; GRPO's step count applies to RLOO, whose step costs the same)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from asyncrl.config.keys import load_config
from asyncrl.train.records import latest_records, read_jsonl
from asyncrl.train.trainer import train

ROOT = Path(__file__).resolve().parent.parent
RUNS = [  # label, config file, A
    ("GRPO sync", "configs/demo.yaml", 0),
    ("GRPO async", "configs/demo.yaml", 1),
    ("PPO sync", "configs/ppo_demo.yaml", 0),
    ("PPO async", "configs/ppo_demo.yaml", 1),
    ("RLOO sync", "configs/rloo_demo.yaml", 0),
    ("RLOO async", "configs/rloo_demo.yaml", 1),
]
COLORS = {"GRPO": "tab:blue", "PPO": "tab:orange", "RLOO": "tab:green"}
THRESHOLDS = (0.5, 0.8, 0.9)
WINDOW = 50


def smoothed(rewards: list[float], window: int = WINDOW) -> list[float]:
    """Trailing mean over the last `window` steps (fewer at the start)."""
    out, total = [], 0.0
    for i, r in enumerate(rewards):
        total += r - (rewards[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def seconds_to(threshold: float, walls: list[float], curve: list[float]) -> float | None:
    return next((w for w, c in zip(walls, curve, strict=True) if c >= threshold), None)


def run_one(config_path: str, age: int, steps: int | None, root: Path) -> list[dict]:
    overrides = [
        f"rollout.max_trajectory_age_steps={age}",
        "logging.progress=false",
        "logging.plot=false",
        "checkpoint.save_period=1000000",  # the last step still gets one
    ]
    if steps:
        overrides.append(f"run.max_num_steps={steps}")
    config = load_config(ROOT / config_path, overrides)
    train(config, root)
    return latest_records(read_jsonl(root / "metrics.jsonl"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpo-steps", type=int, default=1200)
    parser.add_argument("--ppo-steps", type=int, default=600)
    parser.add_argument("--plot", type=Path, default=ROOT / "docs/img/ppo_vs_grpo.png")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, config_path, age in RUNS:
            print(f"[{label}] {config_path} A={age} ...", file=sys.stderr, flush=True)
            slug = label.replace(" ", "-")
            steps = args.ppo_steps if label.startswith("PPO") else args.grpo_steps
            results[label] = run_one(config_path, age, steps, Path(tmp) / slug)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    header = (
        "| run | steps | wall s | steps/s | reward first 10% | last 10% | "
        + " | ".join(f"s to {t}" for t in THRESHOLDS)
        + " |"
    )
    print(header)
    print("|" + " --- |" * (5 + len(THRESHOLDS) + 1))
    for label, records in results.items():
        walls = [r["wall_s"] for r in records]
        rewards = [r["reward_mean"] for r in records]
        curve = smoothed(rewards)
        tenth = max(1, len(records) // 10)
        reach = [seconds_to(t, walls, curve) for t in THRESHOLDS]
        print(
            f"| {label} | {len(records)} | {walls[-1]:.0f} | {len(records) / walls[-1]:.2f} | "
            f"{statistics.mean(rewards[:tenth]):.3f} | {statistics.mean(rewards[-tenth:]):.3f} | "
            + " | ".join("—" if s is None else f"{s:.0f}" for s in reach)
            + " |"
        )
        style = "-" if "async" in label else "--"
        color = COLORS[label.split()[0]]
        ax.plot(walls, curve, style, color=color, label=label)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel(f"reward ({WINDOW}-step mean)")
    ax.set_title("sort 5 digits, tiny Llama from scratch, 2 CPU cores")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
