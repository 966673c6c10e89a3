"""What an agent run is given besides its client: `ctx` (its seed, ordinal and sample, and the
tool journal), and how `agent.name` is loaded.

`await ctx.tool("search", fn, *args, **kwargs)` runs a tool through the run's journal: the call
is logged (durably) before it runs and its result after, so a run replayed after a kill gets
the recorded result and the tool does not run again; a tool cut off by the kill mid-call runs
again once (counted). A tool whose signature has an `idempotency_key` parameter is given the
call's key, unique across runs (`RUN_ID/ORDINAL:SAMPLE:TRY:tN`), for outside services that
take one.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.agents.agent_log import AgentLog, tool_key
from asyncrl.config import ConfigError
from asyncrl.faults import fault_point
from asyncrl.tasks.environments import idempotency_key

AgentFn = Callable[[Any, Any, "AgentContext"], Awaitable[Any]]


def load_agent(name: str) -> AgentFn:
    """`agent.name`'s `module:function` (an `async def run(client, example, ctx)`) or
    `module:Class` (a class with `async def run(self, client, example, ctx)`, one instance a
    run); one that does not resolve is a `ConfigError` naming `agent.name`."""
    if name.startswith("verifiers:"):
        raise ConfigError(f"agent.name: {name} is loaded by asyncrl.agents.verifiers_env")
    module, _, attr = name.partition(":")
    try:
        target = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(
            f"agent.name: cannot load {name!r} ({err}); give 'module:function' importable from "
            "here (docs/agents.md)"
        ) from err
    if inspect.isclass(target):
        cls: Any = target
        if not inspect.iscoroutinefunction(getattr(cls, "run", None)):
            raise ConfigError(
                f"agent.name: {name} has no `async def run(self, client, example, ctx)`"
            )

        def run_instance(client: Any, example: Any, ctx: AgentContext) -> Awaitable[Any]:
            result: Awaitable[Any] = cls().run(client, example, ctx)
            return result

        return run_instance
    if not inspect.iscoroutinefunction(target):
        raise ConfigError(f"agent.name: {name} is not an `async def run(client, example, ctx)`")
    fn: AgentFn = target
    return fn


@dataclass
class ToolCounts:
    executed: int = 0
    replayed: int = 0
    diverged: int = 0
    repeated: int = 0
    """Tools run again whose earlier call the log shows begun without a result (a kill
    between the tool acting and its result being logged)."""


@dataclass
class ToolCall:
    """One journaled tool call (`AgentContext.tool_begin`)."""

    key: str
    name: str
    digest: str
    replayed: bool = False
    result: Any = None
    """The recorded result, where `replayed`."""


@dataclass
class AgentContext:
    """One agent run's `ctx`."""

    seed: int
    """A function of the run's seed, the ordinal and the sample (the same on every try and
    after a kill): seed your agent's own randomness with it."""
    ordinal: int
    sample: int
    attempt: int
    """The try (0, then 1.. for `agent.retries`)."""
    run_id: str
    log: AgentLog
    counts: ToolCounts
    replaying: bool = True
    _calls: int = field(default=0, repr=False)

    async def tool(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs `fn(*args, **kwargs)` (awaited if it is a coroutine) through the journal: the
        recorded result where the log holds this call (same name and arguments), else the
        tool runs, its call and result logged. The result must be JSON (it is logged)."""
        call = self.tool_begin(name, [args, kwargs])
        if call.replayed:
            return call.result
        if "idempotency_key" in inspect.signature(fn).parameters:
            kwargs = {**kwargs, "idempotency_key": idempotency_key(self.run_id, call.key)}
        result = fn(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        try:
            json.dumps(result)
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"ctx.tool({name!r}): its result must be JSON (it is logged, and replayed "
                f"after a kill): {err}"
            ) from err
        self.tool_done(call, result)
        return result

    def tool_begin(self, name: str, arguments: list[Any]) -> ToolCall:
        """The journal's first half, for tools that run elsewhere (a verifiers toolset's
        server): the call's key and, where the log holds this call with the same name and
        `arguments` (a list: `ctx.tool`'s is `[args, kwargs]`), its recorded result
        (`replayed`). Otherwise the call is logged as begun (durably) and the caller runs the
        tool, then hands its result to `tool_done`."""
        key = tool_key(self.ordinal, self.sample, self.attempt, self._calls)
        self._calls += 1
        digest = hashlib.sha256(
            json.dumps([name, *arguments], sort_keys=True, default=repr).encode()
        ).hexdigest()[:32]
        logged = self.log.tools.get(key) if self.replaying else None
        if logged is not None and logged.get("hash") == digest:
            self.counts.replayed += 1
            return ToolCall(key, name, digest, replayed=True, result=logged["result"])
        if logged is not None:
            self.counts.diverged += 1
            self.replaying = False
        if key in self.log.tools_begun:
            self.counts.repeated += 1
        self.log.append({"kind": "tool_begun", "key": key, "name": name, "hash": digest})
        self.log.sync()
        return ToolCall(key, name, digest)

    def tool_done(self, call: ToolCall, result: Any) -> None:
        """The journal's second half: the tool `tool_begin` let run has run; its `result`
        (JSON) is logged, durably, before the run goes on."""
        self.counts.executed += 1
        fault_point("agent.tool_ran")
        self.log.append(
            {"kind": "tool", "key": call.key, "name": call.name, "hash": call.digest,
             "result": result}
        )  # fmt: skip
        self.log.sync()
        fault_point("agent.tool_logged")

    def journaled(self, name: str, fn: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
        """`fn` as a coroutine function that runs through `tool` (for frameworks that take a
        function: `function_tool(ctx.journaled("add", add))`)."""

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await self.tool(name, fn, *args, **kwargs)

        call.__name__ = getattr(fn, "__name__", name)
        call.__doc__ = fn.__doc__
        call.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
        return call
