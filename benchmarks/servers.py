"""vLLM's OpenAI-compatible servers (`rollout.engine=vllm_server`) against vLLM in process
(`rollout.engine=vllm`), on the same requests, on this machine, in one run.

For each size (`demo`: the demo's tiny Llama; `100M`: a random-init Qwen2 of about 100M
parameters; `smollm2`: the real model of `make smol-demo`, prepared offline) a fresh process
builds each engine — vLLM in process, 1 launched server, 2 launched servers — and reports

    ENGINE SIZE: params=P start_s=S gen_tok/s=R update_ms=U pause_ms=Q

gen_tok/s: generated tokens over the seconds of one `generate` call of 8 prompts x 8 samples of
up to 64 new tokens (after an untimed warm-up; temperature 1; a batch's requests spread over
the servers); update_ms: a newly published version taken before one token, less the same call
without a new version, median of 3 (in process: `reload_weights` + prefix cache reset; servers:
the version's file written once, then on each server `/pause?mode=keep`, `/collective_rpc
reload_weights`, `/update_weight_version`, `/resume`); pause_ms: those four calls on one server,
per version (`server_pause_s`). The last line is for the last size:

    servers: update_pause_ms=P tok_s_1=A tok_s_2=B vs_in_process=R

with R = tok_s_1 / the in-process engine's tok/s (the same requests, one vLLM either way).

    .venv/bin/python benchmarks/servers.py [--sizes demo 100M smollm2]   # make bench-servers, 5 min
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engines import NEW_TOKENS, PROMPT_LEN, PROMPTS, SAMPLES, build, run_fresh

SIZES = ["demo", "100M", "smollm2"]
ENGINES = {"vllm": 0, "server_1": 1, "server_2": 2}
"""name -> launched servers (0: vLLM in this process)."""


def measure(name: str, size: str) -> dict[str, float]:
    from asyncrl.rollout.engine import EngineSpec, GenerationRequest, build_engine
    from asyncrl.rollout.weight_sync import CopyWeightSync

    torch.set_num_threads(2)
    model, eos_id, vocab = build(size)
    weights = CopyWeightSync()
    weights.publish(0, model.state_dict())
    vllm = {"kv_cache_bytes": 512 << 20, "max_model_len": 128}
    servers = ENGINES[name]
    with tempfile.TemporaryDirectory() as run_dir:
        if servers:
            options = {"vllm": vllm, "servers": {"launch": servers}, "run_dir": run_dir}
            engine_name = "vllm_server"
        else:
            options, engine_name = vllm, "vllm"
        spec = EngineSpec(model, eos_id, eos_id, NEW_TOKENS, 1.0, options=options,
                          scratch_dir=str(Path(run_dir) / ".scratch"))  # fmt: skip
        started = time.perf_counter()
        engine = build_engine(engine_name, spec, weights)
        start_s = time.perf_counter() - started
        try:
            gen = torch.Generator().manual_seed(0)
            requests = [
                GenerationRequest(
                    torch.randint(1, vocab, (PROMPT_LEN,), generator=gen).tolist(), SAMPLES,
                    100 + i,
                )
                for i in range(PROMPTS)
            ]  # fmt: skip
            engine.generate(requests[:2])  # warm-up, and version 0 loaded everywhere
            started = time.perf_counter()
            outputs = engine.generate(requests)
            gen_s = time.perf_counter() - started
            tokens = sum(int(o.completion_mask.sum()) for o in outputs)
            updates, pauses = [], []
            state = model.state_dict()
            for version in (1, 2, 3):
                weights.publish(version, {k: v + 1e-3 * version for k, v in state.items()})
                before = engine.metrics().get("server_pause_s", 0.0)
                started = time.perf_counter()
                engine.generate(requests[:1], max_tokens=1)  # loads the new version, 1 token
                updates.append(time.perf_counter() - started)
                pauses.append(engine.metrics().get("server_pause_s", 0.0) - before)
            one_token = time.perf_counter()
            engine.generate(requests[:1], max_tokens=1)  # the same without a load
            one_token_s = time.perf_counter() - one_token
        finally:
            stop = getattr(engine, "shutdown", None)
            if stop is not None:
                stop()
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "start_s": start_s,
        "gen_tok_s": tokens / gen_s,
        "update_ms": max(0.0, statistics.median(updates) - one_token_s) * 1e3,
        # a 1-token request reaches one server: the pause is that server's
        "pause_ms": statistics.median(pauses) * 1e3,
    }


def run_one(name: str, size: str) -> dict[str, float]:
    return run_fresh(__file__, name, size, timeout=1200)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="*", default=SIZES)
    parser.add_argument("--one", nargs=2, metavar=("ENGINE", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one)))
        return
    results: dict[str, dict[str, float]] = {}
    for size in args.sizes:
        results = {}
        for name in ENGINES:
            r = results[name] = run_one(name, size)
            print(
                f"{name} {size}: params={r['params'] / 1e6:.1f}M start_s={r['start_s']:.1f} "
                f"gen_tok/s={r['gen_tok_s']:.0f} update_ms={r['update_ms']:.0f} "
                f"pause_ms={r['pause_ms']:.0f}",
                flush=True,
            )
    one, two, local = results["server_1"], results["server_2"], results["vllm"]
    print(
        f"servers: update_pause_ms={one['pause_ms']:.0f} tok_s_1={one['gen_tok_s']:.0f} "
        f"tok_s_2={two['gen_tok_s']:.0f} vs_in_process={one['gen_tok_s'] / local['gen_tok_s']:.2f}"
    )


if __name__ == "__main__":
    main()
