"""The config sections of what a run trains on and is evaluated on: `data.*` and `eval.*`
(part of the schema in `asyncrl.config`; the same rules: one docstring per field, the field's
metadata says what a resume may change)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from asyncrl.config.base import MAY_CHANGE, ConfigError, require

BUILTIN_REWARDS = {
    "partial_match": "asyncrl.tasks.rewards:partial_match",
    "exact_match": "asyncrl.tasks.rewards:exact_match",
    "math": "asyncrl.tasks.rewards:math_reward",
}
"""`data.reward_fn` short names -> the function they stand for."""


@dataclass
class DataConfig:
    task: Literal["sort_digits", "guess_number", "jsonl", "hf"] = "sort_digits"
    """Prompt source: the built-in `sort_digits` task, `guess_number` (the ranges of the
    multi-turn game `env.name=guess_number`, `num_examples` of them), `jsonl` lines of
    `{"prompt", "answer"}` read from `path`, or `hf`: any dataset Hugging Face `datasets` loads
    from `path` (a local JSONL/JSON/CSV/Parquet file, a directory saved with `save_to_disk`, or a
    hub name where the network allows), its rows read with `prompt_key`/`messages_key` and
    `answer_key`."""
    path: str = ""
    """For `task=jsonl`: a file with one `{"prompt": ..., "answer": ...}` object per line. For
    `task=hf`: the dataset (file, saved directory or hub name)."""
    split: str = "train"
    """For `task=hf`: the split to train on (a single file is split `train`)."""
    revision: str = ""
    """For `task=hf` with a hub dataset: the revision (branch, tag or commit) to load; empty:
    the default branch, which can move. Pin it so a resume finds the rows it was cut on (a
    resume on other rows is refused anyway, naming both row counts and digests)."""
    prompt_key: str = "prompt"
    """For `task=hf`: the column holding the prompt, a string or a list of chat messages
    (`[{"role": ..., "content": ...}]`, as TRL's conversational datasets have it)."""
    messages_key: str = ""
    """For `task=hf`: if set, the column holding each row's chat messages, used instead of
    `prompt_key`. Chat prompts go through the tokenizer's chat template with
    `add_generation_prompt=True`; they must not end with an assistant message."""
    answer_key: str = "answer"
    """For `task=hf`: the column holding the reference answer the reward compares with."""
    system_prompt: str = ""
    """For `task=hf`: a system message put first in every chat prompt that has none."""
    apply_chat_template: bool = False
    """For `task=hf`: also send string prompts through the chat template, as one user message
    (what an instruct model expects). Chat-message prompts always go through it."""
    reward_fn: str = ""
    """The reward: `partial_match`, `exact_match`, `math` (`math-verify`: the completion's
    `\\boxed{}` or last number checked for equivalence with the answer), or `module:function`
    called as `f(completion, answer)` (or on lists, if the function has `batched = True`),
    returning a float or a dict of named floats (each logged as `reward/NAME`; the reward is
    its `reward` entry, else their sum). Empty: `partial_match`."""
    format_reward: float = 0.0
    """For `reward_fn=math`: the weight of a format bonus, 1 when the completion has exactly one
    `\\boxed{}` and something in it (components `reward/correct` and `reward/format` are
    logged)."""
    fewshot: int = 0
    """For `task=hf` with chat prompts: put this many solved rows of the training split in front
    of each prompt (training and evaluation alike), as user and assistant turns after the
    system message; drawn per row, the same on every launch and seed, never the row's own
    question, and part of the dataset's identity (docs/datasets.md). 0: the prompts as they are."""
    fewshot_key: str = ""
    """With `fewshot`: the column holding a demonstration's answer (a worked solution). Empty:
    `The answer is \\boxed{ANSWER}.` with `reward_fn=math`, else the answer itself."""
    num_digits: int = 5
    """For `sort_digits`: digits per prompt."""
    num_examples: int = 4096
    """For `sort_digits` and `guess_number`: rows in the generated dataset (one epoch)."""

    @property
    def reward_target(self) -> str:
        """`module:function` of the reward (a short name resolved)."""
        name = self.reward_fn or "partial_match"
        return BUILTIN_REWARDS.get(name, name)

    def validate(self) -> None:
        require(self.num_digits >= 1, "data.num_digits", self.num_digits, ">= 1")
        require(self.num_examples >= 1, "data.num_examples", self.num_examples, ">= 1")
        if self.task in ("jsonl", "hf") and not self.path:
            raise ConfigError(
                f"data.path: required when data.task={self.task} "
                + ("(a .jsonl file)" if self.task == "jsonl" else "(a file, directory or name)")
            )
        if ":" not in self.reward_target:
            raise ConfigError(
                f"data.reward_fn: {self.reward_fn!r} must be one of "
                f"{', '.join(BUILTIN_REWARDS)} or look like 'module:function'"
            )
        require(self.format_reward >= 0, "data.format_reward", self.format_reward, ">= 0")
        require(self.fewshot >= 0, "data.fewshot", self.fewshot, ">= 0")
        require(
            not self.fewshot or self.task == "hf",
            "data.fewshot",
            self.fewshot,
            f"0 with data.task={self.task} (demonstrations come from a task=hf training split)",
        )
        require(
            not self.fewshot_key or self.fewshot > 0,
            "data.fewshot_key",
            self.fewshot_key,
            "empty unless data.fewshot > 0",
        )
        if self.format_reward and self.reward_target != BUILTIN_REWARDS["math"]:
            raise ConfigError(
                f"data.format_reward: {self.format_reward} is an option of reward_fn=math; "
                f"data.reward_fn is {self.reward_fn or 'partial_match'!r}"
            )


@dataclass
class EnvConfig:
    """`env.*`: multi-turn episodes (docs/environments.md). With `name` set, each of a group's
    samples is an episode: the environment opens it from the example (`reset`), and after each
    assistant turn answers (`step`) until it says done or `max_turns` turns were taken; the
    sample trained is the whole episode's tokens, the environment's masked out of the loss."""

    name: str = ""
    """The environment: a built-in's name (`guess_number`, `calculator`) or `module:Class` for
    your own
    (docs/environments.md: the protocol). Empty: single-turn completions scored by
    `data.reward_fn`."""
    max_turns: int = 4
    """Assistant turns per episode at most; an episode still running after them ends with the
    rewards it got."""
    max_episode_tokens: int = 256
    """Tokens after the prompt per episode at most (assistant and environment tokens; each
    assistant turn also at most `rollout.max_new_tokens`). An episode that reaches it ends."""

    def validate(self) -> None:
        require(self.max_turns >= 1, "env.max_turns", self.max_turns, ">= 1")
        require(
            self.max_episode_tokens >= 1, "env.max_episode_tokens", self.max_episode_tokens, ">= 1"
        )
        if self.name and not (self.name in BUILTIN_ENVIRONMENTS or ":" in self.name):
            raise ConfigError(
                f"env.name: {self.name!r} must be one of {', '.join(BUILTIN_ENVIRONMENTS)} or "
                "look like 'module:Class'"
            )


@dataclass
class AgentConfig:
    """`agent.*`: agent runs that speak the OpenAI API (docs/agents.md). With `name` set, each
    of a group's samples is one run of your agent against the run's own OpenAI-compatible
    endpoint; the sample trained is every completion it got, exactly as generated, and the
    messages between them masked out of the loss."""

    name: str = ""
    """`module:function` naming `async def run(client, example, ctx)` (or `module:Class` with
    an `async run` method): `client` an `openai.AsyncOpenAI` for this one run, `ctx` its seed
    and tool journal; the return value is the reward (a dict of named floats: each logged as
    `reward/NAME`, the reward its `reward` entry or their sum; None: `data.reward_fn` scores
    the last answer). `verifiers:MODULE`: an installed verifiers environment, its tasks the
    data, its rubric the reward (docs/verifiers.md). Empty: no agents."""
    args: dict[str, Any] = field(default_factory=dict)
    """With `agent.name=verifiers:MODULE`: the environment's taskset settings (its
    `TasksetConfig` fields, `--env.taskset.*` in verifiers' own CLI), e.g. `{num_tasks: 200}`
    or `agent.args.split=test` on the command line."""
    max_calls: int = 8
    """Model calls per run at most; the call past it ends the run (a limit, not a failure)."""
    max_tokens: int = 512
    """Completion tokens per run at most (all its calls); each call is also held to
    `rollout.max_new_tokens`. A run that has used them is ended by the limit."""
    timeout_s: float = field(default=300.0, metadata=MAY_CHANGE)
    """Seconds a run may take; one past it is a failed run (tried again, `retries`)."""
    retries: int = field(default=1, metadata=MAY_CHANGE)
    """Times a failed run (it raised, timed out or never called the model) is tried again with
    the same seed before the run stops naming it. A failure is never trained as a reward."""
    tool_parser: str = "hermes"
    """How tool calls are read from a completion: `hermes` (`<tool_call>{json}</tool_call>`,
    Qwen/Hermes-style templates) or `none`."""

    def validate(self) -> None:
        require(self.max_calls >= 1, "agent.max_calls", self.max_calls, ">= 1")
        require(self.max_tokens >= 1, "agent.max_tokens", self.max_tokens, ">= 1")
        require(self.timeout_s > 0, "agent.timeout_s", self.timeout_s, "> 0")
        require(self.retries >= 0, "agent.retries", self.retries, ">= 0")
        require(
            self.tool_parser in ("hermes", "none"),
            "agent.tool_parser",
            self.tool_parser,
            "one of hermes, none",
        )
        require(
            not self.args or self.name.startswith("verifiers:"),
            "agent.args",
            self.args,
            "empty unless agent.name=verifiers:MODULE",
        )
        if self.name and ":" not in self.name:
            raise ConfigError(
                f"agent.name: {self.name!r} must look like 'module:function' (or 'module:Class')"
            )


BUILTIN_ENVIRONMENTS = {
    "guess_number": "asyncrl.tasks.games:GuessNumber",
    "calculator": "asyncrl.tasks.tools:Calculator",
}
"""`env.name` short names -> the class they stand for."""


@dataclass
class EvalConfig:
    """`eval.*`: evaluation of the current weights every `every_steps` steps, on prompts the
    training never sees. It uses its own engine copy, its own noise seeds and no training
    ordinal, so switching it on changes no bit of training (docs/evaluation.md)."""

    every_steps: int = field(default=0, metadata=MAY_CHANGE)
    """Evaluate the weights after every `every_steps` steps (and after the last step); 0: no
    evaluation during training (`asyncrl eval` still evaluates a checkpoint)."""
    at_start: bool = field(default=True, metadata=MAY_CHANGE)
    """With `every_steps` > 0: evaluate the initial weights too, before the first step of a
    run that starts at step 0 — the run's own before figure (an `eval` event with `version` 0
    and `step` -1, which the summary and `eval.png` show). Generation starts meanwhile."""
    path: str = field(default="", metadata=MAY_CHANGE)
    """The evaluation prompts, read like `data.path` with `data.task`'s keys. Empty: `data.path`
    with split `eval.split`; for `sort_digits`, a held-out generated set."""
    split: str = field(default="test", metadata=MAY_CHANGE)
    """The split of `eval.path` (or of `data.path` when `eval.path` is empty) to evaluate on."""
    max_examples: int = field(default=0, metadata=MAY_CHANGE)
    """Evaluate on the first this many rows; 0: all of them."""
    num_samples: int = field(default=4, metadata=MAY_CHANGE)
    """k: samples per prompt at `eval.temperature`, for `eval/pass@k` and `eval/reward_mean`;
    0 with `greedy`: the greedy decode alone (half the cost of k=1; `eval/reward/NAME` are then
    the greedy completions')."""
    temperature: float = field(default=1.0, metadata=MAY_CHANGE)
    """Sampling temperature of the k samples."""
    greedy: bool = field(default=True, metadata=MAY_CHANGE)
    """Also decode each prompt greedily (`eval/greedy_reward`, `eval/greedy_pass`)."""
    pass_threshold: float = field(default=1.0, metadata=MAY_CHANGE)
    """A sample passes when its `correct` reward component (the `math` reward has one), or else
    its reward, is at least this (1.0: a fully correct answer for the built-in rewards)."""
    batch_prompts: int = field(default=32, metadata=MAY_CHANGE)
    """Prompts generated together in one engine call."""

    def validate(self) -> None:
        for key in ("every_steps", "max_examples"):
            require(getattr(self, key) >= 0, f"eval.{key}", getattr(self, key), ">= 0")
        require(self.batch_prompts >= 1, "eval.batch_prompts", self.batch_prompts, ">= 1")
        require(
            self.num_samples >= 1 or (self.num_samples == 0 and self.greedy),
            "eval.num_samples",
            self.num_samples,
            ">= 1 (0 only with eval.greedy=true: the greedy decode alone)",
        )
        require(self.temperature > 0, "eval.temperature", self.temperature, "> 0")
