"""The async training loop.

    Collector thread                          Trainer (main thread)
    ----------------                          ---------------------
    admit target k//N <= v + A  ─┐            for t in steps:
    generate with version v      │              groups = buffer.sample(t)   # waits for all N
    score, buffer.add(group) ────┼──────────▶   algorithm.step(groups, t)
    wait if nothing admissible ◀─┴── v=t+1 ──   publish weights version t+1 to the engine
                                                checkpoint when due (save_period,
                                                every_s), deferred while one is written

Who waits on whom: the trainer waits only for the N groups of its own step; the collector
waits only when every target inside the window is already dispatched. Staleness bound: a
group trained at step t was generated with a weights version v in [t - A, t], A =
`rollout.max_trajectory_age_steps`. With A = 0 the collector admits target t only after
version t is published, so generation and training alternate: exactly synchronous training.

Checkpoints are taken between steps: the trainer owns the weights and optimizer there, and
the collector's lock gives one consistent cut of ledger, stream and buffer (generation keeps
running; only admission and completion wait while the cut is read). A checkpoint is the dict
of named stateful parts of `stateful_parts()`; the trainer names no algorithm and no engine.
The big parts' tensors are copied into reused staging buffers while the next step's forward
and backward run; its optimizer step waits for that copy (asyncrl/checkpoint/staging.py).
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm import tqdm

from asyncrl.algos.update import StepAbandoned, abandonable
from asyncrl.checkpoint.schedule import CheckpointSchedule
from asyncrl.checkpoint.snapshot import RNGState, Snapshot, Stateful
from asyncrl.checkpoint.staging import Cut, StagingArea
from asyncrl.checkpoint.writer import CheckpointWriter
from asyncrl.config import Config
from asyncrl.config.keys import config_hash
from asyncrl.core.episodes import recorded_steps
from asyncrl.core.resume import ResumePlan
from asyncrl.core.types import Group
from asyncrl.faults import cut_facts, fault_facts, fault_point
from asyncrl.models.device import bound_onednn_cache, dtype_line, model_device
from asyncrl.models.lora import check_base, checkpoint_part, save_final
from asyncrl.rollout.collector import GenerationFailed
from asyncrl.rollout.episodes import EpisodeRunner
from asyncrl.rollout.evaluation import EvaluationGivenUp, eval_line, is_eval_record
from asyncrl.rollout.rollouts import Chunk
from asyncrl.train.components import build_components
from asyncrl.train.kept import RolloutKeeper, held_by
from asyncrl.train.learning import Knobs, LearningWatch, learning_fields, learning_window
from asyncrl.train.preemption import (
    Deadlines,
    answer_notice,
    shutdown_by_deadline,
    stop_generation_by_deadline,
)
from asyncrl.train.ranks import (
    COLLECTIVE_DEATH_WAIT_S,
    RankFailed,
    RankGroup,
    launch,
)
from asyncrl.train.records import (
    RunLogs,
    generation_span,
    step_record,
    unix_time,
    wall_before,
)
from asyncrl.train.resume import restore, resume
from asyncrl.train.rundir import (
    SCRATCH_DIR,
    RunDir,
    open_run_dir,
    record_launch,
)
from asyncrl.train.signals import Aborted, Preempted, StopRequest

STAGED_IN_BACKGROUND = ("model", "algorithm", "generation")
"""Parts whose tensors change in place only in optimizer steps (weights, optimizer moments, a
critic) or never (generation's older weights versions): `capture` copies them while the next
step's forward and backward run. Every other part is copied under the cut."""


class Trainer:
    """Drives one launch of a run: resumes if the run dir has a verified checkpoint, trains to
    `run.max_num_steps`, checkpoints, reports."""

    def __init__(
        self,
        config: Config,
        run: RunDir,
        stop: StopRequest | None = None,
        group: RankGroup | None = None,
    ) -> None:
        self.config = config
        self.run_dir = run.path
        self.run = run
        self.stop = stop or StopRequest()
        bound_onednn_cache()  # before the first bf16 pass, which fixes oneDNN's cache size
        if config.run.torch_threads:
            torch.set_num_threads(config.run.torch_threads)
        torch.use_deterministic_algorithms(config.run.deterministic)  # process-wide: set both ways
        self.logs = RunLogs(self.run_dir, config.logging, config.to_dict())
        self.group = group
        """The other trainer ranks (`train.num_processes` > 1), else None."""
        self._published: dict[str, torch.Tensor] = {}
        """With ranks: the full weights last published (the policy itself is sharded)."""
        scratch = str(self.run_dir / SCRATCH_DIR)
        try:
            if group is None:
                self.parts = build_components(
                    config, self._on_batch, scratch_dir=scratch, run_dir=str(self.run_dir)
                )
            else:
                ranks = group.ranks
                self.parts = build_components(
                    config, self._on_batch, ranks, ranks.device, scratch, str(self.run_dir)
                )
        except BaseException:
            self.logs.close()  # nothing of a launch that never started stays open
            raise
        self.rng = RNGState()
        self.step = 0
        self.attempt = run.attempt
        if self.parts.episodes is not None:  # its steps log names the attempt
            self.parts.episodes.log.attempt = self.attempt
        if self.parts.agents is not None:  # so does the agent log
            self.parts.agents.log.attempt = self.attempt
        self.last_saved_step = -1
        self._wall_s: float | None = None  # `wall_s` of the last step record; a resume's offset
        self.continued: dict[int, tuple[list[int], list[bool]]] = {}
        self.recorded_steps: list[str] = []
        self._cut_steps: list[str] | None = None
        self.env_steps_offset = 0
        self.agent_log_offset = 0
        self.agent_replay: dict[str, int] = {}  # the resume event's account of the agent log
        self._start_s = time.perf_counter()
        self.staging = StagingArea(
            {"auto": None, "keep": True, "release": False}[config.checkpoint.staging_buffer]
        )
        saves = config.checkpoint
        self.schedule = CheckpointSchedule(
            saves.save_period, saves.every_s, saves.when_busy, last_saved_s=self._start_s
        )
        self.deadlines = Deadlines(self.run_dir / "events.jsonl")
        """Measured checkpoint times, for a preemption notice's deadline."""
        self.abandoned_step: int | None = None
        self.evaluation_at_notice: dict[str, Any] = {"evaluation": None}
        """What a notice did to an evaluation (`preemption_result`): `given_up` (one in
        progress), `skipped` (one due after it), with its `evaluation_version`."""
        self.keeper = RolloutKeeper(self.run_dir / "checkpoints", run.run_id)
        """Groups trained since the newest verified checkpoint, for a notice's kept rollouts."""
        self.keeps = (
            not config.env.name
            and not config.agent.name
            and config.checkpoint.resume_policy == "lossless"
        )
        """Whether a notice whose checkpoint does not fit keeps rollouts (single-turn,
        `lossless`: multi-turn runs recover their turns from the steps log, agent runs replay
        from the agent log)."""
        self.writer = CheckpointWriter(
            run.store, config_hash(config), config.checkpoint.keep_last, self._saved
        )
        rollout = config.rollout
        format_reward = config.data.format_reward if config.data.reward_fn == "math" else None
        self.learning = LearningWatch(
            Knobs(
                rollout.max_new_tokens,
                rollout.num_generations_per_prompt,
                rollout.temperature,
                None if config.agent.name or config.env.name else format_reward,
            ),
            window=learning_window(config.run.max_num_steps),
        )
        """Says once, with the knob, when a run is not learning (`asyncrl.train.learning`)."""

    # --- state ----------------------------------------------------------------------------

    def stateful_parts(self) -> dict[str, Stateful]:
        """Everything a resume must get back, by name: the checkpoint is these parts' states.
        Loaded in this order."""
        p = self.parts
        return {
            "trainer": self,
            "model": checkpoint_part(p.policy.model),  # a LoRA run's: its adapters
            "algorithm": p.algo,
            "rng": self.rng,
            "stream": p.stream,
            "ledger": p.ledger,
            "buffer": p.buffer,
            "generation": p.weights,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "weights_version": self.step,
            "attempt": self.attempt,
            "run_id": self.run.run_id,
            "wall_s": self._wall_s,
            "eval_data": self.parts.evaluator.identity if self.parts.evaluator else None,
            "base_sha256": self.parts.policy.base_sha256,  # None without LoRA
            # where a resume reads the steps log from: the steps this cut may not hold
            "env_steps_offset": episodes.log.log_mark if (episodes := self._episodes()) else None,
            # and the agent log from: the first record of an ordinal not yet in the buffer
            "agent_log_offset": agents.log.mark() if (agents := self.parts.agents) else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_base(state.get("base_sha256"), self.parts.policy.base_sha256, self.config.model)
        self.step = int(state["step"])
        self.last_saved_step = self.step
        if state.get("wall_s") is not None:  # else (older checkpoints) the records are scanned
            self._wall_s = float(state["wall_s"])
        self.env_steps_offset = int(state.get("env_steps_offset") or 0)
        self.agent_log_offset = int(state.get("agent_log_offset") or 0)

    def _episodes(self) -> EpisodeRunner | None:
        return self.parts.episodes

    def capture(self) -> tuple[Cut, float]:
        """The run's consistent cut, staged into this trainer's reused buffers (the parts of
        `STAGED_IN_BACKGROUND` still being copied when this returns: the next optimizer step
        waits for that), and how long generation's bookkeeping was held for it (while the
        parts' states are read and the small ones copied). The staging buffers must be free:
        the previous cut written or released."""
        parts = self.stateful_parts()
        with self.parts.collector.cut():
            start = time.perf_counter()
            states = {name: part.state_dict() for name, part in parts.items()}
            cut = self.staging.stage(states, self.config.to_dict(), STAGED_IN_BACKGROUND)
            cut.facts = cut_facts(states)
            if self.keeps:
                self.keeper.cut(self.step, held_by(states))
            self._cut_steps = recorded_steps(states["ledger"]) if self.config.env.name else None
            pause_s = time.perf_counter() - start
        return cut, pause_s

    def restore(self, snapshot: Snapshot) -> ResumePlan:
        """Loads every part, then applies `checkpoint.resume_policy`; returns the plan."""
        return restore(self, snapshot)

    def resume(self) -> None:
        """Loads the run dir's newest verified checkpoint, if any, and records the resume
        (`asyncrl.train.resume`)."""
        resume(self)

    # --- the loop -------------------------------------------------------------------------

    def run_to_end(self) -> None:
        """Trains to `run.max_num_steps` and saves the final model. Raises `Preempted`
        after writing a checkpoint if a stop signal arrived."""
        self.resume()
        record_launch(self.run)
        chosen = dtype_line(self.config.train.dtype, model_device(self.parts.policy.model))
        if chosen:
            print(chosen)
        self.logs.events.emit(
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
        wall = self._wall_s if self._wall_s is not None else wall_before(self.run_dir, self.step)
        self._start_s = time.perf_counter() - wall
        self.schedule.last_saved_s = time.perf_counter()  # `every_s` counts from the launch
        self.parts.collector.start()
        self.parts.watch_drains(self.config, self.stop.add, self.logs.events.emit)
        try:
            with self.parts.cores.busy():  # idle while it waits for rollouts (`train_step`)
                if self.step == 0:
                    self._evaluate(0)
                    self._wait_check()  # a notice during it: stop now
                while self.step < self.config.run.max_num_steps:
                    record = self.train_step()
                    if is_eval_record(record):
                        tqdm.write(eval_line(record), file=sys.stderr)
                    progress.set_postfix_str(self._postfix(record), refresh=False)
                    progress.update(1)
                    if self.stop.requested:  # the emergency checkpoint: `_on_preempted`
                        raise Preempted(self.stop.signal_name or "signal")
                    self._scheduled_checkpoint()
                if self.last_saved_step != self.step:
                    self.checkpoint()
                self.writer.wait()  # exit 0 only with the final checkpoint written and verified
        except Preempted as stop:
            answer_notice(self, stop)  # exit 75 only once its checkpoint is verified
            raise
        except GenerationFailed:
            # the cut is still consistent (the failed batch is queued as in flight): keep it
            if self.last_saved_step != self.step:
                self.checkpoint(wait=True, reason="generation_failed")
            raise
        finally:
            if self.stop.requested:  # no wait past the notice's deadline
                stop_generation_by_deadline(self)
            self.parts.stop_generation()
            progress.close()
        self.finish()

    def _saved(self, fields: dict[str, Any]) -> None:
        """A checkpoint verified (the writer's thread): its event, and its time measured."""
        self.logs.events.emit("checkpoint", **fields)
        self.deadlines.saved(fields)
        self.keeper.verified(int(fields["step"]))

    def _wait_check(self) -> None:
        self.parts.collector.check()
        if self.group is not None:
            self.group.check_alive()
        n = self.config.rollout.num_prompts_per_step
        self.parts.collector.check_step_can_complete(self.step, n)
        if self.stop.requested:
            raise Preempted(self.stop.signal_name or "signal")

    def train_step(self) -> dict[str, Any]:
        """Samples step t's groups, updates the policy, publishes version t+1, records."""
        step = self.step
        wait_start = time.perf_counter()
        with self.parts.cores.idle():  # generation takes this side's threads meanwhile
            groups = self.parts.buffer.sample(step, check=self._wait_check)
        train_start = time.perf_counter()
        if self.group is not None:
            self.group.command("step", step=step)  # the algorithm sends what ranks need
        algo_metrics = self._algo_step(groups, step)
        if self.keeps:
            self.keeper.trained(step, groups)
        fault_point("train.optimizer_step", step=step)
        trained = time.perf_counter()
        self.logs.timeline.write(
            {
                "kind": "train",
                "start": unix_time(train_start),
                "seconds": trained - train_start,
                "step": step,
                "attempt": self.attempt,
            }
        )
        self.publish_weights(step + 1)
        fault_point("train.weights_published", step=step)
        record = step_record(step, self.attempt, groups, algo_metrics)
        record.update(learning_fields(groups, self.parts.end_id))
        evaluated = self._evaluate(step + 1)
        record.update(
            wall_s=time.perf_counter() - self._start_s,
            buffer_groups=len(self.parts.buffer),
            generation_failures=self.parts.collector.num_failures,
            reward_failures=self.parts.scorer.num_failures,
            **self.parts.engine.metrics(),
            **(self.parts.agents.metrics() if self.parts.agents else {}),
            wait_s=train_start - wait_start,
            train_s=trained - train_start,
            sync_s=time.perf_counter() - trained - evaluated.get("eval/seconds", 0.0),
            **evaluated,
        )
        self.logs.write_step(record)
        for signal, share, message in self.learning.observe(record):
            self.logs.events.emit("not_learning", step=step, signal=signal, share=share,
                                  message=message)  # fmt: skip
            tqdm.write(f"asyncrl: not learning? {message}", file=sys.stderr)
        self._wall_s = record["wall_s"]
        self.step = step + 1
        return record

    def _algo_step(self, groups: list[Group], step: int) -> dict[str, float]:
        """The algorithm's step, given up at a preemption notice that comes before it changed
        a weight: its groups go back to the buffer and the run stops at the state before it,
        its earliest consistent point. With ranks, every rank gives it up at the same pass:
        before each backward they agree on rank 0's notice (one all-reduce)."""
        ranks = None if self.group is None else self.group.ranks

        def stop() -> bool:
            return self.stop.requested if ranks is None else ranks.agree(self.stop.requested)

        torch_rng = torch.get_rng_state()  # a pass's draws (dropout) are given up too
        try:
            with fault_facts(step=step), abandonable(stop):
                return self.parts.algo.step(groups, step)
        except StepAbandoned:
            torch.set_rng_state(torch_rng)
            for group in groups:
                self.parts.buffer.add(group)
            self.abandoned_step = step
            raise Preempted(self.stop.signal_name or "signal") from None

    def _evaluate(self, version: int) -> dict[str, float]:
        """`eval/...` metrics of weights `version` when the evaluation is due for it (also an
        `eval` event), else nothing; version 0, the initial weights, with `eval.at_start`.
        Generation goes on meanwhile; the trainer waits, and hears a notice: the evaluation is
        given up at once (it does not fit a grace period: SmolLM2's takes minutes, issue 63),
        and the step is finished without its figures."""
        evaluator = self.parts.evaluator
        if evaluator is None or not (
            evaluator.due(version) if version else self.config.eval.at_start
        ):
            return {}
        if self.stop.requested:  # a preempted machine's grace period is for the checkpoint
            return self._no_evaluation(version, "skipped", "stop requested")
        with self.stop.listening(evaluator.give_up):  # a notice during it: given up at once
            try:
                metrics = evaluator.evaluate(version, self._full_weights())
            except EvaluationGivenUp:
                return self._no_evaluation(version, "given_up", "given up at a preemption notice")
        self.logs.events.emit("eval", step=version - 1, version=version, **metrics)
        if not version:
            tqdm.write(eval_line({"step": -1, **metrics}), file=sys.stderr)
        return metrics

    def _no_evaluation(self, version: int, what: str, reason: str) -> dict[str, float]:
        """An evaluation due when a notice came: recorded (`eval_skipped`, and for the notice's
        `preemption_result`), no figures. Not redone on resume: `asyncrl eval` of the notice's
        checkpoint gives them (the step whose evaluation it was is finished and checkpointed)."""
        self.evaluation_at_notice = {"evaluation": what, "evaluation_version": version}
        self.logs.events.emit("eval_skipped", version=version, reason=reason)
        if what == "given_up":
            print(f"asyncrl: evaluation of version {version} given up at the notice", flush=True)
        return {}

    def _scheduled_checkpoint(self) -> None:
        """The checkpoint of `checkpoint.save_period` / `every_s` when it is due, or its
        deferral while the previous write is in progress (`checkpoint.when_busy`)."""
        decision, reason = self.schedule.decide(self.step, time.perf_counter(), self.writer.busy())
        if decision == "save":
            self.checkpoint(reason=reason)
        elif decision == "defer":
            self.logs.events.emit(
                "checkpoint_deferred",
                step=self.step,
                writing_step=self.writer.writing_step,
                reason=reason,
            )

    def checkpoint(self, wait: bool = False, reason: str = "final") -> None:
        """Stages the current step's state and hands it to the background writer, which
        writes, verifies and retains; `wait=True` also blocks until that is done. Waits first
        for the previous write (it reads the staging buffers) and raises its error. `reason`
        (in the `checkpoint` event): `save_period`, `every_s`, `stop`, `generation_failed`
        or `final`."""
        start = time.perf_counter()
        self.writer.wait()
        capture_start = time.perf_counter()
        cut, pause_s = self.capture()
        if self.group is not None:  # the other ranks write their files into the same dir
            try:
                cut.begun = self.run.store.begin(self.step)
                cut.written = self.group.checkpoint(self.step, cut.begun)
            except BaseException:
                cut.release()
                raise
            cut.num_shards = self.group.world_size  # (their write runs while we train on)
        info = {
            "blocked_s": time.perf_counter() - start,
            "previous_write_wait_s": capture_start - start,
            "pause_s": pause_s,
            "reason": reason,
            **cut.facts,
            # multi-turn: the environment steps the cut holds (`audit` checks resumes by them)
            **({} if self._cut_steps is None else {"recorded_steps": self._cut_steps}),
        }
        info.update(self.schedule.saved(time.perf_counter()))
        self.writer.submit(self.step, cut, info)
        self.last_saved_step = self.step
        if wait:
            self.writer.wait()

    def publish_weights(self, version: int) -> None:
        weights = self.parts.algo.policy_weights()  # with ranks: a gather on every rank
        if self.group is not None:
            self._published = weights
        self.parts.weights.publish(version, weights)
        self.parts.collector.publish_version(version)

    def _full_weights(self) -> dict[str, torch.Tensor]:
        """The policy's full weights as last published (with one rank: the live ones)."""
        return self._published if self.group is not None else self.parts.algo.policy_weights()

    def _on_batch(self, chunk: Chunk) -> None:
        self.logs.timeline.write(generation_span(chunk, self.attempt))

    def _postfix(self, record: dict[str, Any]) -> str:
        """reward, buffer, staleness; and the share cut at the length limit (`cut`) and of
        groups with nothing to learn (`flat`), where any."""
        capacity = self.parts.buffer.capacity
        signals = "".join(
            f" {name}={record[key]:.0%}"
            for name, key in (("cut", "truncated_share"), ("flat", "zero_variance_groups"))
            if record.get(key)
        )
        return (
            f"reward={record['reward_mean']:.3f} "
            f"buf={record['buffer_groups']}/{capacity} "
            f"stale={record['step'] - record['generation_version_min']}{signals}"
        )

    def finish(self) -> None:
        wall_s = time.perf_counter() - self._start_s
        transformers.utils.logging.disable_progress_bar()
        # with ranks, the sharded model's full weights as published after the last step
        published = None if self.group is None else self._published
        save_final(self.parts.policy.model, self.run_dir / "final_model", published)
        self.parts.policy.tokenizer.save_pretrained(self.run_dir / "final_model")
        self.logs.events.emit("end", step=self.step, wall_s=wall_s)
        self.close()

    def close(self) -> None:
        self.logs.close()


def train(
    config: Config,
    run_dir: Path,
    stop: StopRequest | None = None,
    restart: bool = False,
    force_config: bool = False,
) -> None:
    """Starts or resumes the run in `run_dir` and trains it to the end (the final checkpoint
    and `final_model/` written). With `train.num_processes` > 1 this process is rank 0 and
    starts the others (unless torchrun did). The summary and plots are the caller's:
    `asyncrl.cli.report.end_of_run_report(run_dir, plot)`, as `asyncrl train` does."""
    run = open_run_dir(run_dir, config, restart=restart, force_config=force_config)
    group, graceful = None, False
    try:
        group = launch(config, run_dir / SCRATCH_DIR)
        trainer = Trainer(config, run, stop, group)
        try:
            trainer.run_to_end()
            graceful = True
        except BaseException as err:
            graceful = isinstance(err, Preempted)  # the other ranks wait for a command
            if not isinstance(err, Aborted):  # an abort waits for nothing
                with contextlib.suppress(BaseException):
                    trainer.writer.wait()  # a write in progress is still a good checkpoint
            trainer.close()
            if group is not None and not isinstance(err, RankFailed):
                # a collective broken by a dead rank is a RuntimeError (gloo, NCCL)
                wait_s = COLLECTIVE_DEATH_WAIT_S if isinstance(err, RuntimeError) else 0.0
                if group.dead(wait_s):
                    raise group.failure(err) from err  # the cause, not the symptom
            raise
        finally:
            shutdown_by_deadline(trainer)  # Ray, servers, reward workers; bounded at a notice
    finally:
        if group is not None:
            group.close(graceful)
        if run.lock is not None:
            run.lock.close()  # releases the run dir lock
