"""Time to reward: how many wall seconds and steps a config needs to reach a reward.

Trains a config (default the demo's) once per seed, one run after another, each for at most
`--budget-s` wall seconds (the run is stopped there), and prints per seed and as medians the
seconds and steps until the 50-step trailing mean reward first reaches 0.5, 0.8 and 0.9, the
steps/s, and the final reward (mean over the last 10% of the steps trained).

    .venv/bin/python benchmarks/time_to_reward.py                       # `make bench-reward`
    .venv/bin/python benchmarks/time_to_reward.py --seeds 2 --set algo.lr=1e-3
    .venv/bin/python benchmarks/time_to_reward.py --compare DIR_A DIR_B --table --plot out.png

Seconds are the run's own `wall_s` (metrics.jsonl): from the trainer's start, after the model
and task are built, so Python's imports are not counted. Every run dir and a `summary.json`
stay in `--dir`. A seed that does not reach a threshold counts as never reaching it (the
median is then "not reached" if half the seeds miss). The last line reads

    time_to_0.9: median S s (steps M)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.train.records import latest_records, read_jsonl
from asyncrl.train.signals import EXIT_PREEMPTED

ROOT = Path(__file__).resolve().parents[1]
THRESHOLDS = (0.5, 0.8, 0.9)
QUIET = ["logging.progress=false", "logging.plot=false"]


@dataclass
class SeedResult:
    seed: int
    steps: int
    wall_s: float
    final_reward: float
    reached: dict[str, tuple[float, int] | None] = field(default_factory=dict)
    """threshold -> (seconds, steps) when the trailing mean first reached it, or None."""

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s if self.wall_s > 0 else 0.0


def trailing_means(values: list[float], window: int) -> list[float | None]:
    """The mean of the `window` values ending at each index (None before `window` exist)."""
    out: list[float | None] = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / window if i + 1 >= window else None)
    return out


def time_to(
    rewards: list[float], wall_s: list[float], threshold: float, window: int
) -> tuple[float, int] | None:
    """(wall seconds, steps trained) at the first step whose trailing `window`-step mean reward
    is >= `threshold`; None if none is."""
    for i, mean in enumerate(trailing_means(rewards, window)):
        if mean is not None and mean >= threshold - 1e-12:
            return wall_s[i], i + 1
    return None


def final_reward(rewards: list[float], fraction: float = 0.1) -> float:
    """Mean reward over the last `fraction` of the steps (at least one)."""
    tail = rewards[-max(1, math.ceil(len(rewards) * fraction)) :]
    return sum(tail) / len(tail) if tail else 0.0


def analyse(
    records: list[dict[str, Any]], seed: int, thresholds: tuple[float, ...], window: int
) -> SeedResult:
    """One run's result from its metrics records (the latest record of each step)."""
    records = sorted(latest_records(records), key=lambda r: r["step"])
    rewards = [float(r["reward_mean"]) for r in records]
    wall = [float(r["wall_s"]) for r in records]
    return SeedResult(
        seed=seed,
        steps=len(records),
        wall_s=wall[-1] if wall else 0.0,
        final_reward=final_reward(rewards),
        reached={f"{t:g}": time_to(rewards, wall, t, window) for t in thresholds},
    )


def median_reached(results: list[SeedResult], threshold: str) -> tuple[float, float] | None:
    """Median (seconds, steps) over seeds, a seed that never reached it counting as infinite;
    None if the median is infinite."""
    seconds = [r.reached[threshold][0] if r.reached[threshold] else math.inf for r in results]
    steps = [r.reached[threshold][1] if r.reached[threshold] else math.inf for r in results]
    s, n = statistics.median(seconds), statistics.median(steps)
    return None if math.isinf(s) or math.isinf(n) else (s, n)


def fmt(reached: tuple[float, float] | None) -> str:
    return "not reached" if reached is None else f"{reached[0]:.1f} s ({reached[1]:.0f} steps)"


def train_one(
    config: Path, run_dir: Path, seed: int, overrides: list[str], budget_s: float
) -> None:
    """One `asyncrl train` run of `config` with `run.seed=seed`, stopped (SIGTERM: a
    checkpoint and exit 75; SIGKILL a minute later) if it is still running after `budget_s`
    wall seconds."""
    command = [sys.executable, "-m", "asyncrl.cli", "train", str(config)]
    command += ["--run-dir", str(run_dir), "--restart", f"run.seed={seed}", *QUIET, *overrides]
    log = (run_dir.parent / f"{run_dir.name}.log").open("w")
    proc = subprocess.Popen(
        command, env={**os.environ, "PYTHONWARNINGS": "ignore"}, stdout=log, stderr=log
    )
    try:
        proc.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    finally:
        log.close()
    if proc.returncode not in (0, EXIT_PREEMPTED, -9) or not (run_dir / "metrics.jsonl").exists():
        tail = (run_dir.parent / f"{run_dir.name}.log").read_text()[-2000:]
        raise SystemExit(f"time_to_reward: seed {seed} failed (exit {proc.returncode}):\n{tail}")


def report(results: list[SeedResult], thresholds: tuple[float, ...], label: str) -> list[str]:
    lines = []
    for r in results:
        reached = "  ".join(f"{t}: {fmt(v)}" for t, v in r.reached.items())
        lines.append(
            f"{label}seed {r.seed}: {r.steps} steps in {r.wall_s:.1f} s "
            f"({r.steps_per_s:.2f} steps/s), final {r.final_reward:.3f}  {reached}"
        )
    sps = statistics.median(r.steps_per_s for r in results)
    final = statistics.median(r.final_reward for r in results)
    medians = "  ".join(f"{t:g}: {fmt(median_reached(results, f'{t:g}'))}" for t in thresholds)
    lines.append(f"{label}median: {sps:.2f} steps/s, final {final:.3f}  {medians}")
    last = median_reached(results, f"{thresholds[-1]:g}")
    what = f"time_to_{thresholds[-1]:g}"
    lines.append(
        f"{what}: median not reached"
        if last is None
        else f"{what}: median {last[0]:.1f} s (steps {last[1]:.0f})"
    )
    return lines


def table(rows: list[tuple[str, list[SeedResult]]], thresholds: tuple[float, ...]) -> str:
    """A markdown table: one row per benchmark dir, medians over its seeds, and each
    threshold's steps per seed (— where a seed did not reach it)."""
    head = ["variant", "seeds", "steps/s", "final"]
    head += [f"s to {t:g}" for t in thresholds] + [f"steps to {t:g} (per seed)" for t in thresholds]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for label, results in rows:
        cells = [label, str(len(results))]
        cells.append(f"{statistics.median(r.steps_per_s for r in results):.2f}")
        cells.append(f"{statistics.median(r.final_reward for r in results):.3f}")
        for t in thresholds:
            reached = median_reached(results, f"{t:g}")
            cells.append("—" if reached is None else f"{reached[0]:.0f}")
        for t in thresholds:
            steps = [r.reached[f"{t:g}"] for r in results]
            cells.append(", ".join("—" if v is None else f"{v[1]}" for v in steps))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_summary(directory: Path) -> tuple[dict[str, Any], list[SeedResult]]:
    summary = json.loads((directory / "summary.json").read_text())
    results = []
    for r in summary["results"]:
        reached = {k: (tuple(v) if v else None) for k, v in r.pop("reached").items()}
        results.append(SeedResult(**r, reached=reached))  # type: ignore[arg-type]
    return summary, results


def plot(directories: list[Path], out: Path, window: int) -> None:
    """Trailing-mean reward against steps, one colour per benchmark directory (its label),
    one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, directory in enumerate(directories):
        summary, _ = load_summary(directory)
        for j, run in enumerate(sorted(directory.glob("seed*/metrics.jsonl"))):
            records = sorted(latest_records(read_jsonl(run)), key=lambda r: r["step"])
            means = trailing_means([float(r["reward_mean"]) for r in records], window)
            ax.plot(
                [k + 1 for k, m in enumerate(means) if m is not None],
                [m for m in means if m is not None],
                color=colours[i % len(colours)],
                alpha=0.8,
                label=summary["label"] if j == 0 else None,
            )
    ax.axhline(0.9, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"reward ({window}-step trailing mean)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs/demo.yaml")
    parser.add_argument("--seeds", type=int, default=3, help="runs, with run.seed 0..N-1")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=600.0, help="wall seconds per run")
    parser.add_argument("--window", type=int, default=50, help="trailing-mean steps")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    parser.add_argument("--dir", type=Path, default=None, help="run dirs and summary.json")
    parser.add_argument("--label", default=None, help="this variant's name in plots")
    parser.add_argument(
        "--compare", type=Path, nargs="+", default=None, help="report saved benchmark dirs"
    )
    parser.add_argument("--plot", type=Path, default=None, help="reward-vs-step plot PNG")
    parser.add_argument("--table", action="store_true", help="with --compare: markdown table")
    args = parser.parse_args()

    if args.compare:
        loaded = [load_summary(directory) for directory in args.compare]
        if args.table:
            print(table([(summary["label"], results) for summary, results in loaded], THRESHOLDS))
        for summary, results in [] if args.table else loaded:
            print("\n".join(report(results, THRESHOLDS, f"[{summary['label']}] ")))
        if args.plot:
            plot(args.compare, args.plot, args.window)
        return

    out = args.dir or ROOT / "runs" / f"bench-reward-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    label = args.label or (" ".join(args.set) or args.config.stem)
    print(f"time_to_reward: {args.config} x {args.seeds} seeds, {label}; run dirs in {out}")
    results = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        run_dir = out / f"seed{seed}"
        train_one(args.config, run_dir, seed, args.set, args.budget_s)
        result = analyse(read_jsonl(run_dir / "metrics.jsonl"), seed, THRESHOLDS, args.window)
        results.append(result)
        print(report([result], THRESHOLDS, "")[0], flush=True)
    summary = {
        "label": label,
        "config": str(args.config),
        "overrides": args.set,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "window": args.window,
        "results": [asdict(r) for r in results],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.plot:
        plot([out], args.plot, args.window)
    print("\n".join(report(results, THRESHOLDS, "")[-2:]))


if __name__ == "__main__":
    main()
