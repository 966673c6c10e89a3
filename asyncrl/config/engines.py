"""The generation engines' own settings: `rollout.vllm.*` (vLLM in this process or its engine
process) and `rollout.servers.*` (vLLM's OpenAI-compatible servers, `rollout.engine=vllm_server`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from asyncrl.config.base import MAY_CHANGE
from asyncrl.config.base import require as _require


@dataclass
class VLLMConfig:
    """`rollout.vllm.*`: the vLLM engine's settings (used only with `rollout.engine=vllm`, which
    deterministic mode refuses: so they may change on any resume)."""

    kv_cache_bytes: int = field(default=256 << 20, metadata=MAY_CHANGE)
    """Bytes of KV cache vLLM allocates (`kv_cache_memory_bytes`). The CPU build needs it set;
    0 on a GPU sizes it from `gpu_memory_utilization` instead."""
    gpu_memory_utilization: float = field(default=0.5, metadata=MAY_CHANGE)
    """With `kv_cache_bytes=0` on a GPU: the share of GPU memory vLLM may take (weights, cache
    and activations); the trainer needs the rest when it shares the GPU."""
    max_model_len: int = field(default=0, metadata=MAY_CHANGE)
    """Longest prompt + completion vLLM schedules; 0 takes the model's
    `max_position_embeddings` (lower it when the KV cache cannot hold one such sequence)."""
    max_num_seqs: int = field(default=256, metadata=MAY_CHANGE)
    """Sequences vLLM decodes together at most (its batch)."""
    enforce_eager: bool = field(default=True, metadata=MAY_CHANGE)
    """No CUDA graphs or `torch.compile`: start-up in seconds. On GPUs `false` decodes faster
    after a longer start."""
    enable_prefix_caching: bool = field(default=True, metadata=MAY_CHANGE)
    """Reuse the KV cache of prompts seen before (reset at every weights update)."""
    multiprocessing: bool = field(default=False, metadata=MAY_CHANGE)
    """Run vLLM's engine core in a process of its own (vLLM's default; ~15 s start-up on CPU;
    each weights update then goes through a safetensors file) instead of in the generation
    thread (~5 s; as TRL's colocated mode)."""
    lora_requests: bool = field(default=False, metadata=MAY_CHANGE)
    """A LoRA run (`model.lora.rank` > 0) on vLLM in this process or on its servers: vLLM loads
    the frozen base once and serves each weights version's adapters as a LoRA request of its
    own (`enable_lora`; on servers `/v1/load_lora_adapter`; the adapters written to a directory
    per version, megabytes), instead of reloading the merged weights of every version (`false`).
    May not change on a LoRA run's resume. Measured in `benchmarks/vllm_lora.py`
    (docs/lora.md#vllm)."""

    def validate(self) -> None:
        for key in ("kv_cache_bytes", "max_model_len"):
            _require(getattr(self, key) >= 0, f"rollout.vllm.{key}", getattr(self, key), ">= 0")
        _require(self.max_num_seqs >= 1, "rollout.vllm.max_num_seqs", self.max_num_seqs, ">= 1")
        _require(
            0 < self.gpu_memory_utilization <= 1,
            "rollout.vllm.gpu_memory_utilization",
            self.gpu_memory_utilization,
            "in (0, 1]",
        )


@dataclass
class ServersConfig:
    """`rollout.servers.*`: where `rollout.engine=vllm_server` generates, vLLM's
    OpenAI-compatible servers (docs/servers.md). Exactly one of `launch` and `urls`."""

    launch: int = field(default=0, metadata=MAY_CHANGE)
    """Servers asyncrl starts itself on 127.0.0.1, each at a free port in a process group of
    its own (`python -m vllm.entrypoints.openai.api_server`, with `rollout.vllm.*`), requiring
    a secret of the launch on every route, logging to `RUN_DIR/servers/`; stopped when the run
    ends however it ends (by its lifeline process where the trainer cannot), and what a kill of
    both left is stopped at the next launch under the run dir's lock."""
    urls: list[str] = field(default_factory=list, metadata=MAY_CHANGE)
    """Servers you run, attached (`http://HOST:PORT`, comma-separated on the command line):
    started with `VLLM_SERVER_DEV_MODE=1` (vLLM's RL routes: pause, resume, weight versions)
    and a file system shared with this process (each weights version is reloaded from a
    file under the run dir). Never stopped by asyncrl. One server serves one run (recorded on
    it, in vLLM's weight-version string). Its dev-mode routes change its weights: never expose
    them beyond a private network; start it with `ASYNCRL_SERVER_SECRET` and `--middleware
    asyncrl.rollout.server_auth.RequireSecret` and give the trainer the same variable
    (docs/servers.md)."""
    max_restarts: int = field(default=3, metadata=MAY_CHANGE)
    """Launched servers restarted after they died, in all; a server that dies past it stays
    down (its log's last lines printed), its requests move to the others, and generation fails
    when none is left (`rollout.max_generation_failures`). Attached servers are never
    restarted."""
    health_timeout_s: float = field(default=30.0, metadata=MAY_CHANGE)
    """A server with requests in flight whose `/health` does not answer for this long is dead
    (a hung process): its streams are cut, its requests continue elsewhere from the tokens
    received, and a launched one is killed and restarted. A stream's silence alone is not a
    death: a busy server's queued requests send nothing until they run."""
    start_timeout_s: float = field(default=600.0, metadata=MAY_CHANGE)
    """Longest wait for a launched server to answer `/health` (vLLM's start on CPU: tens of
    seconds)."""

    def validate(self) -> None:
        _require(self.launch >= 0, "rollout.servers.launch", self.launch, ">= 0")
        _require(self.max_restarts >= 0, "rollout.servers.max_restarts", self.max_restarts, ">= 0")
        for key in ("health_timeout_s", "start_timeout_s"):
            value = getattr(self, key)
            _require(value > 0, f"rollout.servers.{key}", value, "> 0")
        for url in self.urls:
            _require(url_problem(url) == "", "rollout.servers.urls", url, url_problem(url))


def url_problem(url: str) -> str:
    """What is wrong with a server URL ("" when nothing): `http(s)://HOST:PORT`, the port in
    1..65535, no path beyond `/` or `/v1`."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as err:
        return f"an http://HOST:PORT URL ({err})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "an http://HOST:PORT URL"
    if port is None:
        return "an http://HOST:PORT URL with its port"
    if not 1 <= port <= 65535:
        return "an http://HOST:PORT URL with a port in 1..65535"
    if parts.path.rstrip("/") not in ("", "/v1") or parts.query:
        return "an http://HOST:PORT URL (no path but /v1)"
    return ""
