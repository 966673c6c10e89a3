"""One agent run's tokens: what the endpoint generated for it, exactly, and the messages
between its calls, as one or more segments (rows to train).

A call whose messages continue the run's last call (the same messages, the answer it was
given, then new ones) continues the sample as one sequence: the prompt is the sample's tokens
so far (the completion exactly as sampled, never re-tokenized) and the new messages' tokens as
the chat template continues the conversation after the assistant's end of turn, masked out of
the loss. So does a call whose rendered prompt starts with the sample's tokens. Any other call
(the agent rewrote or trimmed its history, changed its tools, or the template renders earlier
turns differently) starts a new segment of the same sample, counted as a prefix break; every
segment is trained with the sample's advantage.

Plain lists, no IO: unit-tested in milliseconds. Rendering is given as functions.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.agents.calls import Message


@dataclass
class Segment:
    """One row: its tokens, which of them the policy sampled (trained), their behaviour
    log-probs and weights versions (-1 where not sampled)."""

    tokens: list[int] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def add(self, tokens: list[int], sampled: bool, logprobs: list[float], version: int) -> None:
        self.tokens += tokens
        self.policy += [sampled] * len(tokens)
        self.logprobs += logprobs if sampled else [0.0] * len(tokens)
        self.versions += [version if sampled else -1] * len(tokens)

    @property
    def num_sampled(self) -> int:
        return sum(self.policy)


def canonical(message: Message) -> dict[str, Any]:
    """The parts of a message that decide its tokens: role, text, tool calls (name and
    arguments), a tool answer's id and name. Clients add fields of their own (`refusal`, ids
    of their own making, `null`s): those are left out."""
    out: dict[str, Any] = {"role": message.get("role"), "content": _text(message.get("content"))}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            [
                (c.get("function") or c).get("name"),
                _arguments((c.get("function") or c).get("arguments")),
            ]
            for c in calls
        ]
    for key in ("tool_call_id", "name"):
        if message.get(key):
            out[key] = message[key]
    return out


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content).strip()


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def request_hash(prompt_ids: list[int], max_tokens: int) -> str:
    """What a logged call is checked against on replay: the prompt's tokens and the tokens it
    may generate (the sample's tokens so far are in the prompt)."""
    digest = hashlib.sha256(json.dumps([prompt_ids, max_tokens]).encode())
    return digest.hexdigest()[:32]


Render = Callable[[list[Message], list[dict[str, Any]] | None], list[int]]
"""The chat template's tokens for messages (and tools), with the assistant's opening."""
Reply = Callable[[list[Message], int, bool, list[dict[str, Any]] | None], list[int]]
"""The tokens of the last `n` messages as the template continues the conversation after the
assistant's end of turn (`ChatTokens.reply_ids`); `ended`: the turn's end was sampled."""


@dataclass
class Opening:
    """A call's prompt: the tokens the engine continues, and whether it starts a segment."""

    prompt_ids: list[int]
    new_segment: bool
    continued_by: str = ""
    """How it continues the sample: `messages`, `tokens`, or "" (a new segment)."""


class SampleTokens:
    """One agent run's segments, and what its last call was, to tell whether the next
    continues it."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.breaks = 0
        """Calls after the first that started a new segment (`agent/prefix_breaks`)."""
        self.num_calls = 0
        self.num_sampled = 0
        self._history: list[dict[str, Any]] | None = None
        """The last call's messages and the answer it was given, canonical (chat calls)."""
        self._tools: Any = None
        self._ended = True  # the last completion sampled its end of turn

    @property
    def tokens(self) -> list[int]:
        return self.segments[-1].tokens if self.segments else []

    def open_chat(
        self,
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        render: Render,
        reply: Reply,
    ) -> Opening:
        """The prompt of a chat call: the sample continued where the messages continue its
        last call, else a new segment (`Opening.new_segment`)."""
        history = [canonical(m) for m in messages]
        known = self._history
        if (
            known is not None
            and self.segments
            and tools == self._tools
            and len(history) > len(known)
            and history[: len(known)] == known
        ):
            try:
                added = reply(messages, len(history) - len(known), self._ended, tools)
            except ValueError:  # the template does not extend turn by turn: by tokens
                added = None
            if added is not None:
                return Opening(self.tokens + added, False, "messages")
        rendered = render(messages, tools)
        return self._by_tokens(rendered)

    def open_text(self, prompt_ids: list[int], decoded_so_far: str, prompt: str) -> Opening:
        """The prompt of a text completion: the sample continued where the prompt's text starts
        with its tokens' text (`decoded_so_far`), the rest encoded after them (`prompt_ids` is
        that rest's encoding where it does, else the whole prompt's)."""
        if self.segments and decoded_so_far and prompt.startswith(decoded_so_far):
            return Opening(self.tokens + prompt_ids, False, "tokens")
        return Opening(prompt_ids, True)

    def _by_tokens(self, rendered: list[int]) -> Opening:
        current = self.tokens
        if current and len(rendered) > len(current) and rendered[: len(current)] == current:
            return Opening(rendered, False, "tokens")
        return Opening(rendered, True)

    def record(
        self,
        opening: Opening,
        completion: list[int],
        logprobs: list[float],
        version: int,
        ended: bool,
        messages: list[Message] | None = None,
        answer: Message | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        """A call served: its prompt's new tokens (not sampled) and its completion (sampled)
        added to the sample; for a chat call, its messages and `answer` (the assistant message
        the endpoint returned) kept to tell whether the next call continues it."""
        if opening.new_segment:
            if self.segments:
                self.breaks += 1
            self.segments.append(Segment())
        segment = self.segments[-1]
        segment.add(opening.prompt_ids[len(segment.tokens) :], False, [], -1)
        segment.add(list(completion), True, list(logprobs), version)
        self.num_calls += 1
        self.num_sampled += len(completion)
        self._ended = ended
        if messages is not None and answer is not None:
            self._history = [canonical(m) for m in [*messages, answer]]
            self._tools = tools
        else:
            self._history = None
