"""LoRA adapters against full fine-tuning, side by side, by the real CLI: memory per parameter,
checkpoint bytes and write time, the trainer blocked per checkpoint, steps/s.

    .venv/bin/python benchmarks/lora.py                      # `make bench-lora`, ~25 min
    .venv/bin/python benchmarks/lora.py --sizes 75M --rank 8

Each size of `benchmarks/scale.py` (its shape: N=2 x G=2, 8 new tokens, 9 steps, a checkpoint
every 3; `smollm2` in the real example's shape) is measured three times, one after the other
(never two at once on the 2 cores): full fine-tuning, LoRA of `--rank` on every linear layer
with the torch engine running peft's forward on the trainer's own base (the default), and LoRA
with each version's merged weights loaded by the engine (`model.lora.merge_for_generation`,
what vLLM and Ray workers do). Per size it prints a table row per mode, then a line of ratios,
and the last line is the largest scratch size's:

    lora: size=S ckpt_vs_full=C% blocked_per_step=P% peak_bytes_per_param=B (full F)
          steps_per_s_vs_full=X merged_vs_peft_step=Y
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import SMOL, SizeResult, format_table, measure_size, row

MODES = {
    "full": [],
    "lora": ["model.lora.merge_for_generation=false"],
    "lora_merged": ["model.lora.merge_for_generation=true"],
}


def ratios(label: str, results: dict[str, SizeResult]) -> str:
    """The size's line of LoRA (peft forward) against full fine-tuning."""
    full, lora, merged = results["full"], results["lora"], results["lora_merged"]
    return (
        f"lora: size={label} ckpt_vs_full={100 * lora.ckpt_bytes / full.ckpt_bytes:.1f}% "
        f"blocked_per_step={100 * lora.blocked_s / lora.step_s:.1f}% "
        f"peak_bytes_per_param={lora.rss_train / lora.num_params:.1f} "
        f"(full {full.rss_train / full.num_params:.1f}) "
        f"steps_per_s_vs_full={full.step_s / lora.step_s:.2f} "
        f"merged_vs_peft_step={merged.step_s / lora.step_s:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=f"75M,300M,{SMOL}", help="sizes of benchmarks/scale.py")
    parser.add_argument("--rank", type=int, default=16, help="model.lora.rank (default 16)")
    parser.add_argument("--steps", type=int, default=9, help="steps per run (default 9)")
    parser.add_argument("--dir", type=Path, default=None, help="work here (default: a temp dir)")
    args = parser.parse_args()
    began = time.perf_counter()
    lines, table = [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for label in args.sizes.split(","):
            results = {}
            for mode, keys in MODES.items():
                lora = [f"model.lora.rank={args.rank}", *keys] if keys else []
                print(f"{label} {mode}:", file=sys.stderr)
                results[mode] = measure_size(label, Path(tmp), args.steps, lora)
                table.append({"mode": mode, **row(results[mode])})
            line = ratios(label, results)
            print(line, file=sys.stderr)
            lines.append((label, line))
    for text in format_table(table):
        print(text)
    took = time.perf_counter() - began
    print(f"(rank {args.rank} on every linear layer; benchmark took {took:.0f} s)")
    scratch = [line for label, line in lines if label != SMOL] or [lines[-1][1]]
    for _, line in lines:
        if line != scratch[-1]:
            print(line)
    print(scratch[-1])


if __name__ == "__main__":
    main()
