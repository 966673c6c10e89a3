"""verifiers environments as agent runs (`agent.name=verifiers:MODULE`, docs/verifiers.md).

An installed verifiers (0.4.0, `verifiers.v1`) environment module is loaded as its own
tooling loads it (`load_environment`: its taskset, its `Env`, its agent seats, its toolsets),
with `agent.args` as the taskset's settings. Its tasks are the run's rows: each becomes an
`Example` (the prompt's text, and the task's hash as the answer, so the dataset's identity on
resume covers every field of every task), and the prompt stream orders them as it orders any
data. Each sample is one episode, `Env.run_episode`, run by verifiers' own machinery: the
harness program (`null`: verifiers' chat loop with the taskset's MCP tools) in the
subprocess runtime, verifiers' interception server between it and the run's OpenAI-compatible
endpoint, the sample's client as the model (the run named in `model`, one endpoint config
for all). The rubric is the reward: the trace's weighted sum of its `@vf.reward` functions,
every function logged as `reward/NAME`. An episode that fails (a rubric that raises, a
harness that crashes, a stage cut by verifiers' clock) is a failed run, tried again
(`agent.retries`), never a 0.

Tools go through the run's journal (`AgentContext.tool_begin` / `tool_done`): every task is
given a `@vf.intercept` hook (the task's own class, subclassed) that verifiers calls before
the harness executes a tool call (its tool gate) and again when the call's result reaches the
next model request. The first logs the call as begun, or, where the log holds it, answers it
with the recorded result (the gate denies the harness its own execution, and the model sees
the recorded result); the second logs the result. After a kill, tools the log holds are not
run again; the tools of a turn cut off between acting and their results reaching the next
request run once more (counted).

What would need a hosted sandbox or a remote service is refused at load, with its reason: a
seat pinned to a runtime other than `subprocess` or to another model, a harness that needs a
container, executes the model's commands (`bash`, third-party agents) or has no tool gate, a
task with a container image, a toolset served elsewhere (`url`) or on another runtime, and
LLM judges; and what would break the guarantees: several seats, a seat's own timeouts or
retries, an Env's timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy as pycopy
import functools
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from asyncrl.agents.calls import SAMPLE_MODEL
from asyncrl.agents.context import AgentContext, ToolCall
from asyncrl.config import ConfigError
from asyncrl.tasks.examples import Example

PREFIX = "verifiers:"
SECRET_VAR = "ASYNCRL_VERIFIERS_API_KEY"
"""The environment variable verifiers' client reads the endpoint's key from (its
`api_key_var`); the harness itself is given the interception server's own key. Its name has
`API_KEY` in it: verifiers' subprocess runtime keeps such variables from the processes it
starts (the harness programs, the tool servers)."""
LOCAL_HARNESSES = ("null",)
"""Harnesses that run on the host without a sandbox: tool calls only through the taskset's
MCP toolsets, no shell."""


def is_verifiers(name: str) -> bool:
    return name.startswith(PREFIX)


class VerifiersFailure(RuntimeError):
    """An episode verifiers ended with errors (its rubric raised, its harness crashed)."""


def _refuse(module: str, why: str) -> ConfigError:
    return ConfigError(
        f"agent.name=verifiers:{module}: refused: {why}; asyncrl runs environments on this "
        "host only (the subprocess runtime, the null harness): docs/verifiers.md#limits"
    )


@dataclass
class VerifiersEnv:
    """A loaded environment: the module, verifiers' `Env`, its tasks in taskset order."""

    module: str
    env: Any
    tasks: list[Any]

    def examples(self) -> list[Example]:
        return [
            Example(task.data.prompt_text, task.hash, f"verifiers:{self.module}[{i}]")
            for i, task in enumerate(self.tasks)
        ]

    def task_of(self, example: Example) -> Any:
        found = re.fullmatch(r"verifiers:.*\[(\d+)\]", example.origin)
        if found is None:
            raise ValueError(f"{example.origin!r} is not a row of verifiers:{self.module}")
        return self.tasks[int(found.group(1))]


_LOADED: dict[str, VerifiersEnv] = {}


def verifiers_env(
    name: str, args: dict[str, Any], max_calls: int, max_tokens: int | None = None
) -> VerifiersEnv:
    """`load_env`, once a process for the same settings (the trainer's task and its agent
    runs share it)."""
    key = json.dumps([name, args, max_calls, max_tokens], sort_keys=True, default=repr)
    if key not in _LOADED:
        _LOADED[key] = load_env(name, args, max_calls, max_tokens)
    return _LOADED[key]


def load_env(
    name: str, args: dict[str, Any], max_calls: int, max_tokens: int | None = None
) -> VerifiersEnv:
    """`agent.name=verifiers:MODULE` with `agent.args`: the environment, its seats on this
    host, its tasks; a `ConfigError` naming what is missing or refused. Each seat is held to
    `max_calls` model turns (`agent.max_calls`) and `max_tokens` completion tokens
    (`agent.max_tokens`), unless it holds itself to fewer: verifiers then stops the episode
    and scores it (the endpoint holds the call that reaches the tokens' cap to what is left,
    and verifiers checks its caps before each turn), where the run's own limit would refuse a
    call and leave the episode unscored."""
    module = name.removeprefix(PREFIX)
    try:
        from pydantic import ValidationError
        from verifiers.v1.configs.agent import agent_config_fields
        from verifiers.v1.utils import loaders
    except ImportError as err:
        raise ConfigError(
            f"agent.name={name}: verifiers is not installed here ({err}); `make setup` installs "
            "it (requirements-verifiers.txt)"
        ) from err
    try:
        loaders.import_taskset(module)
    except ModuleNotFoundError as err:
        importable = module.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
        cause = err.__cause__ if isinstance(err.__cause__, ModuleNotFoundError) else err
        missing = cause.name  # verifiers re-raises its own; the import that failed is the cause
        if missing and missing != importable and not importable.startswith(f"{missing}."):
            raise ConfigError(
                f"agent.name={name}: the environment imports {missing!r}, which is not "
                f"installed in this Python ({cause.msg})"
            ) from None
        raise ConfigError(
            f"agent.name={name}: no verifiers environment module {module!r} is installed in "
            f"this Python ({err.msg}). Install it here first: `.venv/bin/pip install -e "
            f"PATH/TO/{module}` for your own, `prime env install OWNER/{module}` for one from "
            "the Environments Hub (docs/verifiers.md)"
        ) from None
    try:
        config = loaders.resolve_env_config({"taskset": {"id": module, **args}})
    except (ValidationError, ValueError, TypeError) as err:
        raise ConfigError(f"agent.args: verifiers:{module} does not take them: {err}") from None
    specs = agent_config_fields(config)
    if len(specs) != 1:
        raise _refuse(module, f"its Env has {len(specs)} agent seats ({', '.join(specs)}); "
                              "asyncrl trains one seat an episode (one sample)")  # fmt: skip
    seats = {}
    for seat, spec in specs.items():
        seats[seat] = _local_seat(module, seat, spec, loaders)
        seats[seat]["max_turns"] = min(spec.max_turns or max_calls, max_calls)
        if max_tokens is not None:
            own = spec.max_output_tokens or max_tokens
            seats[seat]["max_output_tokens"] = min(own, max_tokens)
    if config.timeout.episode is not None or config.timeout.finalize is not None:
        raise _refuse(module, "its Env sets timeouts (env.timeout): an episode cut by the clock "
                              "would be scored; agent.timeout_s bounds a run")  # fmt: skip
    data = {**config.model_dump(exclude={"taskset"}), "taskset": config.taskset, **seats}
    data["max_concurrent_agents"] = 1
    try:
        env = loaders.load_environment(loaders.resolve_env_config(data))
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"agent.name={name}: verifiers could not build it: {err!r}") from err
    _uv_on_path()
    taskset = env.taskset
    if not taskset.bounded:
        raise ConfigError(
            f"agent.name={name}: its taskset is infinite; bound it with its own size setting in "
            "agent.args (the prompt stream needs the dataset's length)"
        )
    tasks = list(taskset)
    if not tasks:
        raise ConfigError(f"agent.name={name}: its taskset has no tasks (agent.args={args})")
    _check_tasks(module, taskset, tasks)
    return VerifiersEnv(module, env, tasks)


def _uv_on_path() -> None:
    """The null harness's program is a uv script (verifiers runs `uv sync --script` once, into
    uv's cache): where this Python's environment has uv (`make setup` installs it), its bin
    directory goes first on PATH, so verifiers finds it rather than installing uv into
    ~/.local with pip or curl."""
    bin_dir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if os.path.exists(os.path.join(bin_dir, "uv")) and bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join(filter(None, [bin_dir, path]))


def _local_seat(module: str, seat: str, spec: Any, loaders: Any) -> dict[str, Any]:
    """One agent seat's settings on this host: the subprocess runtime, and the seat's harness
    (the null harness where it names none); refused where it needs a sandbox."""
    runtime = spec.runtime
    if "runtime" in spec.model_fields_set and getattr(runtime, "type", "") != "subprocess":
        raise _refuse(module, f"seat {seat!r} runs on the {runtime.type!r} runtime (a sandbox)")
    harness = spec.harness
    harness_id = harness.id if harness is not None else loaders.default_harness_id(module)
    if harness is None and harness_id == "bash":  # the taskset has no harness of its own
        harness_id = "null"
    cls = loaders.harness_class(harness_id)
    if harness_id not in LOCAL_HARNESSES and (cls.NEEDS_CONTAINER or cls.EXECUTES_CODE):
        what = "needs a container" if cls.NEEDS_CONTAINER else "runs the model's commands"
        raise _refuse(module, f"seat {seat!r}'s harness {harness_id!r} {what}")
    if not cls.SUPPORTS_TOOL_INTERCEPTION:
        raise _refuse(module, f"seat {seat!r}'s harness {harness_id!r} has no tool gate (tools "
                              "could not be answered from the log after a kill)")  # fmt: skip
    if spec.model is not None or spec.client is not None:
        other = spec.model or spec.client
        raise _refuse(module, f"seat {seat!r} is pinned to another model or endpoint ({other}): "
                              "a remote model is not the policy")  # fmt: skip
    pinned = {f for f in ("timeout", "retries") if f in spec.model_fields_set}
    if pinned:
        raise _refuse(module, f"seat {seat!r} sets {', '.join(sorted(pinned))}: verifiers "
                              "scores a run its clock cut, and a retried run's tokens would "
                              "join the sample (agent.timeout_s, agent.retries)")  # fmt: skip
    dumped = spec.model_dump(exclude={"runtime", "harness"}, exclude_unset=True)
    harness_data = harness.model_dump() if harness is not None else {"id": harness_id}
    return {**dumped, "harness": harness_data, "runtime": {"type": "subprocess"}}


def _check_tasks(module: str, taskset: Any, tasks: Sequence[Any]) -> None:
    from verifiers.v1.configs.judge import JudgeConfig

    for task in tasks:
        if task.data.image:
            raise _refuse(module, f"task {task.data.idx} runs in the container image "
                                  f"{task.data.image!r}")  # fmt: skip
        if getattr(type(task), "NEEDS_CONTAINER", False):
            raise _refuse(module, f"its {type(task).__name__} needs a container")
    first = tasks[0]
    servers = [*taskset.toolsets(taskset.config), *type(first).toolsets(first.config)]
    for server in servers:
        cfg = server.config
        if getattr(cfg, "url", None):
            raise _refuse(module, f"toolset {server.server_name!r} is a remote service "
                                  f"({cfg.url})")  # fmt: skip
        kind = getattr(getattr(cfg, "runtime", None), "type", "subprocess")
        if kind != "subprocess":
            raise _refuse(module, f"toolset {server.server_name!r} runs on the {kind!r} runtime")
    judges = [n for n, v in first.config if isinstance(v, JudgeConfig)]
    if judges or first.plugged_judges():
        raise _refuse(module, f"its rubric asks an LLM judge {judges or ''} (a remote model)")


UNREAD = "(not read: the episode ended before its next model call)"
"""The result logged for a tool the harness ran after the episode's last allowed turn (its
result never reaches a request): a replay answers the call with it, and the model never sees
it (verifiers refuses the request after that turn again)."""


class ToolJournal:
    """One run's tool calls through the run's journal, as verifiers' request hook sees them:
    first at the tool gate (an empty result for the call, before the harness runs it), then
    with the result in the next model request. Calls are told apart by their trace and id."""

    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx
        self.begun: dict[tuple[str, str], ToolCall] = {}
        self.settled: set[tuple[str, str]] = set()

    def intercept(self, request: Any, trace_id: str) -> Any:
        from verifiers.v1.types import AssistantMessage, ToolMessage

        messages = list(request.messages)
        arguments = {
            call.id: call.arguments
            for m in messages
            if isinstance(m, AssistantMessage)
            for call in m.tool_calls or []
        }
        rewritten = False
        for position, message in enumerate(messages):
            if not isinstance(message, ToolMessage):
                continue
            key = (trace_id, message.tool_call_id)
            if key in self.settled:
                continue
            if key in self.begun:  # the result the harness got, in the next request
                self.settled.add(key)
                self.ctx.tool_done(self.begun.pop(key), _jsonable(message.content))
                continue
            self.settled.add(key)
            if message.content not in ("", []):  # another hook's verdict: the harness won't run it
                continue
            call = self.ctx.tool_begin(message.name or "", [arguments.get(message.tool_call_id)])
            if call.replayed:  # answered from the log: the gate denies the harness its own run
                messages[position] = _verdict(message, call.result)
                rewritten = True
            else:
                self.settled.discard(key)
                self.begun[key] = call
        return request.model_copy(update={"messages": messages}) if rewritten else None

    def settle_unread(self) -> None:
        """Logs the tools the harness ran after the episode's last allowed turn (`UNREAD`)."""
        for call in self.begun.values():
            self.ctx.tool_done(call, UNREAD)
        self.settled.update(self.begun)
        self.begun.clear()


def _jsonable(content: Any) -> Any:
    if isinstance(content, str):
        return content
    return [part.model_dump(mode="json") if hasattr(part, "model_dump") else part
            for part in content]  # fmt: skip


def _verdict(probe: Any, result: Any) -> Any:
    """The gate's probe answered with a recorded `result`. A result equal to the probe's own
    empty content would read as no decision (the harness would run the tool): it is given as
    one empty text part, which renders the same."""
    content = result if result not in ("", []) else [{"type": "text", "text": ""}]
    return type(probe).model_validate({**probe.model_dump(), "content": content})


@functools.cache
def _journaled_class(base: type) -> type:
    """`base` (a verifiers `Task` class) with the tool journal's request hook."""
    import verifiers.v1 as vf
    from verifiers.v1.trace import Trace
    from verifiers.v1.types import Request

    def asyncrl_tool_journal(self: Any, request: Request, trace: Trace) -> Request | None:
        journal: ToolJournal | None = getattr(self, "_asyncrl_journal", None)
        return None if journal is None else journal.intercept(request, str(trace.id))

    asyncrl_tool_journal.__annotations__ = {
        "request": Request,
        "trace": Trace,
        "return": Request | None,
    }
    hook = vf.intercept(asyncrl_tool_journal, priority=-(10**6))  # after the task's own
    return type(base.__name__, (base,), {"asyncrl_tool_journal": hook,
                                         "__module__": base.__module__})  # fmt: skip


def journaled(task: Any, journal: ToolJournal) -> Any:
    """A copy of `task` (its instance state kept) whose tool calls go through `journal`."""
    copy = pycopy.copy(task)
    cls: Any = type(task)
    copy.__class__ = _journaled_class(cls)
    copy._asyncrl_journal = journal
    return copy


def episode_scores(episode: Any) -> dict[str, float]:
    """The reward of one episode: its traces' weighted rubric sums, averaged (`reward`), and
    each reward function's score, averaged over the traces that have it (`NAME`)."""
    traces = list(episode.traces)
    scores: dict[str, list[float]] = {}
    for trace in traces:
        for name, reward in trace.rewards.items():
            if reward is not None:
                scores.setdefault(name, []).append(float(reward.score))
    out = {name: sum(v) / len(v) for name, v in sorted(scores.items())}
    out["reward"] = sum(float(t.reward) for t in traces) / len(traces)
    return out


def _errors(episode: Any) -> str:
    errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    said = [getattr(e, "message", None) or str(e) for e in errors]
    return "; ".join(dict.fromkeys(said)) or "the episode did not complete"


@dataclass
class VerifiersAgent:
    """The agent function of `agent.name=verifiers:MODULE`: one episode a run. The
    environment's serving resources (its shared tool servers, the interception server) are
    brought up once, on the agents' event loop, and torn down by `aclose`."""

    venv: VerifiersEnv
    _ready: asyncio.Event | None = field(default=None, repr=False)
    _closing: asyncio.Event | None = field(default=None, repr=False)
    _holder: asyncio.Task[None] | None = field(default=None, repr=False)

    async def _serving(self) -> None:
        if self._holder is None:
            self._ready, self._closing = asyncio.Event(), asyncio.Event()
            self._holder = asyncio.get_running_loop().create_task(self._hold())
        ready = asyncio.ensure_future(self._ready.wait())  # type: ignore[union-attr]
        await asyncio.wait([ready, self._holder], return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            self._holder.result()  # raises what serving raised
            raise RuntimeError(f"verifiers:{self.venv.module}: its servers stopped")

    async def _hold(self) -> None:
        assert self._ready is not None and self._closing is not None
        async with self.venv.env.serving():
            self._ready.set()
            await self._closing.wait()

    async def __call__(self, client: Any, example: Example, ctx: AgentContext) -> dict[str, float]:
        from verifiers.v1.clients import ModelContext
        from verifiers.v1.configs.client import EvalClientConfig

        await self._serving()
        os.environ[SECRET_VAR] = str(client.api_key)
        # one endpoint config for every run, the run named by `model`: verifiers' interception
        # server keeps a client per distinct config for as long as it serves
        found = re.fullmatch(r"(.*)/s/([^/]+)/v1/?", str(client.base_url))
        if found is None:
            raise ValueError(f"{client.base_url} is not an agent run's base URL")
        model = ModelContext(
            model=f"{SAMPLE_MODEL}{unquote(found.group(2))}",
            client=EvalClientConfig(base_url=f"{found.group(1)}/v1", api_key_var=SECRET_VAR),
        )
        journal = ToolJournal(ctx)
        task = journaled(self.venv.task_of(example), journal)
        episode = await self.venv.env.run_episode(task, model)
        if not episode.ok or not episode.traces:
            raise VerifiersFailure(f"verifiers:{self.venv.module}: {_errors(episode)}")
        if episode.is_timeout or any(t.is_timeout for t in episode.traces):
            # verifiers scores a run its clock cut: here it is a failed run, never a reward
            raise VerifiersFailure(f"verifiers:{self.venv.module}: a stage timed out (the "
                                   f"task's own timeout): {_errors(episode)}")  # fmt: skip
        journal.settle_unread()
        return episode_scores(episode)

    async def aclose(self) -> None:
        if self._holder is None or self._closing is None:
            return
        self._closing.set()
        with contextlib.suppress(Exception):  # the servers' own teardown errors end here
            await asyncio.wait_for(self._holder, 20.0)
