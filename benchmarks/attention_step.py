"""The real model's training step with each attention for training passes, side by side.

    .venv/bin/python benchmarks/attention_step.py              # `make bench-attention`
    .venv/bin/python benchmarks/attention_step.py --rounds 3 --dtype float32

One optimizer step of SmolLM2-135M-Instruct (prepared into `data/smol_math/model` first, as
`make smol-demo` does) at the shape of `configs/smol_math.yaml`'s step: 4 prompts of 98 tokens
with 8 completions each, of 7 to 80 tokens, in micro-batches of 8 rows, the log-probs through
`completion_logprobs` (shared prompts, the output layer a chunk at a time), a token-mean loss,
backward, fused AdamW; in `--dtype` (bfloat16: under autocast, as `train.dtype=auto` on a CPU
with avx512_bf16 or AMX) on one thread, as each side of the run gets.

Two ways for the attention of a pass that builds a graph, alternated `--rounds` times in this
one process after one warm step each:

- `fused`: `grouped_fused_attention`, torch's `scaled_dot_product_attention` (with
  `enable_gqa`): what training passes ran before 2026-12-05, and passes without a graph run;
- `grouped`: `asyncrl.models.attention.grouped_matmul_attention`, what training runs now.

Prints each step's seconds, then, last:

    attention_step: fused_s=A grouped_s=B speedup=C dtype=D cpu=FLAGS

A, B: the best step of each; C = A / B.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from asyncrl.models import attention
from asyncrl.models.logprobs import completion_logprobs
from asyncrl.models.policy import load_pretrained_policy

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "data/smol_math/model"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from floor import cpu_flags  # noqa: E402


def make_step(model: Any, dtype: torch.dtype) -> Any:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=True)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (98,), generator=generator).tolist() for _ in range(4)]
    lengths = torch.randint(7, 81, (32,), generator=generator)
    autocast = dtype != torch.float32

    def step() -> float:
        start = time.perf_counter()
        for micro in range(4):
            rows = lengths[micro * 8 : (micro + 1) * 8]
            ids = torch.randint(100, 40000, (8, int(rows.max())), generator=generator)
            mask = torch.arange(ids.shape[1])[None] < rows[:, None]
            with torch.autocast("cpu", dtype=dtype, enabled=autocast):
                logprobs, _ = completion_logprobs(
                    model, [prompts[micro]] * 8, ids, mask, 1.0, 0, shared_prompts=True
                )
            (-(logprobs * mask).sum() / mask.sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args(argv)
    if not (MODEL / "config.json").exists():
        print(f"attention_step: preparing {MODEL} ...", file=sys.stderr, flush=True)
        subprocess.run(
            [sys.executable, "-m", "asyncrl.examples.smol_math", str(MODEL.parent)],
            cwd=ROOT,
            check=True,
        )
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    model = load_pretrained_policy(MODEL).model.train()
    step = make_step(model, dtype)
    grouped_fn = attention.grouped_matmul_attention
    best: dict[str, float] = {}
    for round_ in range(args.rounds):
        for name, fn in (("fused", attention.grouped_fused_attention), ("grouped", grouped_fn)):
            attention.grouped_matmul_attention = fn  # type: ignore[assignment]
            step()  # warm
            seconds = step()
            best[name] = min(best.get(name, seconds), seconds)
            print(f"  round {round_}: {name:8s} {seconds:6.2f} s a step", flush=True)
    attention.grouped_matmul_attention = grouped_fn
    _, flags = cpu_flags()
    print(
        f"attention_step: fused_s={best['fused']:.2f} grouped_s={best['grouped']:.2f} "
        f"speedup={best['fused'] / best['grouped']:.2f} dtype={args.dtype} cpu={flags}"
    )


if __name__ == "__main__":
    main()
