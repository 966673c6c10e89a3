"""How far a real-model step is from this machine's floor: `configs/smol_math.yaml` (SmolLM2-135M),
its training and its generation each against the time their matrix products alone take here.

    .venv/bin/python benchmarks/floor.py                 # `make bench-floor`: trains 6 steps
    .venv/bin/python benchmarks/floor.py --steps 8 --set rollout.max_new_tokens=64
    .venv/bin/python benchmarks/floor.py --from runs/smol-demo-20261203-101500   # a run's steps

It trains the config by the real CLI in a child process (no evaluation, no checkpoint before
the end), then, with the child gone and the machine otherwise idle, measures the floor here, in
this process, on the model's own weights:

- **training**: each `nn.Linear` of the model multiplied forward ([T, in] x [in, out]) and
  backward (the input's gradient, and the weight's where it trains: with `model.lora.rank`
  the base is frozen and the adapters' own products are counted instead), in the dtype
  `train.dtype` resolves to, where T is the tokens the trainer's passes run over the rows it
  trained (with `algo.skip_zero_variance_groups`, the groups of `skipped_ordinals` are left
  out), micro-batch by micro-batch as `train.micro_batch_size` cuts them: with
  `train.shared_prompts` each distinct prompt of a micro-batch once, then every completion
  token, through the body; the completion tokens alone through the output layer; plus causal
  attention (its FLOPs at the rate the body's products reached); and, with `algo.kl_coef` > 0,
  the KL reference's forward pass over the same tokens;
- **generation**: per generate call of the run's timeline, each prompt prefilled once (the
  output layer at its last position only), then one decode pass per token with only the
  samples still generating in the batch (an ideal, compacted batch), in `rollout.dtype`; plus
  the attention over each sample's context.

Each product is timed on `run.torch_threads` threads (what each side of the run gets), the best
of `--repeats`; one over 128 to 2,048 rows is timed once at its rows rounded up to a multiple
of 128 and scaled down, one over more than 2,048 rows is timed at 2,048 and scaled by its rows
(its time grows linearly there; `--check-scaling` measures that). Left out of the floor: norms,
activations, rotary embeddings, softmax, sampling,
the optimizer's update and the weight publish. The measured side is the run's own record:
`train_s` of each step and the `generate` spans of `timeline.jsonl`, over the steps from
`--warmup` on (the first steps allocate and warm up). It prints each part's measured seconds,
floor and ratio, the FLOPs and rates; then training's products timed again at each pass's own
rows (`passes`: a micro-batch's prompt pass and completion pass, each padded to its longest
row, as the trainer runs them; the floor times the step's rows at once, where the rate is the
highest), which splits `train_x` into what the passes' shapes cost the products and what lies
outside the products; and, last:

    floor: train_x=A gen_x=B step_s=S floor_s=F dtype=D cpu=FLAGS

A, B: measured / floor, per step, for training and for generation; S: the steady step's wall
seconds; F: max(training floor, generation floor), the step's floor with the two sides
overlapped, one core each. With `run.share_cores` (the default) a side running alone takes
both cores, so A or B may fall below what one core allows; a line before the last then gives
the floor of the step on both cores, (training floor + generation floor) / 2, and the step's
ratio to it; D: the train and rollout dtypes; FLAGS: the CPU's SIMD flags that
decide the dtype (avx2, avx512f, avx512_bf16, amx_bf16).

The counting and the timing of the products (`Shapes`, `Floor`, `Passes`, `train_part`,
`generate_part`) are `benchmarks/floor_counts.py`; this file runs the config and reports.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from floor_counts import SCALE_ROWS, Floor, Part, Passes, Shapes, generate_part, train_part

from asyncrl.config import ConfigError
from asyncrl.config.keys import build_config
from asyncrl.models.device import DTYPES, ONEDNN_CAP_KEYS, read_cpuinfo, resolve_train_dtype
from asyncrl.models.lora import adapters_in_engine
from asyncrl.train.components import core_share
from asyncrl.train.records import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/smol_math.yaml"
VERBS = {"train": "trained", "generate": "generated"}
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
CAP_KEYS = (*ONEDNN_CAP_KEYS, "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
"""Environment variables that hold torch's kernels (oneDNN, ATen's own, MKL) to an older
instruction set: set to AVX2 they run an AVX2-only machine's code paths here."""


def cpu_flags() -> tuple[str, str]:
    """(the CPU's model name, which of FLAGS it has, comma-joined)."""
    name, flags = platform.processor() or "unknown", set()
    for line in read_cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            name = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
    return name, ",".join(f for f in FLAGS if f in flags) or "none"


def prompt_lengths(config: Any) -> list[int]:
    """Each training example's prompt length in tokens, as the run prompts the model."""
    from transformers import AutoTokenizer

    from asyncrl.tasks.prompts import prompt_ids
    from asyncrl.tasks.source import task_examples

    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    return [len(prompt_ids(e, tokenizer)) for e in task_examples(config.data)]


def covered(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] that the union of `intervals` covers."""
    total, reach = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def busy_shares(timeline: list[dict[str, Any]], steps: set[int]) -> tuple[float, float]:
    """Of the wall time of `steps` (from the end of the step before the first, or the first's
    start, to the end of the last), the shares in which a side was at work (training or
    generating) and in which both were: with `run.share_cores` a side at work alone has both
    cores, so the first share is how busy the two cores were."""
    trains = {s["step"]: s for s in timeline if s["kind"] == "train"}
    first, last = min(steps), max(steps)

    def end(span: dict[str, Any]) -> float:
        return float(span["start"] + span["seconds"])

    lo = end(trains[first - 1]) if first - 1 in trains else trains[first]["start"]
    hi = end(trains[last])
    spans = {
        kind: [(s["start"], end(s)) for s in timeline if s["kind"] == kind]
        for kind in ("train", "generate")
    }
    either = covered(spans["train"] + spans["generate"], lo, hi)
    train, gen = covered(spans["train"], lo, hi), covered(spans["generate"], lo, hi)
    return either / (hi - lo), (train + gen - either) / (hi - lo)


def train_run(run: Path, steps: int, extra: list[str]) -> None:
    command = [
        sys.executable, "-m", "asyncrl.cli", "train", str(CONFIG), "--run-dir", str(run),
        f"run.max_num_steps={steps}", "eval.every_steps=0", f"checkpoint.save_period={steps}",
        "logging.progress=false", "logging.plot=false", *extra,
    ]  # fmt: skip
    print(
        f"floor: training {steps} steps of {CONFIG.name} into {run} ...",
        file=sys.stderr,
        flush=True,
    )
    done = subprocess.run(command, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"floor: asyncrl train exited {done.returncode}")


def check_scaling(floor: Floor) -> None:
    """Prints the body's training products per row at SCALE_ROWS and at 4x as many, timed."""
    small = floor._training_s(floor.body, SCALE_ROWS) / SCALE_ROWS
    large = floor._training_s(floor.body, 4 * SCALE_ROWS) / (4 * SCALE_ROWS)
    print(
        f"  scaling   training products per row: {1e6 * small:.1f} us at {SCALE_ROWS} rows, "
        f"{1e6 * large:.1f} us at {4 * SCALE_ROWS} (x{large / small:.3f})"
    )


def measure(
    run: Path, warmup: int, repeats: int, scaling: bool = False
) -> tuple[list[Part], float, str, bool, tuple[float, float]]:
    events = read_jsonl(run / "events.jsonl")
    start = next(e for e in events if e["event"] == "start")
    try:
        config = build_config(start["config"])
    except ConfigError as err:  # its model or data moved since
        raise SystemExit(f"{run}: the run's config no longer loads here: {err}") from None
    records = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl")}  # the last of each step
    window = [records[s] for s in sorted(records) if s >= warmup]
    if len(window) < 2:
        raise SystemExit(
            f"{run}: {len(records)} steps, {len(window)} from --warmup {warmup}: too few to measure"
        )
    steps_in = {r["step"] for r in window}
    ordinal_to_index = {
        o: i
        for r in records.values()
        for o, i in zip(r["prompt_ordinals"], r["dataset_indices"], strict=True)
    }
    spans = [
        s
        for s in read_jsonl(run / "timeline.jsonl")
        if s["kind"] == "generate" and set(s["targets"]) <= steps_in
    ]
    lengths = prompt_lengths(config)
    prompts = {o: lengths[i] for o, i in ordinal_to_index.items()}

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32)
    shapes = Shapes.of(model, config.model.lora)
    # generation runs the adapters only where the engine applies them on the frozen base
    gen_shapes = shapes if adapters_in_engine(config) else replace(shapes, adapters=[])
    device = torch.device(config.train.device)
    train_dtype = resolve_train_dtype(config.train.dtype, device)
    gen_dtype = config.rollout.dtype
    threads = config.run.torch_threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    print(
        f"floor: {len(window)} steps ({min(steps_in)}-{max(steps_in)}), {len(spans)} generate "
        f"calls; products timed on {threads} thread(s), best of {repeats}",
        file=sys.stderr,
        flush=True,
    )
    passes = Passes.of(config)
    counted = [
        f"micro-batches of {passes.micro_batch_size or 'all'} rows",
        "each distinct prompt once a micro-batch" if passes.shared_prompts else "a prompt a row",
    ]
    if passes.reference:
        counted.append("the KL reference's forward")
    if shapes.frozen:
        counted.append(f"LoRA: a frozen base, {len(shapes.adapters)} adapter matrices")
    print(f"floor: training counted as {', '.join(counted)}", file=sys.stderr, flush=True)
    if scaling:
        check_scaling(Floor(shapes, DTYPES[train_dtype], repeats))
    parts = [
        train_part(run, window, lengths, Floor(shapes, DTYPES[train_dtype], repeats), passes),
        generate_part(spans, prompts, Floor(gen_shapes, DTYPES[gen_dtype], repeats)),
    ]
    count = len(window)
    for part in parts:  # per step
        part.measured_s /= count
        part.floor_s /= count
        part.passes_s /= count
        part.flops /= count
        part.tokens //= count
    walls = [records[s]["wall_s"] for s in sorted(steps_in)]
    before = records.get(min(steps_in) - 1, {}).get("wall_s")
    step_s = (
        (walls[-1] - before) / count
        if before is not None
        else statistics.fmean(b - a for a, b in itertools.pairwise(walls))
    )
    busy = busy_shares(read_jsonl(run / "timeline.jsonl"), steps_in)
    dtypes = f"train:{train_dtype}/gen:{gen_dtype}"
    return parts, step_s, dtypes, core_share(config).sharing, busy


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps to train (default 6)")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out (default 2)")
    parser.add_argument("--repeats", type=int, default=2, help="timings of each product (the best)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--check-scaling", action="store_true", help="time 4x the rows too")
    parser.add_argument("--from", dest="run", type=Path, default=None, help="a finished run dir")
    args = parser.parse_args(argv)
    name, flags = cpu_flags()
    print(f"floor: cpu {name}, {os.cpu_count()} cores, flags {flags}; torch {torch.__version__}")
    caps = [f"{key}={os.environ[key]}" for key in CAP_KEYS if os.environ.get(key)]
    if caps:
        print(
            f"floor: kernels held to an older instruction set: {' '.join(caps)} "
            f"(torch dispatches {torch.backends.cpu.get_cpu_capability()})"
        )
    if args.run is not None:
        parts, step_s, dtype, shared, busy = measure(
            args.run, args.warmup, args.repeats, args.check_scaling
        )
    else:
        subprocess.run([sys.executable, "-m", "asyncrl.examples.smol_math", "data/smol_math"],
                       cwd=ROOT, check=True, capture_output=True)  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            run = Path(tmp) / "run"
            train_run(run, args.steps, args.set)
            parts, step_s, dtype, shared, busy = measure(
                run, args.warmup, args.repeats, args.check_scaling
            )
    for part in parts:
        print(
            f"  {part.name:9s} measured {part.measured_s:7.2f} s  floor {part.floor_s:7.2f} s  "
            f"x{part.ratio:5.2f}   {part.flops / 1e12:6.2f} TFLOP at "
            f"{part.flops / part.floor_s / 1e9:6.1f} GFLOP/s floor "
            f"({part.tokens} completion tokens {VERBS[part.name]} a step)"
        )
    train, gen = parts
    shaped = train.passes_s / train.floor_s if train.floor_s else float("nan")
    rest = train.measured_s / train.passes_s if train.passes_s else float("nan")
    print(
        f"  passes    training's products at its passes' own rows (each pass padded to its "
        f"longest row), not the step's at once: {train.passes_s:.2f} s (x{shaped:.2f} the "
        f"floor); the measured training is x{rest:.2f} that"
    )
    floor_s = max(train.floor_s, gen.floor_s)
    busiest = max(train.measured_s, gen.measured_s)
    print(
        f"  step      {step_s:7.2f} s wall; max(train, generate) measured {busiest:.2f} s "
        f"(x{step_s / busiest:.2f})"
    )
    if shared:  # a side alone ran on both cores: its ratio is against one core's floor
        both = (train.floor_s + gen.floor_s) / 2
        print(
            f"  cores     shared (run.share_cores): a side alone took both cores, so the "
            f"step's floor on two cores is (train + generate) / 2 = {both:.2f} s (step x"
            f"{step_s / both:.2f}); the ratios above are against one core's floor each"
        )
    print(
        f"  busy      a side at work {busy[0]:.1%} of the steps' wall, both sides at once "
        f"{busy[1]:.1%}" + (" (a side alone has both cores)" if shared else "")
    )
    print(
        f"floor: train_x={train.ratio:.2f} gen_x={gen.ratio:.2f} step_s={step_s:.1f} "
        f"floor_s={floor_s:.1f} dtype={dtype} cpu={flags}"
    )


if __name__ == "__main__":
    main()
