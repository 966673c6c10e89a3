"""The shell that plays multi-turn episodes (`env.name`) for the collector: one environment
per sample, each assistant turn handed to it, its reply appended to the sample as tokens the
policy did not sample.

Token in, token out: the sample's tokens are what the engine sampled and what the replies
encoded to, never re-tokenized (`asyncrl.rollout.chat_tokens`). The episode's state
(`asyncrl.core.episodes.Episode`) lives in the sample's `Partial`, so the checkpoint cut holds
it; live environments are a cache of it, rebuilt on a resume as the environment's `restore`
kind says.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import PreTrainedTokenizerBase

from asyncrl.checkpoint.restore import SKIP_RESTORE
from asyncrl.core.episodes import Episode, Message, parse_step_id, step_id, text_sha256
from asyncrl.core.partial import Partial
from asyncrl.core.resume import ResumePolicy, SavedSample, starts_over
from asyncrl.core.seeds import derived_seed
from asyncrl.core.types import PromptTicket
from asyncrl.faults import fault_point
from asyncrl.rollout.chat_tokens import ChatTokens
from asyncrl.rollout.env_state import decode_state, encode_state
from asyncrl.rollout.scorer import Scored
from asyncrl.rollout.steps_log import StepsLog
from asyncrl.tasks.environments import Environment
from asyncrl.tasks.examples import Example


def env_seed(seed: int, ordinal: int, sample: int) -> int:
    """The seed `reset` gets for one episode: a function of (run seed, ordinal, sample)."""
    return derived_seed("asyncrl-env", seed, ordinal, sample)


class _Due(NamedTuple):
    """A sample's ended turn in a pass, before its step is applied (`EpisodeRunner.advance`)."""

    sample: int
    episode: Episode
    text: str
    step_id: str
    env: Any
    """Its live environment, to ask (None where the log answers it)."""
    logged: tuple[list[Message], float | None, bool, Any] | None


class EpisodeError(RuntimeError):
    """An environment broke the protocol or raised; names the environment and the step."""


class EpisodeRunner:
    def __init__(
        self,
        env_class: type[Environment],
        env_name: str,
        examples: Sequence[Example],
        tokenizer: PreTrainedTokenizerBase,
        eos_id: int,
        seed: int,
        max_turns: int,
        max_new_tokens: int,
        max_episode_tokens: int,
        workdir: Path | None = None,
        steps_log: Path | None = None,
        restart_on_resume: bool = False,
        deterministic: bool = False,
        run_id: str = "",
    ) -> None:
        self.env_class = env_class
        self.run_id = run_id
        """The run's id, handed to environments that take it (`set_run_id`): with a step id,
        a key unique across runs (`asyncrl.tasks.environments.idempotency_key`)."""
        self.recover_tokens = not deterministic
        """Turns past a checkpoint come back from the steps log as tokens (`recover`); in
        deterministic mode they are generated again, bitwise the same (the engine's batches
        are then the ones of the run without the kill), and their steps are answered from the
        log (`_step`), their texts checked against it."""
        self.restart_on_resume = restart_on_resume
        self.starts_over = env_class.restore == "restart" or restart_on_resume
        """A reopened episode with steps is started over, under new step ids (a `restart`
        environment, or `checkpoint.resume_policy=restart_episode`); nothing is recovered.
        Which samples start over is `asyncrl.core.resume.starts_over`'s rule, the plan's."""
        self.workdir = workdir
        self.env_name = env_name
        self.examples = examples
        self.tokenizer = tokenizer
        self.seed = seed
        self.max_turns = max_turns
        self.max_new_tokens = max_new_tokens
        self.max_episode_tokens = max_episode_tokens
        self.chat_tokens = ChatTokens(tokenizer, eos_id)
        self.chat = self.chat_tokens.chat
        self.eos_id = self.chat_tokens.eos_id  # a chat template's end of turn, if special
        self._envs: dict[tuple[int, int], Any] = {}
        self._prompts: dict[int, list[int]] = {}
        self.log = StepsLog(steps_log)  # the write-ahead log of the steps
        self._stale: set[tuple[int, int]] = set()  # environments behind their episode

    # --- the collector's calls

    def prompt(self, ticket: PromptTicket) -> list[int]:
        """The group's prompt: its opening messages rendered (every sample opens alike)."""
        if ticket.ordinal not in self._prompts:
            raise KeyError(f"ordinal {ticket.ordinal}: no episode was started or resumed")
        return self._prompts[ticket.ordinal]

    def start(self, ticket: PromptTicket, num_samples: int) -> Partial:
        """New episodes for a group: an environment per sample, reset. Their steps have the
        ids the steps log knows them by (restart 0), so each step the log answered is answered
        from it again (`_logged_answer`), in every mode; only an episode that starts over
        (`starts_over`) takes a restart count past the log's, so its steps have new ids."""
        return self._started(ticket, num_samples, logged=not self.starts_over)

    def _started(self, ticket: PromptTicket, num_samples: int, logged: bool) -> Partial:
        """New episodes; `logged`: under the step ids of the log's (restart 0); else under a
        restart count past every one the log asked steps under."""
        episodes = [
            Episode(tuple(self._reset(ticket, i)),
                    restarts=0 if logged else self.log.restarts(ticket.ordinal, i, 0))
            for i in range(num_samples)
        ]  # fmt: skip
        self._set_prompt(ticket, [list(e.opening) for e in episodes])
        limit = min(self.max_new_tokens, self.max_episode_tokens)
        return Partial.episodes_started(episodes, limit)

    def open(self, ticket: PromptTicket, saved: Partial | None, num_samples: int) -> Partial:
        """A group's episodes as the collector dispatches it: its saved samples (None: none),
        with the turns the steps log holds past them recovered (a failed batch's, or a
        resume's), and live environments; new episodes where nothing was saved or logged."""
        if saved is not None and saved.episodes is None:
            raise EpisodeError(
                f"ordinal {ticket.ordinal}: its saved samples have no episodes (a checkpoint of "
                f"a run without env.name); resume it with env.name unset"
            )
        recovered, _ = self.recover(ticket, saved, num_samples)
        if recovered is None:
            return self.start(ticket, num_samples)
        return self.resume(ticket, recovered)

    def resume(self, ticket: PromptTicket, partial: Partial) -> Partial:
        """A saved partial's episodes with live environments again (after a resume, or a
        failed batch): `restorable` ones loaded from the saved state, `replay` ones handed
        their recorded turns, `restart` ones started over (counted); then a turn recovered
        without its step's result (`recover`) gets its step, asked again with the same id and
        text (an environment's step must be idempotent per id: docs/environments.md)."""
        if partial.episodes is None:
            raise EpisodeError(
                f"ordinal {ticket.ordinal}: its saved samples have no episodes (a checkpoint of "
                f"a run without env.name); resume it with env.name unset"
            )
        episodes = partial.episodes
        policy: ResumePolicy = "restart_episode" if self.restart_on_resume else "lossless"
        for i, episode in enumerate(episodes):
            env, _ = self._new_env(ticket, i)  # live ones may be past the saved state
            self._stale.discard((ticket.ordinal, i))
            if not (episode.turns or partial.lengths[i]) or "env_state" in SKIP_RESTORE:
                continue  # nothing to get back (or a test switch: the trainer reports it)
            sample = SavedSample(partial.lengths[i], episode.num_turns, episode.ended)
            if starts_over(sample, policy, self.env_class.restore == "restart"):
                restarts = self.log.restarts(ticket.ordinal, i, episode.restarts + 1)
                fresh = Episode(episode.opening, restarts=restarts)  # new ids, past the log's
                limit = fresh.limit(self.max_new_tokens, self.max_episode_tokens)
                partial = partial.truncated(i, 0, limit, fresh)  # counted in the resume plan
            elif episode.ended:
                continue
            elif self.starts_over:  # a first turn continued: its step under an id not asked
                restarts = self.log.restarts(ticket.ordinal, i, episode.restarts)
                again = replace(episode, restarts=restarts)
                partial = partial.with_episode(i, again, bool(partial.finished[i]))
            else:
                self._restore(env, ticket, i, episode)
        self._set_prompt(ticket, [list(e.opening) for e in episodes])
        return self.advance(ticket, partial)

    def advance(self, ticket: PromptTicket, partial: Partial) -> Partial:
        """`advance_all` for one group."""
        return self.advance_all([(ticket, partial)])[0]

    def advance_all(self, groups: list[tuple[PromptTicket, Partial]]) -> list[Partial]:
        """Every sample of these groups (an engine pass's) whose assistant turn just ended gets
        its environment's step: the reply appended and the next turn opened, or its episode
        ended. An ended episode (the environment's done or a limit) is finished and never
        stepped again, however many passes its siblings still take.

        A group commit: every step's request is written to the steps log and made durable by
        one fsync before any environment is asked (a step answered from the log is asked
        nothing). The results follow, flushed; the next pass's fsync makes them durable (a
        result lost to a host crash only means its step is asked again, with its id and text,
        as the one in flight at a kill is)."""
        due = []
        for ticket, partial in groups:
            assert partial.episodes is not None
            due.append([
                self._due(ticket, partial, i, episode)
                for i, episode in enumerate(partial.episodes)
                if bool(partial.finished[i]) and not episode.ended
            ])  # fmt: skip
        self.log.sync()  # the requests are durable before any environment acts
        out = []
        for (ticket, partial), steps in zip(groups, due, strict=True):
            for step in steps:
                partial = self._step(ticket, partial, step)
            out.append(partial)
        return out

    def scores(self, partial: Partial) -> Scored:
        """A finished group's rewards: each episode's."""
        assert partial.episodes is not None
        rewards = torch.tensor([e.reward for e in partial.episodes], dtype=torch.float32)
        turns = torch.tensor([float(e.num_turns) for e in partial.episodes])
        return Scored(rewards, {"turns": turns})

    def forget(self, ordinal: int) -> None:
        """The group landed: its environments are no longer needed."""
        for key in [k for k in self._envs if k[0] == ordinal]:
            del self._envs[key]
            self._stale.discard(key)
        self._prompts.pop(ordinal, None)
        self.log.restored.discard(ordinal)  # its steps are in the ledger's buffer now

    # --- one step

    def _due(self, ticket: PromptTicket, partial: Partial, i: int, episode: Episode) -> _Due:
        """Sample `i`'s ended turn: answered from the steps log where it holds the step's
        result, else its request written ahead to the log (not yet durable: `advance` syncs
        a pass's requests at once) and its environment brought up to date."""
        length = partial.lengths[i]
        ids = [int(x) for x in partial.tokens[i, episode.turn_start : length]]
        text = str(self.tokenizer.decode(ids, skip_special_tokens=True))
        sid = step_id(ticket.ordinal, i, episode.num_turns, episode.restarts)
        logged = self._logged_answer(ticket, i, sid, text)
        if logged is not None:
            return _Due(i, episode, text, sid, None, logged)
        env = self._live_env(ticket, i, episode)
        span = slice(episode.turn_start, length)
        self.log.append({
            "kind": "request",
            "step_id": sid,
            "attempt": self.log.attempt,
            "text_sha256": text_sha256(text),
            "start": episode.turn_start,
            "tokens": ids,
            "logprobs": [float(x) for x in partial.logprobs[i, span]],
            "versions": [int(x) for x in partial.versions[i, span]],
        })  # fmt: skip
        return _Due(i, episode, text, sid, env, None)

    def _step(self, ticket: PromptTicket, partial: Partial, due: _Due) -> Partial:
        """A due turn's step applied: its logged answer, or the environment asked (its
        request already durable) and its result written after."""
        i, episode, text, sid = due.sample, due.episode, due.text, due.step_id
        if due.logged is not None:
            return self._answered(partial, i, episode, text, sid, *due.logged)
        try:
            messages, reward, done = due.env.step(text, sid)
        except Exception as err:
            raise EpisodeError(f"env.name={self.env_name}: step {sid} raised {err!r}") from err
        fault_point("episode.env_answered")  # asked, its result not yet logged
        _check_messages(messages, f"env.name={self.env_name}: step {sid}")
        state: Any = None
        record: dict[str, Any] = {}
        if self.env_class.restore == "restorable":
            state, record = self._state(due.env, sid)
        result: dict[str, Any] = {
            "kind": "result",
            "step_id": sid,
            "attempt": self.log.attempt,
            "messages": [dict(m) for m in messages],
            "reward": None if reward is None else float(reward),
            "done": bool(done),
            **record,
        }
        self.log.append(result)
        fault_point("episode.env_step")
        return self._answered(partial, i, episode, text, sid, messages, reward, bool(done), state)

    def _logged_answer(
        self, ticket: PromptTicket, i: int, sid: str, text: str
    ) -> tuple[list[Message], float | None, bool, Any] | None:
        """The step's answer from the steps log, where a launch before this one asked it with
        this text and logged the result (a `restorable` environment's state with it): the
        environment is not asked again. The same id with other text is an `EpisodeError`:
        one id, one request."""
        request = self.log.requests.get(sid)
        if request is None:
            return None
        if request.get("text_sha256") != text_sha256(text):
            raise EpisodeError(
                f"env.name={self.env_name}: step {sid} was asked before with another text "
                f"(hash {request.get('text_sha256')}, now {text_sha256(text)}); a step id names "
                "one request (a deterministic run that did not generate the same text: resumed "
                "on another machine type, software or thread count? docs/determinism.md: "
                "resume it where it ran)"
            )
        answer = self._logged_result(sid)
        if answer is None:
            return None  # asked again: an environment's step is idempotent per id
        self._stale.add((ticket.ordinal, i))  # its environment did not see this step
        return answer

    def _logged_result(self, sid: str) -> tuple[list[Message], float | None, bool, Any] | None:
        """The one rule for a step the steps log asked, in every mode and for every kind of
        environment: where its result was logged, the step is answered from the log and never
        asked again; where it was not (the kill came inside the step), None: it is asked again
        with the same id and text. A `restorable` environment's state comes back with the
        result, tensors included (`decode_state`); a result logged by a version that kept
        only JSON states, without its state, cannot be answered (None)."""
        result = self.log.results.get(sid)
        if result is None:
            return None
        state = None
        if self.env_class.restore == "restorable":
            if "state" not in result:
                return None
            state = decode_state(result)
        return result["messages"], result["reward"], bool(result["done"]), state

    def _live_env(self, ticket: PromptTicket, i: int, episode: Episode) -> Any:
        """Sample `i`'s environment, brought up to its episode's last turn where steps were
        answered from the log (restored or replayed, as on a resume)."""
        if (ticket.ordinal, i) in self._stale:
            self._stale.discard((ticket.ordinal, i))
            env, _ = self._new_env(ticket, i)
            if "env_state" not in SKIP_RESTORE:  # a test switch: the trainer reports it
                self._restore(env, ticket, i, episode)
        return self._envs[(ticket.ordinal, i)]

    def _restore(self, env: Any, ticket: PromptTicket, i: int, episode: Episode) -> None:
        """A fresh environment (reset) brought to the end of `episode`'s turns: its state
        loaded (`restorable`) or its turns replayed (`replay`)."""
        if not episode.turns:
            return
        where = f"ordinal {ticket.ordinal} sample {i} after step {_last_step(episode)}"
        if self.env_class.restore == "restorable":
            state = copy.deepcopy(episode.env_state)  # the episode's is the checkpoint's
            self._call(env.load_state_dict, "load_state_dict", where, state)
        elif self.env_class.restore == "replay":
            self._call(env.replay, "replay", where, list(episode.turns))

    def _answered(
        self,
        partial: Partial,
        i: int,
        episode: Episode,
        text: str,
        sid: str,
        messages: list[Message],
        reward: float | None,
        done: bool,
        state: Any,
    ) -> Partial:
        """Sample `i` with its ended turn answered: the environment's reply appended and the
        next turn opened, or the episode ended (done, `env.max_turns`, or no room left)."""
        length = partial.lengths[i]
        ended_with_eos = length > episode.turn_start and int(partial.tokens[i, length - 1]) == (
            self.eos_id
        )
        episode = episode.after_step(
            text, sid, episode.turn_start, length, messages, reward, done, state
        )
        reply: list[int] = []
        if not episode.done and episode.num_turns < self.max_turns:
            reply = self._reply_ids(episode, messages, ended_with_eos)
        room = self.max_episode_tokens - length - len(reply)
        if episode.done or episode.num_turns >= self.max_turns or room < 1:
            return partial.with_episode(i, replace(episode, ended=True), finished=True)
        opened = Episode(
            episode.opening, length + len(reply), episode.turns, False, state, episode.restarts
        )
        limit = opened.limit(self.max_new_tokens, self.max_episode_tokens)
        return partial.with_reply(i, reply, limit, opened)

    def _call(self, method: Any, name: str, where: str, *args: Any) -> Any:
        """An environment's method, its failure an `EpisodeError` naming `env.name`, the
        method and where."""
        try:
            return method(*args)
        except Exception as err:
            raise EpisodeError(
                f"env.name={self.env_name}: {name}() for {where} raised {err!r}"
            ) from err

    def _state(self, env: Any, sid: str) -> tuple[Any, dict[str, Any]]:
        """A `restorable` environment's state after step `sid`, copied now (the environment
        may change its own objects at later steps, and the checkpoint holds the state of this
        one), and its result record's fields (`encode_state`); checked now that a checkpoint
        can hold it (JSON values and tensors), so a failure names this step, not a checkpoint
        steps later."""
        state = self._call(env.state_dict, "state_dict", f"step {sid}")
        try:
            return encode_state(state)
        except (TypeError, ValueError, RecursionError) as err:
            raise EpisodeError(
                f"env.name={self.env_name}: state_dict() after step {sid} returned what a "
                f"checkpoint cannot hold ({err}); return JSON values (dict, list, str, number, "
                "bool, None) and torch tensors"
            ) from err

    def logged_steps(self) -> set[str]:
        """The steps the loaded log asked (of the ordinals a run opens again), each a turn
        that comes back from the log rather than being asked again, unless its episode starts
        over (none then)."""
        return set() if self.starts_over else set(self.log.requests)

    def recover(
        self, ticket: PromptTicket, partial: Partial | None, num_samples: int
    ) -> tuple[Partial | None, int]:
        """The ticket's samples with the turns the steps log holds past `partial` (its saved
        samples; None: none were saved) put back exactly as they were sampled, and how many.
        A turn whose step's result was logged is answered from the log (the environment is
        not asked); one whose result was not is left ended and unanswered, and `resume` asks
        its step again, with the same id and the same text. Turns the log does not hold are
        generated again (their steps were never asked)."""
        if (
            self.starts_over
            or not self.recover_tokens
            or not any(parse_step_id(k)[0] == ticket.ordinal for k in self.log.requests)
        ):
            return partial, 0  # episodes that start over do so under new step ids
        if partial is None:
            partial = self._started(ticket, num_samples, logged=True)
        assert partial.episodes is not None
        count = 0
        for i in range(partial.num_samples):
            while not partial.episodes[i].ended:
                episode = partial.episodes[i]
                sid = step_id(ticket.ordinal, i, episode.num_turns, episode.restarts)
                request = self.log.requests.get(sid)
                if request is None or int(request["start"]) != episode.turn_start:
                    break
                have = [int(x) for x in partial.tokens[i, episode.turn_start : partial.lengths[i]]]
                ids = [int(x) for x in request["tokens"]]
                if ids[: len(have)] != have:
                    raise EpisodeError(
                        f"env.name={self.env_name}: the steps log's request for step {sid} "
                        f"does not continue the checkpoint's tokens of that turn"
                    )
                partial = partial.with_turn(
                    i, episode.turn_start, ids, request["logprobs"], request["versions"]
                )
                count += 1
                answer = self._logged_result(sid)
                if answer is None:
                    break  # asked again by `resume`
                text = str(self.tokenizer.decode(ids, skip_special_tokens=True))
                partial = self._answered(partial, i, episode, text, sid, *answer)
        return partial, count

    # --- environments and rendering

    def _new_env(self, ticket: PromptTicket, sample: int) -> tuple[Any, list[Message]]:
        """A fresh environment for one sample's episode, reset, and its opening messages."""
        example = self.examples[ticket.dataset_index]
        where = f"ordinal {ticket.ordinal} ({example.origin}) sample {sample}"
        env = self._call(self.env_class, "the constructor", where)
        if self.run_id and callable(getattr(env, "set_run_id", None)):
            self._call(env.set_run_id, "set_run_id", where, self.run_id)
        if self.workdir is not None and callable(getattr(env, "set_workdir", None)):
            self._call(env.set_workdir, "set_workdir", where, self.workdir)
        try:
            opening = env.reset(example, env_seed(self.seed, ticket.ordinal, sample))
        except Exception as err:
            raise EpisodeError(
                f"env.name={self.env_name}: reset of ordinal {ticket.ordinal} ({example.origin}) "
                f"raised {err!r}"
            ) from err
        _check_messages(opening, f"env.name={self.env_name}: reset of ordinal {ticket.ordinal}")
        self._envs[(ticket.ordinal, sample)] = env
        return env, [dict(m) for m in opening]

    def _reset(self, ticket: PromptTicket, sample: int) -> list[Message]:
        return self._new_env(ticket, sample)[1]

    def _set_prompt(self, ticket: PromptTicket, openings: list[list[Message]]) -> None:
        if any(o != openings[0] for o in openings):
            example = self.examples[ticket.dataset_index]
            raise EpisodeError(
                f"env.name={self.env_name}: the samples of ordinal {ticket.ordinal} "
                f"({example.origin}) opened with different messages; reset must open every "
                "episode of an example alike (its seed is for hidden state)"
            )
        self._prompts[ticket.ordinal] = self._render(openings[0])

    def _render(self, messages: list[Message]) -> list[int]:
        return self.chat_tokens.render(messages)

    def _reply_ids(self, episode: Episode, messages: list[Message], ended: bool) -> list[int]:
        """The tokens of the environment's reply as the history continues it
        (`ChatTokens.reply_ids`)."""
        try:
            return self.chat_tokens.reply_ids(episode.history(), len(messages), ended)
        except ValueError as err:
            raise EpisodeError(f"env.name={self.env_name}: {err}") from err


def _last_step(episode: Episode) -> str:
    return episode.turns[-1].step_id if episode.turns else "none"


def _check_messages(messages: Any, where: str) -> None:
    ok = isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    )
    if not ok:
        raise EpisodeError(
            f"{where}: messages must be a list of {{'role': str, 'content': str}} dicts, got "
            f"{messages!r:.200}"
        )
