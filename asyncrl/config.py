"""Typed configuration: dataclasses loaded from YAML, with dotted overrides.

Each field's docstring (the string literal under it) is its only documentation; the README's
config reference is generated from them (`asyncrl config-reference`). Loading validates every
key and value: an unknown key names the nearest known keys, a bad value names the key and
what is allowed.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import hashlib
import inspect
import itertools
import json
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config file, key or value the user must fix. The message says where and how."""


@dataclass
class RunConfig:
    seed: int = 0
    """Seeds model init, the per-epoch prompt permutations and each group's sampling noise."""
    max_num_steps: int = 200
    """Optimizer steps to train; the run ends (exit 0) when step `max_num_steps - 1` is done."""
    deterministic: bool = False
    """Bit-for-bit reproducible runs, resumed or not (DESIGN.md I5): target t is generated with
    exactly weights version max(0, t-A), in fixed batches; see docs/determinism.md."""
    torch_threads: int = 1
    """torch intra-op threads per process. 1 lets generation and training each own a core on a
    2-core machine; 0 keeps torch's default."""

    def validate(self) -> None:
        _require(self.max_num_steps >= 1, "run.max_num_steps", self.max_num_steps, ">= 1")
        _require(self.torch_threads >= 0, "run.torch_threads", self.torch_threads, ">= 0")


@dataclass
class ModelConfig:
    preset: Literal["tiny"] = "tiny"
    """Built-in architecture used when `path` is empty: `tiny` is a Llama-style causal LM built
    from a config in code, with a character tokenizer over the task's alphabet."""
    path: str = ""
    """A local Hugging Face model directory (`save_pretrained` format, with its tokenizer).
    Empty means: build `preset` from scratch."""
    hidden_size: int = 128
    """Width of the `tiny` preset."""
    num_layers: int = 2
    """Transformer blocks of the `tiny` preset."""
    num_heads: int = 4
    """Attention heads of the `tiny` preset."""
    max_seq_len: int = 64
    """Longest prompt + completion the `tiny` preset accepts, in tokens."""

    def validate(self) -> None:
        for key in ("hidden_size", "num_layers", "num_heads", "max_seq_len"):
            _require(getattr(self, key) >= 1, f"model.{key}", getattr(self, key), ">= 1")
        _require(
            self.hidden_size % self.num_heads == 0,
            "model.hidden_size",
            self.hidden_size,
            f"a multiple of model.num_heads={self.num_heads}",
        )
        if self.path and not Path(self.path).is_dir():
            raise ConfigError(
                f"model.path: {self.path!r} is not a directory; give a local model directory "
                "saved with save_pretrained, or leave it empty to build model.preset"
            )


@dataclass
class DataConfig:
    task: Literal["sort_digits", "jsonl"] = "sort_digits"
    """Prompt source: the built-in `sort_digits` task, or `jsonl` lines read from `path`."""
    path: str = ""
    """For `task=jsonl`: a file with one `{"prompt": ..., "answer": ...}` object per line."""
    reward_fn: str = ""
    """For `task=jsonl`: the reward as `module:function`, called as `f(completion, answer)`
    and returning a float. Empty means `asyncrl.tasks.rewards:partial_match`."""
    num_digits: int = 5
    """For `sort_digits`: digits per prompt."""
    num_examples: int = 4096
    """For `sort_digits`: rows in the generated dataset (one epoch)."""

    def validate(self) -> None:
        _require(self.num_digits >= 1, "data.num_digits", self.num_digits, ">= 1")
        _require(self.num_examples >= 1, "data.num_examples", self.num_examples, ">= 1")
        if self.task == "jsonl" and not self.path:
            raise ConfigError("data.path: required when data.task=jsonl (a .jsonl file)")
        if self.reward_fn and ":" not in self.reward_fn:
            raise ConfigError(
                f"data.reward_fn: {self.reward_fn!r} must look like 'module:function'"
            )


@dataclass
class RolloutConfig:
    num_prompts_per_step: int = 16
    """N: prompt groups trained per optimizer step."""
    num_generations_per_prompt: int = 16
    """G: samples generated per prompt (the group)."""
    max_new_tokens: int = 5
    """Longest completion, in tokens, EOS included."""
    temperature: float = 1.0
    """Sampling temperature; the trainer scores tokens at the same temperature."""
    max_trajectory_age_steps: int = 1
    """A: a group trained at step t was generated with weights versions in [t-A, t].
    0 is exactly synchronous, on-policy training."""
    max_generation_failures: int = 3
    """Failed generation batches in a row (an exception in the engine or the reward function)
    after which the run stops; each failed batch is re-dispatched first."""
    groups_per_batch: int = 0
    """Prompt groups the engine generates together in one batch; 0 means N (one step's worth).
    Smaller batches make groups land in the buffer a few at a time."""
    backend: Literal["threads", "ray"] = "threads"
    """Where generation runs: `threads` is a background thread in this process; `ray` runs
    `num_workers` generation actors on a Ray cluster (local by default, see `ray.address`)."""
    num_workers: int = 1
    """For `backend=ray`: generation worker actors; each batch is split across them."""

    def validate(self) -> None:
        for key in ("num_prompts_per_step", "num_generations_per_prompt", "max_new_tokens"):
            _require(getattr(self, key) >= 1, f"rollout.{key}", getattr(self, key), ">= 1")
        _require(self.temperature > 0, "rollout.temperature", self.temperature, "> 0")
        _require(
            self.max_generation_failures >= 1,
            "rollout.max_generation_failures",
            self.max_generation_failures,
            ">= 1",
        )
        _require(
            self.groups_per_batch >= 0, "rollout.groups_per_batch", self.groups_per_batch, ">= 0"
        )
        _require(self.num_workers >= 1, "rollout.num_workers", self.num_workers, ">= 1")
        _require(
            self.max_trajectory_age_steps >= 0,
            "rollout.max_trajectory_age_steps",
            self.max_trajectory_age_steps,
            ">= 0",
        )


@dataclass
class AlgoConfig:
    name: Literal["grpo", "ppo"] = "grpo"
    """The RL algorithm: `grpo` (group-normalised advantages, no critic) or `ppo` (a critic,
    GAE, epochs over minibatches; see docs/ppo.md)."""
    lr: float = 3e-4
    """AdamW learning rate of the policy."""
    weight_decay: float = 0.0
    """AdamW weight decay (policy and critic)."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global norm (policy and critic each); 0 disables
    clipping."""
    clip_eps: float = 0.2
    """PPO-style ratio clip: the surrogate uses ratio clipped to [1-clip_eps, 1+clip_eps]."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the frozen reference policy (the initial weights); 0
    disables it and builds no reference model."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """Per-token KL estimator: `k1` = log-ratio, `k3` = exp(-log-ratio) + log-ratio - 1."""
    kl_in_reward: bool = False
    """`ppo` only: subtract the KL penalty from the per-token rewards (as InstructGPT) instead
    of adding it to the policy loss (as GRPO)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus: the loss subtracts `entropy_coef` times the token-mean
    entropy of the policy."""
    gamma: float = 1.0
    """`ppo`: discount of GAE."""
    lam: float = 0.95
    """`ppo`: GAE's lambda (0 = one-step TD advantages, 1 = Monte Carlo returns minus values)."""
    normalize_advantages: bool = True
    """`ppo`: whiten the advantages over the step's real tokens."""
    ppo_epochs: int = 1
    """`ppo`: passes over the step's samples; each pass is `num_minibatches` optimizer steps."""
    num_minibatches: int = 1
    """`ppo`: optimizer steps per epoch; the step's N*G samples are shuffled (seeded by
    `run.seed`, the step and the epoch) and split this many ways."""
    critic_lr: float = 1e-3
    """`ppo`: AdamW learning rate of the critic."""
    value_clip_eps: float = 0.2
    """`ppo`: the value loss clips the new value to within this of the value at the start of
    the step; 0 disables value clipping."""
    critic_warmup_steps: int = 0
    """`ppo`: steps at the start of the run that train only the critic; the policy (and so the
    generated weights) stays as it is."""
    tis_cap: float = 2.0
    """`ppo`: truncation of the token-level importance weight pi_old / pi_behaviour that
    corrects for tokens generated by older weights (TIS); 0 leaves it untruncated."""

    def validate(self) -> None:
        _require(self.lr > 0, "algo.lr", self.lr, "> 0")
        _require(self.weight_decay >= 0, "algo.weight_decay", self.weight_decay, ">= 0")
        _require(self.max_grad_norm >= 0, "algo.max_grad_norm", self.max_grad_norm, ">= 0")
        _require(0 < self.clip_eps < 1, "algo.clip_eps", self.clip_eps, "in (0, 1)")
        _require(self.kl_coef >= 0, "algo.kl_coef", self.kl_coef, ">= 0")
        _require(self.entropy_coef >= 0, "algo.entropy_coef", self.entropy_coef, ">= 0")
        _require(0 <= self.gamma <= 1, "algo.gamma", self.gamma, "in [0, 1]")
        _require(0 <= self.lam <= 1, "algo.lam", self.lam, "in [0, 1]")
        _require(self.ppo_epochs >= 1, "algo.ppo_epochs", self.ppo_epochs, ">= 1")
        _require(self.num_minibatches >= 1, "algo.num_minibatches", self.num_minibatches, ">= 1")
        _require(self.critic_lr > 0, "algo.critic_lr", self.critic_lr, "> 0")
        _require(self.value_clip_eps >= 0, "algo.value_clip_eps", self.value_clip_eps, ">= 0")
        _require(
            self.critic_warmup_steps >= 0,
            "algo.critic_warmup_steps",
            self.critic_warmup_steps,
            ">= 0",
        )
        _require(self.tis_cap == 0 or self.tis_cap >= 1, "algo.tis_cap", self.tis_cap, "0 or >= 1")
        if self.kl_in_reward and self.name != "ppo":
            raise ConfigError(
                "algo.kl_in_reward: only `ppo` has per-token rewards; with algo.name="
                f"{self.name!r} the KL penalty goes in the loss (set algo.kl_in_reward=false)"
            )


@dataclass
class CheckpointConfig:
    save_period: int = 10
    """Write a checkpoint after every `save_period` steps; the last step always gets one."""
    keep_last: int = 3
    """Verified checkpoints of this run to keep; older ones are deleted after each save. The
    newest verified checkpoint is never deleted."""
    resume_policy: Literal["lossless", "keep_incomplete", "drop_incomplete"] = "lossless"
    """What a resume does with the checkpoint's in-flight and short targets: `lossless` re-
    dispatches in-flight prompts; `keep_incomplete` and `drop_incomplete` reproduce NeMo RL's
    lossy resumes (see the README)."""

    def validate(self) -> None:
        _require(self.save_period >= 1, "checkpoint.save_period", self.save_period, ">= 1")
        _require(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, ">= 1")


@dataclass
class LoggingConfig:
    progress: bool = True
    """Show a progress bar on stderr."""
    tensorboard: bool = False
    """Also write every metric as TensorBoard scalars under `RUN_DIR/tensorboard/`."""
    plot: bool = True
    """At the end of the run, write `reward_curve.png` and the four `plots/` PNGs of
    `asyncrl plot`."""


@dataclass
class RayConfig:
    address: str = ""
    """For `rollout.backend=ray`: the cluster to join (`auto`, `HOST:6379`, or `ray://HOST:10001`).
    Empty starts a local Ray sized to this machine, node address 127.0.0.1, no dashboard."""
    num_cpus_per_worker: float = 1.0
    """CPUs each generation worker actor reserves (its torch threads follow
    `run.torch_threads`)."""

    def validate(self) -> None:
        _require(
            self.num_cpus_per_worker >= 0,
            "ray.num_cpus_per_worker",
            self.num_cpus_per_worker,
            ">= 0",
        )


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def validate(self) -> None:
        for section in dataclasses.fields(self):
            check = getattr(getattr(self, section.name), "validate", None)
            if check is not None:
                check()
        samples = self.rollout.num_prompts_per_step * self.rollout.num_generations_per_prompt
        _require(
            self.algo.num_minibatches <= samples,
            "algo.num_minibatches",
            self.algo.num_minibatches,
            f"at most the N*G={samples} samples of a step",
        )
        n, batch = self.rollout.num_prompts_per_step, self.rollout.groups_per_batch
        _require(
            batch <= n and (batch == 0 or n % batch == 0),
            "rollout.groups_per_batch",
            batch,
            f"0 or a divisor of rollout.num_prompts_per_step={n}",
        )
        if self.run.deterministic:
            _require(
                self.checkpoint.resume_policy == "lossless",
                "checkpoint.resume_policy",
                self.checkpoint.resume_policy,
                "lossless when run.deterministic=true",
            )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: got {value!r}, must be {allowed}")


SECTIONS: dict[str, type] = dict(typing.get_type_hints(Config))
"""Section name -> its dataclass, in declaration order."""


BENIGN_KEYS = frozenset(
    {"run.max_num_steps", "run.torch_threads", "rollout.backend", "rollout.groups_per_batch"}
    | {"rollout.max_generation_failures", "rollout.num_workers"}
    | {f"ray.{f.name}" for f in dataclasses.fields(RayConfig)}
    | {f"checkpoint.{f.name}" for f in dataclasses.fields(CheckpointConfig)}
    | {f"logging.{f.name}" for f in dataclasses.fields(LoggingConfig)}
)
"""Keys a resume may change: they do not change what any step trains."""


def flatten(config: Config | dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`{"section.key": value}` for every key."""
    nested = config.to_dict() if isinstance(config, Config) else config
    return {f"{s}.{k}": v for s, values in nested.items() for k, v in values.items()}


DETERMINISM_KEYS = frozenset(
    {"run.torch_threads", "rollout.groups_per_batch", "rollout.backend", "rollout.num_workers"}
    | {"ray.num_cpus_per_worker"}  # with run.torch_threads=0 it sets the workers' threads
)
"""Benign keys that still change the bits: batch shapes and intra-op thread counts change
floating-point reduction order, so a deterministic run may not change them."""


def semantic_differences(saved: dict[str, dict[str, Any]], now: Config) -> list[str]:
    """`key: checkpoint=X, now=Y` for every semantics-bearing key that differs."""
    before, after = flatten(saved), flatten(now)
    benign = BENIGN_KEYS - DETERMINISM_KEYS if before.get("run.deterministic") else BENIGN_KEYS
    return [
        f"{key}: checkpoint={before.get(key)!r}, now={after[key]!r}"
        for key in after
        if key not in benign and before.get(key) != after[key]
    ]


def benign_differences(saved: dict[str, dict[str, Any]], now: Config) -> dict[str, list[Any]]:
    before, after = flatten(saved), flatten(now)
    return {k: [before.get(k), after[k]] for k in sorted(BENIGN_KEYS) if before.get(k) != after[k]}


def config_hash(config: Config) -> str:
    """SHA-256 of the semantics-bearing keys: equal hashes train the same steps."""
    semantic = {k: v for k, v in flatten(config).items() if k not in BENIGN_KEYS}
    return hashlib.sha256(json.dumps(semantic, sort_keys=True).encode()).hexdigest()


def config_keys() -> list[str]:
    """Every accepted `section.key`, in declaration order: the frozen config surface."""
    return [f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def field_docs(cls: type) -> dict[str, str]:
    """Maps each field of a config dataclass to the docstring written under it."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Checks `value` against the field's type hint; returns it converted (int -> float)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            choices = ", ".join(repr(a) for a in allowed)
            raise ConfigError(f"{key}: got {value!r}, allowed values: {choices}")
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
        if value is None:
            return ""
    raise ConfigError(f"{key}: got {value!r} ({type(value).__name__}), expected {hint.__name__}")


def _unknown(key: str, known: list[str]) -> ConfigError:
    near = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(near)}?" if near else f"; known keys: {', '.join(known)}"
    return ConfigError(f"unknown config key {key!r}{hint}")


def build_config(raw: dict[str, Any], overrides: Sequence[str] = ()) -> Config:
    """Builds a validated Config from a nested dict plus `section.key=value` overrides.
    Override values are parsed as YAML scalars (`8` is an int, `true` a bool)."""
    merged: dict[str, dict[str, Any]] = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a mapping of sections, got {type(raw).__name__}")
    for section, values in raw.items():
        if section not in SECTIONS:
            raise _unknown(str(section), list(SECTIONS))
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: must be a mapping of keys, got {values!r}")
        merged.setdefault(section, {}).update(values)
    for item in overrides:
        key, sep, text = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or not name:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        if section not in SECTIONS:
            raise _unknown(key, config_keys())
        merged.setdefault(section, {})[name] = yaml.safe_load(text) if text else ""
    kwargs = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        values = {}
        for name, value in merged.get(section, {}).items():
            key = f"{section}.{name}"
            if name not in hints:
                raise _unknown(key, config_keys())
            values[name] = _coerce(key, value, hints[name])
        kwargs[section] = cls(**values)
    config = Config(**kwargs)
    config.validate()
    return config


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Reads a YAML config file and applies overrides; errors name the file."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    try:
        return build_config(raw, overrides)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


def reference_markdown() -> str:
    """The README's config reference: one table row per key, from the field docstrings."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    defaults = Config().to_dict()
    for name, cls in SECTIONS.items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            shown = json.dumps(defaults[name][f.name])
            rows.append(f"| `{name}.{f.name}` | `{shown}` | {docs.get(f.name, '')} |")
    return "\n".join(rows)
