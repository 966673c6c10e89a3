"""Does the real model learn the task, and how fast: `make smol-demo`'s run, once per seed.

    .venv/bin/python benchmarks/smol.py                     # `make bench-smol`: seeds 0,1,2
    .venv/bin/python benchmarks/smol.py --seeds 0 --set run.max_num_steps=40
    .venv/bin/python benchmarks/smol.py --from runs/smol-demo-20261202-040245   # read runs

Each seed trains `configs/smol_math.yaml` (SmolLM2-135M-Instruct on the generated word
problems, evaluated greedily on 256 held-out problems before the first step and every
`eval.every_steps`) by the real CLI in a child process, `run.seed` set to the seed. From the
run's `events.jsonl` it prints, per seed, the held-out greedy accuracy of the initial weights
(the `eval` event of step -1) and of the last evaluation, with their standard errors, the
`\\boxed{}` format share of the last one, and the wall seconds from the run's `start` event to
the last evaluation; then, last, the means over the seeds and how many rose by at least
`--target` points (issue 45: 10 points on 2 of 3 seeds within 45 minutes):

    smol: heldout_acc S0 -> S1 in T s (seeds up >= 10 points: K/N)

`--from DIR ...` reads finished run directories instead of training; `--plot PNG` draws each
seed's held-out greedy accuracy against the step, with its standard error (docs/img/).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.train.records import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/smol_math.yaml"


@dataclass
class SeedResult:
    run: Path
    before: float
    before_se: float
    after: float
    after_se: float
    after_step: int
    format_share: float
    prompts: int
    seconds: float


def read_run(run: Path) -> SeedResult:
    """The first and last `eval` events of a run directory (the first must be step -1, the
    initial weights)."""
    events = read_jsonl(run / "events.jsonl")
    evals = [e for e in events if e["event"] == "eval"]
    starts = [e["time"] for e in events if e["event"] == "start"]
    if not evals or evals[0]["step"] != -1 or not starts:
        raise SystemExit(f"{run}: no evaluation of the initial weights (eval.at_start) in it")
    first, last = evals[0], evals[-1]
    return SeedResult(
        run,
        first["eval/greedy_pass"],
        first["eval/stderr/greedy_pass"],
        last["eval/greedy_pass"],
        last["eval/stderr/greedy_pass"],
        int(last["step"]),
        float(last.get("eval/reward/format", float("nan"))),
        int(last["eval/num_examples"]),
        last["time"] - starts[0],
    )


def curve(run: Path) -> list[tuple[int, float, float]]:
    """(step, held-out greedy accuracy, its standard error) of each evaluation of a run, the
    initial weights at step 0 (their `eval` event says step -1), the last one per step."""
    points = {
        int(e["step"]) + 1: (float(e["eval/greedy_pass"]), float(e["eval/stderr/greedy_pass"]))
        for e in read_jsonl(run / "events.jsonl")
        if e["event"] == "eval"
    }
    return [(step, *points[step]) for step in sorted(points)]


def plot(pairs: list[tuple[str, Path]], out: Path, title: str = "configs/smol_math.yaml") -> None:
    """Each run's held-out curve, labelled `seed S`, or by its directory's name where runs
    share a seed (recipes compared on one seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    by_name = len({seed for seed, _ in pairs}) < len(pairs)
    for seed, run in pairs:
        steps, acc, se = zip(*curve(run), strict=True)
        label = f"{run.name} (seed {seed})" if by_name else f"seed {seed}"
        ax.errorbar(steps, acc, yerr=se, marker="o", capsize=3, label=label)
    ax.set_xlabel("steps trained")
    ax.set_ylabel("held-out greedy accuracy (256)")
    ax.set_title(f"SmolLM2-135M-Instruct, {title}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}", file=sys.stderr)


def seed_line(seed: str, r: SeedResult) -> str:
    return (
        f"seed {seed}: heldout greedy {r.before:.3f} ± {r.before_se:.3f} before training -> "
        f"{r.after:.3f} ± {r.after_se:.3f} after step {r.after_step} "
        f"({100 * (r.after - r.before):+.1f} points, n={r.prompts}), "
        f"format {r.format_share:.2f}, {r.seconds:.0f} s  [{r.run}]"
    )


def summary_line(results: list[SeedResult], target_points: float) -> str:
    before = statistics.fmean(r.before for r in results)
    after = statistics.fmean(r.after for r in results)
    seconds = statistics.fmean(r.seconds for r in results)
    up = sum(100 * (r.after - r.before) >= target_points for r in results)
    return (
        f"smol: heldout_acc {before:.3f} -> {after:.3f} in {seconds:.0f} s "
        f"(seeds up >= {target_points:g} points: {up}/{len(results)})"
    )


def train(seed: str, run: Path, extra: list[str]) -> None:
    command = [sys.executable, "-m", "asyncrl.cli", "train", str(CONFIG), "--run-dir", str(run)]
    command += [f"run.seed={seed}", "logging.progress=false", *extra]
    print(f"seed {seed}: training {run} ...", file=sys.stderr, flush=True)
    done = subprocess.run(command, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"seed {seed}: asyncrl train exited {done.returncode}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--target", type=float, default=10.0, help="points (default 10)")
    parser.add_argument("--from", dest="runs", nargs="+", type=Path, default=[])
    parser.add_argument("--dir", type=Path, default=None, help="runs go here (default: temp)")
    parser.add_argument("--plot", type=Path, default=None, help="write the curves to this PNG")
    parser.add_argument("--title", default="configs/smol_math.yaml", help="plot title")
    args = parser.parse_args(argv)
    pairs: list[tuple[str, SeedResult]] = []
    if args.runs:
        for run in args.runs:
            config: dict[str, Any] = read_jsonl(run / "events.jsonl")[0].get("config", {})
            pairs.append((str(config.get("run", {}).get("seed", "?")), read_run(run)))
        if args.plot:
            plot([(seed, r.run) for seed, r in pairs], args.plot, args.title)
    else:
        subprocess.run([sys.executable, "-m", "asyncrl.examples.smol_math", "data/smol_math"],
                       cwd=ROOT, check=True, capture_output=True)  # fmt: skip
        if args.dir is not None:
            args.dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            for seed in args.seeds.split(","):
                run = (args.dir or Path(tmp)) / f"smol-seed{seed}"
                train(seed, run, args.set)
                pairs.append((seed, read_run(run)))
                print(seed_line(seed, pairs[-1][1]), flush=True)
    if args.runs:
        for seed, result in pairs:
            print(seed_line(seed, result))
    print(summary_line([r for _, r in pairs], args.target))


if __name__ == "__main__":
    main()
