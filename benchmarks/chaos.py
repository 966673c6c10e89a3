"""Chaos: SIGKILL `asyncrl train` at random moments, resume, repeat; then check I1 and I3
(`asyncrl audit`) and I4 (the newest verified checkpoint never goes backwards, every resume
starts from it, and no torn directory is ever loaded).

    .venv/bin/python benchmarks/chaos.py --trials 200      # `make chaos`
    .venv/bin/python benchmarks/chaos.py --trials 30 --set algo.name=ppo
    .venv/bin/python benchmarks/chaos.py --trials 20 --set rollout.backend=ray --jitter 1
    .venv/bin/python benchmarks/chaos.py --trials 30 --episodes     # multi-turn episodes

A trial is one launch killed at a random moment placed by the run's state, not by the clock
alone, so that a faster or slower machine is hit in the same places: once the launch has
recorded a uniformly random number of new steps in [0, 12], after a further uniformly random
delay in [0, `--jitter`] s (mid-step, mid-generation, mid-checkpoint-write, mid-retention);
with 0 steps, at a random moment in [0, 3] s of its start-up. When a run completes, it is
audited and a fresh run dir starts. The last line reads `chaos: K kills over R runs ...: I1,
I3, I4 held in 100%` or names the first violation (exit 1).

`--episodes`: the multi-turn shape (`configs/multi_turn_game.yaml` with the test suite's user
environment `tests/user_envs/tally_game.py:TallyState`, episodes capped at 2 turns by
`env.max_turns`, generated in chunks of 1 token, the default mode), and I9 checked
too: every resume event says `turns_regenerated=0 tool_calls_repeated=0
tokens_regenerated=0`, the environment's journal shows that no launch called a step the
checkpoint it resumed from had recorded, and over each whole run that no step was asked with
two texts and at most one step per kill was executed twice (the one in flight at the kill;
the steps log recovers the turns past the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.checkpoint.snapshot import FILES
from asyncrl.checkpoint.store import CheckpointStore
from asyncrl.cli.audit import audit_run_dir, format_report
from asyncrl.cli.inspect import inspect_run_dir
from asyncrl.train.records import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
RUN = [
    "run.max_num_steps=120",
    "rollout.num_prompts_per_step=4",
    "rollout.num_generations_per_prompt=4",
    "rollout.groups_per_batch=2",
    "rollout.max_trajectory_age_steps=2",
    "checkpoint.save_period=3",
    "checkpoint.keep_last=2",
    "logging.progress=false",
    "logging.plot=false",
]


EPISODES = [
    "env.name=tally_game:TallyState",
    "env.max_turns=2",
    "rollout.chunk_tokens=1",
    "rollout.max_trajectory_age_steps=1",
]
"""`--episodes`: the multi-turn shape, with a user's environment that journals its steps. Its
episodes are capped by `env.max_turns` (the environment would say done after 3 turns, the cap
is 2: an episode ended by a limit) and generated in chunks of 1 token, so a cut can fall inside a
turn and siblings are out of lockstep (issue 44's shape)."""


class ChaosViolation(AssertionError):
    pass


class Shape:
    """What the launches run: the config, and for episodes the journal's environment."""

    def __init__(self, episodes: bool = False) -> None:
        self.episodes = episodes
        self.config = ROOT / ("configs/multi_turn_game.yaml" if episodes else "configs/demo.yaml")
        self.overrides = EPISODES if episodes else []

    def env(self, run_dir: Path) -> dict[str, str]:
        if not self.episodes:
            return {}
        paths = [str(ROOT / "tests" / "user_envs"), os.environ.get("PYTHONPATH", "")]
        return {"PYTHONPATH": os.pathsep.join(filter(None, paths)),
                "TALLY_JOURNAL": str(journal(run_dir))}  # fmt: skip


def journal(run_dir: Path) -> Path:
    return run_dir.parent / f"{run_dir.name}.journal"


POPEN: Any = subprocess.Popen
"""What starts a launch: `subprocess.Popen` here; the tests' pre-imported launcher
(`tests/launcher.py`, real processes forked from an interpreter that has imported torch)."""


def launch(
    run_dir: Path, extra: list[str], fault: str = "", shape: Shape | None = None
) -> subprocess.Popen:
    shape = shape or Shape()
    command = [sys.executable, "-m", "asyncrl.cli", "train", str(shape.config)]
    return POPEN(
        [*command, "--run-dir", str(run_dir), "--restart", *RUN, *shape.overrides, *extra],
        env={
            **os.environ,
            "PYTHONWARNINGS": "ignore",
            "ASYNCRL_FAULT": fault,
            **shape.env(run_dir),
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def recorded_steps(run_dir: Path) -> set[str]:
    """The environment steps of the episodes in flight in the newest verified checkpoint."""
    if latest_step(run_dir) < 0:
        return set()
    info = inspect_run_dir(run_dir)
    return {s for samples in info["episodes_in_flight"].values() for e in samples
            for s in e["step_ids"]}  # fmt: skip


def check_episodes(run_dir: Path, pid: int, recorded: set[str], resume: dict | None) -> None:
    """I9 for one launch: its resume event redid no turn, step or token, and it called none
    of the steps the checkpoint it resumed from recorded (the environment's journal)."""
    if resume is not None:
        redone = {k: resume[k] for k in ("turns_regenerated", "tool_calls_repeated",
                                         "tokens_regenerated")}  # fmt: skip
        if any(redone.values()):
            raise ChaosViolation(f"I9: {run_dir}: resume from step {resume['from_step']} {redone}")
    path = journal(run_dir)
    calls = path.read_text().split("\n") if path.exists() else []
    again = sorted(recorded & {line.split()[1] for line in calls if line.startswith(f"{pid} ")})
    if again:
        raise ChaosViolation(f"I9: {run_dir}: recorded steps called again: {again[:5]}")


def latest_step(run_dir: Path) -> int:
    run_json = run_dir / "run.json"
    if not run_json.exists():
        return -1
    store = CheckpointStore(
        run_dir / "checkpoints", json.loads(run_json.read_text())["run_id"], FILES
    )
    latest, _ = store.latest()
    return latest.step if latest else -1


def resumes(run_dir: Path) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "resume"]


STEPS_PER_LAUNCH = (0, 12)
"""The range of new steps a launch records before its kill (uniform)."""
START_UP_S = 3.0
"""A launch killed after 0 new steps dies at a random moment of its first seconds."""


def steps_recorded(run_dir: Path) -> int:
    """Complete step records in the run's metrics.jsonl (a half-written last line not counted)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return path.read_bytes().count(b"\n")


def wait_for_state(proc: subprocess.Popen, run_dir: Path, new_steps: int, delay_s: float) -> None:
    """Returns once the launch has recorded `new_steps` more steps and `delay_s` more seconds
    have passed, or once it has ended."""
    before = steps_recorded(run_dir)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if steps_recorded(run_dir) >= before + new_steps:
            break
        time.sleep(0.005)
    end = time.monotonic() + delay_s
    while proc.poll() is None and time.monotonic() < end:
        time.sleep(0.005)


def launch_and_check(
    run_dir: Path,
    kill_at: tuple[int, float] | None,
    extra: list[str],
    fault: str = "",
    shape: Shape | None = None,
) -> bool:
    """One launch, SIGKILLed once it has recorded `kill_at = (new steps, then seconds)` (None:
    let it finish, or die by the fault point `fault`). Checks I4 around it: the newest
    verified checkpoint does not go backwards, and a resume starts from it (and I9 for
    episodes). Returns whether the launch was killed."""
    shape = shape or Shape()
    newest = latest_step(run_dir)
    seen = len(resumes(run_dir))
    recorded = recorded_steps(run_dir) if shape.episodes else set()
    proc = launch(run_dir, extra, fault, shape)
    if kill_at is None:
        proc.wait(600)
    else:
        wait_for_state(proc, run_dir, *kill_at)
    killed = proc.poll() is None or proc.returncode == -signal.SIGKILL  # by us or a fault
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    elif proc.returncode not in (0, -signal.SIGKILL):
        raise ChaosViolation(f"{run_dir}: a launch exited {proc.returncode}")
    after = resumes(run_dir)
    if len(after) > seen and after[seen]["from_step"] != newest:
        raise ChaosViolation(
            f"I4: {run_dir}: resumed from step {after[seen]['from_step']}, the newest verified "
            f"checkpoint was step {newest}"
        )
    if latest_step(run_dir) < newest:
        raise ChaosViolation(f"I4: {run_dir}: newest verified step went back from {newest}")
    if shape.episodes:
        check_episodes(run_dir, proc.pid, recorded, after[seen] if len(after) > seen else None)
    return killed


def check_run(run_dir: Path) -> None:
    report = audit_run_dir(run_dir)
    if not report.ok:
        raise ChaosViolation(format_report(report, run_dir))


def check_journal(run_dir: Path, kills: int) -> tuple[int, int]:
    """I9 over a whole run from the environment's own journal (`PID STEP_ID TEXT_SHA256` a
    line): no step asked with two texts, and at most one turn (`ORDINAL:SAMPLE:TURN`, whatever
    its restart count) executed twice per kill (the one in flight at it). Returns (turns
    executed, turns executed more than once)."""
    path = journal(run_dir)
    rows = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
    texts: dict[str, set[str]] = {}
    count: dict[str, int] = {}
    for _, sid, *sha in rows:
        texts.setdefault(sid, set()).update(sha)
        turn = ":".join(sid.split(":")[:3])  # a turn asked again under a new id counts too
        count[turn] = count.get(turn, 0) + 1
    two = sorted(s for s, t in texts.items() if len(t) > 1)
    if two:
        raise ChaosViolation(f"I9: {run_dir}: steps asked with two texts: {two[:5]}")
    twice = sum(1 for n in count.values() if n > 1)
    if twice > kills:
        raise ChaosViolation(
            f"I9: {run_dir}: {twice} steps executed more than once over {kills} kills (at most "
            "the one in flight at each kill may be)"
        )
    return len(count), twice


def run_chaos(  # type: ignore[no-untyped-def]
    trials: int,
    root: Path,
    seed: int = 0,
    log=print,
    extra: list[str] | None = None,
    fault: str = "",
    jitter_s: float = 0.3,
    episodes: bool = False,
) -> dict:
    """`trials` kills, each at a random state (see the module docstring) or earlier, at the
    `ASYNCRL_FAULT` point `fault` (then no launch is killed by the clock: for the negative
    control); raises `ChaosViolation` at the first broken invariant. Returns the counts of
    kills, runs, and launches that resumed from a checkpoint (`resumed`)."""
    rng = random.Random(seed)
    extra = extra or []
    shape = Shape(episodes)
    runs, kills, run_kills = 0, 0, 0
    executed, twice = 0, 0

    def finished(run_dir: Path) -> None:
        nonlocal executed, twice
        check_run(run_dir)
        if shape.episodes:
            steps, again = check_journal(run_dir, run_kills)
            executed, twice = executed + steps, twice + again

    while kills < trials:
        run_dir = root / f"run{runs}"
        new_steps = rng.randint(*STEPS_PER_LAUNCH)
        delay_s = rng.uniform(0.0, START_UP_S if new_steps == 0 else jitter_s)
        kill_at = None if fault else (new_steps, delay_s)
        if launch_and_check(run_dir, kill_at, extra, fault, shape):
            kills += 1
            run_kills += 1
            if kills % 10 == 0:
                log(f"chaos: {kills}/{trials} kills, {runs + 1} runs")
            continue
        finished(run_dir)  # finished during the chaos
        runs += 1
        run_kills = 0
    run_dir = root / f"run{runs}"
    launch_and_check(run_dir, None, extra, shape=shape)
    finished(run_dir)
    events = [e for i in range(runs + 1) for e in resumes(root / f"run{i}")]
    resumed = sum(1 for e in events if e["from_step"] > 0)
    turns_kept = sum(e.get("turns_kept", 0) for e in events)
    continued = sum(1 for e in events if e.get("turns_kept", 0) > 0)
    recovered = sum(e.get("turns_recovered", 0) for e in events)
    return {"kills": kills, "runs": runs + 1, "resumed": resumed, "turns_kept": turns_kept,
            "episode_resumes": continued, "turns_recovered": recovered,
            "steps_executed": executed, "steps_executed_twice": twice}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", type=Path, default=None, help="keep the run dirs here")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    parser.add_argument(
        "--jitter", type=float, default=0.3, metavar="S",
        help="kill up to this many seconds after the launch's random number of new steps",
    )  # fmt: skip
    parser.add_argument(
        "--episodes", action="store_true",
        help="the multi-turn shape (a user's environment, I9 checked too)",
    )  # fmt: skip
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        root = args.dir or Path(tmp)
        try:
            result = run_chaos(
                args.trials, root, args.seed, extra=args.set, jitter_s=args.jitter,
                episodes=args.episodes,
            )  # fmt: skip
        except ChaosViolation as err:
            print(f"chaos: VIOLATION: {err}")
            sys.exit(1)
    held = "I1, I3, I4, I9" if args.episodes else "I1, I3, I4"
    shape = " on the multi-turn shape" if args.episodes else ""
    episodes = (
        f", {result['episode_resumes']} of them continuing episodes in flight "
        f"({result['turns_kept']} turns kept, none redone; {result['turns_recovered']} turns "
        f"past the checkpoints recovered from the steps log; the environment executed "
        f"{result['steps_executed_twice']} of {result['steps_executed']} steps twice)"
        if args.episodes else ""
    )  # fmt: skip
    print(
        f"chaos: {result['kills']} kills over {result['runs']} runs at random moments{shape} "
        f"({result['resumed']} launches resumed from a checkpoint{episodes})"
        f"{' with ' + ' '.join(args.set) if args.set else ''}: {held} held in 100%"
    )


if __name__ == "__main__":
    main()
