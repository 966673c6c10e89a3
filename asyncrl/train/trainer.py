"""The async training loop.

    Collector thread                          Trainer (main thread)
    ----------------                          ---------------------
    admit target k//N <= v + A  ─┐            for t in steps:
    generate with version v      │              groups = buffer.sample(t)   # waits for all N
    score, buffer.add(group) ────┼──────────▶   GRPO step on groups
    wait if nothing admissible ◀─┴── v=t+1 ──   publish weights version t+1 to the engine
                                                every save_period steps: checkpoint

Who waits on whom: the trainer waits only for the N groups of its own step; the collector
waits only when every target inside the window is already dispatched. Staleness bound: a
group trained at step t was generated with a weights version v in [t - A, t], A =
`rollout.max_trajectory_age_steps`. With A = 0 the collector admits target t only after
version t is published, so generation and training alternate: exactly synchronous training.

Checkpoints are taken between steps: the trainer owns the weights and optimizer there, and
the collector's lock gives one consistent cut of ledger and buffer (generation keeps running;
only admission and completion wait while the cut is copied).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm import tqdm

from asyncrl.checkpoint.snapshot import Snapshot, capture_rng, restore_rng
from asyncrl.checkpoint.store import CheckpointError
from asyncrl.checkpoint.writer import CheckpointWriter
from asyncrl.config import Config, benign_differences, config_hash
from asyncrl.core.resume import ResumePlan, SavedLedger, plan_resume
from asyncrl.core.tensors import clone_state
from asyncrl.core.types import Group, PromptTicket
from asyncrl.faults import fault_point
from asyncrl.plots import write_plots
from asyncrl.rollout.collector import GenerationFailed
from asyncrl.train.components import build_components
from asyncrl.train.records import (
    EventLog,
    JsonlLog,
    MetricsSink,
    TensorBoardSink,
    latest_records,
    read_jsonl,
)
from asyncrl.train.report import plot_reward_curve, summarize
from asyncrl.train.rundir import RunDir, open_run_dir
from asyncrl.train.signals import Preempted, StopRequest

SKIP_RESTORE = frozenset(filter(None, os.environ.get("ASYNCRL_TEST_SKIP_RESTORE", "").split(",")))
"""Test-only: pieces of state a resume deliberately does not restore (`optimizer`, `rng`,
`cursor`, `buffer`, `critic`), so the determinism tests can prove they would notice. Read once."""


class Trainer:
    """Drives one launch of a run: resumes if the run dir has a verified checkpoint, trains to
    `run.max_num_steps`, checkpoints, reports."""

    def __init__(self, config: Config, run: RunDir, stop: StopRequest | None = None) -> None:
        self.config = config
        self.run_dir = run.path
        self.run = run
        self.stop = stop or StopRequest()
        if config.run.torch_threads:
            torch.set_num_threads(config.run.torch_threads)
        torch.use_deterministic_algorithms(config.run.deterministic)  # process-wide: set both ways
        self.events = EventLog(self.run_dir / "events.jsonl")
        self.metrics = JsonlLog(self.run_dir / "metrics.jsonl")
        self.timeline = JsonlLog(self.run_dir / "timeline.jsonl")
        self.sinks: list[MetricsSink] = [self.metrics]
        if config.logging.tensorboard:
            self.sinks.append(TensorBoardSink(self.run_dir / "tensorboard"))
        self.parts = build_components(config, self._on_batch)
        self.step = 0
        self.attempt = run.attempt
        self.last_saved_step = -1
        self._start_s = time.perf_counter()
        self.writer = CheckpointWriter(
            run.store,
            config_hash(config),
            config.checkpoint.keep_last,
            lambda fields: self.events.emit("checkpoint", **fields),
        )

    # --- state ----------------------------------------------------------------------------

    def state_dict(self) -> tuple[Snapshot, float]:
        """The run's consistent cut, and how long generation's bookkeeping was held for it."""
        ledger, buffer, pause_s = self.parts.collector.snapshot()
        snapshot = Snapshot(
            trainer={
                "step": self.step,
                "weights_version": self.step,
                "attempt": self.attempt,
                "run_id": self.run.run_id,
            },
            model=self.parts.policy.model.state_dict(),
            optimizer=self.parts.algo.optimizer.state_dict(),
            ledger=ledger,
            buffer=buffer,
            rng=capture_rng(),
            config=self.config.to_dict(),
        )
        algo = self.parts.algo
        if algo.critic is not None and algo.critic_optimizer is not None:
            snapshot.critic = algo.critic.state_dict()
            snapshot.critic_optimizer = algo.critic_optimizer.state_dict()
        if algo.reference is not None:
            snapshot.trainer["reference_sha256"] = algo.reference.sha256
        if self.config.run.deterministic:  # versions older than `step` still to generate with
            published = self.parts.engine.published_versions()
            snapshot.generation = {v: w for v, w in published.items() if v < self.step}
        return snapshot, pause_s

    def load_state_dict(self, snapshot: Snapshot) -> ResumePlan:
        """Restores a snapshot and applies `checkpoint.resume_policy`; returns the plan."""
        skip = SKIP_RESTORE  # test-only negative controls; empty in real use
        self.parts.policy.model.load_state_dict(snapshot.model)
        algo = self.parts.algo
        if "optimizer" not in skip:
            algo.optimizer.load_state_dict(snapshot.optimizer)
        if algo.critic is not None and algo.critic_optimizer is not None and "critic" not in skip:
            if not snapshot.critic or not snapshot.critic_optimizer:
                raise CheckpointError(
                    f"the checkpoint of step {snapshot.trainer['step']} has no critic (it was "
                    "written by a run without one); algo.name cannot change on resume"
                )
            algo.critic.load_state_dict(snapshot.critic)
            algo.critic_optimizer.load_state_dict(snapshot.critic_optimizer)
        saved_reference = snapshot.trainer.get("reference_sha256")
        if algo.reference is not None and saved_reference != algo.reference.sha256:
            raise CheckpointError(
                f"the reference policy rebuilt from the config (weights sha256 "
                f"{algo.reference.sha256}) is not the one step {snapshot.trainer['step']} was "
                f"trained against ({saved_reference}); did the files under model.path change?"
            )
        if "rng" not in skip:
            restore_rng(snapshot.rng)
        self.step = int(snapshot.trainer["step"])
        self.last_saved_step = self.step
        ledger, buffer = self.parts.ledger, self.parts.buffer
        if "cursor" not in skip:
            ledger.load_state_dict(snapshot.ledger)
        if "buffer" not in skip:
            buffer.load_state_dict(snapshot.buffer)
        for version in sorted(snapshot.generation):
            self.parts.engine.update_weights(snapshot.generation[version], version)
        saved = SavedLedger(
            step=self.step,
            num_prompts_per_step=self.config.rollout.num_prompts_per_step,
            cursor=ledger.stream.cursor,
            in_flight=[(t.ordinal, t.target_step) for t in ledger.redispatch],
            buffered=buffer.ordinals_and_targets(),
        )
        plan = plan_resume(saved, self.config.checkpoint.resume_policy)
        if plan.policy != "lossless":
            ledger.redispatch.clear()
            buffer.discard(plan.discarded)
            ledger.stream.schedule.refill(saved.cursor, plan.fills, plan.next_target)
        self._publish_weights(self.step)
        return plan

    def resume(self) -> None:
        """Loads the run dir's newest verified checkpoint, if any, and records the resume."""
        for reason in self.run.rejected:
            print(f"asyncrl: skipping checkpoint: {reason}")
        if self.run.rejected:
            fallback = (
                self.run.latest.path if self.run.latest else "nothing (no verified checkpoint)"
            )
            print(f"asyncrl: falling back to {fallback}")
        snapshot = self.run.snapshot
        if snapshot is None:
            if self.attempt:
                print(f"asyncrl: no verified checkpoint; from step 0 (attempt {self.attempt})")
            return
        cursor = int(snapshot.ledger["stream"]["cursor"])
        plan = self.load_state_dict(snapshot)
        for line in plan.messages:
            print(line)
        self.events.emit(
            "resume",
            attempt=self.attempt,
            from_step=self.step,
            cursor=cursor,
            policy=plan.policy,
            kept_groups=plan.kept,
            reissued_ordinals=[k for k, _ in plan.redispatched],
            skipped_ordinals=plan.skipped,
            discarded_groups=plan.discarded,
            refilled_targets=plan.fills,
            rejected_checkpoints=self.run.rejected,
            config_changes=benign_differences(snapshot.config, self.config),
            forced_config_changes=self.run.forced_changes,
        )
        print(
            f"asyncrl: resumed at step {self.step} (attempt {self.attempt}, {plan.policy}): kept "
            f"{len(plan.kept)} buffered groups, re-dispatched {len(plan.redispatched)} in-flight "
            f"prompts, skipped {len(plan.skipped)} prompts, discarded {len(plan.discarded)} "
            "finished groups"
        )

    # --- the loop -------------------------------------------------------------------------

    def run_to_end(self) -> str:
        """Trains to `run.max_num_steps`; returns the end-of-run summary. Raises `Preempted`
        after writing a checkpoint if a stop signal arrived."""
        self.resume()
        self.events.emit(
            "start",
            attempt=self.attempt,
            from_step=self.step,
            run_id=self.run.run_id,
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
        self._start_s = time.perf_counter() - self._wall_offset()
        self.parts.collector.start()
        try:
            while self.step < self.config.run.max_num_steps:
                record = self.train_step()
                progress.set_postfix_str(self._postfix(record), refresh=False)
                progress.update(1)
                if self.stop.requested or self.step % self.config.checkpoint.save_period == 0:
                    self.checkpoint()
                if self.stop.requested:
                    raise Preempted(self.stop.signal_name or "signal")
            if self.last_saved_step != self.step:
                self.checkpoint()
            self.writer.wait()  # exit 0 only with the final checkpoint written and verified
        except Preempted as stop:
            self._on_preempted(stop)
            raise
        except GenerationFailed:
            # the cut is still consistent (the failed batch is queued as in flight): keep it
            if self.last_saved_step != self.step:
                self.checkpoint(wait=True)
            raise
        finally:
            self.parts.collector.stop(timeout_s=1.0)  # a batch still running is not waited for
            progress.close()
        return self.finish()

    def _wall_offset(self) -> float:
        """Wall seconds the run had spent up to the resumed step, so `wall_s` keeps counting
        across attempts."""
        earlier = [r for r in read_jsonl(self.run_dir / "metrics.jsonl") if r["step"] < self.step]
        return max((r["wall_s"] for r in latest_records(earlier)), default=0.0)

    def _on_preempted(self, stop: Preempted) -> None:
        """The emergency checkpoint, first: the cut needs no pause of generation, and a
        preempted machine's grace period is short."""
        self.events.emit("signal", signal=stop.signal_name, step=self.step)
        try:
            self.writer.wait()
        except CheckpointError as err:  # an earlier periodic save failed: still try this one
            print(f"asyncrl: an earlier checkpoint write failed: {err}")
        if self.last_saved_step != self.step:
            self.checkpoint(wait=True)
        print(
            f"asyncrl: {stop.signal_name}: checkpoint of step {self.step} written; run the same "
            "command again to resume"
        )

    def _wait_check(self) -> None:
        self.parts.collector.check()
        n = self.config.rollout.num_prompts_per_step
        self.parts.collector.check_step_can_complete(self.step, n)
        if self.stop.requested:
            raise Preempted(self.stop.signal_name or "signal")

    def train_step(self) -> dict[str, Any]:
        """Samples step t's groups, updates the policy, publishes version t+1, records."""
        step = self.step
        wait_start = time.perf_counter()
        groups = self.parts.buffer.sample(step, check=self._wait_check)
        train_start = time.perf_counter()
        algo_metrics = self.parts.algo.step(groups, step)
        fault_point("train.optimizer_step")
        trained = time.perf_counter()
        self.timeline.write(
            {
                "kind": "train",
                "start": unix_time(train_start),
                "seconds": trained - train_start,
                "step": step,
                "attempt": self.attempt,
            }
        )
        self._publish_weights(step + 1)
        fault_point("train.weights_published")
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

    def checkpoint(self, wait: bool = False) -> None:
        """Copies the current step's state and hands it to the background writer, which
        writes, verifies and retains; `wait=True` also blocks until that is done."""
        start = time.perf_counter()
        snapshot, pause_s = self.state_dict()
        snapshot.model = clone_state(snapshot.model)
        snapshot.optimizer = copy.deepcopy(snapshot.optimizer)
        snapshot.critic = clone_state(snapshot.critic)  # the next step updates them in place
        snapshot.critic_optimizer = copy.deepcopy(snapshot.critic_optimizer)
        info = {
            "blocked_s": time.perf_counter() - start,
            "pause_s": pause_s,
            "in_flight": len(snapshot.ledger["in_flight"]),
            "buffered": len(snapshot.buffer["groups"]),
        }
        self.writer.submit(self.step, snapshot, info)
        self.last_saved_step = self.step
        if wait:
            self.writer.wait()

    def _publish_weights(self, version: int) -> None:
        self.parts.engine.update_weights(self.parts.policy.model.state_dict(), version)
        self.parts.collector.publish_version(version)

    def _on_batch(
        self, start: float, elapsed: float, version: int, tickets: list[PromptTicket]
    ) -> None:
        self.timeline.write(
            {
                "kind": "generate",
                "start": unix_time(start),
                "seconds": elapsed,
                "version": version,
                "attempt": self.attempt,
                "ordinals": [t.ordinal for t in tickets],
                "targets": [t.target_step for t in tickets],
            }
        )

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
            "tokens_sha256": tokens_digest(groups),
            "buffer_groups": len(self.parts.buffer),
            "generation_failures": self.parts.collector.num_failures,
            **self._engine_record(),
            **algo,
        }

    def _engine_record(self) -> dict[str, Any]:
        """Ray backend: cumulative seconds workers spent fetching and loading weights, and
        workers replaced after dying."""
        engine = self.parts.engine
        load_s = getattr(engine, "load_s", None)
        if load_s is None:
            return {}
        return {
            "weights_load_s": load_s,
            "workers_replaced": getattr(engine, "workers_replaced", 0),
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
        self.close()
        records = latest_records(read_jsonl(self.run_dir / "metrics.jsonl"))
        if self.config.logging.plot and records:
            plot_reward_curve(records, self.run_dir / "reward_curve.png")
            write_plots(self.run_dir)
        return summarize(records, self.run_dir, records[-1]["wall_s"] if records else wall_s)

    def close(self) -> None:
        for sink in self.sinks[1:]:
            sink.close()
        for log in (self.metrics, self.events, self.timeline):
            log.close()


_UNIX_OFFSET_S = time.time() - time.perf_counter()


def unix_time(perf_s: float) -> float:
    """The wall-clock time of a `time.perf_counter()` reading, through one offset fixed per
    process: spans of one launch keep perf_counter's exact order (no jitter from reading two
    clocks per span), and spans of different launches share the Unix clock."""
    return perf_s + _UNIX_OFFSET_S


def tokens_digest(groups: list[Group]) -> str:
    """SHA-256 (first 16 hex digits) of the step's sampled tokens, in ordinal order: equal
    digests mean the same completions were trained."""
    digest = hashlib.sha256()
    for group in groups:
        digest.update(group.completion_ids.numpy().tobytes())
        digest.update(group.completion_mask.numpy().tobytes())
    return digest.hexdigest()[:16]


def train(
    config: Config,
    run_dir: Path,
    stop: StopRequest | None = None,
    restart: bool = False,
    force_config: bool = False,
) -> str:
    """Starts or resumes the run in `run_dir`; returns the end-of-run summary."""
    run = open_run_dir(run_dir, config, restart=restart, force_config=force_config)
    try:
        trainer = Trainer(config, run, stop)
        try:
            return trainer.run_to_end()
        except BaseException:
            with contextlib.suppress(BaseException):
                trainer.writer.wait()  # a write in progress is still a good checkpoint
            trainer.close()
            raise
        finally:
            trainer.parts.shutdown()  # Ray actors and a local Ray, if this run started them
    finally:
        if run.lock is not None:
            run.lock.close()  # releases the run dir lock
