"""Attaching to vLLM servers the user runs (`rollout.servers.urls`): before a server is used it
is checked to serve this run (`attach_problems`: its log-probs, its dtype, its model's
architecture, a LoRA run's adapter settings), and refused in one line naming
`rollout.servers.urls` and its URL where it cannot; a server whose dev-mode routes answer
without a secret is attached with a warning. Which run holds it, and what a killed trainer left
on it, is `server_leases.claim`'s; the processes asyncrl launches itself are `servers.py`'s.
"""

from __future__ import annotations

from typing import Any

import httpx

from asyncrl.config import ConfigError
from asyncrl.rollout.server_auth import SECRET_ENV
from asyncrl.rollout.servers import GUARD, Server

MODEL_FIELDS = (
    "architectures",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
)
"""What makes an attached server's model this run's, as far as weights go (its Hugging Face
config's fields): same names and shapes, so this run's weights load into it."""


def attach_problems(
    info: dict[str, Any],
    theirs: dict[str, Any] | None,
    ours: dict[str, Any],
    dtype: str,
    lora_rank: int = 0,
) -> list[str]:
    """Why an attached server cannot serve this run: `info` is its `/server_info` (JSON),
    `theirs` its model's Hugging Face config (None where this machine cannot read it), `ours`
    this run's model config, `dtype` `rollout.dtype`, `lora_rank` a LoRA run's adapters' rank
    (`rollout.vllm.lora_requests`; 0: none). Empty: it can (its weights are then replaced by
    this run's before its first request)."""
    config = info.get("vllm_config") or {}
    served = config.get("model_config") or {}
    problems = []
    mode = served.get("logprobs_mode")
    if mode != "processed_logprobs":
        problems.append(
            f"it gives {mode} log-probs: start it with --logprobs-mode processed_logprobs (the "
            "log-probs of the distribution it samples, after temperature, which the trainer's "
            "importance ratios compare with)"
        )
    served_dtype = str(served.get("dtype", "")).removeprefix("torch.")
    if served_dtype != dtype:
        problems.append(
            f"it computes in {served_dtype}, this run's rollout.dtype is {dtype}: start it "
            f"with --dtype {dtype}, or set rollout.dtype={served_dtype}"
        )
    if theirs is not None:
        for key in MODEL_FIELDS:
            if None not in (theirs.get(key), ours.get(key)) and theirs[key] != ours[key]:
                problems.append(
                    f"its model ({served.get('model')}) has {key} {theirs[key]!r}, this run's "
                    f"{ours[key]!r}: it serves another model"
                )
    if lora_rank:
        lora = config.get("lora_config") or {}
        if int(lora.get("max_lora_rank") or 0) < lora_rank:
            problems.append(
                f"a LoRA run's adapters (rank {lora_rank}) need it started with --enable-lora "
                f"--max-lora-rank {lora_rank} (it has {lora.get('max_lora_rank')})"
            )
        runtime = (info.get("vllm_env") or {}).get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        if str(runtime).lower() not in ("true", "1"):
            problems.append(
                "a LoRA run loads each version's adapters at run time: start it with "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
            )
    return problems


def attach(
    index: int,
    url: str,
    ours: dict[str, Any],
    dtype: str,
    lora_rank: int,
    health_timeout: float,
    secret: str = "",
) -> Server:
    """A server the user runs, checked to serve this run (`attach_problems`; ConfigError naming
    `rollout.servers.urls` and the URL, in one line, where not), every request to it carrying
    `secret` where one is given (`server_auth`). A server whose dev-mode routes answer without
    a secret is attached, with a warning naming what anyone who reaches it can do. Which run
    holds it, and what a killed trainer left on it, is `server_leases.claim`'s."""
    server = Server(index, url.rstrip("/").removesuffix("/v1"))
    where = f"rollout.servers.urls: {server.url}"
    if secret:
        server.authorize(secret)
    try:
        health = server.control.get(server.url + "/health", timeout=health_timeout).status_code
    except httpx.HTTPError:
        health = 0
    if health == 401:
        raise ConfigError(
            f"{where} requires a secret: set {SECRET_ENV} in the trainer's environment to the "
            + ("one it was started with (the one set is refused)" if secret else "one it has")
        )
    if health != 200:
        raise ConfigError(
            f"{where} does not answer /health (is the server running, and the URL and port right?)"
        )
    served, model = _server_info(server, where)
    theirs = _hf_config(str(model.get("model", "")))
    problems = attach_problems(served, theirs, ours, dtype, lora_rank)
    if problems:
        raise ConfigError(f"{where} cannot serve this run: " + "; ".join(problems))
    if theirs is None:
        print(
            f"asyncrl: {server.url} serves {model.get('model')}, which this machine cannot "
            "read: its architecture is not checked, only its dtype and log-probs"
        )
    models = server.control.get(server.url + "/v1/models", timeout=30).json()
    server.model = models["data"][0]["id"]
    if routes_open(server.url):
        print(
            f"asyncrl: WARNING: {server.url} answers vLLM's dev-mode routes without a secret: "
            "anyone who reaches it can change its weights (/collective_rpc), its adapters or "
            "its weight version, pause it or abort its requests, and so poison this run's "
            "rollouts. Start it on a loopback or private address with "
            f"{SECRET_ENV}=... and --middleware {GUARD} (docs/servers.md)"
        )
    return server


def _server_info(server: Server, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A server's `/server_info` (JSON) and the model config in it; ConfigError (`where`
    first) where it has none."""
    info = server.control.get(
        server.url + "/server_info", params={"config_format": "json"}, timeout=30
    )
    if info.status_code == 404:
        raise ConfigError(
            f"{where} has no /server_info: start it with VLLM_SERVER_DEV_MODE=1 (weights are "
            "pushed through its dev-mode routes)"
        )
    try:
        served: dict[str, Any] = info.json()
        model: dict[str, Any] = served["vllm_config"]["model_config"]
    except (ValueError, KeyError, TypeError):
        raise ConfigError(
            f"{where}: /server_info answered {info.status_code} without a model config "
            f"({info.text[:200]!r}): is it a vLLM server?"
        ) from None
    return served, model


def routes_open(url: str) -> bool:
    """Whether a server answers a dev-mode route (`GET /is_paused`) to a request with no
    secret."""
    try:
        return httpx.get(url + "/is_paused", timeout=10.0).status_code == 200
    except httpx.HTTPError:
        return False


def _hf_config(model: str) -> dict[str, Any] | None:
    """The Hugging Face config of the model a server was started on, where this machine can
    read it (a local folder, or a hub id in the local cache); None where not."""
    try:
        from transformers import AutoConfig

        config: dict[str, Any] = AutoConfig.from_pretrained(model, local_files_only=True).to_dict()
        return config
    except Exception:  # not readable here: another node's folder, a hub id not cached
        return None
