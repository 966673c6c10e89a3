"""Builds everything one run is made of from its config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asyncrl.config import Config
from asyncrl.core.buffer import Buffer, ReplayBuffer
from asyncrl.core.ledger import Ledger
from asyncrl.core.stream import PromptStream
from asyncrl.core.types import PromptTicket
from asyncrl.models.critic import build_critic
from asyncrl.models.policy import Policy, load_policy
from asyncrl.rollout.collector import Collector, Scorer, encode_prompts
from asyncrl.rollout.engine import TorchGenerationEngine
from asyncrl.tasks.source import Task, load_task
from asyncrl.train.grpo import GRPO
from asyncrl.train.ppo import PPO
from asyncrl.train.update import ReferencePolicy

if TYPE_CHECKING:
    from asyncrl.distributed.ray_backend import RayEngine

OnBatch = Callable[[float, float, int, list[PromptTicket]], None]


@dataclass
class Components:
    policy: Policy
    task: Task
    stream: PromptStream
    ledger: Ledger
    buffer: Buffer
    engine: TorchGenerationEngine | RayEngine
    collector: Collector
    algo: GRPO | PPO
    shutdown_steps: list[Callable[[], None]] = field(default_factory=list)

    def shutdown(self) -> None:
        """Releases what the backend started (Ray actors, a local Ray); threads need nothing."""
        self.run_steps(self.shutdown_steps)

    @staticmethod
    def run_steps(steps: list[Callable[[], None]]) -> None:
        for step in steps:
            try:
                step()
            except Exception as err:  # the run's outcome is decided; report and go on
                print(f"asyncrl: shutdown: {err!r}")
        steps.clear()


def build_components(config: Config, on_batch: OnBatch | None = None) -> Components:
    rollout = config.rollout
    task = load_task(config.data)
    policy = load_policy(config.model, config.run.seed, task.alphabet())
    prompts = encode_prompts(task, policy.tokenizer, rollout.max_new_tokens, policy.max_seq_len)
    stream = PromptStream(len(task.examples), rollout.num_prompts_per_step, config.run.seed)
    ledger = Ledger(stream)
    # built before any checkpoint is loaded: both copy the policy's initial weights
    reference = ReferencePolicy(policy.model) if config.algo.kl_coef > 0 else None
    algo: GRPO | PPO
    if config.algo.name == "ppo":
        critic = build_critic(policy, config.model, config.run.seed)
        algo = PPO(
            policy.model,
            critic,
            config.algo,
            rollout.temperature,
            policy.pad_id,
            config.run.seed,
            reference,
        )
    else:
        algo = GRPO(policy.model, config.algo, rollout.temperature, policy.pad_id, reference)
    deterministic = config.run.deterministic
    max_versions = rollout.max_trajectory_age_steps + 1 if deterministic else 1
    buffer: Buffer
    engine: TorchGenerationEngine | RayEngine
    shutdown: list[Callable[[], None]] = []
    if rollout.backend == "ray":
        from asyncrl.distributed import ray_backend  # ray is an optional extra

        if ray_backend.start_ray(config):
            shutdown.append(ray_backend.ray.shutdown)
        try:
            engine = ray_backend.build_ray_engine(
                config, policy.model, policy.eos_id, policy.pad_id, max_versions
            )
            shutdown.insert(0, engine.shutdown)
            buffer = ray_backend.BufferClient(
                rollout.num_prompts_per_step, rollout.max_trajectory_age_steps
            )
            shutdown.insert(0, buffer.shutdown)
        except BaseException:
            Components.run_steps(shutdown)
            raise
    else:
        buffer = ReplayBuffer(rollout.num_prompts_per_step, rollout.max_trajectory_age_steps)
        engine = TorchGenerationEngine(
            policy.model,
            policy.eos_id,
            policy.pad_id,
            rollout.max_new_tokens,
            rollout.temperature,
            max_versions=max_versions,
        )
    collector = Collector(
        ledger=ledger,
        buffer=buffer,
        engine=engine,
        prompts=prompts,
        scorer=Scorer(task, policy.tokenizer),
        num_generations=rollout.num_generations_per_prompt,
        max_age_steps=rollout.max_trajectory_age_steps,
        seed=config.run.seed,
        batch_groups=rollout.groups_per_batch or rollout.num_prompts_per_step,
        on_batch=on_batch,
        pin_versions=deterministic,
        max_failures=rollout.max_generation_failures,
    )
    return Components(policy, task, stream, ledger, buffer, engine, collector, algo, shutdown)
