"""One job as one streamed completion on a vLLM server, read as it arrives:

    job ─▶ POST /v1/completions: prompt token ids, n, seed, max_tokens, temperature,
           logprobs=0, stream, return_token_ids, stop on eos only
    reply ─▶ "data: {chunk}" lines ─▶ per choice: its token ids and their log-probs, appended
           to its sample's piece the moment they arrive; a finish reason ends the sample

What arrived is in the caller's `received` even when the stream breaks (`BREAKS`: the server
died, hung and had its streams cut, or aborted the request), so the job continues from its last
received token (`jobs.continue_job`) and no token that arrived is asked for again. A reply
against asyncrl's contract (a stop on a token not eos) is a `ProtocolError`: not retried.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx

from asyncrl.faults import server_fault_point
from asyncrl.rollout.jobs import Job, Piece, sample_ended
from asyncrl.rollout.servers import Server, ServerDown, ServerError


class ProtocolError(RuntimeError):
    """A server answered against asyncrl's contract (a stop token not ours): not retried."""


class StreamBroken(Exception):
    """A job's stream stopped before its end; `received` holds what arrived."""

    def __init__(self, received: dict[int, Piece], cause: BaseException) -> None:
        super().__init__(repr(cause))
        self.received = received
        self.cause = cause


BREAKS: tuple[type[BaseException], ...] = (httpx.TransportError, ServerDown, OSError)
"""What breaks a stream, so that its job continues elsewhere from what arrived (any other error
fails the batch)."""


def completion_body(job: Job, model: str, temperature: float, eos_id: int) -> dict[str, Any]:
    """The streamed request of `job` to the model (or adapter) named `model`: token ids in and
    out, each token's own log-prob, stopping on `eos_id` only."""
    return {
        "model": model,
        "prompt": job.prompt,
        "n": job.n,
        "seed": job.seed % (1 << 63),
        "max_tokens": job.max_tokens,
        "temperature": temperature,
        "logprobs": 0,
        "stream": True,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "stop_token_ids": [eos_id],
        "ignore_eos": False,
    }


def read_stream(
    server: Server,
    job: Job,
    body: dict[str, Any],
    received: dict[int, Piece],
    eos_id: int,
    timeout_s: float,
    version: int,
    on_tokens: Callable[[int], None],
) -> None:
    """Streams `body` from `server` to its end, each sample's tokens into `received` as they
    arrive (`on_tokens` told how many). One of `BREAKS` if the stream stops before every
    sample ended (what arrived stays in `received`); ServerError where the server refuses the
    request, ProtocolError where it stops a sample on a token not `eos_id`."""
    # the reply's headers within `timeout_s` (vLLM sends them at once, even for a queued
    # request); then no read timeout: a busy server's stream may be silent while requests
    # ahead of it in its queue run, and a hung one is found by the engine's watchdog (its
    # /health), which cuts it
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    with (
        server.client.stream(
            "POST", server.url + "/v1/completions", json=body, timeout=timeout
        ) as reply,
        server.watching(reply),
    ):
        reply.request.extensions["timeout"]["read"] = None  # httpcore reads it here
        if reply.status_code != 200:  # a request it refuses: not retried
            raise ServerError(
                f"{server.name()}: /v1/completions: {reply.status_code} "
                f"{reply.read().decode(errors='replace')[:500]}"
            )
        ended: set[int] = set()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # vLLM's engine failed mid-stream
                raise ServerDown(f"{server.name()}: {chunk['error']}")
            for choice in chunk["choices"]:
                sample, count, reason = take_choice(choice, job, received, eos_id, server.name)
                on_tokens(count)
                if reason == "abort":  # aborted elsewhere (another client)
                    raise ServerDown(f"{server.name()} aborted a request")
                if reason is not None:
                    ended.add(sample)
                for _ in range(count):
                    server_fault_point(
                        "server.tokens_received", server.signal, server=server.index,
                        version=version,
                    )  # fmt: skip
        if len(ended) < job.n:
            raise ServerDown(f"{server.name()}: the stream ended before its samples")


def take_choice(
    choice: dict[str, Any],
    job: Job,
    received: dict[int, Piece],
    eos_id: int,
    name: Callable[[], str],
) -> tuple[int, int, str | None]:
    """One choice of a streamed chunk appended to its sample's piece in `received` (ended
    where its finish reason and `jobs.sample_ended` say so; an abort's is kept, not ended):
    (the sample, how many tokens it brought, its finish reason). ServerError where its token
    ids and log-probs differ in number, ProtocolError where it stopped on a token not
    `eos_id`; `name` names the server in either."""
    sample = job.samples[choice["index"]]
    ids = [int(t) for t in choice.get("token_ids") or []]
    lps = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
    if len(ids) != len(lps):
        raise ServerError(f"{name()}: {len(ids)} token ids but {len(lps)} log-probs in one chunk")
    have, have_lps, _ = received.get(sample, ([], [], False))
    have, have_lps = have + ids, have_lps + lps
    reason = choice.get("finish_reason")
    if reason == "stop" and not (have and have[-1] == eos_id):
        raise ProtocolError(
            f"{name()} stopped a sample on token {have[-1:]}, not on eos {eos_id}: its stop "
            "tokens are not asyncrl's"
        )
    done = reason not in (None, "abort") and sample_ended(have, len(job.prefix), eos_id, job.end)
    received[sample] = (have, have_lps, done)
    return sample, len(ids), reason
