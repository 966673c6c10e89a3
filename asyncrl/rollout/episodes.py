"""The shell that plays multi-turn episodes (`env.name`) for the collector: one environment
per sample, each assistant turn handed to it, its reply appended to the sample as tokens the
policy did not sample.

Token in, token out: the sample's tokens are what the engine sampled and what the replies
encoded to, never re-tokenized; a reply is encoded as the chat template continues the history
after the assistant's end-of-turn token (or, for a tokenizer without a template, as its
messages' text). The episode's state (`asyncrl.core.episodes.Episode`) lives in the sample's
`Partial`, so the checkpoint cut holds it; live environments are a cache of it, rebuilt on a
resume as the environment's `restore` kind says.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from asyncrl.checkpoint.restore import SKIP_RESTORE
from asyncrl.checkpoint.snapshot import flatten_part
from asyncrl.checkpoint.torn import end_torn_line
from asyncrl.core.episodes import Episode, Message, step_id
from asyncrl.core.partial import Partial
from asyncrl.core.seeds import derived_seed
from asyncrl.core.types import PromptTicket
from asyncrl.faults import fault_point
from asyncrl.rollout.scorer import Scored
from asyncrl.tasks.environments import Environment, Turn
from asyncrl.tasks.examples import Example


def env_seed(seed: int, ordinal: int, sample: int) -> int:
    """The seed `reset` gets for one episode: a function of (run seed, ordinal, sample)."""
    return derived_seed("asyncrl-env", seed, ordinal, sample)


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
    ) -> None:
        self.env_class = env_class
        self.workdir = workdir
        self.steps_log = steps_log
        """`RUN_DIR/env_steps.jsonl`: every environment step this run asked for, with the
        launch's attempt (what `audit` checks I9 from)."""
        self.attempt = 0  # the trainer sets its own
        self.env_name = env_name
        self.examples = examples
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.seed = seed
        self.max_turns = max_turns
        self.max_new_tokens = max_new_tokens
        self.max_episode_tokens = max_episode_tokens
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        if self.chat:  # the token the template ends an assistant turn with, if special
            self.eos_id = turn_end_id(tokenizer, eos_id)
        self._envs: dict[tuple[int, int], Any] = {}
        self._prompts: dict[int, list[int]] = {}
        self._steps_opened = False

    # --- the collector's calls

    def prompt(self, ticket: PromptTicket) -> list[int]:
        """The group's prompt: its opening messages rendered (every sample opens alike)."""
        if ticket.ordinal not in self._prompts:
            raise KeyError(f"ordinal {ticket.ordinal}: no episode was started or resumed")
        return self._prompts[ticket.ordinal]

    def start(self, ticket: PromptTicket, num_samples: int) -> Partial:
        """New episodes for a group: an environment per sample, reset."""
        episodes = [Episode(tuple(self._reset(ticket, i))) for i in range(num_samples)]
        self._set_prompt(ticket, [list(e.opening) for e in episodes])
        limit = min(self.max_new_tokens, self.max_episode_tokens)
        return Partial.episodes_started(episodes, limit)

    def resume(self, ticket: PromptTicket, partial: Partial) -> Partial:
        """A saved partial's episodes with live environments again (after a resume, or a
        failed batch): `restorable` ones loaded from the saved state, `replay` ones handed
        their recorded turns, `restart` ones started over (counted)."""
        if partial.episodes is None:
            raise EpisodeError(
                f"ordinal {ticket.ordinal}: its saved samples have no episodes (a checkpoint of "
                f"a run without env.name); resume it with env.name unset"
            )
        kind = self.env_class.restore
        episodes = partial.episodes
        for i, episode in enumerate(episodes):
            env, _ = self._new_env(ticket, i)  # live ones may be past the saved state
            if episode.ended or not (episode.turns or partial.lengths[i]):
                continue
            if "env_state" in SKIP_RESTORE:  # a test switch: the trainer reports it
                continue
            where = f"ordinal {ticket.ordinal} sample {i} after step {_last_step(episode)}"
            if kind == "restorable" and episode.turns:
                self._call(env.load_state_dict, "load_state_dict", where, episode.env_state)
            elif kind == "replay" and episode.turns:
                turns = [Turn(t["text"], t["step_id"], t["messages"], t["reward"], t["done"])
                         for t in episode.turns]  # fmt: skip
                self._call(env.replay, "replay", where, turns)
            elif kind == "restart":  # counted in the resume plan
                fresh = Episode(episode.opening, restarts=episode.restarts + 1)
                limit = fresh.limit(self.max_new_tokens, self.max_episode_tokens)
                partial = partial.truncated(i, 0, limit, fresh)
        self._set_prompt(ticket, [list(e.opening) for e in episodes])
        return partial

    def advance(self, ticket: PromptTicket, partial: Partial) -> Partial:
        """Every sample whose assistant turn just ended gets its environment's step: the
        reply appended and the next turn opened, or its episode ended. An ended episode (the
        environment's done or a limit) is finished and never stepped again, however many
        passes its siblings still take."""
        assert partial.episodes is not None
        for i, episode in enumerate(partial.episodes):
            if not bool(partial.finished[i]) or episode.ended:
                continue
            partial = self._step(ticket, partial, i, episode)
        return partial

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
        self._prompts.pop(ordinal, None)

    # --- one step

    def _step(self, ticket: PromptTicket, partial: Partial, i: int, episode: Episode) -> Partial:
        length = partial.lengths[i]
        ids = [int(x) for x in partial.tokens[i, episode.turn_start : length]]
        ended_with_eos = bool(ids) and ids[-1] == self.eos_id
        text = str(self.tokenizer.decode(ids, skip_special_tokens=True))
        sid = step_id(ticket.ordinal, i, episode.num_turns)
        env = self._envs[(ticket.ordinal, i)]
        try:
            messages, reward, done = env.step(text, sid)
            self._log_step(sid)
            fault_point("episode.env_step")
        except Exception as err:
            raise EpisodeError(f"env.name={self.env_name}: step {sid} raised {err!r}") from err
        _check_messages(messages, f"env.name={self.env_name}: step {sid}")
        state = self._state(env, sid) if self.env_class.restore == "restorable" else None
        episode = episode.after_step(
            text, sid, episode.turn_start, length, messages, reward, bool(done), state
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

    def _state(self, env: Any, sid: str) -> Any:
        """A `restorable` environment's state after step `sid`: copied now (the environment
        may change its own objects at later steps, and the checkpoint holds the state of this
        one) and checked now that a checkpoint can hold it (JSON values and tensors), so a
        failure names this step, not a checkpoint steps later."""
        state = self._call(env.state_dict, "state_dict", f"step {sid}")
        try:
            json.dumps(flatten_part("env_state", state, {}))
            return copy.deepcopy(state)
        except (TypeError, ValueError, RecursionError) as err:
            raise EpisodeError(
                f"env.name={self.env_name}: state_dict() after step {sid} returned what a "
                f"checkpoint cannot hold ({err}); return JSON values (dict, list, str, number, "
                "bool, None) and torch tensors"
            ) from err

    def _log_step(self, sid: str) -> None:
        """Appends the step to the steps log (flushed: a SIGKILL loses at most a torn line,
        which the first append of the next launch cuts off, as `JsonlLog` does the records')."""
        if self.steps_log is None:
            return
        if not self._steps_opened:
            self.steps_log.parent.mkdir(parents=True, exist_ok=True)
            end_torn_line(self.steps_log)
            self._steps_opened = True
        with open(self.steps_log, "a") as f:
            f.write(json.dumps({"step_id": sid, "attempt": self.attempt}) + "\n")

    # --- environments and rendering

    def _new_env(self, ticket: PromptTicket, sample: int) -> tuple[Any, list[Message]]:
        """A fresh environment for one sample's episode, reset, and its opening messages."""
        example = self.examples[ticket.dataset_index]
        where = f"ordinal {ticket.ordinal} ({example.origin}) sample {sample}"
        env = self._call(self.env_class, "the constructor", where)
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
        if self.chat:
            encoded: Any = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
            ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
            return [int(x) for x in ids]
        return self._encode("".join(m["content"] for m in messages))

    def _reply_ids(self, episode: Episode, messages: list[Message], ended: bool) -> list[int]:
        """The tokens of the environment's reply as the history continues it: the chat
        template's text after the assistant's end-of-turn token, up to the next assistant
        turn's opening (an end-of-turn token first, where the turn was cut off)."""
        eos = [] if ended else [self.eos_id]
        if not self.chat:
            return eos + self._encode("".join(m["content"] for m in messages))
        history = episode.history()  # the reply's messages are its last ones
        before = self._template(history[: len(history) - len(messages)], generation=False)
        after = self._template(history, generation=True)
        if not after.startswith(before):
            raise EpisodeError(
                f"env.name={self.env_name}: the chat template does not extend the history "
                "turn by turn (its rendering of a longer conversation does not start with the "
                "shorter one's), so replies cannot be appended as tokens"
            )
        eos_text = str(self.tokenizer.decode([self.eos_id]))
        tail = before[before.rindex(eos_text) + len(eos_text) :] if eos_text in before else ""
        return eos + self._encode(tail + after[len(before) :])

    def _encode(self, text: str) -> list[int]:
        return [int(x) for x in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def _template(self, messages: list[Message], generation: bool) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation, tokenize=False
            )
        )


def turn_end_id(tokenizer: PreTrainedTokenizerBase, eos_id: int) -> int:
    """The token a chat template closes an assistant message with (`<|im_end|>` in ChatML),
    where it is a special or added token of its own; else `eos_id`. Generation stops an
    episode's turn there, so the tokens are the template's (an instruct model's eos is usually
    this token; a base tokenizer's `<|endoftext|>` is not)."""
    marker = "ASYNCRL-TURN-END-MARKER"
    text = str(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}],
            tokenize=False,
        )
    )
    suffix = text[text.index(marker) + len(marker) :] if marker in text else ""
    ids = tokenizer(suffix, add_special_tokens=False)["input_ids"] if suffix else []
    added = set(getattr(tokenizer, "added_tokens_decoder", {})) | set(tokenizer.all_special_ids)
    if ids and int(ids[0]) in added:  # a token of its own, not text
        return int(ids[0])
    return eos_id


def _last_step(episode: Episode) -> str:
    return str(episode.turns[-1]["step_id"]) if episode.turns else "none"


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
