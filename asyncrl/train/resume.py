"""A launch's resume: the run dir's newest verified checkpoint loaded into the trainer's parts,
`checkpoint.resume_policy` applied (`asyncrl.core.resume` plans it), the turns the steps log
holds past the checkpoint recovered (multi-turn), the rollouts a preemption notice kept beside
it put back (`asyncrl.train.kept`), and the `resume` event that accounts for all of it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asyncrl.checkpoint.restore import SKIP_RESTORE, ShapeMismatch, load_parts
from asyncrl.checkpoint.snapshot import Snapshot, decode
from asyncrl.checkpoint.store import Verified
from asyncrl.config.keys import benign_differences
from asyncrl.core.buffer import tokens_per_group
from asyncrl.core.episodes import recorded_steps
from asyncrl.core.kept import new_tokens
from asyncrl.core.resume import ResumePlan, continued_samples, plan_resume
from asyncrl.rollout.episodes import EpisodeRunner
from asyncrl.tasks.environments import environment_class
from asyncrl.train.kept import held_by, put_back
from asyncrl.train.ranks import restore_templates
from asyncrl.train.records import plan_fields, resume_line
from asyncrl.train.rundir import other_shapes, refuse_other_data

if TYPE_CHECKING:
    from asyncrl.train.trainer import Trainer


def resume(trainer: Trainer) -> None:
    """Loads the run dir's newest verified checkpoint, if any, and records the resume."""
    run = trainer.run
    for reason in run.rejected:
        print(f"asyncrl: skipping checkpoint: {reason}")
    if run.rejected:
        fallback = run.latest.path if run.latest else "nothing (no verified checkpoint)"
        print(f"asyncrl: falling back to {fallback}")
    if run.latest is None:
        if trainer.attempt:
            print(f"asyncrl: no verified checkpoint; from step 0 (attempt {trainer.attempt})")
            if (episodes := trainer.parts.episodes) is not None:  # the steps asked
                episodes.log.load(0, lambda ordinal: True)  # before the kill: recovered
            _replay_agents(trainer, 0, lambda ordinal: True)
        return
    start = time.perf_counter()
    refuse_other_data(run, trainer.parts.stream, trainer.state_dict(), trainer.config)  # I8
    snapshot = _decode_latest(trainer, run.latest)
    cursor = int(snapshot.parts["stream"]["cursor"])
    saved_config = snapshot.config
    plan = restore(trainer, snapshot)
    del snapshot  # the restored parts own their state now: no second copy stays
    kept = _put_back_kept(trainer, plan)
    _record_resume(trainer, plan, cursor, saved_config, time.perf_counter() - start, kept)


def restore(trainer: Trainer, snapshot: Snapshot) -> ResumePlan:
    """Loads every part, then applies `checkpoint.resume_policy`; returns the plan."""
    try:
        load_parts(trainer.stateful_parts(), snapshot)
    except ShapeMismatch as err:
        raise other_shapes(trainer.run, err, trainer.config.model) from None
    ledger, buffer = trainer.parts.ledger, trainer.parts.buffer
    tokens = tokens_per_group(snapshot.parts["buffer"])
    saved = ledger.saved(trainer.step, buffer.ordinals_and_targets(), tokens)
    trainer.recorded_steps = recorded_steps(ledger.state_dict())  # as restored
    restarts = bool(trainer.config.env.name) and (
        environment_class(trainer.config.env.name).restore == "restart"
    )
    policy = trainer.config.checkpoint.resume_policy
    plan = plan_resume(saved, policy, restarts)
    trainer.continued = continued_samples(saved, policy, restarts)
    ledger.apply(plan)
    buffer.discard(plan.discarded)
    if (episodes := trainer.parts.episodes) is not None:
        plan.turns_recovered = _recover_turns(trainer, episodes)
    queued = {t.ordinal for t in ledger.redispatch}
    cursor = trainer.parts.stream.cursor  # ordinals from here were not handed out yet
    trainer.agent_replay = _replay_agents(
        trainer, trainer.agent_log_offset, lambda k: k in queued or k >= cursor
    )
    trainer.publish_weights(trainer.step)
    return plan


def _put_back_kept(trainer: Trainer, plan: ResumePlan) -> dict[str, Any] | None:
    """Under `lossless`, the rollouts a notice kept beside the restored checkpoint, put back
    into the ledger (single-turn runs: multi-turn ones recover from the steps log); the
    resume plan and the continued samples count them. Returns the resume event's account."""
    ledger, buffer = trainer.parts.ledger, trainer.parts.buffer
    no_keeping = trainer.config.env.name or trainer.config.agent.name
    if no_keeping or plan.policy != "lossless" or "ledger" in SKIP_RESTORE:
        return None
    held = held_by({"buffer": buffer.state_dict(), "ledger": ledger.state_dict()})
    trainer.keeper.restored(trainer.step, held)
    if "kept" in SKIP_RESTORE:  # the test switch: the checkpoint alone, as without the file
        return None
    buffered = {k for k, _ in buffer.ordinals_and_targets()}
    applied, problem = put_back(trainer.keeper.root, trainer.run.run_id, trainer.step,
                                ledger, buffered)  # fmt: skip
    if problem is not None:
        print(f"asyncrl: ignoring rollouts kept at a notice: {problem}")
    if not applied:
        return None if problem is None else {"ignored": problem}
    tokens = 0
    for item in applied:
        lengths = item.partial.lengths
        before = held.get(item.ordinal, [0] * len(lengths))
        tokens += new_tokens(lengths, before)
        trainer.continued[item.ordinal] = (lengths, [bool(f) for f in item.partial.finished])
        if item.ordinal not in plan.continued:
            plan.continued.append(item.ordinal)
    plan.kept_tokens += tokens
    finished = sum(1 for item in applied if item.partial.done)
    print(
        f"asyncrl: put back the rollouts a preemption notice kept beside step {trainer.step}'s "
        f"checkpoint: {finished} finished and {len(applied) - finished} partial groups, "
        f"{tokens} tokens"
    )
    return {
        "groups": finished,
        "partial_groups": len(applied) - finished,
        "tokens": tokens,
        "ordinals": [item.ordinal for item in applied],
    }


def _recover_turns(trainer: Trainer, episodes: EpisodeRunner) -> int:
    """Puts the turns the steps log holds past the checkpoint (from its offset) back into the
    ledger's queued samples, before any is dispatched (so the next checkpoint's cut holds them
    and its offset can start later); returns how many."""
    ledger = trainer.parts.ledger
    queued = {t.ordinal for t in ledger.redispatch}
    cursor = trainer.parts.stream.cursor  # ordinals from here were not handed out yet
    episodes.log.load(trainer.env_steps_offset, lambda k: k in queued or k >= cursor)
    for ticket in list(ledger.redispatch):
        saved = ledger.partials.get(ticket.ordinal)
        partial, n = episodes.recover(
            ticket, saved, trainer.config.rollout.num_generations_per_prompt
        )
        if partial is not None and n:
            ledger.recovered(ticket.ordinal, partial)
    # every turn the log asked past the cut: recovered now (re-dispatched groups), when the
    # stream reaches it (groups handed out after the checkpoint), or in deterministic mode
    # generated again and answered from the log
    return len(episodes.logged_steps() - set(trainer.recorded_steps))


def _replay_agents(
    trainer: Trainer, offset: int, reopened: Callable[[int], bool]
) -> dict[str, int]:
    """Agent runs: the agent log read from `offset` for the ordinals the run opens again,
    whose runs start over and are answered from it; the resume event's account of what the
    log holds (an `agent_replay` event says what the replay did once they all landed)."""
    agents = trainer.parts.agents
    if agents is None:
        return {}
    if "agent_log" in SKIP_RESTORE:  # the test switch: every call generated again
        return {}

    def replayed(**counts: int) -> None:
        trainer.logs.events.emit("agent_replay", attempt=trainer.attempt, **counts)

    pending = agents.load_log(offset, reopened, replayed)
    return {
        "agent_calls_replayed": pending["replayable"],
        "agent_calls_regenerated": pending["regenerated"],
        "tool_calls_repeated": pending["tools_repeated"],
    }


def _decode_latest(trainer: Trainer, latest: Verified) -> Snapshot:
    """The checkpoint's parts: the only read of its tensors (with ranks, every rank reads its
    own rows at the same time and rank 0 only what it restores itself)."""
    if trainer.group is None:
        return decode(latest)  # the one-process call, exactly as before ranks
    trainer.group.command(
        "restore",
        path=str(latest.path),
        step=latest.step,
        manifest=latest.manifest,
        format_version=latest.format_version,
        manifest_sha256=latest.manifest_sha256,
    )
    templates = restore_templates(
        {"model": trainer.parts.policy.model, "algorithm": trainer.parts.algo}
    )
    return decode(latest, templates) if templates else decode(latest)


def _start_over(trainer: Trainer) -> dict[str, bool]:
    """`episodes_start_over` for a multi-turn run's resume event: whether its episodes start
    over under new step ids (`restart_episode`, a `restart` environment); where they do not,
    `audit` holds every step to the ids the steps log knows it by."""
    episodes = trainer.parts.episodes
    return {} if episodes is None else {"episodes_start_over": episodes.starts_over}


def _record_resume(
    trainer: Trainer,
    plan: ResumePlan,
    cursor: int,
    saved_config: dict[str, Any],
    load_s: float,
    kept: dict[str, Any] | None,
) -> None:
    """The `resume` event and the one-line report of what the resume kept and redoes."""
    for line in plan.messages:
        print(line)
    if SKIP_RESTORE:  # a test switch: never silent, and on the record
        print(f"asyncrl: WARNING: ASYNCRL_TEST_SKIP_RESTORE: {sorted(SKIP_RESTORE)} not restored")
    config, run = trainer.config, trainer.run
    trainer.logs.events.emit(
        "resume",
        attempt=trainer.attempt,
        from_step=trainer.step,
        cursor=cursor,
        **plan_fields(plan, trainer.continued, episodes=bool(config.env.name)),
        **({"recorded_steps": trainer.recorded_steps} if config.env.name else {}),
        **_start_over(trainer),
        **trainer.agent_replay,
        **({} if kept is None else {"kept_rollouts": kept}),
        rejected_checkpoints=run.rejected,
        config_changes={**benign_differences(saved_config, config), **run.notes},
        forced_config_changes=run.forced_changes,
        load_s=load_s,
        **({"skipped_restore": sorted(SKIP_RESTORE)} if SKIP_RESTORE else {}),
    )
    print(resume_line(trainer.step, trainer.attempt, plan))
