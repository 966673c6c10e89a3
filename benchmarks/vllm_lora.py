"""vLLM with LoRA adapters, the two ways a weights version reaches it, side by side on this
machine, in one run: `merged` (each version's merged weights, `W + scale * B @ A` per adapted
layer, reloaded into vLLM in place) against `requests` (`rollout.vllm.lora_requests`: the
frozen base loaded once, each version's adapters written to a directory and served as a
`LoRARequest` through vLLM's LoRA kernels).

For each size (`smollm2`: the real model of `make smol-demo`; `100M`: a random-init Qwen2 of
about that many parameters, `asyncrl.models.scratch.shape_for`) and each way, a fresh process
wraps the model in rank-16 adapters on every linear layer (their B drawn at random, so they
change the model), builds vLLM in process, and for versions 1-3 reports the median of

    MODE SIZE: publish_ms=P update_ms=U gen_tok/s=R version_s=S

publish_ms: the weight sync taking the trainer's version (merged: computing and copying the
whole merged model; requests: copying the adapters); update_ms: vLLM taking it (merged:
`reload_weights` + `reset_prefix_cache`; requests: writing the adapter files and vLLM loading
them at the batch's first request), as a one-token call with the load less one without;
gen_tok/s: one step's generation, 4 prompts x 8 samples of up to 64 new tokens (temperature 1,
random 16-token prompts); version_s: publish + update + that generation, the cost a training
step puts on the generator. The last line gives requests / merged per size.

    .venv/bin/python benchmarks/vllm_lora.py        # `make bench-vllm-lora`, ~6 min

`--engine vllm_server` measures the same on one launched vLLM server
(`rollout.engine=vllm_server`): merged, each version's file reloaded through `/pause`,
`/collective_rpc reload_weights`, `/update_weight_version`, `/resume`; requests, each
version's adapters through `/v1/load_lora_adapter` (the previous one unloaded), the requests
naming them.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import tempfile
import time

import torch
from engines import build, run_fresh  # benchmarks/engines.py: the same sizes and models

SIZES = ["smollm2", "100M"]
MODES = ["merged", "requests"]
PROMPTS, SAMPLES, PROMPT_LEN, NEW_TOKENS, RANK = 4, 8, 16, 64, 16


def measure(mode: str, size: str, engine_name: str = "vllm") -> dict[str, float]:
    from asyncrl.config import LoraConfig
    from asyncrl.models.lora import generation_weights, wrap
    from asyncrl.rollout.engine import EngineSpec, GenerationRequest
    from asyncrl.rollout.vllm_engine import VLLMGenerationEngine
    from asyncrl.rollout.vllm_server import VLLMServerEngine
    from asyncrl.rollout.weight_sync import CopyWeightSync

    torch.set_num_threads(2)
    model, eos_id, vocab = build(size)
    plain = copy.deepcopy(model)  # merged: vLLM is built on the plain architecture
    wrapped = wrap(model, LoraConfig(rank=RANK, alpha=2 * RANK), seed=0)
    merged = mode == "merged"

    def new_version(version: int) -> float:
        generator = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for name, param in wrapped.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 1e-2)
        started = time.perf_counter()
        weights.publish(version, generation_weights(wrapped, merged=merged))
        return time.perf_counter() - started

    weights = CopyWeightSync()
    new_version(0)
    options: dict[str, object] = {"kv_cache_bytes": 512 << 20, "max_model_len": 128}
    run_dir = tempfile.mkdtemp(prefix="bench-vllm-lora-")
    if engine_name == "vllm_server":
        options = {"vllm": options, "servers": {"launch": 1}, "run_dir": run_dir}
    spec = EngineSpec(
        plain if merged else wrapped, eos_id, eos_id, NEW_TOKENS, 1.0, options=options,
        scratch_dir=f"{run_dir}/.scratch",
    )  # fmt: skip
    engine_class = VLLMServerEngine if engine_name == "vllm_server" else VLLMGenerationEngine
    engine = engine_class(spec, weights)
    gen = torch.Generator().manual_seed(0)
    requests = [
        GenerationRequest(
            torch.randint(1, vocab, (PROMPT_LEN,), generator=gen).tolist(), SAMPLES, 100 + i
        )
        for i in range(PROMPTS)
    ]
    engine.generate(requests[:2])  # warm-up: first-call allocations, the base loaded
    rows: list[dict[str, float]] = []
    for version in (1, 2, 3):
        publish_s = new_version(version)
        started = time.perf_counter()
        engine.generate(requests[:1], max_tokens=1)  # takes the new version, then 1 token
        load_s = time.perf_counter() - started
        started = time.perf_counter()
        engine.generate(requests[:1], max_tokens=1)  # the same without a load
        update_s = max(0.0, load_s - (time.perf_counter() - started))
        started = time.perf_counter()
        outputs = engine.generate(requests)
        gen_s = time.perf_counter() - started
        tokens = sum(int(o.completion_mask.sum()) for o in outputs)
        rows.append(
            {
                "publish_ms": publish_s * 1e3,
                "update_ms": update_s * 1e3,
                "gen_tok_s": tokens / gen_s,
                "version_s": publish_s + update_s + gen_s,
            }
        )
    if engine_name == "vllm_server":
        engine.shutdown()
    shutil.rmtree(run_dir, ignore_errors=True)
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


def run_one(mode: str, size: str, engine: str) -> dict[str, float]:
    return run_fresh(__file__, mode, size, engine, timeout=1200)


def line(mode: str, size: str, r: dict[str, float], engine: str = "vllm") -> str:
    where = "" if engine == "vllm" else f" ({engine})"
    return (
        f"{mode} {size}{where}: publish_ms={r['publish_ms']:.0f} update_ms={r['update_ms']:.0f} "
        f"gen_tok/s={r['gen_tok_s']:.0f} version_s={r['version_s']:.2f}"
    )


def ratios(results: dict[str, dict[str, dict[str, float]]], engine: str = "vllm") -> str:
    """The last line: requests / merged per size, version_s and gen_tok/s."""
    parts = []
    for size, by_mode in results.items():
        req, mer = by_mode["requests"], by_mode["merged"]
        parts.append(
            f"{size} version_s x{req['version_s'] / mer['version_s']:.2f} "
            f"gen_tok/s x{req['gen_tok_s'] / mer['gen_tok_s']:.2f}"
        )
    where = "" if engine == "vllm" else f" on {engine}"
    return f"vllm_lora: requests/merged{where} " + ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="*", default=SIZES)
    parser.add_argument("--engine", choices=["vllm", "vllm_server"], default="vllm")
    parser.add_argument("--one", nargs=3, metavar=("MODE", "SIZE", "ENGINE"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one)))
        return
    results: dict[str, dict[str, dict[str, float]]] = {}
    for size in args.sizes:
        for mode in MODES:
            r = results.setdefault(size, {})[mode] = run_one(mode, size, args.engine)
            print(line(mode, size, r, args.engine), flush=True)
    print(ratios(results, args.engine))


if __name__ == "__main__":
    main()
