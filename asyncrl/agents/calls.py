"""What the run's OpenAI-compatible endpoint (`asyncrl.agents.endpoint`) asks of the run, and
what it gets back: the HTTP layer parses and checks a request, turns its messages into the
chat template's form and hands the call to an `AgentBackend`, which owns the tokens (renders,
continues the sample, generates or answers from the log) and returns the completion's tokens
exactly as generated. No HTTP, no torch here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

Message = dict[str, Any]
"""A chat message as transformers' chat templates take it: `role`, `content`, and for an
assistant's tool calls `tool_calls=[{"type": "function", "function": {"name": ..., "arguments":
{...}}}]` (arguments a dict, not the OpenAI wire format's JSON string), for a tool's answer
`role="tool"` with `tool_call_id`/`name`."""


@dataclass(frozen=True)
class ChatCall:
    """`POST /s/{sample_key}/v1/chat/completions`."""

    sample_key: str
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    """The request's `tools`, OpenAI's form (`{"type": "function", "function": {...}}`), for
    the chat template's `tools=` argument."""
    max_tokens: int | None = None
    """`max_completion_tokens` or `max_tokens` as asked (None: not given); the backend holds
    it to `agent.max_tokens`."""


@dataclass(frozen=True)
class TextCall:
    """`POST /s/{sample_key}/v1/completions`: a prompt as text."""

    sample_key: str
    prompt: str
    max_tokens: int | None = None


@dataclass(frozen=True)
class Completion:
    """One completion, as the engine generated it (or as the run's log holds it)."""

    token_ids: list[int]
    """Exactly as sampled, the end-of-turn token included where it was sampled."""
    logprobs: list[float]
    """The behaviour log-prob of each token of `token_ids`."""
    text: str
    """`token_ids` decoded, the end-of-turn/eos token left out."""
    finish_reason: str
    """`stop` (an end of turn was sampled) or `length` (cut at max_tokens)."""
    prompt_token_ids: list[int] = field(default_factory=list)
    """The tokens the completion was generated after (the sample's tokens so far)."""


class CallRefused(Exception):
    """A call the backend will not serve: the endpoint answers `status` with `message` as an
    OpenAI-style error body (`{"error": {"message", "type", "code"}}`)."""

    def __init__(self, status: int, message: str, code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


class AgentBackend(Protocol):
    """The run behind the endpoint: one agent run (sample) per key."""

    model_name: str
    """What `GET /v1/models` lists and a request's `model` may name (any name is accepted)."""

    def known(self, sample_key: str) -> bool:
        """Whether `sample_key` names an agent run of this run that is still going (else the
        endpoint answers 404)."""
        ...

    async def chat(self, call: ChatCall) -> Completion:
        """Renders, continues the sample, generates (or answers from the log). May raise
        `CallRefused` (a limit reached: the agent run is being ended)."""
        ...

    async def complete(self, call: TextCall) -> Completion: ...


SAMPLE_MODEL = "sample:"
"""The shared routes (`/v1/chat/completions`, `/v1/completions`) take the agent run from the
request's `model`, `sample:KEY`: for clients that keep one connection pool per base URL across
many runs (verifiers' interception server keeps one client per distinct endpoint config for as
long as it serves, so a base URL per run would be a client per run)."""
