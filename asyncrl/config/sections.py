"""Typed configuration: the schema, one dataclass per section, each validating its values.

Each field's docstring (the string literal under it) is its only documentation; the config
reference (docs/config.md) is generated from them (`make docs`). Each field's metadata
says what a resume may do with it. Loading from YAML with dotted overrides, the flat
`section.key` surface, resume comparisons and the reference live in `asyncrl.config.keys`;
the algorithms' own keys in `asyncrl.config.algos`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from asyncrl.config.algos import options_class
from asyncrl.config.base import (
    MAY_CHANGE,
    MAY_CHANGE_UNLESS_DETERMINISTIC,
    NEVER_CHANGES,
)
from asyncrl.config.base import require as _require
from asyncrl.config.data import AgentConfig, DataConfig, EnvConfig, EvalConfig
from asyncrl.config.engines import ServersConfig, VLLMConfig
from asyncrl.config.model import ModelConfig


@dataclass
class RunConfig:
    seed: int = 0
    """Seeds model init, the per-epoch prompt permutations and each group's sampling noise."""
    max_num_steps: int = field(default=200, metadata=MAY_CHANGE)
    """Optimizer steps to train; the run ends (exit 0) when step `max_num_steps - 1` is done."""
    deterministic: bool = False
    """Bit-for-bit reproducible runs, resumed or not (DESIGN.md I5): target t is generated with
    exactly weights version max(0, t-A), in fixed batches; see docs/determinism.md."""
    torch_threads: int = field(default=1, metadata=MAY_CHANGE_UNLESS_DETERMINISTIC)
    """torch intra-op threads of each side, generation and training, while both are busy. 1
    lets each own a core on a 2-core machine; 0 keeps torch's default (and shares nothing)."""
    share_cores: bool = field(default=True, metadata=MAY_CHANGE)
    """A side running alone (the trainer waiting for rollouts, generation waiting for weights)
    takes the other side's threads too: up to `torch_threads` x 2, at most this process's
    cores. Set at each pass (a decode step, a micro-batch). Applies to `rollout.backend=threads`
    with one trainer process, and never in deterministic runs (thread counts would follow
    timing there); docs/devices.md."""

    def validate(self) -> None:
        _require(self.max_num_steps >= 1, "run.max_num_steps", self.max_num_steps, ">= 1")
        _require(self.torch_threads >= 0, "run.torch_threads", self.torch_threads, ">= 0")


def buffer_capacity(num_prompts_per_step: int, max_trajectory_age_steps: int) -> int:
    """(A+1)*N: with the window checked at admission, no more groups are ever buffered."""
    return (max_trajectory_age_steps + 1) * num_prompts_per_step


@dataclass
class RolloutConfig:
    num_prompts_per_step: int = field(default=16, metadata=NEVER_CHANGES)
    """N: prompt groups trained per optimizer step."""
    num_generations_per_prompt: int = 16
    """G: samples generated per prompt (the group)."""
    max_new_tokens: int = 5
    """Longest completion, in tokens, EOS included."""
    temperature: float = 1.0
    """Sampling temperature; the trainer scores tokens at the same temperature."""
    overlong_buffer: int = 0
    """DAPO's soft overlong penalty: a completion longer than `max_new_tokens -
    overlong_buffer` tokens loses `overlong_penalty` x (its excess / `overlong_buffer`) of
    reward, the whole `overlong_penalty` at `max_new_tokens` (logged as `reward/overlong`);
    single-turn completions only. 0: off (asyncrl/rollout/overlong.py)."""
    overlong_penalty: float = 1.0
    """With `overlong_buffer`: the penalty at `max_new_tokens`."""
    max_trajectory_age_steps: int = field(default=1, metadata=NEVER_CHANGES)
    """A: a group trained at step t was generated with weights versions in [t-A, t].
    0 is exactly synchronous, on-policy training."""
    max_generation_failures: int = field(default=3, metadata=MAY_CHANGE)
    """Failed generation batches in a row (an exception in the engine, or a reward call that
    raised or ran past `reward_timeout_s`) after which the run stops; each failed batch is
    re-dispatched first."""
    reward_workers: int = field(default=0, metadata=MAY_CHANGE)
    """Processes that compute rewards, each group's samples in one call, a chunk's groups in
    parallel; 0: in the generation thread (no timeout possible). Slow rewards (math
    verification, code execution) want a few."""
    reward_timeout_s: float = field(default=0.0, metadata=MAY_CHANGE)
    """With `reward_workers`: a reward call running longer is stopped (its worker process is
    killed and replaced) and counts as a failed batch, named by ordinal; 0: no limit."""
    groups_per_batch: int = field(default=0, metadata=MAY_CHANGE_UNLESS_DETERMINISTIC)
    """Prompt groups the engine generates together in one batch; 0 means N (one step's worth).
    Smaller batches make groups land in the buffer a few at a time."""
    chunk_tokens: int = field(default=0, metadata=MAY_CHANGE_UNLESS_DETERMINISTIC)
    """Partial generations: the engine generates at most this many new tokens per sample per
    pass, and a checkpoint saves every in-flight group's samples so far, so a `lossless`
    resume continues them from their last saved token instead of generating them again.
    0: each batch in one pass (nothing partial to save). For long completions, 16-64."""
    update_weights_mid_generation: bool = field(
        default=False, metadata=MAY_CHANGE_UNLESS_DETERMINISTIC
    )
    """With `chunk_tokens`: each chunk uses the newest published weights, so a long batch does
    not keep generating on old ones; a group's tokens may then come from several versions
    (each token's own behaviour log-prob and version travel with it; the oldest token stays
    within A). Off: a sample keeps the version its batch started with."""
    engine: Literal["torch", "vllm", "vllm_server"] = "torch"
    """Which engine generates: `torch` is asyncrl's own batched sampler with a KV cache over the
    Hugging Face model (pinned weights versions and per-request noise: deterministic mode works
    with it); `vllm` is vLLM in this process (`rollout.vllm.*`; not in deterministic mode);
    `vllm_server` is vLLM's OpenAI-compatible servers, launched or attached
    (`rollout.servers.*`, docs/servers.md)."""
    backend: Literal["threads", "ray"] = field(
        default="threads", metadata=MAY_CHANGE_UNLESS_DETERMINISTIC
    )
    """Where generation runs: `threads` is a background thread in this process; `ray` runs
    `num_workers` generation actors on a Ray cluster (local by default, see `ray.address`)."""
    num_workers: int = field(default=1, metadata=MAY_CHANGE_UNLESS_DETERMINISTIC)
    """For `backend=ray`: generation worker actors; each batch is split across them."""
    device: str = field(default="cpu", metadata=MAY_CHANGE_UNLESS_DETERMINISTIC)
    """Where the engine generates: `cpu`, `cuda` or `cuda:N` (on Ray: inside each worker)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The engine's weights and compute: the trainer's fp32 weights are cast to it when they
    are published (the engine then holds them in this dtype only)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """The vLLM engine's settings, `rollout.vllm.*` (also the launched servers')."""
    servers: ServersConfig = field(default_factory=ServersConfig)
    """The servers of `rollout.engine=vllm_server`, `rollout.servers.*`."""

    @property
    def buffer_capacity(self) -> int:
        """(A+1)*N: the most groups the replay buffer ever holds (targets t..t+A)."""
        return buffer_capacity(self.num_prompts_per_step, self.max_trajectory_age_steps)

    @property
    def resolved_groups_per_batch(self) -> int:
        """`groups_per_batch`, with 0 resolved to N."""
        return self.groups_per_batch or self.num_prompts_per_step

    def validate(self) -> None:
        for key in ("num_prompts_per_step", "num_generations_per_prompt", "max_new_tokens"):
            _require(getattr(self, key) >= 1, f"rollout.{key}", getattr(self, key), ">= 1")
        _require(self.temperature > 0, "rollout.temperature", self.temperature, "> 0")
        _require(
            0 <= self.overlong_buffer < self.max_new_tokens,
            "rollout.overlong_buffer",
            self.overlong_buffer,
            f">= 0 and < rollout.max_new_tokens={self.max_new_tokens}",
        )
        _require(
            self.overlong_penalty >= 0, "rollout.overlong_penalty", self.overlong_penalty, ">= 0"
        )
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
        _require(self.reward_workers >= 0, "rollout.reward_workers", self.reward_workers, ">= 0")
        _require(
            self.reward_timeout_s >= 0, "rollout.reward_timeout_s", self.reward_timeout_s, ">= 0"
        )
        _require(
            not self.reward_timeout_s or self.reward_workers >= 1,
            "rollout.reward_timeout_s",
            self.reward_timeout_s,
            "0 unless rollout.reward_workers >= 1 (a call in the generation thread cannot be "
            "stopped)",
        )
        _require(self.chunk_tokens >= 0, "rollout.chunk_tokens", self.chunk_tokens, ">= 0")
        _require(
            not self.update_weights_mid_generation or self.chunk_tokens > 0,
            "rollout.update_weights_mid_generation",
            self.update_weights_mid_generation,
            "false unless rollout.chunk_tokens > 0 (weights change only between chunks)",
        )
        _check_device("rollout.device", self.device)
        self.vllm.validate()
        self.servers.validate()
        if self.engine == "vllm_server":
            _require(
                (self.servers.launch > 0) != bool(self.servers.urls),
                "rollout.servers.launch",
                self.servers.launch,
                "> 0 with no rollout.servers.urls, or 0 with rollout.servers.urls set "
                "(rollout.engine=vllm_server generates on servers launched or attached)",
            )
            _require(
                self.backend == "threads",
                "rollout.backend",
                self.backend,
                "threads with rollout.engine=vllm_server (the servers are the workers)",
            )
        if self.engine in ("vllm", "vllm_server") and self.device == "cpu":
            _require(
                self.vllm.kv_cache_bytes > 0,
                "rollout.vllm.kv_cache_bytes",
                self.vllm.kv_cache_bytes,
                "> 0 on rollout.device=cpu (vLLM's CPU build sizes nothing from free memory)",
            )
        _require(
            self.max_trajectory_age_steps >= 0,
            "rollout.max_trajectory_age_steps",
            self.max_trajectory_age_steps,
            ">= 0",
        )


DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def _check_device(key: str, value: str) -> None:
    _require(bool(DEVICE.match(value)), key, value, "cpu, cuda or cuda:N")


@dataclass
class TrainConfig:
    device: str = field(default="cpu", metadata=MAY_CHANGE_UNLESS_DETERMINISTIC)
    """Where the policy (and PPO's critic and the KL reference) train: `cpu`, `cuda` or
    `cuda:N`. Weights and optimizer state stay fp32 there (see `train.dtype`)."""
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """Compute precision of the forward and backward passes. `bfloat16` is mixed precision as
    FSDP and torchtitan users know it: fp32 master weights, gradients and Adam moments, bf16
    matmuls under `torch.autocast`; log-probs, losses and the optimizer in fp32. `auto`:
    `bfloat16` where `train.device` multiplies bf16 natively (a GPU that supports it; a CPU
    whose `/proc/cpuinfo` flags have avx512_bf16 or amx_bf16, or bf16 on aarch64 — not
    oneDNN's check, which says yes on AVX-512 without bf16), `float32` elsewhere — a CPU
    without them runs bf16 matmuls through a slow fallback (measured ~20x slower a training
    step on an AVX2-only CPU); the start line says which was chosen and why."""
    micro_batch_size: int = field(default=0, metadata=MAY_CHANGE_UNLESS_DETERMINISTIC)
    """Sequences per forward/backward pass; 0 = the whole step (or PPO minibatch) at once.
    Losses are masked sums over the step's normaliser, so the gradient does not depend on it
    (up to floating-point summation order): it only bounds activation memory."""
    shared_prompts: bool = field(default=True, metadata=MAY_CHANGE_UNLESS_DETERMINISTIC)
    """Run each distinct prompt of a micro-batch through the model once and its samples'
    completions against that pass's KV cache, instead of prompt + completion for every sample:
    the same log-probs and gradients (up to float summation order) for a G-th of the prompt
    tokens' work. `false`: one full pass per sample (a model whose KV cache cannot carry a
    gradient needs it)."""
    num_processes: int = field(default=1, metadata=MAY_CHANGE_UNLESS_DETERMINISTIC)
    """Trainer ranks: data parallel with FSDP2 on `torch.distributed` (gloo on CPU, nccl on
    `cuda:LOCAL_RANK`), weights, gradients and AdamW moments 1/P per rank (docs/distributed.md).
    `asyncrl train` starts them, or joins torchrun's. Another value on resume reshards."""
    rank_timeout_s: float = field(default=30.0, metadata=MAY_CHANGE)
    """With `train.num_processes` > 1: seconds a trainer rank may send no heartbeat before
    the run stops with `RankFailed` (exit 1; a rerun resumes from the newest verified
    checkpoint). It catches a rank that hangs, is stopped, or whose machine drops off the
    network; a rank that exits is caught at once (its connections close)."""

    def validate(self) -> None:
        _check_device("train.device", self.device)
        _require(self.num_processes >= 1, "train.num_processes", self.num_processes, ">= 1")
        _require(self.rank_timeout_s > 0, "train.rank_timeout_s", self.rank_timeout_s, "> 0")
        _require(
            self.micro_batch_size >= 0, "train.micro_batch_size", self.micro_batch_size, ">= 0"
        )


@dataclass
class AlgoConfig:
    """The keys every algorithm shares. An algorithm's own keys are its `Options` dataclass
    (in its file under `asyncrl/algos/`), set as `algo.KEY` like these and held in `options`."""

    name: str = "grpo"
    """The RL algorithm: a name in the registry (`asyncrl/config/algos.py`; a bad name lists
    them). `grpo` is group-normalised advantages without a critic; the others are described in
    docs/algorithms.md."""
    lr: float = 3e-4
    """AdamW learning rate of the policy (its peak, under `algo.lr_schedule`)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """The learning rate of training step t as transformers' `get_*_schedule_with_warmup`
    make it: `lr * t / warmup_steps` while t < `warmup_steps` (0 at step 0), then `lr`
    (`constant`), or a `linear` or half-`cosine` decay to 0 at step `run.max_num_steps`. PPO's
    critic follows the same shape from `critic_lr`. Raising `run.max_num_steps` on resume moves
    where the decay ends: the steps still to train get the new horizon's learning rates."""
    warmup_steps: int = 0
    """Training steps of linear learning-rate warm-up from 0 (see `lr_schedule`); 0: none."""
    weight_decay: float = 0.0
    """AdamW weight decay (policy and critic)."""
    adam_beta1: float = 0.9
    """AdamW's beta1, the decay of the gradient's running mean (policy and critic)."""
    adam_beta2: float = 0.999
    """AdamW's beta2, the decay of the squared gradient's running mean (policy and critic).
    0.999 is torch's and Hugging Face's default (TRL users often set 0.99)."""
    adam_epsilon: float = 1e-8
    """AdamW's epsilon, added to the root of the squared-gradient mean (policy and critic)."""
    loss_aggregation: Literal["token_mean", "sequence_mean", "constant"] = "token_mean"
    """How the policy loss (and the KL and entropy terms) sum over a step's tokens:
    `token_mean` divides by the step's real tokens (DAPO; TRL's `dapo`), `sequence_mean`
    averages each sequence's token mean over the sequences (the original GRPO),
    `constant` divides by sequences x `rollout.max_new_tokens` (Dr. GRPO). PPO applies it per
    minibatch; its value loss is always the token mean."""
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
    entropy_coef: float = 0.0
    """Weight of the entropy bonus: the loss subtracts `entropy_coef` times the policy's
    entropy, aggregated over tokens as `algo.loss_aggregation` says (the token mean by
    default). It keeps a group's samples apart, so fewer groups have one reward for all and no
    signal (docs/time_to_reward.md)."""
    options: Any = field(default=None, metadata={"options": True})
    # not a key: the chosen algorithm's `Options` instance (its own keys)

    def __post_init__(self) -> None:
        if self.options is None:
            self.options = options_class(self.name)()

    def validate(self) -> None:
        _require(self.lr > 0, "algo.lr", self.lr, "> 0")
        _require(self.warmup_steps >= 0, "algo.warmup_steps", self.warmup_steps, ">= 0")
        _require(self.weight_decay >= 0, "algo.weight_decay", self.weight_decay, ">= 0")
        _require(0 <= self.adam_beta1 < 1, "algo.adam_beta1", self.adam_beta1, "in [0, 1)")
        _require(0 <= self.adam_beta2 < 1, "algo.adam_beta2", self.adam_beta2, "in [0, 1)")
        _require(self.adam_epsilon > 0, "algo.adam_epsilon", self.adam_epsilon, "> 0")
        _require(self.max_grad_norm >= 0, "algo.max_grad_norm", self.max_grad_norm, ">= 0")
        _require(0 < self.clip_eps < 1, "algo.clip_eps", self.clip_eps, "in (0, 1)")
        _require(self.kl_coef >= 0, "algo.kl_coef", self.kl_coef, ">= 0")
        _require(self.entropy_coef >= 0, "algo.entropy_coef", self.entropy_coef, ">= 0")


@dataclass
class CheckpointConfig:
    save_period: int = field(default=10, metadata=MAY_CHANGE)
    """A checkpoint falls due after every `save_period` steps (written then, or deferred while
    the previous one is still being written: `when_busy`); the last step always gets one."""
    every_s: float = field(default=0.0, metadata=MAY_CHANGE)
    """A checkpoint also falls due once `every_s` seconds of wall time have passed since the
    last one was cut (or since the launch), checked at step boundaries: what a user on
    preemptible machines sets, to bound in time, not steps, the work a kill can cost; 0: off."""
    when_busy: Literal["defer", "wait"] = field(default="defer", metadata=MAY_CHANGE)
    """A checkpoint that falls due while the previous one is still being written: `defer`
    trains on and writes it at the first step boundary after that write ends (a
    `checkpoint_deferred` event), so the trainer never waits for the disk; `wait` blocks
    until the write ends, so the checkpoints' steps depend on the config alone. A stop's
    emergency checkpoint and the final one always wait. (With `every_s` on, which steps get
    one depends on the wall clock either way.)"""
    grace_s: float = field(default=30.0, metadata=MAY_CHANGE)
    """SIGTERM's deadline: the seconds between the signal and the kill (Kubernetes'
    `terminationGracePeriodSeconds`, 30 by default; a spot instance's notice). At the signal
    the run says whether its checkpoint fits before it, from this run's measured checkpoint
    times, and cuts at its earliest consistent point (docs/failures.md)."""
    signal_warning_s: float = field(default=60.0, metadata=MAY_CHANGE)
    """SIGUSR1's and SIGUSR2's deadline: Slurm's `--signal=USR1@N` sends it N seconds before
    the job's end (60 when `@N` is left out); set this to that N."""
    keep_last: int = field(default=3, metadata=MAY_CHANGE)
    """Verified checkpoints of this run to keep; older ones are deleted after each save. The
    newest verified checkpoint is never deleted."""
    resume_policy: Literal["lossless", "keep_incomplete", "drop_incomplete", "restart_episode"] = (
        field(default="lossless", metadata=MAY_CHANGE)
    )
    """What a resume does with the checkpoint's in-flight and short targets: `lossless` re-
    dispatches in-flight prompts, continuing their partial samples; `keep_incomplete` and
    `drop_incomplete` reproduce NeMo RL's lossy resumes; `restart_episode` re-dispatches them
    started over (what peers do with in-flight multi-turn episodes) (docs/checkpoint.md)."""
    staging_buffer: Literal["auto", "keep", "release"] = field(default="auto", metadata=MAY_CHANGE)
    """The one CPU copy a save stages the state into (~12 bytes per parameter with AdamW):
    `keep` reuses it from save to save (no allocation after the first save, but held for the
    whole run), `release` gives it back after each write (fresh pages at every save), `auto`
    keeps it only when it is pinned memory staging GPU tensors. See docs/checkpoint.md."""

    def validate(self) -> None:
        _require(self.save_period >= 1, "checkpoint.save_period", self.save_period, ">= 1")
        _require(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, ">= 1")
        _require(self.every_s >= 0, "checkpoint.every_s", self.every_s, ">= 0")
        _require(self.grace_s >= 0, "checkpoint.grace_s", self.grace_s, ">= 0")
        _require(
            self.signal_warning_s >= 0,
            "checkpoint.signal_warning_s",
            self.signal_warning_s,
            ">= 0",
        )


@dataclass
class LoggingConfig:
    progress: bool = field(default=True, metadata=MAY_CHANGE)
    """Show a progress bar on stderr."""
    tensorboard: bool = field(default=False, metadata=MAY_CHANGE)
    """Also write every metric as TensorBoard scalars under `RUN_DIR/tensorboard/`."""
    plot: bool = field(default=True, metadata=MAY_CHANGE)
    """At the end of the run, `asyncrl train` writes `reward_curve.png` and the four `plots/`
    PNGs of `asyncrl plot` (from Python: `asyncrl.cli.report.end_of_run_report`)."""
    wandb: bool = field(default=False, metadata=MAY_CHANGE)
    """Also log every metric to Weights & Biases (`pip install wandb`; files under
    `RUN_DIR/wandb/`, `WANDB_MODE` honoured); a resume continues the same W&B run."""
    wandb_project: str = field(default="asyncrl", metadata=MAY_CHANGE)
    """The W&B project of `logging.wandb`."""
    wandb_run_name: str = field(default="", metadata=MAY_CHANGE)
    """The W&B run's display name; empty: the run dir's name."""
    mlflow: bool = field(default=False, metadata=MAY_CHANGE)
    """Also log every metric to MLflow (`pip install mlflow-skinny`); a resume continues the
    same MLflow run. See docs/trackers.md."""
    mlflow_tracking_uri: str = field(default="", metadata=MAY_CHANGE)
    """Where `logging.mlflow` logs (a server URL, a path or `file:` URI, `sqlite:///...`);
    empty: a local file store in `RUN_DIR/mlruns/`."""
    mlflow_experiment: str = field(default="asyncrl", metadata=MAY_CHANGE)
    """The MLflow experiment of `logging.mlflow` (created if missing)."""


@dataclass
class RayConfig:
    address: str = field(default="", metadata=MAY_CHANGE)
    """For `rollout.backend=ray`: the cluster to join (`auto`, `HOST:6379`, or `ray://HOST:10001`).
    Empty starts a local Ray sized to this machine, node address 127.0.0.1, no dashboard."""
    num_cpus_per_worker: float = field(default=1.0, metadata=MAY_CHANGE_UNLESS_DETERMINISTIC)
    """CPUs each generation worker actor reserves (its torch threads follow
    `run.torch_threads`)."""
    watch_drains: bool = field(default=True, metadata=MAY_CHANGE)
    """Read Ray's drained nodes (`ray drain-node`, a preempting autoscaler): a generation
    worker on one hands its work back, tokens kept, and is replaced on another node; a drain
    of the trainer's node is a preemption notice with Ray's deadline (docs/failures.md)."""
    drain_poll_s: float = field(default=1.0, metadata=MAY_CHANGE)
    """Seconds between two reads of Ray's drained nodes (`ray.watch_drains`)."""

    def validate(self) -> None:
        _require(
            self.num_cpus_per_worker >= 0,
            "ray.num_cpus_per_worker",
            self.num_cpus_per_worker,
            ">= 0",
        )
        _require(self.drain_poll_s > 0, "ray.drain_poll_s", self.drain_poll_s, "> 0")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def validate(self) -> None:
        for section in dataclasses.fields(self):
            check = getattr(getattr(self, section.name), "validate", None)
            if check is not None:
                check()
        self.algo.options.validate(self)
        n, batch = self.rollout.num_prompts_per_step, self.rollout.groups_per_batch
        _require(
            batch <= n and (batch == 0 or n % batch == 0),
            "rollout.groups_per_batch",
            batch,
            f"0 or a divisor of rollout.num_prompts_per_step={n}",
        )
        _require(
            self.algo.warmup_steps < self.run.max_num_steps,
            "algo.warmup_steps",
            self.algo.warmup_steps,
            f"< run.max_num_steps={self.run.max_num_steps} (the lr would never reach algo.lr)",
        )
        if self.model.lora.rank:
            _require(
                self.train.num_processes == 1,
                "train.num_processes",
                self.train.num_processes,
                "1 with model.lora.rank > 0 (LoRA adapters train in one process for now)",
            )
        if self.env.name:
            self._validate_episodes()
        if self.agent.name:
            self._validate_agents()
        if self.run.deterministic:
            _require(
                self.model.lora.dropout == 0,
                "model.lora.dropout",
                self.model.lora.dropout,
                "0 when run.deterministic=true (its random draws are not checkpointed)",
            )
            _require(
                self.checkpoint.resume_policy == "lossless",
                "checkpoint.resume_policy",
                self.checkpoint.resume_policy,
                "lossless when run.deterministic=true",
            )
            _require(
                not self.rollout.update_weights_mid_generation,
                "rollout.update_weights_mid_generation",
                True,
                "false when run.deterministic=true: which version is newest at a chunk boundary "
                "depends on timing (a schedule fixing the version per target and chunk would be "
                "deterministic, but would make generation wait for it)",
            )

    def _validate_episodes(self) -> None:
        """What multi-turn episodes (`env.name`) do not run with yet."""
        _require(
            self.data.fewshot == 0,
            "data.fewshot",
            self.data.fewshot,
            "0 with env.name set (demonstrations are for single-turn chat prompts)",
        )
        _require(
            self.rollout.overlong_buffer == 0,
            "rollout.overlong_buffer",
            self.rollout.overlong_buffer,
            "0 with env.name set (the overlong penalty is for single-turn completions)",
        )
        _require(
            self.eval.every_steps == 0,
            "eval.every_steps",
            self.eval.every_steps,
            "0 with env.name set (evaluating episodes is not built yet: the run's own rewards "
            "are its measure)",
        )
        _require(
            self.rollout.max_new_tokens <= self.env.max_episode_tokens,
            "rollout.max_new_tokens",
            self.rollout.max_new_tokens,
            f"<= env.max_episode_tokens={self.env.max_episode_tokens} (a turn is part of its "
            "episode)",
        )

    def _validate_agents(self) -> None:
        """What agent runs (`agent.name`) do not run with."""
        name = f"with agent.name={self.agent.name}"
        _require(not self.env.name, "env.name", self.env.name, f"empty {name} (one mode a run)")
        _require(
            self.data.fewshot == 0,
            "data.fewshot",
            self.data.fewshot,
            f"0 {name} (demonstrations are for single-turn chat prompts)",
        )
        _require(
            self.rollout.overlong_buffer == 0,
            "rollout.overlong_buffer",
            self.rollout.overlong_buffer,
            f"0 {name} (the overlong penalty is for single-turn completions)",
        )
        _require(
            self.eval.every_steps == 0,
            "eval.every_steps",
            self.eval.every_steps,
            f"0 {name} (evaluating agents is not built yet: the run's own rewards are its measure)",
        )
        _require(
            self.rollout.chunk_tokens == 0,
            "rollout.chunk_tokens",
            self.rollout.chunk_tokens,
            f"0 {name} (a call is generated whole; a kill replays runs from the agent log)",
        )
        _require(
            self.rollout.backend == "threads",
            "rollout.backend",
            self.rollout.backend,
            f"threads {name} (the endpoint serves the engine of the trainer's process)",
        )
        _require(
            self.rollout.engine == "torch",
            "rollout.engine",
            self.rollout.engine,
            f"torch {name} (agent calls on vLLM are not built yet)",
        )
        _require(
            self.checkpoint.resume_policy == "lossless",
            "checkpoint.resume_policy",
            self.checkpoint.resume_policy,
            f"lossless {name}",
        )

    @property
    def generated_tokens(self) -> int:
        """Tokens a sample holds after its prompt at most: `rollout.max_new_tokens`, or for
        episodes `env.max_episode_tokens` (the loss's `constant` normaliser uses it)."""
        if self.agent.name:
            return self.agent.max_tokens
        return self.env.max_episode_tokens if self.env.name else self.rollout.max_new_tokens

    @property
    def kept_weight_versions(self) -> int:
        """Weights versions generation keeps: deterministic mode generates target t with
        version max(0, t-A), and chunked generation (without mid-generation updates) finishes
        a sample on the version it started with, so both keep A+1; otherwise only the newest
        is ever used."""
        rollout = self.rollout
        pinned = rollout.chunk_tokens > 0 and not rollout.update_weights_mid_generation
        return rollout.max_trajectory_age_steps + 1 if self.run.deterministic or pinned else 1

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """`{section: {key: value}}`, the algorithm's own keys among `algo`'s."""
        out = {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)}
        out["algo"].update(out["algo"].pop("options"))
        return out
