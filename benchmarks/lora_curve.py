"""The real model's learning curve, LoRA against full fine-tuning, side by side, by the real CLI.

    .venv/bin/python benchmarks/lora_curve.py                   # `make bench-lora-curve`, ~30 min
    .venv/bin/python benchmarks/lora_curve.py --steps 20 --lora-lrs 2e-4

`configs/smol_math.yaml` (SmolLM2-135M-Instruct on the generated word problems: 4 prompts x 8
samples, 80 new tokens, bf16 training) is trained `--steps` steps once with full fine-tuning at
the example's lr, then once per `--lora-lrs` with `model.lora.rank=16` (alpha 32, every linear
layer), one run after the other, evaluation off (it would dominate the time). From each run's
`metrics.jsonl` it reads the training samples' `reward/format` (one non-empty `\\boxed{}`) and
`reward/correct` per step and plots their 5-step means against the step and the wall time
(`--plot`, default docs/img/lora_vs_full.png). It prints per run the means over the last 5
steps with their standard error (the samples of those steps as independent trials) and the
wall seconds, and last, for full fine-tuning and the best LoRA run (by the last-5 format
share):

    lora_curve: steps=S format_last5 full=A+-a lora=B+-b (lr L) correct_last5 full=C lora=D
                wall_s full=E lora=F
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from asyncrl.train.records import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/smol_math.yaml"
FULL_LR = 2e-5  # the example's own (configs/smol_math.yaml)
RUN = [
    "eval.every_steps=0", "eval.at_start=false", "checkpoint.save_period=1000",
    "logging.progress=false", "logging.plot=false",
]  # fmt: skip
SAMPLES_PER_STEP = 32  # 4 prompts x 8 samples


@dataclass
class Curve:
    label: str
    steps: list[int]
    wall_s: list[float]
    format: list[float]
    correct: list[float]

    def last(self, values: list[float], n: int = 5) -> tuple[float, float]:
        """The mean of the last `n` steps' values and its standard error, the steps' samples
        taken as independent trials."""
        tail = values[-n:]
        mean = sum(tail) / len(tail)
        return mean, math.sqrt(max(mean * (1 - mean), 0.0) / (len(tail) * SAMPLES_PER_STEP))


def read_curve(label: str, run: Path) -> Curve:
    final = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl")}
    steps = sorted(final)
    return Curve(
        label,
        steps,
        [final[t]["wall_s"] for t in steps],
        [final[t]["reward/format"] for t in steps],
        [final[t]["reward/correct"] for t in steps],
    )


def moving_mean(values: list[float], n: int = 5) -> list[float]:
    return [
        sum(values[max(0, i + 1 - n) : i + 1]) / (i + 1 - max(0, i + 1 - n))
        for i in range(len(values))
    ]


def curve_line(curve: Curve) -> str:
    (f, fse), (c, cse) = curve.last(curve.format), curve.last(curve.correct)
    return (
        f"{curve.label}: format_last5={f:.3f}+-{fse:.3f} correct_last5={c:.3f}+-{cse:.3f} "
        f"wall_s={curve.wall_s[-1]:.0f}"
    )


def summary_line(full: Curve, loras: dict[float, Curve]) -> str:
    lr, best = max(loras.items(), key=lambda item: item[1].last(item[1].format)[0])
    (ff, ffse), (lf, lfse) = full.last(full.format), best.last(best.format)
    fc, lc = full.last(full.correct)[0], best.last(best.correct)[0]
    return (
        f"lora_curve: steps={len(full.steps)} format_last5 full={ff:.3f}+-{ffse:.3f} "
        f"lora={lf:.3f}+-{lfse:.3f} (lr {lr:g}) correct_last5 full={fc:.3f} lora={lc:.3f} "
        f"wall_s full={full.wall_s[-1]:.0f} "
        f"lora={best.wall_s[-1]:.0f}"
    )


def plot(curves: list[Curve], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for curve in curves:
        axes[0].plot(curve.steps, moving_mean(curve.format), label=curve.label)
        axes[1].plot(curve.steps, moving_mean(curve.correct), label=curve.label)
        axes[2].plot(curve.wall_s, moving_mean(curve.format), label=curve.label)
    titles = ["boxed format share", "correct share", "boxed format share"]
    for ax, title, xlabel in zip(axes, titles, ["step", "step", "wall s"], strict=True):
        ax.set_title(f"{title} (training samples, 5-step mean)", fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, configs/smol_math.yaml: LoRA rank 16 vs full fine-tuning")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def train(run: Path, files: Path, steps: int, extra: list[str]) -> None:
    command = [
        sys.executable, "-m", "asyncrl.cli", "train", str(CONFIG), "--run-dir", str(run),
        f"model.path={files / 'model'}", f"data.path={files / 'train.parquet'}",
        f"eval.path={files / 'test.parquet'}", f"run.max_num_steps={steps}", *RUN, *extra,
    ]  # fmt: skip
    subprocess.run(command, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    parser.add_argument(
        "--lora-lrs", default="1e-4,3e-4", help="LoRA runs' lrs (default 1e-4,3e-4)"
    )
    parser.add_argument("--dir", type=Path, default=None, help="work here (default: a temp dir)")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs/img/lora_vs_full.png")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="passed to every run"
    )
    args = parser.parse_args()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        files = Path(tmp) / "smol"
        print("preparing SmolLM2-135M-Instruct and the word problems ...", file=sys.stderr)
        write = [sys.executable, "-m", "asyncrl.examples.smol_math", str(files)]
        subprocess.run(write, check=True, capture_output=True)
        print(f"full fine-tuning, lr {FULL_LR:g}:", file=sys.stderr)
        full_run = ["model.lora.rank=0", "train.micro_batch_size=8", f"algo.lr={FULL_LR}"]
        train(Path(tmp) / "full", files, args.steps, [*args.set, *full_run])
        full = read_curve(f"full (lr {FULL_LR:g})", Path(tmp) / "full")
        print(curve_line(full), file=sys.stderr)
        loras = {}
        for lr in (float(x) for x in args.lora_lrs.split(",")):
            print(f"LoRA rank 16, lr {lr:g}:", file=sys.stderr)
            run = Path(tmp) / f"lora-{lr:g}"
            train(run, files, args.steps, [*args.set, "model.lora.rank=16", f"algo.lr={lr}"])
            loras[lr] = read_curve(f"LoRA r16 (lr {lr:g})", run)
            print(curve_line(loras[lr]), file=sys.stderr)
    plot([full, *loras.values()], args.plot)
    for curve in (full, *loras.values()):
        print(curve_line(curve))
    print(f"(plot: {args.plot}; benchmark took {time.perf_counter() - began:.0f} s)")
    print(summary_line(full, loras))


if __name__ == "__main__":
    main()
