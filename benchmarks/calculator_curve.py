"""Does SmolLM2 learn to use the calculator tool: `make calculator-demo`'s run, read per window.

    .venv/bin/python benchmarks/calculator_curve.py                  # train, then read
    .venv/bin/python benchmarks/calculator_curve.py --from RUN_DIR   # read a finished run
    .venv/bin/python benchmarks/calculator_curve.py --set run.max_num_steps=40 --plot PNG

The run trains `configs/calculator_tool.yaml` (SmolLM2-135M-Instruct, the word problems, the
built-in calculator environment: a turn either calls `<calc>EXPRESSION</calc>` or answers in
`\\boxed{}`) by the real CLI. Episodes have no held-out evaluation yet, so the measure is the
run's own samples, per window of `--window` steps:

- `reward`: the episodes' mean reward (`reward_mean`: correct + 0.2 for the boxed format);
- `turns`: assistant turns per episode (`reward/turns`);
- `tool`: the share of the window's episodes that called the calculator at least once, from the
  environment's own journal (`RUN_DIR/env/calculator.jsonl`, its rows by step id
  `ORDINAL:SAMPLE:TURN`), matched to the steps' `prompt_ordinals`.

Last line:

    calculator: reward A -> B, tool calls X -> Y (first and last window), T s
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from asyncrl.train.records import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/calculator_tool.yaml"


def windows(run: Path, size: int, group: int) -> list[dict[str, Any]]:
    """Per window of `size` steps (the records that count: a step's last): its first step,
    mean reward, turns per episode and tool-calling share (`group` samples a prompt)."""
    final = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl")}
    journal = run / "env" / "calculator.jsonl"
    called: set[tuple[int, int]] = set()  # (ordinal, sample) that called the tool
    if journal.exists():
        for line in journal.read_text().splitlines():
            try:
                ordinal, sample = json.loads(line)["step_id"].split(":")[:2]
            except (ValueError, KeyError):
                continue  # a torn last line
            called.add((int(ordinal), int(sample)))
    steps = sorted(final)
    out = []
    for i in range(0, len(steps), size):
        rows = [final[t] for t in steps[i : i + size]]
        episodes = [(k, s) for r in rows for k in r["prompt_ordinals"] for s in range(group)]
        out.append({
            "step": rows[0]["step"],
            "reward": statistics.mean(r["reward_mean"] for r in rows),
            "turns": statistics.mean(r.get("reward/turns", 1.0) for r in rows),
            "tool": sum(e in called for e in episodes) / max(len(episodes), 1),
        })  # fmt: skip
    return out


def wall_seconds(run: Path) -> float:
    events = read_jsonl(run / "events.jsonl")
    start = min(e["time"] for e in events if e["event"] == "start")
    end = max(e["time"] for e in events)
    return float(end - start)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["reward"] for r in rows], marker="o", label="episode reward")
    ax.plot(steps, [r["tool"] for r in rows], marker="s", label="episodes calling the tool")
    ax.set_xlabel("training step (window start)")
    ax.set_ylim(0, max(1.0, max(r["reward"] for r in rows)))
    ax.legend()
    ax.set_title("SmolLM2-135M with the calculator tool")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="run", type=Path, default=None)
    parser.add_argument("--dir", type=Path, default=None, help="the run goes here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    run = args.run
    if run is None:
        subprocess.run(
            [sys.executable, "-m", "asyncrl.examples.smol_math", str(ROOT / "data/smol_math")],
            check=True,
        )
        run = (args.dir or Path(tempfile.mkdtemp())) / "calculator"
        command = [sys.executable, "-m", "asyncrl.cli", "train", str(CONFIG), "--run-dir",
                   str(run), *args.set]  # fmt: skip
        print(f"calculator: training {run} ...", flush=True)
        subprocess.run(command, check=True, cwd=ROOT)
    config = yaml.safe_load((run / "config.yaml").read_text())
    rows = windows(run, args.window, int(config["rollout"]["num_generations_per_prompt"]))
    print(f"{'steps':>9} {'reward':>7} {'turns':>6} {'tool':>6}")
    for r in rows:
        print(f"{r['step']:>4}-{r['step'] + args.window - 1:<4} {r['reward']:7.3f} "
              f"{r['turns']:6.2f} {r['tool']:6.2f}")  # fmt: skip
    if args.plot:
        plot(rows, args.plot)
    first, last = rows[0], rows[-1]
    print(
        f"calculator: reward {first['reward']:.3f} -> {last['reward']:.3f}, tool calls "
        f"{first['tool']:.2f} -> {last['tool']:.2f} (first and last window of {args.window} "
        f"steps), {wall_seconds(run):.0f} s"
    )


if __name__ == "__main__":
    main()
