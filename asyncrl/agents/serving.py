"""The endpoint's backend for agent runs (`asyncrl.agents.calls.AgentBackend`): one state per
agent run (its sample key, its tokens so far, its limits), a call's prompt rendered and the
sample continued (`asyncrl.agents.samples`), the call answered from the agent log where it
holds the same request, else queued for the next engine pass (`asyncrl.agents.runs` runs the
passes). Runs on the endpoint's event loop; the queue is shared with the pass loop's thread
under one condition."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from asyncrl.agents.agent_log import AgentLog, call_key
from asyncrl.agents.calls import CallRefused, ChatCall, Completion, Message, TextCall
from asyncrl.agents.context import AgentContext, ToolCounts
from asyncrl.agents.samples import Opening, SampleTokens, request_hash
from asyncrl.agents.tool_calls import tool_parser
from asyncrl.core.types import PromptTicket
from asyncrl.rollout.chat_tokens import ChatTokens


@dataclass
class AgentLimits:
    max_calls: int
    max_tokens: int  # completion tokens per run
    call_tokens: int  # per call (`rollout.max_new_tokens`)
    timeout_s: float
    retries: int
    max_seq_len: int


@dataclass
class AgentCounts:
    """Cumulative, for the step records (`agent/*`) and the resume's account."""

    calls: int = 0
    calls_generated: int = 0
    calls_replayed: int = 0
    calls_diverged: int = 0
    prefix_breaks: int = 0
    runs: int = 0
    runs_failed: int = 0
    runs_ended_by_limit: int = 0
    runs_calling_tools: int = 0
    runs_landed: int = 0
    """Runs of the groups that landed (`runs` counts those started, a window ahead)."""
    tools: ToolCounts = field(default_factory=ToolCounts)

    def metrics(self) -> dict[str, float]:
        return {
            "agent/calls": self.calls,
            "agent/calls_generated": self.calls_generated,
            "agent/calls_replayed": self.calls_replayed,
            "agent/calls_diverged": self.calls_diverged,
            "agent/prefix_breaks": self.prefix_breaks,
            "agent/runs": self.runs,
            "agent/runs_failed": self.runs_failed,
            "agent/runs_ended_by_limit": self.runs_ended_by_limit,
            "agent/runs_calling_tools": self.runs_calling_tools,
            "agent/runs_landed": self.runs_landed,
            "agent/tools_executed": self.tools.executed,
            "agent/tools_replayed": self.tools.replayed,
            "agent/tools_repeated": self.tools.repeated,
        }


@dataclass
class Pending:
    """A live call waiting for an engine pass."""

    state: RunState
    key: str
    call: int
    prompt_ids: list[int]
    max_tokens: int
    digest: str
    future: asyncio.Future[tuple[list[int], list[float], int]]
    loop: asyncio.AbstractEventLoop


@dataclass
class RunState:
    ticket: PromptTicket
    sample: int
    attempt: int
    key: str
    tokens: SampleTokens = field(default_factory=SampleTokens)
    replaying: bool = True
    limit: str = ""
    """The limit that ended the run (`agent.max_calls`, ...), or ""."""
    last_text: str = ""
    called_tools: bool = False
    lock: asyncio.Lock | None = None
    future: concurrent.futures.Future[Any] | None = None
    ctx: AgentContext | None = None
    started: float = field(default_factory=time.perf_counter)
    """When the run (its try) started: a group's `generation_s` is from its first."""


class AgentServer:
    """The backend: the agent runs in flight by sample key, and the calls waiting for a
    pass."""

    model_name = "policy"

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        eos_id: int,
        limits: AgentLimits,
        log: AgentLog,
        parser: str = "hermes",
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_tokens = ChatTokens(tokenizer, eos_id)
        self.stop_ids = {int(eos_id), int(self.chat_tokens.eos_id)}
        self.limits = limits
        self.log = log
        self.parse = tool_parser(parser)
        self.parser_name = parser
        self.counts = AgentCounts()
        self.runs: dict[str, RunState] = {}
        self.pending: list[Pending] = []
        self.events = 0  # calls queued and runs ended, for the pass loop to wait on
        self.cond = threading.Condition()

    def notify(self) -> None:
        with self.cond:
            self.events += 1
            self.cond.notify_all()

    def known(self, sample_key: str) -> bool:
        return sample_key in self.runs

    async def chat(self, call: ChatCall) -> Completion:
        state = self._state(call.sample_key)
        assert state.lock is not None
        async with state.lock:  # one call of a run at a time: its tokens are one sequence
            cap = self._cap(state, call.max_tokens)
            opening = state.tokens.open_chat(
                call.messages, call.tools, self.chat_tokens.render, self.chat_tokens.reply_ids
            )
            tokens, logprobs, version = await self._serve(state, opening, cap)
            content, calls = self.parse(self._text(tokens))
            answer: Message = {"role": "assistant", "content": content or ""}
            if calls:
                answer["tool_calls"] = [
                    {"type": "function", "function": {"name": c["function"]["name"],
                                                      "arguments": c["function"]["arguments"]}}
                    for c in calls
                ]  # fmt: skip
                state.called_tools = True
            self._record(
                state, opening, tokens, logprobs, version, call.messages, answer, call.tools
            )
            return self._completion(opening, tokens, logprobs)

    async def complete(self, call: TextCall) -> Completion:
        state = self._state(call.sample_key)
        assert state.lock is not None
        async with state.lock:
            cap = self._cap(state, call.max_tokens)
            so_far = (
                str(self.tokenizer.decode(state.tokens.tokens)) if state.tokens.segments else ""
            )
            rest = call.prompt[len(so_far) :] if so_far and call.prompt.startswith(so_far) else None
            ids = self.chat_tokens.encode(call.prompt if rest is None else rest)
            opening = state.tokens.open_text(ids, so_far, call.prompt)
            tokens, logprobs, version = await self._serve(state, opening, cap)
            self._record(state, opening, tokens, logprobs, version, None, None, None)
            return self._completion(opening, tokens, logprobs)

    def _state(self, key: str) -> RunState:
        state = self.runs.get(key)
        if state is None:
            raise CallRefused(404, f"no agent run of this run has the sample key {key!r}")
        if state.limit:
            raise CallRefused(429, f"this agent run was ended by {state.limit}", "agent_limit")
        return state

    def _cap(self, state: RunState, asked: int | None) -> int:
        """The call's token cap, or the run ended by a limit (`CallRefused`, 429)."""
        limits = self.limits
        if state.tokens.num_calls >= limits.max_calls:
            self._end_by_limit(state, f"agent.max_calls={limits.max_calls}")
        left = limits.max_tokens - state.tokens.num_sampled
        if left <= 0:
            self._end_by_limit(state, f"agent.max_tokens={limits.max_tokens}")
        return max(1, min(asked or limits.call_tokens, limits.call_tokens, left))

    def _end_by_limit(self, state: RunState, limit: str) -> None:
        state.limit = limit
        if state.future is not None:  # the run ends here, whatever the agent does with the 429
            state.future.cancel()
        raise CallRefused(429, f"this agent run reached {limit}: it is ended", "agent_limit")

    async def _serve(
        self, state: RunState, opening: Opening, cap: int
    ) -> tuple[list[int], list[float], int]:
        """The call's completion: from the log where it holds this call with this request,
        else from an engine pass (logged before it is answered)."""
        if len(opening.prompt_ids) + cap > self.limits.max_seq_len:
            self._end_by_limit(state, f"the model's context ({self.limits.max_seq_len} tokens)")
        key = call_key(state.ticket.ordinal, state.sample, state.attempt, state.tokens.num_calls)
        digest = request_hash(opening.prompt_ids, cap)
        logged = self.log.completions.get(key) if state.replaying else None
        if logged is not None and logged.get("hash") == digest:
            self.counts.calls_replayed += 1
            return list(logged["tokens"]), list(logged["logprobs"]), int(logged["version"])
        if logged is not None:
            self.counts.calls_diverged += 1
        state.replaying = False  # the log ran out, or the run diverged from it: live from here
        loop = asyncio.get_running_loop()
        call = state.tokens.num_calls
        pending = Pending(
            state, key, call, opening.prompt_ids, cap, digest, loop.create_future(), loop
        )
        with self.cond:
            self.pending.append(pending)
            self.events += 1
            self.cond.notify_all()
        return await pending.future

    def _record(
        self,
        state: RunState,
        opening: Opening,
        tokens: list[int],
        logprobs: list[float],
        version: int,
        messages: list[Message] | None,
        answer: Message | None,
        tools: list[dict[str, Any]] | None,
    ) -> None:
        ended = bool(tokens) and tokens[-1] in self.stop_ids
        if opening.new_segment and state.tokens.segments:
            self.counts.prefix_breaks += 1
        state.tokens.record(opening, tokens, logprobs, version, ended, messages, answer, tools)
        state.last_text = str(answer["content"]) if answer is not None else self._text(tokens)
        self.counts.calls += 1

    def _text(self, tokens: list[int]) -> str:
        body = tokens[:-1] if tokens and tokens[-1] in self.stop_ids else tokens
        return str(self.tokenizer.decode(body, skip_special_tokens=True))

    def _completion(self, opening: Opening, tokens: list[int], logprobs: list[float]) -> Completion:
        ended = bool(tokens) and tokens[-1] in self.stop_ids
        return Completion(
            token_ids=list(tokens),
            logprobs=list(logprobs),
            text=self._text(tokens),
            finish_reason="stop" if ended else "length",
            prompt_token_ids=list(opening.prompt_ids),
        )
