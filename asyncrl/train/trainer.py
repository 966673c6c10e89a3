"""The async training loop.

    Collector thread                          Trainer (main thread)
    ----------------                          ---------------------
    admit target k//N <= v + A  ─┐            for t in steps:
    generate with version v      │              groups = buffer.sample(t)   # waits for all N
    score, buffer.add(group) ────┼──────────▶   GRPO step on groups
    wait if nothing admissible ◀─┴── v=t+1 ──   publish weights version t+1 to the engine

Who waits on whom: the trainer waits only for the N groups of its own step; the collector
waits only when every target inside the window is already dispatched. Staleness bound: a
group trained at step t was generated with a weights version v in [t - A, t], A =
`rollout.max_trajectory_age_steps`. With A = 0 the collector admits target t only after
version t is published, so generation and training alternate: exactly synchronous training.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm import tqdm

from asyncrl.config import Config, dump_config
from asyncrl.core.buffer import ReplayBuffer
from asyncrl.core.stream import PromptStream
from asyncrl.core.types import Group
from asyncrl.models.policy import Policy, load_policy
from asyncrl.rollout.collector import Collector, Scorer, encode_prompts
from asyncrl.rollout.engine import TorchGenerationEngine
from asyncrl.tasks.source import Task, load_task
from asyncrl.train.grpo import GRPO
from asyncrl.train.records import EventLog, JsonlLog, MetricsSink, TensorBoardSink, read_jsonl
from asyncrl.train.report import plot_reward_curve, summarize


class RunDirError(RuntimeError):
    """The run dir cannot be used as asked; the message says what to do."""


@dataclass
class Components:
    """Everything one run is made of, built from the config by `build_components`."""

    policy: Policy
    task: Task
    stream: PromptStream
    buffer: ReplayBuffer
    engine: TorchGenerationEngine
    collector: Collector
    algo: GRPO


def build_components(config: Config, timeline: JsonlLog | None = None) -> Components:
    rollout = config.rollout
    task = load_task(config.data)
    policy = load_policy(config.model, config.run.seed, task.alphabet())
    prompts = encode_prompts(task, policy.tokenizer, rollout.max_new_tokens, policy.max_seq_len)
    stream = PromptStream(len(task.examples), rollout.num_prompts_per_step, config.run.seed)
    buffer = ReplayBuffer(rollout.num_prompts_per_step, rollout.max_trajectory_age_steps)
    engine = TorchGenerationEngine(
        policy.model, policy.eos_id, policy.pad_id, rollout.max_new_tokens, rollout.temperature
    )

    def on_batch(start: float, elapsed: float, version: int, ordinals: list[int]) -> None:
        if timeline is not None:
            timeline.write(
                {
                    "kind": "generate",
                    "start": start,
                    "seconds": elapsed,
                    "version": version,
                    "ordinals": ordinals,
                }
            )

    collector = Collector(
        stream=stream,
        buffer=buffer,
        engine=engine,
        prompts=prompts,
        scorer=Scorer(task, policy.tokenizer),
        num_generations=rollout.num_generations_per_prompt,
        max_age_steps=rollout.max_trajectory_age_steps,
        seed=config.run.seed,
        batch_groups=rollout.num_prompts_per_step,
        on_batch=on_batch,
    )
    algo = GRPO(policy.model, config.algo, rollout.temperature, policy.pad_id)
    return Components(policy, task, stream, buffer, engine, collector, algo)


def prepare_run_dir(run_dir: Path, config: Config) -> None:
    """Creates the run dir; refuses one that already holds a run."""
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "events.jsonl").exists():
        raise RunDirError(
            f"{run_dir} already holds a run (metrics.jsonl/events.jsonl). Resuming needs a "
            "checkpoint, which this version does not write yet: choose a new --run-dir."
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(config))


class Trainer:
    """Drives one run: starts the collector, trains `run.max_num_steps` steps, reports."""

    def __init__(self, config: Config, run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir
        if config.run.torch_threads:
            torch.set_num_threads(config.run.torch_threads)
        self.events = EventLog(run_dir / "events.jsonl")
        self.metrics = JsonlLog(run_dir / "metrics.jsonl")
        self.timeline = JsonlLog(run_dir / "timeline.jsonl")
        self.sinks: list[MetricsSink] = [self.metrics]
        if config.logging.tensorboard:
            self.sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        self.parts = build_components(config, self.timeline)
        self.step = 0
        self.attempt = 0
        self._start_s = 0.0

    def run(self) -> str:
        """Trains to `run.max_num_steps`; returns the end-of-run summary."""
        self._start_s = time.perf_counter()
        self.events.emit(
            "start",
            attempt=self.attempt,
            from_step=self.step,
            num_parameters=self.parts.policy.num_parameters(),
            config=self.config.to_dict(),
        )
        progress = tqdm(
            total=self.config.run.max_num_steps,
            initial=self.step,
            desc="train",
            unit="step",
            disable=not self.config.logging.progress,
            dynamic_ncols=True,
            mininterval=0.5,
        )
        self.parts.collector.start()
        try:
            while self.step < self.config.run.max_num_steps:
                record = self.train_step()
                progress.set_postfix_str(self._postfix(record), refresh=False)
                progress.update(1)
        finally:
            self.parts.collector.stop()
            progress.close()
        return self.finish()

    def train_step(self) -> dict[str, Any]:
        """Samples step t's groups, updates the policy, publishes version t+1, records."""
        step = self.step
        wait_start = time.perf_counter()
        groups = self.parts.buffer.sample(step, check=self.parts.collector.check)
        train_start = time.perf_counter()
        algo_metrics = self.parts.algo.step(groups)
        trained = time.perf_counter()
        self.timeline.write(
            {"kind": "train", "start": train_start, "seconds": trained - train_start, "step": step}
        )
        self._publish_weights(step + 1)
        record = self._record(step, groups, algo_metrics)
        record.update(
            wait_s=train_start - wait_start,
            train_s=trained - train_start,
            sync_s=time.perf_counter() - trained,
        )
        for sink in self.sinks:
            sink.write(record)
        self.step = step + 1
        return record

    def _publish_weights(self, version: int) -> None:
        self.parts.engine.update_weights(self.parts.policy.model.state_dict(), version)
        self.parts.collector.publish_version(version)

    def _record(self, step: int, groups: list[Group], algo: dict[str, float]) -> dict[str, Any]:
        return {
            "step": step,
            "attempt": self.attempt,
            "prompt_ordinals": [g.ordinal for g in groups],
            "dataset_indices": [g.ticket.dataset_index for g in groups],
            "reward_mean": algo.pop("reward_mean"),
            "loss": algo.pop("loss"),
            "generation_version_min": min(g.version_min for g in groups),
            "generation_version_max": max(g.version_max for g in groups),
            "wall_s": time.perf_counter() - self._start_s,
            "generation_s": sum(g.generation_s for g in groups),
            "buffer_groups": len(self.parts.buffer),
            **algo,
        }

    def _postfix(self, record: dict[str, Any]) -> str:
        capacity = self.parts.buffer.capacity
        return (
            f"reward={record['reward_mean']:.3f} "
            f"buf={record['buffer_groups']}/{capacity} "
            f"stale={record['step'] - record['generation_version_min']}"
        )

    def finish(self) -> str:
        wall_s = time.perf_counter() - self._start_s
        transformers.utils.logging.disable_progress_bar()
        self.parts.policy.model.save_pretrained(self.run_dir / "final_model")
        self.parts.policy.tokenizer.save_pretrained(self.run_dir / "final_model")
        self.events.emit("end", step=self.step, wall_s=wall_s)
        for sink in self.sinks[1:]:
            sink.close()
        for log in (self.metrics, self.events, self.timeline):
            log.close()
        records = read_jsonl(self.run_dir / "metrics.jsonl")
        if self.config.logging.plot and records:
            plot_reward_curve(records, self.run_dir / "reward_curve.png")
        return summarize(records, self.run_dir, wall_s)


def train(config: Config, run_dir: Path) -> str:
    prepare_run_dir(run_dir, config)
    return Trainer(config, run_dir).run()
