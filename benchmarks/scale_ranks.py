"""The rank lines of `benchmarks/scale.py` (`--ranks`): the largest scratch size trained with
`train.num_processes` = 1, 2, 3 by the real CLI, the peak RSS of rank 0 (which also generates)
and of the largest other rank, steady step time and the trainer blocked per checkpoint:

    ranks: size=S num_processes=P peak_rss_rank0=R (B/param) peak_rss_other_rank=O (B/param)
           step_s=T ckpt_blocked_ms=M ckpt=C
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rss import OutOfMemory
from scale import blocked_s, human, launch, steady, steady_state

from asyncrl.models.scratch import count_parameters, parse_count, shape_for, train_tokenizer
from asyncrl.train.records import read_jsonl


@dataclass
class RankResult:
    """One rank count's run of the largest size (`--ranks`)."""

    num_processes: int
    num_params: int
    step_s: float
    rss_rank0: int
    rss_other: int
    blocked_s: float
    ckpt_bytes: float


def measure_ranks(label: str, tmp: Path, steps: int, extra: list[str], ranks: int) -> RankResult:
    """The size `label` trained with `train.num_processes=ranks`: peak RSS of rank 0 (which
    also generates) and of the largest other rank, steady step time, blocked ms per
    checkpoint."""
    vocab = len(train_tokenizer())
    num_params = count_parameters("qwen2", shape_for(parse_count(label), "qwen2", vocab), vocab)
    model_dir, run_dir = tmp / f"model-{label}", tmp / f"run-{label}-ranks{ranks}"
    if not model_dir.exists():
        save = [sys.executable, "-m", "asyncrl.models.scratch", str(model_dir), "--params", label]
        subprocess.run(save, check=True, capture_output=True)
    print(f"{label}: training {steps} steps on {ranks} ranks ...", file=sys.stderr)
    _, sampler = launch(model_dir, run_dir, steps, [*extra, f"train.num_processes={ranks}"])
    events = read_jsonl(run_dir / "events.jsonl")
    checkpoints = [e for e in events if e["event"] == "checkpoint"]
    step_s, _ = steady_state(read_jsonl(run_dir / "metrics.jsonl"))
    shutil.rmtree(run_dir)
    return RankResult(
        ranks,
        num_params,
        step_s,
        max((v for _, v in sampler.samples), default=0),
        max(sampler.child_peak_bytes.values(), default=0),
        statistics.median(blocked_s(e) for e in steady(checkpoints)),
        statistics.median(e["bytes"] for e in checkpoints),
    )


def rank_line(label: str, r: RankResult) -> str:
    """One line per rank count: `ranks: size=S num_processes=P ...`."""
    other = (
        f"peak_rss_other_rank={human(r.rss_other, 'B')} ({r.rss_other / r.num_params:.1f} B/param)"
        if r.num_processes > 1
        else "peak_rss_other_rank=-"
    )
    return (
        f"ranks: size={label} num_processes={r.num_processes} "
        f"peak_rss_rank0={human(r.rss_rank0, 'B')} ({r.rss_rank0 / r.num_params:.1f} B/param) "
        f"{other} step_s={r.step_s:.2f} ckpt_blocked_ms={1e3 * r.blocked_s:.0f} "
        f"ckpt={human(r.ckpt_bytes, 'B')}"
    )


def measure_rank_counts(
    label: str, tmp: Path, args: argparse.Namespace, counts: list[int]
) -> list[str]:
    """The rank lines of size `label` for each rank count that fits in memory, and a last line
    on what they mean on this machine (none when no count fitted)."""
    lines = []
    for ranks in counts:
        try:
            lines.append(rank_line(label, measure_ranks(label, tmp, args.steps, args.set, ranks)))
        except OutOfMemory as err:
            print(f"{label} on {ranks} ranks: does not fit in memory today ({err})")
    if lines:
        lines.append(
            f"(ranks: {os.cpu_count()} CPU cores here; with more ranks than cores the ranks "
            "share them, so step_s shows the cost of the ranks' communication and sharding, "
            "not a speed-up; rank 0 also holds the generation engine and the full weights it "
            "publishes)"
        )
    return lines
