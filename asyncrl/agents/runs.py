"""Agent runs as samples (`agent.name`): the rollout mode that drives each of a group's
samples as one run of the user's agent against the run's OpenAI-compatible endpoint, and the
endpoint's backend, which owns the tokens.

    generate(tickets):
      start G agent runs per ticket (an event loop of their own), each with an
        `openai.AsyncOpenAI` whose base URL names the run's sample key
      until every ticket has landed:
        the calls pending at the endpoint go to the engine together, one pass (in
          deterministic mode one call a pass: a call's tokens then do not depend on its batch)
        each completion is logged and made durable (one fsync a pass) before it is answered
        a ticket whose G runs all ended is scored (the agent's reward, or `data.reward_fn` on
          its last answer) and lands as one group: each sample's segments are its rows
      a failed run (raised, timed out, never called) is tried again with the same seed up to
        `agent.retries` times, then the run stops naming it (`RolloutFatal`)

After a kill, a ticket in flight starts again: its runs get the same seeds, and each call the
agent log holds (`asyncrl.agents.agent_log`) is answered from it when its request's hash
matches, with no engine pass; past the log's end, or from the first call that differs
(counted as diverged), calls go live.
"""

from __future__ import annotations

import asyncio
import secrets
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from asyncrl.agents.agent_log import AgentLog, ordinal_of
from asyncrl.agents.calls import CallRefused
from asyncrl.agents.context import AgentContext, AgentFn
from asyncrl.agents.rows import NoOpening, group_of
from asyncrl.agents.serving import AgentLimits, AgentServer, Pending, RunState
from asyncrl.core.seeds import derived_seed
from asyncrl.core.types import Group, PromptTicket
from asyncrl.faults import fault_point
from asyncrl.rollout.engine import GenerationEngine, GenerationRequest
from asyncrl.rollout.reward_pool import RewardJob, RewardPool
from asyncrl.rollout.rollouts import Chunk, Landing, RolloutFatal
from asyncrl.tasks.examples import Example
from asyncrl.tasks.reward_calls import GroupScores, RewardFailure, collect_scores

GATHER_S = 0.02
GATHER_MAX_S = 0.1
"""Once a call is pending, a pass waits for the other live runs' calls while they keep
arriving (`GATHER_S` after the last one), `GATHER_MAX_S` in all at most."""


def agent_seed(seed: int, ordinal: int, sample: int) -> int:
    """`ctx.seed`: a function of the run's seed, the ordinal and the sample."""
    return derived_seed("asyncrl-agent", seed, ordinal, sample)


def call_noise_seed(seed: int, ordinal: int, sample: int, attempt: int, call: int) -> int:
    """The sampling noise of one call (its own, whatever pass it lands in)."""
    return derived_seed("asyncrl-agent-call", seed, ordinal, sample, attempt, call)


class _Loop:
    """An asyncio event loop on a daemon thread of its own."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)


class AgentRuns:
    """The agent-run `Rollout`: the runs, the passes, the groups."""

    def __init__(
        self,
        agent: AgentFn,
        agent_name: str,
        examples: Sequence[Example],
        tokenizer: PreTrainedTokenizerBase,
        eos_id: int,
        engine: GenerationEngine,
        num_generations: int,
        seed: int,
        limits: AgentLimits,
        log: AgentLog,
        pool: RewardPool | None,
        parser: str = "hermes",
        deterministic: bool = False,
        run_id: str = "",
    ) -> None:
        self.agent = agent
        self.agent_name = agent_name
        self.examples = examples
        self.tokenizer = tokenizer
        self.engine = engine
        self.num_generations = num_generations
        self.seed = seed
        self.limits = limits
        self.log = log
        self.pool = pool
        self.deterministic = deterministic
        self.run_id = run_id
        self.server = AgentServer(tokenizer, eos_id, limits, log, parser)
        """The endpoint's backend: the runs in flight and the calls waiting for a pass."""
        self.counts = self.server.counts
        self.secret = secrets.token_urlsafe(24)
        self._endpoint: Any = None
        self._agents: _Loop | None = None
        self._tls: ssl.SSLContext | None = None  # the runs' clients share it
        self._replaying: set[int] = set()  # ordinals the loaded log holds, not yet landed
        self._on_replayed: Callable[..., None] | None = None

    # -- a resume ---------------------------------------------------------------------------

    def load_log(
        self, offset: int, reopened: Callable[[int], bool], on_replayed: Callable[..., None]
    ) -> dict[str, int]:
        """A resume's part: the agent log from its checkpoint's `offset` for the ordinals it
        opens again (`reopened`); returns what the log says the resume will cost
        (`AgentLog.pending`). `on_replayed(**counts)` is called once every ordinal the log
        held has landed, with what the replay did."""
        self.log.load(offset, reopened)
        self._replaying = {ordinal_of(k) for k in [*self.log.completions, *self.log.tools]}
        self._on_replayed = on_replayed
        if not self._replaying:
            self._on_replayed = None
        return self.log.pending()

    def _replayed(self, ordinal: int) -> None:
        self._replaying.discard(ordinal)
        if self._replaying or self._on_replayed is None:
            return
        c = self.counts
        self._on_replayed(
            agent_calls_replayed=c.calls_replayed,
            agent_calls_diverged=c.calls_diverged,
            tool_calls_replayed=c.tools.replayed,
            tool_calls_repeated=c.tools.repeated,
            tool_calls_diverged=c.tools.diverged,
        )
        self._on_replayed = None

    # -- the rollout ----------------------------------------------------------------------

    def start(self) -> None:
        """Starts the endpoint (loopback, the run's secret) and the agents' event loop."""
        if self._endpoint is not None:
            return
        from asyncrl.agents.endpoint import AgentEndpoint  # FastAPI, uvicorn: agent runs only

        self._endpoint = AgentEndpoint(
            self.server, self.tokenizer, self.secret, self.server.parser_name
        )
        self._endpoint.start()
        self._agents = _Loop("asyncrl-agents")

    def close(self) -> None:
        """Stops the endpoint and the agents' loop (bounded), and closes the log."""
        if self._endpoint is not None:
            self._endpoint.stop()
            self._endpoint = None
        if self._agents is not None:
            aclose = getattr(self.agent, "aclose", None)
            if aclose is not None:  # the agent's own resources (a verifiers env's servers)
                done = asyncio.run_coroutine_threadsafe(aclose(), self._agents.loop)
                try:
                    done.result(30.0)
                except Exception:  # closing goes on; the loop ends anyway
                    done.cancel()
            self._agents.close()
            self._agents = None
        self.log.close()

    def generate(self, tickets: list[PromptTicket], landing: Landing) -> None:
        """Runs the batch's agent runs until every ticket landed or a stop is asked (then
        its runs are cancelled: their tickets stay in flight, and start again)."""
        self.start()
        runs: dict[int, list[RunState]] = {
            t.ordinal: [self._launch(t, i, 0) for i in range(self.num_generations)] for t in tickets
        }
        seen = -1
        try:
            while runs and not landing.stopping:
                live = sum(s.future is not None and not s.future.done() for r in runs.values()
                           for s in r)  # fmt: skip
                seen = self._wait_for_work(seen, live)
                self._pass(landing)
                self._land_finished(runs, landing)
        finally:
            for states in runs.values():
                self._cancel(states)

    def halt(self) -> None:
        """Ends the engine pass in progress where the engine can (a stop was asked): its calls
        fail, their runs are cancelled with the batch, and start again on a resume."""
        stop_generating = getattr(self.engine, "stop_generating", None)
        if callable(stop_generating):
            stop_generating()
        self._notify()

    def _launch(self, ticket: PromptTicket, sample: int, attempt: int) -> RunState:
        assert self._agents is not None and self._endpoint is not None
        key = f"{ticket.ordinal}-{sample}-{attempt}-{secrets.token_hex(6)}"
        state = RunState(ticket, sample, attempt, key)
        state.lock = asyncio.Lock()
        state.ctx = AgentContext(
            seed=agent_seed(self.seed, ticket.ordinal, sample),
            ordinal=ticket.ordinal,
            sample=sample,
            attempt=attempt,
            run_id=self.run_id,
            log=self.log,
            counts=self.counts.tools,
        )
        self.server.runs[key] = state
        example = self.examples[ticket.dataset_index]
        state.future = asyncio.run_coroutine_threadsafe(
            self._drive(state, example), self._agents.loop
        )
        state.future.add_done_callback(lambda _: self._notify())
        self.counts.runs += 1
        return state

    def _notify(self) -> None:
        self.server.notify()

    async def _drive(self, state: RunState, example: Example) -> Any:
        import openai  # the agent's client: agent runs only

        assert self._endpoint is not None and state.ctx is not None
        if self._tls is None:  # made once: each client making its own costs ~20 ms a run
            self._tls = ssl.create_default_context()
        client = openai.AsyncOpenAI(
            base_url=self._endpoint.base_url(state.key),
            api_key=self.secret,
            max_retries=0,
            timeout=self.limits.timeout_s,
            http_client=openai.DefaultAsyncHttpxClient(verify=self._tls),
        )
        try:
            return await asyncio.wait_for(
                self.agent(client, example, state.ctx), self.limits.timeout_s
            )
        finally:
            await client.close()

    def _wait_for_work(self, seen: int, live: int) -> int:
        """Waits (briefly, to hear a stop) until a call is pending or something happened since
        `seen`; once a call is pending, up to `GATHER_S` more for the other `live` runs' calls
        (a pass of them all costs about what one costs). The events counted now."""
        server = self.server
        with server.cond:
            if not server.pending and server.events == seen:
                server.cond.wait(0.1)
            first = last = time.perf_counter()
            arrived = len(server.pending)
            while server.pending and len(server.pending) < live and not self.deterministic:
                if len(server.pending) != arrived:  # calls still arriving: the window goes on
                    arrived, last = len(server.pending), time.perf_counter()
                left = min(first + GATHER_MAX_S, last + GATHER_S) - time.perf_counter()
                if left <= 0:
                    break
                server.cond.wait(left)
            return server.events

    def _pass(self, landing: Landing) -> None:
        """One engine pass over the calls pending now (one call in deterministic mode), each
        logged and made durable before it is answered."""
        with self.server.cond:
            if not self.server.pending:
                return
            if self.deterministic:
                self.server.pending.sort(key=lambda p: p.key)
                batch, self.server.pending = self.server.pending[:1], self.server.pending[1:]
            else:
                batch, self.server.pending = self.server.pending, []
        by_version: dict[int | None, list[Pending]] = {}
        for p in batch:
            by_version.setdefault(landing.version_for(p.state.ticket, None), []).append(p)
        for version, calls in by_version.items():
            self._generate(calls, version, landing)

    def _generate(self, calls: list[Pending], version: int | None, landing: Landing) -> None:
        for p in calls:
            self.log.append({"kind": "begun", "key": p.key, "hash": p.digest})
        self.log.sync()
        requests = [
            GenerationRequest(
                prompt_ids=p.prompt_ids,
                num_samples=1,
                noise_seed=call_noise_seed(
                    self.seed, p.state.ticket.ordinal, p.state.sample, p.state.attempt, p.call
                ),
                limits=(p.max_tokens,),
            )
            for p in calls
        ]  # fmt: skip
        start = time.perf_counter()
        try:
            outputs = self.engine.generate(requests, version)
        except BaseException as err:
            for p in calls:
                p.loop.call_soon_threadsafe(_fail, p.future, err)
            raise
        answers = []
        for p, out in zip(calls, outputs, strict=True):
            mask = out.completion_mask[0]
            tokens = [int(x) for x in out.completion_ids[0][mask]]
            logprobs = [float(x) for x in out.logprobs[0][mask]]
            self.log.append(
                {
                    "kind": "completion",
                    "key": p.key,
                    "hash": p.digest,
                    "tokens": tokens,
                    "logprobs": logprobs,
                    "version": out.weights_version,
                    "diverged": p.key in self.log.completions,
                }
            )
            answers.append((p, (tokens, logprobs, out.weights_version)))
        self.log.sync()  # durable before any agent sees it
        fault_point("agent.call_logged")
        self.counts.calls_generated += len(calls)
        for p, answer in answers:
            p.loop.call_soon_threadsafe(_resolve, p.future, answer)
        by_ticket: dict[int, tuple[PromptTicket, list[int]]] = {}
        for p, (tokens, _, _) in answers:
            ticket = p.state.ticket
            _, counts = by_ticket.setdefault(ticket.ordinal, (ticket, [0] * self.num_generations))
            counts[p.state.sample] += len(tokens)
        tickets = [ticket for ticket, _ in by_ticket.values()]
        landing.land(
            Chunk(
                start=start,
                seconds=time.perf_counter() - start,
                version=outputs[0].weights_version,
                tickets=tickets,
                token_starts=[[0] * self.num_generations for _ in tickets],
                token_counts=[counts for _, counts in by_ticket.values()],
            ),
            {},
            [],
        )

    def _land_finished(self, runs: dict[int, list[RunState]], landing: Landing) -> None:
        """Tries failed runs again (or stops the run), and lands every ticket whose runs all
        ended."""
        for ordinal, states in list(runs.items()):
            for i, state in enumerate(states):
                if state.future is None or not state.future.done() or state.limit:
                    continue
                failure = self._failure(state)
                if failure is None:
                    continue
                self.counts.runs_failed += 1
                self._forget(state)
                if state.attempt >= self.limits.retries:
                    raise RolloutFatal(
                        f"agent {self.agent_name} failed on ordinal {ordinal} sample "
                        f"{state.sample} ({state.attempt + 1} tries, agent.retries="
                        f"{self.limits.retries}): {failure}"
                    )
                states[i] = self._launch(state.ticket, state.sample, state.attempt + 1)
            if all(s.future is not None and s.future.done() for s in states):
                group = self._group(states)
                landing.land(None, {}, [group])
                for s in states:
                    self._forget(s)
                self.log.landed(ordinal)
                self.log.forget(ordinal)
                del runs[ordinal]
                self._replayed(ordinal)

    def _failure(self, state: RunState) -> str | None:
        """Why a finished run failed, or None (it returned, or a limit ended it)."""
        assert state.future is not None
        if state.future.cancelled():
            return None if state.limit else "cancelled"
        err = state.future.exception()
        if state.tokens.num_calls == 0:
            return f"never called the model{f' ({state.limit})' if state.limit else ''}" + (
                f": it raised {err!r}" if err is not None else ""
            )
        if state.limit:
            return None
        if isinstance(err, TimeoutError):
            return f"timed out after agent.timeout_s={self.limits.timeout_s}"
        if err is not None:
            return f"raised {err!r}"
        reward = state.future.result()
        if isinstance(reward, dict):
            bad = {k: v for k, v in reward.items() if not isinstance(v, int | float)}
            return f"returned {reward!r}: {sorted(bad)} not numbers" if bad or not reward else None
        if reward is not None and not isinstance(reward, int | float):
            return f"returned {reward!r}, not a number, a dict of named numbers or None"
        return None

    def _forget(self, state: RunState) -> None:
        self.server.runs.pop(state.key, None)

    def _cancel(self, states: list[RunState]) -> None:
        for s in states:
            if s.future is not None:
                s.future.cancel()
            self._forget(s)
        with self.server.cond:
            dropped = [p for p in self.server.pending if p.state in states]
            self.server.pending = [p for p in self.server.pending if p.state not in states]
        for p in dropped:
            p.loop.call_soon_threadsafe(
                _fail, p.future, CallRefused(503, "the run is stopping", "stopping")
            )

    def _rewards(self, states: list[RunState]) -> GroupScores:
        """Each run's reward (and named parts, where the runs returned dicts): what it
        returned; for a run that returned None or was ended by a limit, `data.reward_fn` on
        its last answer."""
        returned = [
            None if s.limit or s.future is None or s.future.cancelled() else s.future.result()
            for s in states
        ]
        missing = [i for i, r in enumerate(returned) if r is None]
        if missing:
            if self.pool is None:
                raise RolloutFatal(
                    f"agent {self.agent_name} returned no reward and no data.reward_fn is set"
                    + (" (a run ended by a limit: agent.max_calls, agent.max_tokens)"
                       if any(s.limit for s in states) else "")
                )  # fmt: skip
            example = self.examples[states[0].ticket.dataset_index]
            result = self.pool.score(
                [RewardJob([states[i].last_text for i in missing], example.answer)]
            )[0]
            if isinstance(result, RewardFailure):
                raise RolloutFatal(
                    f"data.reward_fn on ordinal {states[0].ticket.ordinal}: {result}"
                )
            for i, r in zip(missing, result.rewards, strict=True):
                returned[i] = r
        try:
            return collect_scores(
                returned, [f"ordinal {s.ticket.ordinal} sample {s.sample}" for s in states]
            )
        except RewardFailure as err:
            raise RolloutFatal(f"agent {self.agent_name}: {err}") from err

    def _group(self, states: list[RunState]) -> Group:
        """The ticket's group (`rows.group_of`), its runs' rewards and counts."""
        scores = self._rewards(states)
        rewards = torch.tensor(scores.rewards, dtype=torch.float32)
        self.counts.runs_ended_by_limit += sum(bool(s.limit) for s in states)
        self.counts.runs_calling_tools += sum(s.called_tools for s in states)
        self.counts.runs_landed += len(states)
        try:
            group = group_of(states[0].ticket, [s.tokens.segments for s in states], rewards)
            group.generation_s = time.perf_counter() - min(s.started for s in states)
            group.reward_components = {
                name: torch.tensor(parts, dtype=torch.float32)
                for name, parts in scores.components.items()
            }
            return group
        except NoOpening as err:
            raise RolloutFatal(f"agent {self.agent_name}: {err}") from err

    def metrics(self) -> dict[str, float]:
        return self.counts.metrics()


def _resolve(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[Any], err: BaseException) -> None:
    if not future.done():
        future.set_exception(err)
