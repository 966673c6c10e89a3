"""`train.num_processes` > 1: the trainer's ranks — how they start, and what ranks 1..P-1 do.

    rank 0 (the `asyncrl train` process)               ranks 1..P-1 (`serve`)
    ------------------------------------               ----------------------
    run dir, lock, collector, ledger, buffer           policy + algorithm only
    build: algo (sharded), publish v0  ── gather ──    build: algo (sharded), gather
    resume: "restore" ────────────────────────────▶    load own rows of model + algorithm
    step t: groups = buffer.sample(t)
            "step" ───────────────────────────────▶    algo.step([], t):
            algo.step: each rank its rows ─ scatter ▶  its rows (GRPO/RLOO; PPO: all groups)
            trains its rows ◀───── FSDP2 reduce ───▶   (gradients summed by reduce-scatter)
            publish v=t+1 ◀── full weights gather ─    gather
    checkpoint: cut, store.begin ─ "checkpoint" ──▶    writes its rank files into the
            ◀────────────── sizes + SHA-256 ──────     temp dir, hashed while written
            writer: own files, manifest (all), rename
    end / signal / error: "stop" ─────────────────▶    exit 0

Rank 0 decides everything; the others only answer commands, so the invariants' bookkeeping
stays in one process exactly as with one rank. Ranks 1..P-1 ignore SIGTERM and SIGINT (rank 0
takes the emergency checkpoint, and needs them for it) and exit when rank 0's process goes
away. A rank that dies makes rank 0's next collective, or its wait for a step's groups, fail:
`RankFailed`, exit 1, and no checkpoint newer than the last verified one (a manifest is
written only once every rank's files are in). A rank that hangs, is stopped, or whose machine
drops off the network closes no connection, so no collective fails: the ranks' heartbeat
(`asyncrl.distributed.heartbeat`) catches it after `train.rank_timeout_s`. Rank 0 then fails
the same way; if a collective holds its main thread, it stops the process itself
(`ABANDON_GRACE_S` later: the newest verified checkpoint is intact, as after a SIGKILL). A
rank > 0 whose rank 0 falls silent exits.

Launch: `asyncrl train` starts ranks 1..P-1 itself as child processes on this machine (they
meet through a file, so no rendezvous server listens anywhere; `gloo` runs over `lo`). Under
`torchrun` (RANK and WORLD_SIZE set) it starts nothing: torchrun started every rank, and rank 0
is the one with the run dir.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from asyncrl.algos.update import NonFiniteLoss, StepAbandoned, abandonable
from asyncrl.checkpoint.shards import write_rank_files
from asyncrl.checkpoint.snapshot import MODEL_FILE, STATE_FILE, Stateful, decode
from asyncrl.checkpoint.staging import Cut, StagingArea
from asyncrl.checkpoint.store import CheckpointError, Verified
from asyncrl.config import Config, ConfigError
from asyncrl.distributed.heartbeat import Heartbeat, describe, group_store
from asyncrl.distributed.ranks import LOCAL_RENDEZVOUS, TorchRanks, init_ranks
from asyncrl.faults import fault_facts, fault_point
from asyncrl.models.device import bound_onednn_cache, resolve_device
from asyncrl.train.signals import SIGNALS

COLLECTIVE_DEATH_WAIT_S = 5.0
"""After a failed collective, how long rank 0 waits for a rank it started to be seen dead (so
the error names the rank, not the broken connection)."""
ABANDON_GRACE_S = 5.0
"""After a rank fell silent, how long rank 0 gives its main thread to fail the run in order
before it stops the process itself (the thread is held by a collective that never ends)."""
EXIT_FAILED = 1


class RankFailed(RuntimeError):
    """A trainer rank died or a collective failed: the run stops; the newest verified
    checkpoint is intact and a rerun resumes from it."""


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def this_rank() -> int:
    """This process's rank as its environment says (0 when nothing says)."""
    return int(os.environ.get("RANK", "0")) if launched_by_torchrun() else 0


class RankGroup:
    """Rank 0's handle on the other ranks: commands out, answers in, their health."""

    def __init__(
        self,
        ranks: TorchRanks,
        children: list[Any],  # subprocess.Popen, or what ASYNCRL_TEST_SPAWN starts
        rendezvous_dir: Path | None = None,
        timeout_s: float = 0.0,
    ) -> None:
        self.ranks = ranks
        self.children = children
        self.rendezvous_dir = rendezvous_dir
        self.world_size = ranks.world_size
        self._broken = False
        self._silent = ""
        self._abandon: threading.Timer | None = None
        self.heartbeat = (
            Heartbeat(
                group_store(), 0, tuple(range(1, self.world_size)), timeout_s, self._on_silent
            )
            if timeout_s > 0
            else None
        )

    def _on_silent(self, silent: list[tuple[int, float]]) -> None:
        """(The heartbeat's watch thread.) Fails the run at the main thread's next check, and
        stops the process if that thread does not get there (a collective holds it)."""
        self._silent = describe(silent) + " (hung, stopped, or its machine unreachable)"
        self._broken = True
        self._abandon = threading.Timer(ABANDON_GRACE_S, self._stop_process)
        self._abandon.daemon = True
        self._abandon.start()

    def _stop_process(self) -> None:
        print(
            f"asyncrl: error: {self.failure(None)}; a collective waits on it, so this process "
            "stops now. The newest verified checkpoint is intact; rerun the same command to "
            "resume",
            file=sys.stderr,
            flush=True,
        )
        for child in self.children:
            child.kill()
        os._exit(EXIT_FAILED)

    def command(self, kind: str, **fields: Any) -> None:
        """Tells every other rank to do `kind` (they are waiting for it)."""
        self.check_alive()
        self._collective(self.ranks.broadcast, {"kind": kind, **fields})

    def checkpoint(self, step: int, begun: Path) -> Callable[[], dict[str, dict[str, Any]]]:
        """Has every other rank stage its share of the checkpoint of `step` and write it into
        `begun` in the background; returns the function (for rank 0's writer thread; called
        once) that waits for their files and returns their manifest entries."""
        self.command("checkpoint", step=step, dir=str(begun))
        done: list[dict[str, dict[str, Any]]] = []

        def collect() -> dict[str, dict[str, Any]]:
            if done:
                return done[0]
            done.append({})
            try:
                answers = self.ranks.gather_side(None)
            except RuntimeError as err:
                self._broken = True
                raise self.failure(err) from err
            for rank, entries in enumerate(answers[1:], start=1):
                if "__error__" in entries:
                    raise CheckpointError(
                        f"trainer rank {rank} could not write its files of the checkpoint of "
                        f"step {step}: {entries['__error__']}"
                    )
                done[0].update(entries)
            return done[0]

        return collect

    def _collective(self, call: Any, value: Any) -> Any:
        try:
            return call(value)
        except RuntimeError as err:
            self._broken = True
            raise self.failure(err) from err

    def dead(self, wait_s: float = 0.0) -> list[str]:
        """The other ranks that have exited ("rank R (pid P) exited with C"); with `wait_s`,
        waits up to that long for one to: a killed rank's sockets close as it exits, so a
        collective fails a moment before its process can be reaped."""
        deadline = time.monotonic() + wait_s
        while True:
            found = [
                f"rank {rank} (pid {child.pid}) exited with {child.returncode}"
                for rank, child in enumerate(self.children, start=1)
                if child.poll() is not None
            ]
            if found or not self.children or time.monotonic() >= deadline:
                return found
            time.sleep(0.01)

    def check_alive(self) -> None:
        dead = self.dead()
        if dead or self._silent:
            self._broken = True
            raise self.failure(None)

    def failure(self, err: BaseException | None) -> RankFailed:
        """The run's failure, naming the ranks that died; `err` is the collective's error, the
        symptom (reported only when no rank of ours died)."""
        dead = self.dead(wait_s=COLLECTIVE_DEATH_WAIT_S if err is not None else 0.0)
        what = "; ".join(dead or [self._silent] * bool(self._silent))
        what = what or f"a collective failed: {err}"
        return RankFailed(
            f"trainer {what}; the run stops with no checkpoint newer than the last verified one"
        )

    def close(self, graceful: bool) -> None:
        """Ends the other ranks: with `graceful` (the run ended or was preempted: they are
        waiting for a command) by telling them to stop, else (a failure left them anywhere,
        perhaps inside a collective rank 0 will never join) by killing the ones this process
        started; then leaves the process group."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        graceful = graceful and not self._broken and not self.dead()
        if graceful:
            try:
                self.command("stop")
            except RankFailed:
                graceful = False
        deadline = time.monotonic() + 30
        for child in self.children:
            if not graceful:
                child.kill()
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if graceful:
            self.ranks.close()
        if self.rendezvous_dir is not None:
            shutil.rmtree(self.rendezvous_dir, ignore_errors=True)
        if self._abandon is not None:  # the failure reached the caller in order
            self._abandon.cancel()


TEST_SPAWN = "ASYNCRL_TEST_SPAWN"
"""Test-only (docs/testing.md, never set otherwise): a Python file whose `spawn(argv, env)`
starts each rank > 0 instead of `subprocess.Popen(argv, env=env)`, returning a handle with
Popen's `pid`, `returncode`, `poll`, `wait`, `kill`. The suite's pre-imported launcher
(`tests/launcher.py`) forks ranks with it: real processes, without a fresh interpreter's
seconds of imports each."""


def _spawner() -> Callable[..., Any]:
    path = os.environ.get(TEST_SPAWN, "")
    if not path:
        return subprocess.Popen
    import importlib.util

    spec = importlib.util.spec_from_file_location("asyncrl_test_spawn", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{TEST_SPAWN}: {path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.spawn


def launch(config: Config, scratch: Path | None = None) -> RankGroup | None:
    """Rank 0's start of a `train.num_processes` > 1 run: the other ranks (spawned here unless
    torchrun started them), the process group, and the resolved config sent to every rank."""
    world_size = config.train.num_processes
    device = resolve_device("train.device", config.train.device)
    if launched_by_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise ConfigError(
                f"train.num_processes: got {world_size}, but torchrun started "
                f"{os.environ['WORLD_SIZE']} processes (WORLD_SIZE); make them equal"
            )
        ranks = init_ranks(device)
        ranks.broadcast(config.to_dict())
        return RankGroup(ranks, [], timeout_s=config.train.rank_timeout_s)
    if world_size == 1:
        return None
    if scratch is not None:  # the run dir's: emptied at the next launch, even after a SIGKILL
        scratch.mkdir(parents=True, exist_ok=True)
    rendezvous = Path(tempfile.mkdtemp(prefix="asyncrl-ranks-", dir=scratch)) / "rendezvous"
    env = {
        **os.environ,
        LOCAL_RENDEZVOUS: str(rendezvous),  # I7: a file, no server socket; gloo on loopback
        "WORLD_SIZE": str(world_size),
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "ASYNCRL_PARENT_PID": str(os.getpid()),
        "ASYNCRL_TRAIN_DEVICE": config.train.device,
    }
    argv = [sys.executable, "-m", "asyncrl.train.ranks"]
    spawn = _spawner()
    children = [
        spawn(argv, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
        for rank in range(1, world_size)
    ]
    try:
        ranks = init_ranks(device, rank=0, world_size=world_size, rendezvous=str(rendezvous))
        ranks.broadcast(config.to_dict())
    except BaseException:
        for child in children:
            child.kill()
        shutil.rmtree(rendezvous.parent, ignore_errors=True)
        raise
    return RankGroup(ranks, children, rendezvous.parent, config.train.rank_timeout_s)


# --- ranks 1..P-1 -----------------------------------------------------------------------------


def _watch_parent(parent_pid: int) -> None:
    """Exits this rank once the process that spawned it is gone (a SIGKILLed rank 0 cannot
    tell it): at once, from a pidfd of rank 0's process, which becomes readable when it ends
    (its parent, where pidfds are not to be had)."""
    try:
        pidfd = os.pidfd_open(parent_pid)
    except ProcessLookupError:  # already gone
        os._exit(1)
    except (AttributeError, OSError):  # no pidfds (Linux < 5.3): rank 0 is our parent
        pidfd = -1

    def watch() -> None:
        if pidfd >= 0:
            select.select([pidfd], [], [])
        else:
            while os.getppid() == parent_pid:
                time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="asyncrl-parent-watch", daemon=True).start()


def serve(device: torch.device) -> int:
    """A rank > 0: joins the group, builds the policy and the algorithm from rank 0's config,
    and answers rank 0's commands until it says stop. Returns the exit code."""
    from asyncrl.config.keys import build_config
    from asyncrl.train.components import build_trainer_side

    for signum in SIGNALS:  # rank 0 stops the run, with our help (SIGUSR1's default kills)
        signal.signal(signum, signal.SIG_IGN)
    if "ASYNCRL_PARENT_PID" in os.environ:
        _watch_parent(int(os.environ["ASYNCRL_PARENT_PID"]))
    ranks = init_ranks(device)
    config = build_config(ranks.broadcast())
    heartbeat = Heartbeat(
        group_store(), ranks.rank, (0,), config.train.rank_timeout_s, _exit_on_silent_rank_0
    )
    bound_onednn_cache()
    if config.run.torch_threads:
        torch.set_num_threads(config.run.torch_threads)
    torch.use_deterministic_algorithms(config.run.deterministic)
    _, policy, build_algorithm = build_trainer_side(config, ranks, ranks.device)
    algo = build_algorithm()
    algo.policy_weights()  # rank 0 publishes version 0
    parts: dict[str, Stateful] = {"model": policy.model, "algorithm": algo}
    writer = RankWriter(ranks)
    while True:
        command = ranks.broadcast()
        kind = command["kind"]
        if kind == "stop":
            heartbeat.stop()
            writer.wait()
            break
        if kind == "step":
            torch_rng = torch.get_rng_state()
            try:  # its data comes from rank 0's algo.step; a notice there gives it up here too
                with fault_facts(step=command["step"]), abandonable(lambda: ranks.agree(False)):
                    algo.step([], command["step"])
            except NonFiniteLoss:
                continue  # every rank refused the step (the norm is global): rank 0 stops
            except StepAbandoned:  # rank 0 checkpoints the state before the step, with us
                torch.set_rng_state(torch_rng)
                continue
            fault_point("rank.step_done", step=command["step"])
            algo.policy_weights()  # rank 0 publishes the new version
        elif kind == "checkpoint":
            writer.submit(Path(command["dir"]), parts, command["step"])
        elif kind == "restore":
            restore_rank(command, parts)
            algo.policy_weights()  # rank 0 publishes the restored version
    ranks.close()
    return 0


def _exit_on_silent_rank_0(silent: list[tuple[int, float]]) -> None:
    print(f"asyncrl: trainer {describe(silent)}; this rank exits", file=sys.stderr, flush=True)
    os._exit(EXIT_FAILED)


class RankWriter:
    """A rank > 0's checkpoint writes, in the background like rank 0's: `submit` stages the
    rank's model and algorithm state (the copy runs in a thread; the next optimizer step waits
    for it: `asyncrl.checkpoint.staging`) and a writer thread writes its rank files, then
    sends their entries, or the error it met, to rank 0's writer over the side group."""

    def __init__(self, ranks: TorchRanks) -> None:
        self.ranks = ranks
        self.staging = StagingArea()
        self._thread: threading.Thread | None = None

    def submit(self, begun: Path, parts: dict[str, Stateful], step: int) -> None:
        self.wait()  # the previous write (its staging buffers) is done
        states = {name: part.state_dict() for name, part in parts.items()}
        cut = self.staging.stage(states, {}, background=tuple(parts))
        self._thread = threading.Thread(
            target=self._write, args=(begun, cut, step), name="asyncrl-rank-ckpt", daemon=True
        )
        self._thread.start()

    def _write(self, begun: Path, cut: Cut, step: int) -> None:
        answer: dict[str, Any]
        try:
            cut.wait_staged()
            with fault_facts(step=step):
                sharded_files = {f: cut.tensors[f] for f in (MODEL_FILE, STATE_FILE)}
                answer = write_rank_files(begun, cut.trees, sharded_files, self.ranks.rank)
        except BaseException as err:  # reported to rank 0, whose save then fails
            answer = {"__error__": f"{type(err).__name__}: {err}"}
        finally:
            cut.release()
        self.ranks.gather_side(answer)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Creates an optimizer's per-parameter state (torch creates it lazily, at the first
    step) without moving a weight: one step on zero gradients at lr 0 (what DCP does too).
    AdamW at lr 0 leaves every weight bit-identical, its decay included."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for param in params:
        param.grad = torch.zeros_like(param)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def restore_templates(parts: dict[str, Any]) -> dict[str, Any]:
    """The live states a sharded restore reads this rank's rows into (`decode`'s
    `templates`): the model's and the algorithm's, with every optimizer's state created first
    so that its moments are DTensors like the parameters they belong to (a fresh optimizer has
    none to show the layout)."""
    for value in vars(parts["algorithm"]).values():
        if isinstance(value, torch.optim.Optimizer):
            _init_optimizer_state(value)
    return {name: part.state_dict() for name, part in parts.items()}


def restore_rank(command: dict[str, Any], parts: dict[str, Any]) -> None:
    """Loads this rank's rows of the model and algorithm parts of the checkpoint rank 0 has
    verified (its files are hash-checked again as they are read)."""
    from asyncrl.checkpoint.restore import load_parts

    verified = Verified(
        Path(command["path"]),
        command["step"],
        command["manifest"],
        command["format_version"],
        command["manifest_sha256"],
    )
    snapshot = decode(verified, restore_templates(parts))
    load_parts(parts, snapshot)


def main() -> int:
    device = torch.device(os.environ.get("ASYNCRL_TRAIN_DEVICE", "cpu"))
    return serve(device)


if __name__ == "__main__":
    sys.exit(main())
