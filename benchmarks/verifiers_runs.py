"""A verifiers environment's episodes as asyncrl agent runs against verifiers' own evaluation
loop on vLLM: rollouts per second for the same environment, tasks and model, side by side in
one process, and what asyncrl's path adds per rollout.

    .venv/bin/python benchmarks/verifiers_runs.py           # `make bench-verifiers`, ~5-10 min
    .venv/bin/python benchmarks/verifiers_runs.py --quick   # no vLLM: instant engines (the test)

The environment is examples/verifiers/asyncrl_calculator (its `test` split's first N tasks;
tool `calc_calculate` on verifiers' shared MCP server; rewards `correct`, `used_tool`), every
seat verifiers' `null` harness (its chat program, a subprocess per episode) on the subprocess
runtime, held to `max_turns` model calls. Each task is run G times, all N*G episodes at once,
on both sides. Every model call is held to the same max tokens and temperature 1.0 on both
sides (verifiers' `Sampling` imposes them on vLLM's requests; asyncrl's engine has them as
`rollout.max_new_tokens` and its temperature), and stops at the chat template's end of turn
(`<|im_end|>`: vLLM's `stop_token_ids`, the torch engine's eos).

1. Throughput, per shape:
   (a) verifiers' own loop: `load_environment(resolve_env_config(...))`, `env.serving()` held
       open, `env.run_episode(task, ModelContext(EvalClientConfig(base_url=vLLM), sampling))`
       for the N*G episodes gathered (a semaphore of N*G) against vLLM's OpenAI server (CPU
       build; launched with asyncrl's own launcher pieces, `asyncrl.rollout.servers`, with its
       tokenizer and chat template on and the `hermes` tool parser); completion tokens and
       calls from the episodes' traces (`trace.num_output_tokens`, `trace.calls`).
   (b) asyncrl's agent runs: `AgentRuns` with `VerifiersAgent` (`agent.name=verifiers:
       asyncrl_calculator`, `agent.max_calls` = max_turns) over the torch engine
       (`TorchGenerationEngine`, the only engine agent runs run on), N tickets of G samples,
       measured as benchmarks/agent_runs.py measures runs (every ticket landed), the calls'
       tokens counted at the engine.
   One warm-up round each (vLLM's first requests, verifiers' chat-program script prepared,
   the tool server up), then `--rounds` rounds alternating which side goes first; each side's
   best round (the least disturbed by whatever else the machine runs) gives its rollouts/s,
   and their ratio (b)/(a). Tokens/s and calls per rollout are printed beside them: the two
   engines sample differently (the replies, so the calls per episode, differ), so an engine's
   speed shows apart from the per-rollout costs.
   Shapes: `tiny`, the tiny Qwen2 of `asyncrl.examples.agent_math` (data/agent_math/model,
   `make agent-demo`'s model: tools in its chat template, warm-started to call a calculator
   (`calculate`, not this environment's `calc_calculate`)); its head size is 16, which vLLM's
   CPU attention does not take (32 and up), so both sides load the same function written as
   a Llama with head size 32 (q and k zero-padded, each rotary pair put where the same
   frequency falls, q scaled by sqrt 2 for the softmax scale; its logits are checked against
   the original's before any timing). `smol`, SmolLM2-135M-Instruct (data/smol_math/model,
   `asyncrl prepare-model`; its chat template has no tools section: the model is never shown
   the tool), float32.
2. Overhead per rollout, on an instant fake engine: every episode's first call answers a
   fixed `calc_calculate` tool call, the call after the tool's result a fixed final answer,
   instantly. (c) ours: `AgentRuns` with `VerifiersAgent` over a torch-engine-shaped fake
   giving those tokens (the endpoint, its chat template and tool parser, the agent log with its
   fsyncs, the tool journal's request hook); the baseline: verifiers' own loop against a
   minimal OpenAI chat server (Starlette/uvicorn in a thread) giving the same two replies. The
   same N*G episodes at once (and, without `--quick`, one at a time). The baseline's seconds
   per rollout are verifiers' own per-episode cost (its chat program's start, the
   interception server, MCP to the tool server, scoring); ours less the baseline's, per
   rollout, is what asyncrl's path adds. Best of rounds, alternating.

The last line (with `--quick`, tiny= is the instant engines' ratio: vLLM's start alone takes
~30 s here, and the quick mode says so):

    verifiers: ours/vf-eval rollouts/s tiny=R [smol=R], overhead A ms/rollout (ours) vs
    B ms/rollout (verifiers' harness)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODULE = "asyncrl_calculator"
SPLIT = "test"
TOOL = "calc_calculate"
SEAT = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}
KEY_VAR = "ASYNCRL_BENCH_VF_KEY"
"""The environment variable verifiers' client reads the server's key from (`api_key_var`)."""
TEMPERATURE = 1.0
TOOL_REPLY = (
    '<tool_call>\n{"name": "calc_calculate", "arguments": {"expression": "2 + 2"}}\n</tool_call>'
)
ANSWER_REPLY = "The answer is 4."


@dataclass(frozen=True)
class Shape:
    name: str
    tasks: int
    samples: int
    max_tokens: int  # per call
    max_turns: int  # calls per episode


SHAPES = {"tiny": Shape("tiny", 4, 2, 48, 3), "smol": Shape("smol", 4, 2, 48, 3)}


# -- the models ------------------------------------------------------------------------------


def tiny_as_llama(data: Path, out: Path) -> Path:
    """agent_math's tiny Qwen2 (head size 16) as the same function in a Llama of head size 32,
    written to `out` with its tokenizer and chat template; checked against the original."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from asyncrl.examples import agent_math

    source = Path(agent_math.prepare(data)["model"])
    qwen = AutoModelForCausalLM.from_pretrained(source, local_files_only=True).eval()
    c = qwen.config
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    old = c.hidden_size // heads
    new, half = 32, old // 2
    config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=new, max_position_embeddings=
        c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps, rope_theta=10000.0,
        tie_word_embeddings=True, attention_bias=True, bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id, torch_dtype="float32",
    )  # fmt: skip
    rope = getattr(c, "rope_parameters", None) or {}
    assert float(rope.get("rope_theta", 10000.0)) == 10000.0, rope
    llama = LlamaForCausalLM(config).eval()
    # rotate_half pairs dim i with i + d/2 at frequency theta^(-2i/d): i (< d/2 = 8) of 16 goes
    # to 2i of 32, i + 8 to 2i + 16 (the same frequency, the same pairing); the rest zeros
    where = torch.tensor([2 * i for i in range(half)] + [new // 2 + 2 * i for i in range(half)])

    def padded(weight: Any, count: int, scale: float = 1.0) -> Any:
        rows = weight.reshape(count, old, *weight.shape[1:]) * scale
        out = torch.zeros(count, new, *weight.shape[1:])
        out[:, where] = rows
        return out.reshape(count * new, *weight.shape[1:])

    state = qwen.state_dict()
    mine = {k: torch.zeros_like(v) for k, v in llama.state_dict().items()}
    for key, value in state.items():
        if ".self_attn." not in key:
            mine[key] = value.clone()
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}.self_attn."
        scale = math.sqrt(new / old)  # the softmax's 1/sqrt(head size) kept
        for part in ("weight", "bias"):
            mine[p + f"q_proj.{part}"] = padded(state[p + f"q_proj.{part}"], heads, scale)
            mine[p + f"k_proj.{part}"] = padded(state[p + f"k_proj.{part}"], kv_heads)
            v = state[p + f"v_proj.{part}"].reshape(kv_heads, old, *state[p + "v_proj." + part]
                                                    .shape[1:])  # fmt: skip
            v_new = torch.zeros(kv_heads, new, *v.shape[2:])
            v_new[:, :old] = v
            mine[p + f"v_proj.{part}"] = v_new.reshape(kv_heads * new, *v.shape[2:])
        o = state[p + "o_proj.weight"].reshape(c.hidden_size, heads, old)
        o_new = torch.zeros(c.hidden_size, heads, new)
        o_new[:, :, :old] = o
        mine[p + "o_proj.weight"] = o_new.reshape(c.hidden_size, heads * new)
    llama.load_state_dict(mine)
    ids = torch.randint(0, c.vocab_size, (2, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (llama(ids).logits - qwen(ids).logits).abs().max().item()
    assert gap < 1e-3, f"the Llama copy's logits differ from the original's by {gap}"
    out.mkdir(parents=True, exist_ok=True)
    llama.save_pretrained(out)
    for name in os.listdir(source):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(source / name, out / name)
    return out


def model_dir(shape: Shape, data: Path, tmp: Path) -> Path:
    if shape.name == "tiny":
        return tiny_as_llama(data, tmp / "tiny-llama")
    from asyncrl.models.prepare import prepare_model

    path = ROOT / "data/smol_math/model"
    prepare_model("smollm2-135m-instruct", path)  # kept if already there
    return path


def describe(shape: Shape, policy: Any) -> str:
    params = sum(p.numel() for p in policy.model.parameters()) / 1e6
    if shape.name == "tiny":
        return (f"agent_math's tiny Qwen2 as a Llama of head size 32, {params:.2f}M params, "
                "tools in its template")  # fmt: skip
    return f"SmolLM2-135M-Instruct, {params:.1f}M params, no tools in its template"


# -- vLLM's OpenAI server, launched as asyncrl launches one ----------------------------------


def start_vllm(model: Path, max_len: int, logs: Path) -> tuple[Any, str]:
    """vLLM's server on `model` with asyncrl's launcher pieces (`asyncrl.rollout.servers`:
    its command, its environment and auth, its health wait), its tokenizer and chat template
    on (asyncrl's launch skips them: it sends token ids) and the `hermes` tool parser."""
    from asyncrl.rollout import servers
    from asyncrl.rollout.lifeline import start_time

    secret = secrets.token_urlsafe(24)
    port = servers.free_port()
    vllm = {"kv_cache_bytes": 512 << 20, "max_model_len": max_len}
    command = [
        arg
        for arg in servers.server_command(str(model), port, "float32", vllm)
        if arg not in ("--skip-tokenizer-init", "--return-tokens-as-token-ids")
    ]
    command += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]  # fmt: skip
    log = logs / f"vllm-{model.name}.log"
    server = servers.Server(0, f"http://127.0.0.1:{port}", log=log)
    with open(log, "ab") as out:
        server.process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=servers.server_env(secret), start_new_session=True,
        )  # fmt: skip
    server.started = start_time(server.process.pid)
    server.authorize(secret)
    try:
        servers.wait_healthy([server], 600.0)
    except BaseException:
        servers.stop([server])
        raise
    return server, secret


# -- verifiers' own loop -----------------------------------------------------------------------


class Loop:
    """An event loop on a thread of its own, where an environment is served (`env.serving()`
    held open across rounds, entered and left in one task)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.holders: list[tuple[asyncio.Event, Any]] = []

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 900.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, env: Any) -> None:
        async def hold(ready: asyncio.Event, closing: asyncio.Event) -> None:
            async with env.serving():
                ready.set()
                await closing.wait()

        async def start() -> None:
            ready, closing = asyncio.Event(), asyncio.Event()
            task = asyncio.get_running_loop().create_task(hold(ready, closing))
            waiting = asyncio.ensure_future(ready.wait())
            await asyncio.wait([waiting, task], return_when=asyncio.FIRST_COMPLETED)
            if not ready.is_set():
                task.result()
            self.holders.append((closing, task))

        self.run(start())

    def close(self) -> None:
        async def stop() -> None:
            for closing, task in self.holders:
                closing.set()
                await asyncio.wait_for(task, 30.0)

        try:
            self.run(stop(), 60.0)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5.0)


def vf_env(shape: Shape) -> Any:
    """The environment as verifiers' own tooling loads it."""
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config

    taskset = {"id": MODULE, "num_tasks": shape.tasks, "split": SPLIT}
    return load_environment(
        resolve_env_config({"taskset": taskset, "agent": {**SEAT, "max_turns": shape.max_turns}})
    )


@dataclass
class Round:
    seconds: float
    rollouts: int
    tokens: int
    calls: int
    passes: str = ""
    """Ours: the calls of each engine pass, "5+2+1"."""


def vf_round(
    loop: Loop, env: Any, shape: Shape, base_url: str, model: str, sampling: dict[str, Any]
) -> Round:
    """verifiers' loop: the N*G episodes gathered, N*G at a time."""
    import verifiers.v1 as vf

    ctx = vf.ModelContext(
        client=vf.EvalClientConfig(base_url=base_url, api_key_var=KEY_VAR),
        model=model,
        sampling=vf.Sampling(**sampling),
    )
    tasks = list(env.taskset)[: shape.tasks]

    async def episodes() -> list[Any]:
        gate = asyncio.Semaphore(shape.tasks * shape.samples)

        async def one(task: Any) -> Any:
            async with gate:
                return await env.run_episode(task, ctx)

        return await asyncio.gather(*(one(t) for t in tasks for _ in range(shape.samples)))

    start = time.perf_counter()
    done = loop.run(episodes())
    seconds = time.perf_counter() - start
    bad = [e.errors or [t.errors for t in e.traces] for e in done if not e.ok or not e.traces]
    assert not bad, f"verifiers' episodes failed: {bad[:2]}"
    traces = [t for e in done for t in e.traces]
    return Round(seconds, len(done), sum(t.num_output_tokens for t in traces),
                 sum(len(t.calls) for t in traces))  # fmt: skip


# -- asyncrl's agent runs ----------------------------------------------------------------------


def agent_runs(shape: Shape, policy: Any, engine: Any, eos: int, log: Path) -> Any:
    """`AgentRuns` of `verifiers:asyncrl_calculator` over `engine`, started."""
    from asyncrl.agents.agent_log import AgentLog
    from asyncrl.agents.runs import AgentLimits, AgentRuns
    from asyncrl.agents.verifiers_env import VerifiersAgent, load_env

    venv = load_env(f"verifiers:{MODULE}", {"num_tasks": shape.tasks, "split": SPLIT},
                    shape.max_turns)  # fmt: skip
    agent_log = AgentLog(log)
    agent_log.load(0, lambda ordinal: True)
    limits = AgentLimits(shape.max_turns, shape.max_turns * shape.max_tokens, shape.max_tokens,
                         600.0, 0, int(policy.model.config.max_position_embeddings))  # fmt: skip
    runs = AgentRuns(
        VerifiersAgent(venv), f"verifiers:{MODULE}", venv.examples(), policy.tokenizer, eos,
        engine, shape.samples, 0, limits, agent_log, None,
    )  # fmt: skip
    runs.start()
    return runs


def ours_round(runs: Any, engine: Any, shape: Shape) -> Round:
    from benchmarks.agent_runs import Landing, tickets

    engine.clear()
    landing = Landing()
    start = time.perf_counter()
    runs.generate(tickets(shape.tasks), landing)
    seconds = time.perf_counter() - start
    assert len(landing.groups) == shape.tasks, "a ticket did not land"
    passes = [len(p) for p in engine.passes]
    return Round(seconds, shape.tasks * shape.samples, engine.tokens, sum(passes),
                 "+".join(map(str, passes)))  # fmt: skip


def alternate(sides: dict[str, Callable[[], Round]], rounds: int) -> dict[str, list[Round]]:
    """One warm-up round each, then `rounds` rounds alternating which side goes first."""
    for measure in sides.values():
        measure()
    times: dict[str, list[Round]] = {name: [] for name in sides}
    order = list(sides.items())
    for i in range(rounds):
        for name, measure in order if i % 2 == 0 else order[::-1]:
            times[name].append(measure())
    return times


def best(rounds: list[Round]) -> Round:
    return min(rounds, key=lambda r: r.seconds)


def rate(r: Round) -> str:
    per = r.rollouts
    return (
        f"{per / r.seconds:.2f} rollouts/s, {r.tokens / r.seconds:.0f} tok/s, "
        f"{r.calls / per:.2f} calls and {r.tokens / per:.1f} tokens a rollout"
    )


def throughput(shape: Shape, data: Path, rounds: int, tmp: Path) -> float:
    """Prints the shape's line; returns (b)/(a) rollouts/s, each side's best round."""
    from asyncrl.models.policy import load_pretrained_policy
    from asyncrl.rollout import servers
    from asyncrl.rollout.chat_tokens import turn_end_id
    from asyncrl.rollout.engine import EngineSpec
    from asyncrl.rollout.torch_engine import TorchGenerationEngine
    from asyncrl.rollout.weight_sync import CopyWeightSync
    from benchmarks.agent_runs import Recorder

    model = model_dir(shape, data, tmp)
    policy = load_pretrained_policy(model)
    eos = turn_end_id(policy.tokenizer, policy.eos_id)
    max_len = int(policy.model.config.max_position_embeddings)
    started = time.perf_counter()
    server, secret = start_vllm(model, max_len, tmp)
    vllm_s = time.perf_counter() - started
    weights = CopyWeightSync()
    weights.publish(0, policy.model.state_dict())
    spec = EngineSpec(policy.model, eos, policy.pad_id, shape.max_tokens, TEMPERATURE,
                      dtype="float32")  # fmt: skip
    engine = Recorder(TorchGenerationEngine(spec, weights))
    loop = Loop()
    runs = None
    os.environ[KEY_VAR] = secret
    sampling = {"temperature": TEMPERATURE, "max_tokens": shape.max_tokens,
                "stop_token_ids": [eos]}  # fmt: skip
    try:
        env = vf_env(shape)
        loop.serve(env)
        runs = agent_runs(shape, policy, engine, eos, tmp / f"{shape.name}.jsonl")
        times = alternate(
            {
                "vf": lambda: vf_round(
                    loop, env, shape, server.url + "/v1", servers.SERVED_NAME, sampling
                ),
                "ours": lambda: ours_round(runs, engine, shape),
            },
            rounds,
        )
    finally:
        if runs is not None:
            runs.close()
        loop.close()
        servers.stop([server])
    vf, ours = best(times["vf"]), best(times["ours"])
    ratio = vf.seconds / ours.seconds * (ours.rollouts / vf.rollouts)
    each = " ".join(f"{v.seconds / o.seconds:.2f}" for v, o in zip(times["vf"], times["ours"],
                                                                   strict=True))  # fmt: skip
    print(
        f"throughput {shape.name} ({describe(shape, policy)}): {shape.tasks} tasks x "
        f"{shape.samples} samples at once, <= {shape.max_turns} calls x {shape.max_tokens} "
        f"tokens, temperature {TEMPERATURE}, vLLM start {vllm_s:.1f} s: (a) vf-eval on vLLM "
        f"{rate(vf)}; (b) ours on the torch engine {rate(ours)}, calls a pass {ours.passes}; "
        f"(b)/(a) {ratio:.2f} (each "
        f"round's: {each})",
        flush=True,
    )
    return ratio


# -- the overhead, on instant engines ---------------------------------------------------------


class ToolThenAnswer:
    """An instant engine (torch engine's shape): a call whose prompt holds no tool result
    gets `TOOL_REPLY`, one that does `ANSWER_REPLY`, each ending with `eos`."""

    def __init__(self, tokenizer: Any, eos: int) -> None:
        from asyncrl.rollout.torch_engine import TorchGenerationEngine

        self.capabilities = TorchGenerationEngine.capabilities
        self.tokenizer = tokenizer
        encode = tokenizer.encode
        self.tool = [*encode(TOOL_REPLY, add_special_tokens=False), eos]
        self.answer = [*encode(ANSWER_REPLY, add_special_tokens=False), eos]

    def reply(self, prompt_ids: list[int]) -> list[int]:
        tail = str(self.tokenizer.decode(list(prompt_ids)[-400:]))
        return self.answer if "<tool_response>" in tail else self.tool

    def generate(self, requests: list[Any], version: Any = None, max_tokens: Any = None) -> Any:
        import torch

        from asyncrl.rollout.engine import GenerationOutput

        outputs = []
        for request in requests:
            ids = torch.tensor([self.reply(request.prompt_ids)])
            mask = torch.ones_like(ids, dtype=torch.bool)
            outputs.append(GenerationOutput(ids, mask, torch.zeros(ids.shape), 0, mask[:, 0]))
        return outputs

    def metrics(self) -> dict[str, float]:
        return {}


class InstantServer:
    """A minimal OpenAI chat server (Starlette, uvicorn on a thread) with the same two replies:
    a `calc_calculate` call, then after the tool's result the answer."""

    def __init__(self, tokens: tuple[int, int]) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

        from asyncrl.rollout.servers import free_port

        counter = iter(range(1 << 62))

        async def chat(request: Any) -> Any:
            body = await request.json()
            answered = any(m.get("role") == "tool" for m in body.get("messages", []))
            n = next(counter)
            if answered:
                message: dict[str, Any] = {"role": "assistant", "content": ANSWER_REPLY}
                finish, used = "stop", tokens[1]
            else:
                arguments = json.dumps({"expression": "2 + 2"})
                message = {"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"call_{n}", "type": "function",
                     "function": {"name": TOOL, "arguments": arguments}}]}  # fmt: skip
                finish, used = "tool_calls", tokens[0]
            head = {"id": f"chatcmpl-{n}", "created": int(time.time()),
                    "model": body.get("model", "instant")}  # fmt: skip
            usage = {"prompt_tokens": 1, "completion_tokens": used, "total_tokens": used + 1}
            if not body.get("stream"):
                return JSONResponse({
                    **head, "object": "chat.completion", "usage": usage,
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                })  # fmt: skip
            delta = dict(message)
            if "tool_calls" in delta:
                delta["tool_calls"] = [{"index": 0, **c} for c in delta["tool_calls"]]
            chunk = {**head, "object": "chat.completion.chunk"}
            events = [
                {**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
                {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
            ]
            if (body.get("stream_options") or {}).get("include_usage"):
                events.append({**chunk, "choices": [], "usage": usage})
            text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            return Response(text, media_type="text/event-stream")

        app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])

        port = free_port()
        self.url = f"http://127.0.0.1:{port}/v1"
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                access_log=False)  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "did not start"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10.0)


def overhead(
    shapes: list[tuple[str, Shape, int]], data: Path, tmp: Path
) -> tuple[float, float, float]:
    """Prints a line per concurrency; returns (ours ms/rollout over the baseline, the
    baseline's ms/rollout, ours/baseline rollouts/s), of the first of `shapes`."""
    from asyncrl.examples import agent_math
    from asyncrl.models.policy import load_pretrained_policy
    from asyncrl.rollout.chat_tokens import turn_end_id
    from benchmarks.agent_runs import Recorder

    policy = load_pretrained_policy(agent_math.prepare(data)["model"])
    eos = turn_end_id(policy.tokenizer, policy.eos_id)
    engine = Recorder(ToolThenAnswer(policy.tokenizer, eos))
    server = InstantServer((len(engine.engine.tool), len(engine.engine.answer)))
    os.environ[KEY_VAR] = "instant"
    results = []
    for label, shape, rounds in shapes:
        loop = Loop()
        runs = None
        try:
            env = vf_env(shape)
            loop.serve(env)
            runs = agent_runs(shape, policy, engine, eos, tmp / f"instant-{label}.jsonl")
            times = alternate(
                {
                    "vf": lambda env=env, loop=loop, shape=shape: vf_round(
                        loop, env, shape, server.url, "instant", {}
                    ),
                    "ours": lambda runs=runs, shape=shape: ours_round(runs, engine, shape),
                },
                rounds,
            )
            tools = runs.counts.tools.executed
        finally:
            if runs is not None:
                runs.close()
            loop.close()
        vf, ours = best(times["vf"]), best(times["ours"])
        assert ours.calls == 2 * ours.rollouts and vf.calls == 2 * vf.rollouts, (ours, vf)
        base_ms = vf.seconds / vf.rollouts * 1e3
        ours_ms = ours.seconds / ours.rollouts * 1e3
        added = ours_ms - base_ms
        each = " ".join(f"{(o.seconds - v.seconds) / o.rollouts * 1e3:+.0f}"
                        for v, o in zip(times["vf"], times["ours"], strict=True))  # fmt: skip
        print(
            f"overhead {label}: instant engines, 2 calls and 1 tool call a rollout ({tools} "
            f"tool calls journaled in all): verifiers' loop on a plain server "
            f"{base_ms:.0f} ms/rollout ({vf.rollouts / vf.seconds:.2f} rollouts/s); ours "
            f"{ours_ms:.0f} ms/rollout ({ours.rollouts / ours.seconds:.2f} rollouts/s): "
            f"{added:+.1f} ms/rollout (each round's: {each})",
            flush=True,
        )
        results.append((added, base_ms, vf.seconds / ours.seconds))
    server.close()
    return results[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="no vLLM: the instant engines only, one round (seconds)")  # fmt: skip
    parser.add_argument("--shapes", nargs="*", choices=list(SHAPES), default=None)
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 2)")
    parser.add_argument(
        "--data",
        type=Path,
        default=ROOT / "data/agent_math",
        help="agent_math's files (the tiny shape), built there if missing",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 2)
    shapes = [] if args.quick else (args.shapes or list(SHAPES))
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import torch

    from benchmarks.agent_runs import machine_line

    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_line(), flush=True)
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for name in shapes:
            ratios[name] = throughput(SHAPES[name], args.data, rounds, tmp)
        tiny = SHAPES["tiny"]
        at_once = (f"{tiny.tasks * tiny.samples} at once", tiny, rounds)
        one = ("1 at a time", Shape("one", 1, 1, tiny.max_tokens, tiny.max_turns), 2 * rounds + 1)
        if args.quick:
            at_once = ("2 at once", Shape("quick", 1, 2, tiny.max_tokens, tiny.max_turns), rounds)
        chosen = [at_once] if args.quick else [at_once, one]
        added, base_ms, instant_ratio = overhead(chosen, args.data, tmp)
    if args.quick:
        ratios["tiny"] = instant_ratio
        print(
            "quick: vLLM not started (its start alone takes ~30 s here); tiny= below is ours/"
            "verifiers' loop on the instant engines, not against vLLM",
            flush=True,
        )
    figures = " ".join(f"{name}={ratio:.2f}" for name, ratio in ratios.items())
    print(
        f"verifiers: ours/vf-eval rollouts/s {figures}, overhead {added:.0f} ms/rollout (ours) "
        f"vs {base_ms:.0f} ms/rollout (verifiers' harness)"
    )


if __name__ == "__main__":
    main()
