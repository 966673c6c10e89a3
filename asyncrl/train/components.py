"""Builds everything one run is made of from its config: the only place that knows which
algorithm, which engine and which backend (threads or Ray) a run uses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncrl.agents.agent_log import AGENT_LOG, AgentLog
from asyncrl.agents.context import load_agent
from asyncrl.agents.runs import AgentRuns
from asyncrl.agents.serving import AgentLimits
from asyncrl.agents.verifiers_env import VerifiersAgent, is_verifiers, verifiers_env
from asyncrl.algos import algorithm_class
from asyncrl.algos.base import Algorithm
from asyncrl.algos.parallel import SINGLE, Ranks
from asyncrl.config import Config
from asyncrl.config.data import BUILTIN_REWARDS
from asyncrl.core.buffer import Buffer, ReplayBuffer
from asyncrl.core.ledger import Ledger
from asyncrl.core.preemption import Notice
from asyncrl.core.stream import PromptStream
from asyncrl.models.device import DTYPES, place, resolve_device
from asyncrl.models.lora import adapters_in_engine, apply_lora
from asyncrl.models.policy import Policy, load_policy
from asyncrl.models.threads import CoreShare
from asyncrl.rollout.chat_tokens import turn_end_id
from asyncrl.rollout.collector import Collector
from asyncrl.rollout.engine import (
    EngineSpec,
    GenerationEngine,
    build_engine,
    check_engine,
    engine_options,
)
from asyncrl.rollout.episodes import EpisodeRunner
from asyncrl.rollout.evaluation import Evaluator, build_evaluator, task_reward_pool
from asyncrl.rollout.overlong import with_overlong_penalty
from asyncrl.rollout.reward_pool import RewardPool
from asyncrl.rollout.rollouts import Chunk, EpisodeTurns, PassOptions, Rollout, SingleTurns
from asyncrl.rollout.scorer import Scorer
from asyncrl.rollout.weight_sync import CopyWeightSync, WeightSync
from asyncrl.tasks.environments import environment_class
from asyncrl.tasks.examples import Task, examples_sha256
from asyncrl.tasks.prompts import encode_prompts
from asyncrl.tasks.source import load_task
from asyncrl.train.rundir import read_run_id

OnBatch = Callable[[Chunk], None]
ENV_DIR = "env"
"""`RUN_DIR/env/`: the environments' own files (a tool's journal), kept across resumes."""
ENV_STEPS = "env_steps.jsonl"
"""`RUN_DIR/env_steps.jsonl`: every environment step asked for, with its attempt."""


@dataclass
class Components:
    policy: Policy
    task: Task
    stream: PromptStream
    ledger: Ledger
    buffer: Buffer
    weights: WeightSync
    engine: GenerationEngine
    collector: Collector
    algo: Algorithm
    scorer: Scorer
    shutdown_steps: list[Callable[[], None]] = field(default_factory=list)
    evaluator: Evaluator | None = None
    """With `eval.every_steps`: evaluates the weights the trainer publishes."""
    cores: CoreShare = field(default_factory=lambda: CoreShare(0))
    """The torch threads of generation and training (`run.share_cores`)."""
    episodes: EpisodeRunner | None = None
    """With `env.name`: what plays the episodes (its steps log, for the checkpoint and the
    resume)."""
    agents: AgentRuns | None = None
    """With `agent.name`: the agent runs (their log, for the checkpoint and the resume)."""
    end_id: int = -1
    """The token a sample's turn ends with (the engine's eos): a sample whose last token is
    another was cut at the length limit (`asyncrl.train.learning`)."""

    def stop_generation(self) -> None:
        """Stops the collector: asks it to stop, stops the reward workers (a reward call that
        hangs without a timeout would otherwise hold the join forever; its batch fails and
        stays in flight in the ledger), then waits for the engine call in progress."""
        self.collector.stop(timeout_s=0)
        self.scorer.pool.close()
        self.collector.stop()

    def watch_drains(
        self, config: Config, notify_trainer: Callable[[Notice], None], emit: Callable[..., None]
    ) -> None:
        """On Ray: records where each generation worker runs (a `generation_worker` event), and
        with `ray.watch_drains` answers Ray's drains from now on (its generation workers hand
        their work back, a drain of this node is a notice), until `shutdown`. Nothing on
        threads."""
        if config.rollout.backend != "ray":
            return
        from asyncrl.distributed.drains import watch_drains
        from asyncrl.distributed.worker import RayEngine

        assert isinstance(self.engine, RayEngine)
        self.engine.record_placements(emit)
        if not config.ray.watch_drains:
            return
        stop = watch_drains(self.engine, notify_trainer, emit, config.ray.drain_poll_s)
        self.shutdown_steps.insert(0, stop)

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


def load_run_task(config: Config) -> Task:
    """The run's rows: `data.*`'s, or with `agent.name=verifiers:MODULE` the environment's
    tasks (its rubric is the reward: `data.reward_fn` is not used)."""
    if not is_verifiers(config.agent.name):
        return load_task(config.data)
    agent = config.agent
    venv = verifiers_env(agent.name, agent.args, agent.max_calls, agent.max_tokens)
    # data.* is not read (its path may not exist): the reward named is never called
    return Task(
        name=agent.name,
        examples=venv.examples(),
        reward_target=BUILTIN_REWARDS["exact_match"],
        reward_fn_name=f"{agent.name}'s rubric",
    )


def build_trainer_side(
    config: Config, ranks: Ranks = SINGLE, device: torch.device | None = None
) -> tuple[Task, Policy, Callable[[], Algorithm]]:
    """What every trainer rank builds: the task, the policy on `train.device` (this rank's
    `device` with ranks), and a function that builds the algorithm — called once the engine
    and the evaluator have copied the full policy, since the algorithm shards it with ranks."""
    train_device = device or resolve_device("train.device", config.train.device)
    task = load_run_task(config)
    alphabet = task.alphabet()
    if config.env.name:  # the characters its replies use, for the `tiny` preset's vocabulary
        alphabet |= set(getattr(environment_class(config.env.name), "alphabet", ""))
    policy = load_policy(config.model, config.run.seed, alphabet)
    place(policy.model, train_device)
    if adapters_in_engine(config):  # the torch engine shares the base and runs the adapters
        apply_lora(policy, config.model, config.run.seed)

    def build_algorithm() -> Algorithm:
        if not adapters_in_engine(config):  # the engines copied the plain model: merged weights
            apply_lora(policy, config.model, config.run.seed)
        # built before any checkpoint is loaded: a critic or reference copies the initial weights
        return algorithm_class(config.algo.name)(policy, config, ranks)

    return task, policy, build_algorithm


def build_components(
    config: Config,
    on_batch: OnBatch | None = None,
    ranks: Ranks = SINGLE,
    device: torch.device | None = None,
    scratch_dir: str = "",
    run_dir: str = "",
) -> Components:
    """Rank 0's (the only rank's) run: generation, the ledger, the buffer, the algorithm.
    `scratch_dir`: where an engine in this process may write files (`EngineSpec`); `run_dir`:
    the run's directory (environments keep files that outlive a launch under it)."""
    rollout = config.rollout
    check_engine(config)
    if rollout.backend == "threads":  # on Ray the device is the workers' (checked there)
        resolve_device("rollout.device", rollout.device)
    task, policy, build_algorithm = build_trainer_side(config, ranks, device)
    cores = core_share(config)
    if rollout.backend == "threads":  # before the engine, evaluator and reference copy it
        cores.watch(policy.model)
    # a prompt the model cannot take is refused here, before any engine or worker starts
    budget = (
        "agent.max_tokens" if config.agent.name
        else "env.max_episode_tokens" if config.env.name
        else "rollout.max_new_tokens"
    )  # fmt: skip
    prompts = encode_prompts(
        task, policy.tokenizer, config.generated_tokens, policy.max_seq_len, budget
    )
    stream = PromptStream(
        len(task.examples),
        rollout.num_prompts_per_step,
        config.run.seed,
        data_sha256=examples_sha256(task.examples),
    )
    ledger = Ledger(stream)
    shutdown: list[Callable[[], None]] = []
    local = scratch_dir if rollout.backend == "threads" else ""  # a Ray worker's is its node's
    episodes = _episode_runner(config, task, policy, run_dir)
    # an episode's assistant turn ends where its chat template ends one (`<|im_end|>`)
    # (and an agent's call, where its template ends the turn)
    eos_id = episodes.eos_id if episodes else _turn_end(config, policy)
    spec = _engine_spec(config, policy, local, eos_id, run_dir)
    buffer, weights, engine = _generation_backend(config, spec, shutdown)
    pool = task_reward_pool(task, rollout)
    shutdown.append(pool.close)
    try:
        evaluator = build_evaluator(config, policy, task, pool) if config.eval.every_steps else None
        algo = build_algorithm()  # after the engine and evaluator copied the full policy
        weights.publish(0, algo.policy_weights())
    except BaseException:
        Components.run_steps(shutdown)  # what the backend started, and the reward pool
        raise
    scorer = Scorer(task, policy.tokenizer, pool)
    agents = _agent_runs(config, task, policy, engine, pool, eos_id, run_dir)
    if agents is not None:
        shutdown.append(agents.close)
    collector = Collector(
        ledger=ledger,
        buffer=buffer,
        rollout=agents or _rollout(config, engine, policy, prompts, scorer, episodes),
        window=rollout.max_trajectory_age_steps,
        groups_per_batch=rollout.resolved_groups_per_batch,
        end_target=config.run.max_num_steps,
        on_batch=on_batch,
        pin_versions=config.run.deterministic,
        max_failures=rollout.max_generation_failures,
        weights=weights,
        cores=cores,
    )
    return Components(
        policy, task, stream, ledger, buffer, weights, engine, collector, algo, scorer, shutdown,
        evaluator, cores, episodes, agents, eos_id,
    )  # fmt: skip


def core_share(config: Config) -> CoreShare:
    """`run.torch_threads` for each side, handed to a side running alone with
    `run.share_cores` where it can be: generation in this process, one trainer process, and
    no deterministic run."""
    run = config.run
    sharing = (
        run.share_cores
        and not run.deterministic
        and config.rollout.backend == "threads"
        and config.train.num_processes == 1
    )
    return CoreShare(run.torch_threads, sharing)


def _rollout(
    config: Config,
    engine: GenerationEngine,
    policy: Policy,
    prompts: Sequence[list[int]],
    scorer: Scorer,
    episodes: EpisodeRunner | None,
) -> Rollout:
    """How the collector drives a sample: a multi-turn episode with `env.name`, else a single
    turn scored by the task's reward."""
    rollout = config.rollout
    options = PassOptions(
        engine,
        rollout.num_generations_per_prompt,
        config.run.seed,
        policy.pad_id,
        rollout.chunk_tokens,
        rollout.update_weights_mid_generation,
    )
    if episodes is not None:
        return EpisodeTurns(options, episodes)
    if not rollout.overlong_buffer:
        return SingleTurns(options, prompts, scorer.score)
    # the run's own rewards only: an evaluation scores the answers alone
    score = with_overlong_penalty(scorer.score, rollout.max_new_tokens, rollout.overlong_buffer,
                                  rollout.overlong_penalty)  # fmt: skip
    return SingleTurns(options, prompts, score)


def _turn_end(config: Config, policy: Policy) -> int:
    """Where generation stops a sample: an agent's call at its chat template's end of turn
    (`<|im_end|>`), else the model's eos."""
    if config.agent.name and getattr(policy.tokenizer, "chat_template", None):
        return turn_end_id(policy.tokenizer, policy.eos_id)
    return policy.eos_id


def _agent_runs(
    config: Config,
    task: Task,
    policy: Policy,
    engine: GenerationEngine,
    pool: RewardPool,
    eos_id: int,
    run_dir: str,
) -> AgentRuns | None:
    """With `agent.name`: the agent runs, their endpoint and their log (`RUN_DIR/
    agent_calls.jsonl`)."""
    agent = config.agent
    if not agent.name:
        return None
    limits = AgentLimits(
        agent.max_calls,
        agent.max_tokens,
        config.rollout.max_new_tokens,
        agent.timeout_s,
        agent.retries,
        policy.max_seq_len,
    )
    agent_fn: Any
    scorer: RewardPool | None = pool
    if is_verifiers(agent.name):  # its rubric scores every run: no data.reward_fn
        venv = verifiers_env(agent.name, agent.args, agent.max_calls, agent.max_tokens)
        agent_fn = VerifiersAgent(venv)
        scorer = None
    else:
        agent_fn = load_agent(agent.name)
    return AgentRuns(
        agent_fn,
        agent.name,
        task.examples,
        policy.tokenizer,
        eos_id,
        engine,
        config.rollout.num_generations_per_prompt,
        config.run.seed,
        limits,
        AgentLog(Path(run_dir) / AGENT_LOG if run_dir else None),
        scorer,
        agent.tool_parser,
        config.run.deterministic,
        read_run_id(Path(run_dir)) if run_dir else "",
    )


def _episode_runner(
    config: Config, task: Task, policy: Policy, run_dir: str
) -> EpisodeRunner | None:
    """With `env.name`: what plays the episodes for the collector (an environment's files,
    such as a tool's journal, go to `RUN_DIR/env/`)."""
    env = config.env
    if not env.name:
        return None
    return EpisodeRunner(
        environment_class(env.name),
        env.name,
        task.examples,
        policy.tokenizer,
        policy.eos_id,
        config.run.seed,
        env.max_turns,
        config.rollout.max_new_tokens,
        env.max_episode_tokens,
        Path(run_dir) / ENV_DIR if run_dir else None,
        Path(run_dir) / ENV_STEPS if run_dir else None,
        restart_on_resume=config.checkpoint.resume_policy == "restart_episode",
        deterministic=config.run.deterministic,
        run_id=read_run_id(Path(run_dir)) if run_dir else "",
    )


def _engine_spec(
    config: Config, policy: Policy, scratch_dir: str, eos_id: int, run_dir: str = ""
) -> EngineSpec:
    rollout = config.rollout
    options = engine_options(config)
    if rollout.engine == "vllm_server":  # its servers' logs and records: RUN_DIR/servers/
        options["run_dir"] = run_dir
    return EngineSpec(
        policy.model,
        eos_id,
        policy.pad_id,
        config.generated_tokens,
        rollout.temperature,
        rollout.device,
        rollout.dtype,
        keep_cache_between_chunks=not config.run.deterministic,
        options=options,
        scratch_dir=scratch_dir,
    )


def _generation_backend(
    config: Config, spec: EngineSpec, shutdown: list[Callable[[], None]]
) -> tuple[Buffer, WeightSync, GenerationEngine]:
    """The buffer, the weight sync and the engine of `rollout.backend`: in this process
    (`threads`), or on Ray (what it starts is added to `shutdown`)."""
    rollout = config.rollout
    if rollout.backend == "ray":
        return _ray_backend(config, spec, shutdown)
    buffer = ReplayBuffer(rollout.num_prompts_per_step, rollout.buffer_capacity)
    weights = CopyWeightSync(config.kept_weight_versions, rollout.device, DTYPES[rollout.dtype])
    engine = build_engine(rollout.engine, spec, weights)
    stop_engine = getattr(engine, "shutdown", None)  # what an engine started (vLLM servers)
    if stop_engine is not None:
        shutdown.insert(0, stop_engine)
    return buffer, weights, engine


def _ray_backend(
    config: Config, spec: EngineSpec, shutdown: list[Callable[[], None]]
) -> tuple[Buffer, WeightSync, GenerationEngine]:
    """Generation workers, the weights' object store and the buffer actor on Ray; what it
    starts is released by `shutdown` (in that list), also if building fails half-way."""
    import ray  # an optional extra: only this backend needs it

    from asyncrl.distributed.cluster import start_ray
    from asyncrl.distributed.remote_buffer import BufferClient
    from asyncrl.distributed.weights import ObjectStoreWeightSync
    from asyncrl.distributed.worker import build_ray_engine

    if start_ray(config):
        shutdown.append(ray.shutdown)
    try:
        weights = ObjectStoreWeightSync(config.kept_weight_versions)
        engine = build_ray_engine(config, spec, weights)
        shutdown.insert(0, engine.shutdown)
        rollout = config.rollout
        buffer = BufferClient(rollout.num_prompts_per_step, rollout.buffer_capacity)
        shutdown.insert(0, buffer.shutdown)
    except BaseException:
        Components.run_steps(shutdown)
        raise
    return buffer, weights, engine
