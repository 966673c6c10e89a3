"""What one crash costs under each resume policy, measured from real resumed runs.

A real `asyncrl train` process on the long-generation shape (completions of up to 128 tokens
generated 16 at a time, a step's 4 groups per batch, A=1; `benchmarks/long_generation.py`) is
SIGKILLed (fault injection) right after the first checkpoint whose cut has groups in flight
holding partial samples became durable (targets half-buffered, as in the seed's scenario). The run
dir is copied once per policy and each copy is resumed. From each resumed run's own records
it prints

    POLICY: skipped=S discarded=D regenerated=R tokens_regenerated=T redo_s=X

skipped: prompts no step will ever train; discarded: finished groups deleted; regenerated:
groups generated for the checkpoint's targets beyond the slots that had never been dispatched
and the groups continued from saved partial samples (work done twice); tokens_regenerated:
generated tokens the checkpoint held that the resumed run generated again (read off its
timeline's per-sample token spans) or threw away (the partial samples of skipped prompts,
the discarded groups); redo_s: the generation seconds those tokens cost at the resumed run's
seconds per token. `lossless` continues the partial samples; `lossless_without_partials` is
the same resume with the partials not restored (what asyncrl did before partial generations:
the test-only `ASYNCRL_TEST_SKIP_RESTORE` switch).
Then the checkpoint's own cost at the demo's shape: seconds the trainer is blocked per
checkpoint against the step time. Last, the multi-turn shape (`configs/multi_turn_game.yaml`
with the user environment `tests/user_envs/tally_game.py:TallyLong`: 8 turns an episode of
up to 4 tokens each, a reply after each), killed right after a checkpoint with episodes in
flight became durable and resumed under each policy:

    multi_turn POLICY: skipped=S turns_regenerated=T tool_calls_repeated=C tokens_regenerated=K

turns_regenerated from the resume event; tool_calls_repeated measured from the environment's
journal (steps the checkpoint recorded that the resumed launch called again);
tokens_regenerated measured from the timeline as above.

    .venv/bin/python benchmarks/resume_cost.py
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from long_generation import shape, write_task

from asyncrl.cli.inspect import inspect_run_dir
from asyncrl.core.resume import POLICIES
from asyncrl.train.records import read_jsonl, span_token_starts

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["logging.progress=false", "logging.plot=false"]
VARIANTS = [*POLICIES[:1], "lossless_without_partials", *POLICIES[1:]]


def train(
    run_dir: Path,
    *extra: str,
    fault: str = "",
    skip: str = "",
    config: str = "configs/demo.yaml",
    env: dict[str, str] | None = None,
) -> int:
    env = {
        **os.environ,
        "ASYNCRL_FAULT": fault,
        "ASYNCRL_TEST_SKIP_RESTORE": skip,
        "PYTHONWARNINGS": "ignore",
        **(env or {}),
    }
    command = [sys.executable, "-m", "asyncrl.cli", "train", str(ROOT / config)]
    done = subprocess.run(
        [*command, "--run-dir", str(run_dir), *QUIET, *extra],
        env=env,
        capture_output=True,
        text=True,
    )
    return done.returncode


def generated_for(run_dir: Path, targets: set[int]) -> int:
    """Groups the resumed attempt (1) generated for `targets` (each counted once, in the span
    where it landed: a chunked group spans several)."""
    count = 0
    for span in read_jsonl(run_dir / "timeline.jsonl"):
        if span["kind"] == "generate" and span["attempt"] == 1:
            landed = span.get("landed", span["ordinals"])
            count += sum(
                1
                for k, t in zip(span["ordinals"], span["targets"], strict=True)
                if k in landed and t in targets
            )
    return count


def tokens_regenerated(
    run_dir: Path, saved: dict[str, Any], resume: dict[str, Any]
) -> tuple[int, float]:
    """Generated tokens of the checkpoint `saved` (its `inspect`) that the resumed attempt
    generated again or threw away, and the seconds per generated token of that attempt."""
    partials, buffered = saved["partial_samples"], saved["buffered_tokens"]
    again, tokens, seconds = 0, 0, 0.0
    for span in read_jsonl(run_dir / "timeline.jsonl"):
        if span["kind"] != "generate" or span["attempt"] != 1:
            continue
        seconds += span["seconds"]
        for k, starts, counts in zip(
            span["ordinals"], span_token_starts(span), span["token_counts"], strict=True
        ):
            tokens += sum(counts)
            if str(k) in buffered:
                again += sum(counts)
            elif str(k) in partials:
                had = partials[str(k)]["lengths"]
                again += sum(
                    max(0, min(s + c, n) - s) for s, c, n in zip(starts, counts, had, strict=True)
                )
    thrown = sum(buffered[str(k)] for k in resume["discarded_groups"])
    thrown += sum(
        sum(partials[str(k)]["lengths"]) for k in resume["skipped_ordinals"] if str(k) in partials
    )
    return again + thrown, seconds / max(tokens, 1)


def crash_and_resume(tmp: Path) -> None:
    crash_shape = shape(write_task(tmp / "long.jsonl"))
    base = tmp / "crashed"
    print("crashing a run right after a checkpoint with partials in flight ...", file=sys.stderr)
    state = "checkpoint.parent_fsynced[in_flight,partial_tokens]"
    code = train(base, *crash_shape, "run.max_num_steps=100", fault=state)
    assert code == -9, f"expected a SIGKILL, got exit {code}"
    info = inspect_run_dir(base)
    n, started = info["num_prompts_per_step"], {int(t) for t in info["targets"]}
    buffered, in_flight = info["ledger"]["buffered"], info["ledger"]["in_flight"]
    never_dispatched = n * len(started) - buffered - in_flight
    fill = ", ".join(f"{t}: {r['buffered']}/{n}" for t, r in info["targets"].items())
    partial = sum(info["partial_tokens"].values())
    finished = sum(sum(p["finished"]) for p in info["partial_samples"].values())
    print(
        f"checkpoint of step {info['step']}: buffered per target {{{fill}}}, "
        f"{in_flight} in flight {info['in_flight_ordinals']} holding {partial} generated "
        f"tokens ({finished} samples finished), buffered groups "
        f"{sum(info['buffered_tokens'].values())} tokens"
    )
    for variant in VARIANTS:
        policy = "lossless" if variant.startswith("lossless") else variant
        skip = "ledger.partial" if variant == "lossless_without_partials" else ""
        run_dir = tmp / variant
        shutil.copytree(base, run_dir)
        print(f"resuming under {variant} ...", file=sys.stderr)
        steps = f"run.max_num_steps={max(started) + 2}"
        code = train(run_dir, *crash_shape, steps, f"checkpoint.resume_policy={policy}", skip=skip)
        assert code == 0, f"{variant}: resume exited {code}"
        (resume,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "resume"]
        continued = sum(1 for p in resume["continued_partials"].values() if sum(p["lengths"]))
        redone = generated_for(run_dir, started) - never_dispatched - continued
        tokens, per_token_s = tokens_regenerated(run_dir, info, resume)
        print(
            f"{variant}: skipped={len(resume['skipped_ordinals'])} "
            f"discarded={len(resume['discarded_groups'])} regenerated={redone} "
            f"tokens_regenerated={tokens} redo_s={tokens * per_token_s:.3f}"
        )


def checkpoint_cost(tmp: Path) -> None:
    run_dir = tmp / "demo-shape"
    print("measuring checkpoints at the demo's shape ...", file=sys.stderr)
    assert train(run_dir, "run.max_num_steps=60", "checkpoint.save_period=5") == 0
    events = read_jsonl(run_dir / "events.jsonl")
    checkpoints = [e for e in events if e["event"] == "checkpoint"]
    steps = read_jsonl(run_dir / "metrics.jsonl")
    step_s = statistics.median(r["wait_s"] + r["train_s"] + r["sync_s"] for r in steps)
    blocked_s = statistics.median(e["blocked_s"] for e in checkpoints)
    pause_s = statistics.median(e["pause_s"] for e in checkpoints)
    write_s = statistics.median(e["seconds"] for e in checkpoints)
    print(
        f"checkpoint ({checkpoints[0]['bytes'] / 1e6:.1f} MB, demo shape): trainer blocked "
        f"{blocked_s * 1e3:.1f} ms = {100 * blocked_s / step_s:.1f}% of a {step_s * 1e3:.0f} ms "
        f"step; generation bookkeeping paused {pause_s * 1e3:.2f} ms; written and verified in "
        f"the background in {write_s * 1e3:.0f} ms (medians of {len(checkpoints)})"
    )


MULTI_TURN = [
    "env.name=tally_game:TallyLong",
    "env.max_turns=8",
    "env.max_episode_tokens=48",
    "rollout.max_new_tokens=4",
    "rollout.num_prompts_per_step=4",
    "rollout.num_generations_per_prompt=4",
    "rollout.groups_per_batch=4",
    "rollout.max_trajectory_age_steps=1",
    "checkpoint.save_period=2",
]


def journal_env(journal: Path) -> dict[str, str]:
    paths = [str(ROOT / "tests" / "user_envs"), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(filter(None, paths)), "TALLY_JOURNAL": str(journal)}


def multi_turn_cost(tmp: Path) -> None:
    """The multi-turn shape crashed with episodes in flight, resumed under each policy."""
    base = tmp / "multi-turn-crashed"
    print("crashing a multi-turn run right after a checkpoint with episodes in flight ...",
          file=sys.stderr)  # fmt: skip
    state = "checkpoint.parent_fsynced[in_flight,partial_tokens]"
    code = train(
        base,
        *MULTI_TURN,
        "run.max_num_steps=100",
        fault=state,
        config="configs/multi_turn_game.yaml",
        env=journal_env(tmp / "crashed.journal"),
    )
    assert code == -9, f"expected a SIGKILL, got exit {code}"
    info = inspect_run_dir(base)
    recorded = {s for samples in info["episodes_in_flight"].values() for e in samples
                for s in e["step_ids"]}  # fmt: skip
    in_flight = sum(1 for samples in info["episodes_in_flight"].values() for e in samples
                    if not e["done"])  # fmt: skip
    print(
        f"multi-turn checkpoint of step {info['step']}: {in_flight} episodes in flight, "
        f"{len(recorded)} environment steps recorded, {sum(info['partial_tokens'].values())} "
        "tokens"
    )
    started = max(int(t) for t in info["targets"])
    for policy in POLICIES:
        run_dir = tmp / f"multi-turn-{policy}"
        shutil.copytree(base, run_dir)
        journal = tmp / f"{policy}.journal"
        print(f"resuming the multi-turn run under {policy} ...", file=sys.stderr)
        code = train(run_dir, *MULTI_TURN, f"run.max_num_steps={started + 2}",
                     f"checkpoint.resume_policy={policy}", config="configs/multi_turn_game.yaml",
                     env=journal_env(journal))  # fmt: skip
        assert code == 0, f"{policy}: resume exited {code}"
        (resume,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "resume"]
        called = {line.split()[1] for line in journal.read_text().splitlines()}
        tokens, _ = tokens_regenerated(run_dir, info, resume)
        print(
            f"multi_turn {policy}: skipped={len(resume['skipped_ordinals'])} "
            f"turns_regenerated={resume['turns_regenerated']} "
            f"tool_calls_repeated={len(recorded & called)} tokens_regenerated={tokens}"
        )


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        crash_and_resume(Path(tmp))
        checkpoint_cost(Path(tmp))
        multi_turn_cost(Path(tmp))


if __name__ == "__main__":
    main()
