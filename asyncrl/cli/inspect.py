"""`asyncrl inspect DIR`: the newest verified checkpoint and what resuming it would cost under
each resume policy — the seed's "what one checkpoint costs you" table, for this run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from asyncrl.checkpoint.kept import KeptFileError, kept_path, read_kept
from asyncrl.checkpoint.run_checkpoints import run_store
from asyncrl.checkpoint.snapshot import decode_parts, read_parts
from asyncrl.checkpoint.store import Verified
from asyncrl.core.buffer import tokens_per_group
from asyncrl.core.kept import steps_lost
from asyncrl.core.partial import Partial
from asyncrl.core.resume import POLICIES, ResumePolicy, SavedLedger, plan_resume
from asyncrl.train.preemption import tail_events


def inspect_run_dir(run_dir: Path) -> dict[str, Any]:
    """The newest verified checkpoint of `run_dir`: its ledger, buffer per target, partial
    generations, and each resume policy's cost (`asyncrl inspect --json` prints this)."""
    store = run_store(run_dir)
    latest, rejected = store.latest()
    if latest is None:
        return {"run_dir": str(run_dir), "checkpoint": None, "rejected": rejected}
    parts, config = read_parts(latest)
    saved, samples, episodes = _saved_ledger(
        latest, parts, int(config["rollout"]["num_prompts_per_step"])
    )
    env_name = str(config.get("env", {}).get("name", ""))
    restore = _restore_kind(env_name)
    return {
        "run_dir": str(run_dir),
        "checkpoint": str(latest.path),
        "step": saved.step,
        "num_prompts_per_step": saved.num_prompts_per_step,
        "algorithm": config["algo"]["name"],
        "has_critic": "critic" in parts["algorithm"],
        "reference_sha256": parts["algorithm"].get("reference_sha256"),
        "ledger": {
            "trained": saved.step * saved.num_prompts_per_step,
            "buffered": len(saved.buffered),
            "in_flight": len(saved.in_flight),
            "handed_out": saved.cursor,
        },
        "targets": _per_target(saved),
        "in_flight_ordinals": sorted(k for k, _ in saved.in_flight),
        "partial_tokens": {str(k): v for k, v in sorted(saved.partial_tokens.items())},
        "partial_samples": {str(k): v for k, v in sorted(samples.items())},
        "buffered_tokens": {str(k): v for k, v in sorted(saved.buffered_tokens.items())},
        "buffered_ordinals": sorted(k for k, _ in saved.buffered),
        "env_name": env_name,
        "env_restore": restore,
        "episodes_in_flight": {str(k): v for k, v in sorted(episodes.items())},
        "steps_past_checkpoint": _steps_past(run_dir, parts["trainer"], episodes)
        if env_name
        else None,
        "resume_cost": {policy: _cost(saved, policy, restore == "restart") for policy in POLICIES},
        "last_preemption": last_preemption(run_dir),
        "kept_rollouts": _kept(store.root, saved.step, store.run_id),
        "rejected": rejected,
    }


def _kept(root: Path, step: int, run_id: str) -> dict[str, Any] | None:
    """The rollouts a preemption notice kept beside this checkpoint, as a `lossless` resume
    would put them back (verified); None where there are none."""
    try:
        found = read_kept(root, step, run_id)
    except KeptFileError as err:
        return {"ignored": str(err)}
    if found is None:
        return None
    kept, account = found
    return {
        "file": str(kept_path(root, step)),
        "ordinals": [k.ordinal for k in kept],
        **account,
    }


def _steps_past(
    run_dir: Path, trainer: dict[str, Any], episodes: dict[int, list[dict[str, Any]]]
) -> dict[str, int]:
    """The steps the run's steps log asked past the checkpoint's cut (read from its saved
    offset): `logged`, each a turn a resume recovers instead of generating again (unless its
    episode starts over), of which `unanswered` have no logged result (the kill came inside
    the step: asked again with the same id and text)."""
    path = run_dir / "env_steps.jsonl"
    held = {s for samples in episodes.values() for e in samples for s in e["step_ids"]}
    asked: set[str] = set()
    answered: set[str] = set()
    if path.exists():
        with open(path, "rb") as f:
            f.seek(int(trainer.get("env_steps_offset") or 0))
            lines = f.read().split(b"\n")[:-1]  # a torn last line is no record
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            sid = str(record.get("step_id"))
            if record.get("kind") == "request" and sid not in held:
                asked.add(sid)
            elif record.get("kind") == "result":
                answered.add(sid)
    return {"logged": len(asked), "unanswered": len(asked - answered)}


def last_preemption(run_dir: Path) -> dict[str, Any] | None:
    """The run's last preemption notice and what came of it (`preemption_notice`,
    `preemption_result` and its newest `rollouts_kept` events, from the end of
    `events.jsonl`); None if none is there."""
    events = tail_events(run_dir / "events.jsonl")
    notices = [i for i, e in enumerate(events) if e.get("event") == "preemption_notice"]
    if not notices:
        return None
    notice = events[notices[-1]]
    after = events[notices[-1] :]
    if notice.get("role") == "generation":  # a Ray drain of generation workers' node
        handbacks = [
            e for e in after if e.get("event") == "drain_handback" and e["node"] == notice["node"]
        ]
        return {"notice": notice, "result": None, "handbacks": handbacks}
    result = next((e for e in after if e.get("event") == "preemption_result"), None)
    # the newest: a notice that keeps rollouts beside S while S+k's write is in flight keeps
    # them again beside S+k once it is verified, and that keep deletes the file beside S
    kept = next((e for e in reversed(after) if e.get("event") == "rollouts_kept"), None)
    return {"notice": notice, "result": result, "kept": kept}


def _restore_kind(env_name: str) -> str | None:
    """The `restore` kind of the checkpoint's `env.name` (what its resume does with the
    episodes in flight), as the trainer resolves it; None without episodes, or where the
    environment's module does not import here."""
    if not env_name:
        return None
    from asyncrl.config import ConfigError
    from asyncrl.tasks.environments import environment_class

    try:
        return str(environment_class(env_name).restore)
    except ConfigError:
        return None


def _saved_ledger(
    latest: Verified, parts: dict[str, Any], n: int
) -> tuple[SavedLedger, dict[int, dict[str, list[Any]]], dict[int, list[dict[str, Any]]]]:
    """The checkpoint's ledger as a resume plans from it, each in-flight ordinal's partial
    samples (tokens so far, finished), and of a multi-turn run its episodes (per sample: turns
    taken, tokens, done, the environment steps recorded, and whether its state is saved)."""
    buffered = [
        (g["ticket"]["ordinal"], g["ticket"]["target_step"]) for g in parts["buffer"]["groups"]
    ]
    in_flight = [(int(k), int(t)) for k, t in parts["ledger"]["in_flight"]]
    decoded = decode_parts(latest, ("ledger", "buffer"))
    samples: dict[int, dict[str, list[Any]]] = {
        int(k): {
            "lengths": [int(n) for n in torch.as_tensor(p["mask"]).sum(dim=1)],
            "finished": [bool(f) for f in torch.as_tensor(p["finished"])],
        }
        for k, p in decoded["ledger"].get("partial", {}).items()
    }
    episodes = {
        int(k): [
            {
                "turns": len(e["turns"]),
                "tokens": samples[int(k)]["lengths"][i],
                "done": bool(e.get("ended", e["done"])),
                "step_ids": [t["step_id"] for t in e["turns"]],
                "env_state_saved": e.get("env_state") is not None,
            }
            for i, e in enumerate(p["episodes"])
        ]
        for k, p in decoded["ledger"].get("partial", {}).items()
        if "episodes" in p
    }
    saved = SavedLedger(
        int(parts["trainer"]["step"]),
        n,
        int(parts["stream"]["cursor"]),
        in_flight,
        buffered,
        partial_tokens={k: sum(v["lengths"]) for k, v in samples.items()},
        buffered_tokens=tokens_per_group(decoded["buffer"]),
        partial_samples={
            int(k): Partial.from_state(p).saved_samples()
            for k, p in decoded["ledger"].get("partial", {}).items()
        },
    )
    return saved, samples, episodes


def _per_target(saved: SavedLedger) -> dict[str, dict[str, Any]]:
    targets = sorted({t for _, t in saved.buffered + saved.in_flight})
    return {
        str(t): {
            "buffered": sum(1 for _, x in saved.buffered if x == t),
            "in_flight": sum(1 for _, x in saved.in_flight if x == t),
            "complete": sum(1 for _, x in saved.buffered if x == t) == saved.num_prompts_per_step,
        }
        for t in targets
    }


def _cost(saved: SavedLedger, policy: ResumePolicy, episodes_restart: bool) -> dict[str, Any]:
    plan = plan_resume(saved, policy, episodes_restart)
    return {
        "prompts_skipped": len(plan.skipped),
        "finished_groups_discarded": len(plan.discarded),
        "groups_regenerated": plan.num_regenerated,
        "groups_continued": len(plan.continued),
        "kept_tokens": plan.kept_tokens,
        "regenerated_tokens": plan.regenerated_tokens,
        "turns_kept": plan.turns_kept,
        "turns_regenerated": plan.turns_regenerated,
        "tool_calls_repeated": plan.tool_calls_repeated,
        "messages": plan.messages,
    }


def render(info: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for reason in info["rejected"]:
        console.print(f"[yellow]rejected:[/] {reason}")
    if info["checkpoint"] is None:
        console.print(f"{info['run_dir']}: no verified checkpoint")
        return
    ledger = info["ledger"]
    console.print(
        f"[bold]{info['checkpoint']}[/]  step {info['step']}, N={info['num_prompts_per_step']}, "
        f"{info['algorithm']}"
        + (" (critic and its optimizer saved)" if info["has_critic"] else "")
        + (f", KL reference {info['reference_sha256']}" if info["reference_sha256"] else "")
        + "\n"
        f"ledger: trained {ledger['trained']}, buffered {ledger['buffered']}, in flight "
        f"{ledger['in_flight']}, handed out {ledger['handed_out']}"
    )
    targets = Table(title="buffer per target step")
    for column in ("target", "buffered", "in flight", "complete"):
        targets.add_column(column, justify="right")
    for t, row in info["targets"].items():
        targets.add_row(
            t, str(row["buffered"]), str(row["in_flight"]), "yes" if row["complete"] else "no"
        )
    console.print(targets)
    console.print(f"in-flight ordinals: {info['in_flight_ordinals']}")
    if info["partial_tokens"]:
        listed = ", ".join(f"{k}: {v}" for k, v in info["partial_tokens"].items())
        console.print(f"partial generations (tokens so far): {listed}")
    if info["episodes_in_flight"]:
        kind = info["env_restore"] or (
            "unknown: its module does not import here, so the costs assume it restores"
        )
        console.print(f"episodes in flight (env.name={info['env_name']}, restore={kind}):")
        for k, samples in info["episodes_in_flight"].items():
            listed = ", ".join(
                "done" if e["done"] else f"turn {e['turns'] + 1} at {e['tokens']} tokens"
                for e in samples
            )
            console.print(f"  ordinal {k}: {listed}")
    past = info.get("steps_past_checkpoint")
    if past:
        console.print(
            f"steps log past the checkpoint: {past['logged']} environment steps asked, their "
            f"turns recovered on resume rather than generated again ({past['unanswered']} "
            "without a logged result: asked again with the same id and text)"
        )
    costs = Table(title="what resuming this checkpoint costs")
    columns: tuple[str, ...] = (
        "policy", "prompts skipped", "finished groups discarded", "groups regenerated",
        "groups continued", "tokens kept", "tokens regenerated",
    )  # fmt: skip
    episodes = bool(info["env_name"])
    if episodes:
        columns = (*columns, "turns regenerated", "tool calls repeated")
    for column in columns:
        costs.add_column(column, justify="right")
    for policy, cost in info["resume_cost"].items():
        turns = (str(cost["turns_regenerated"]), str(cost["tool_calls_repeated"]))
        costs.add_row(
            policy,
            str(cost["prompts_skipped"]),
            str(cost["finished_groups_discarded"]),
            str(cost["groups_regenerated"]),
            str(cost["groups_continued"]),
            str(cost["kept_tokens"]),
            str(cost["regenerated_tokens"]),
            *(turns if episodes else ()),
        )
    console.print(costs)
    if (kept := info.get("kept_rollouts")) is not None:
        console.print(kept_rollouts_line(kept, info["step"]))
    if (preempted := info.get("last_preemption")) is not None:
        console.print(preemption_line(preempted))


def preemption_line(preempted: dict[str, Any]) -> str:
    """`inspect`'s account of the run's last preemption notice."""
    notice, result = preempted["notice"], preempted["result"]
    deadline = "no deadline" if notice.get("deadline_s") is None else (
        f"deadline {notice['deadline_s']:g} s")  # fmt: skip
    if notice.get("role") == "generation":
        handbacks = preempted.get("handbacks", [])
        head = f"last preemption: {notice['source']} of node {notice['node'][:8]} ({deadline})"
        if not handbacks:
            return f"{head}: generation worker(s) {notice['workers']} handed nothing back yet"
        returned = sum(h["requests"] for h in handbacks)
        tokens = sum(h["tokens"] for h in handbacks)
        return (
            f"{head}: generation worker(s) {[h['worker'] for h in handbacks]} handed back "
            f"{returned} requests ({tokens} tokens kept) and were replaced"
        )
    head = f"last preemption: {notice['source']} at step {notice['step']} ({deadline})"
    kept = preempted.get("kept")
    kept_part = "" if kept is None else (
        f"; kept {kept['groups']} finished and {kept['partial_groups']} partial groups "
        f"({kept['tokens']} tokens) beside step {kept['step']}'s checkpoint")  # fmt: skip
    if result is None:
        return f"{head}: no checkpoint was verified after it (killed before?){kept_part}"
    met = {True: "met", False: "MISSED", None: "no deadline"}[result.get("met")]
    given_up = ", its step given up" if result.get("abandoned_step") else ""
    return (
        f"{head}: checkpoint of step {result['step']} verified "
        f"{result['notice_to_durable_s']:.2f} s after the notice ({met}{given_up}){kept_part}"
    )


def kept_rollouts_line(kept: dict[str, Any], step: int) -> str:
    """`inspect`'s line for rollouts a notice kept beside the newest checkpoint."""
    if "ignored" in kept:
        return f"rollouts kept at a notice: IGNORED on resume: {kept['ignored']}"
    return (
        f"rollouts kept at a notice beside step {step}: {kept['groups']} finished and "
        f"{kept['partial_groups']} partial groups, {kept['tokens']} tokens (a lossless resume "
        f"puts them back; {kept['lost_tokens']} tokens of newer weights and the training of "
        f"{steps_lost(step, kept['cut_step'])} were lost)"
    )
