"""What a launch leaves behind, ended however it ends: launched vLLM servers (process groups of
their own, so a signal to the trainer's group never reaches them) and scratch copies of the
model (`RUN_DIR/.scratch/...`).

    trainer ──pipe (stdin of the guard)──▶ guard: `python -m asyncrl.rollout.lifeline`,
      watch_group(pid, started)             a session of its own, ignores SIGINT/SIGTERM/...
      watch_path(dir)                        EOF (the trainer closed it, exited, os._exit'ed,
                                             was SIGKILLed): ends every recorded group that is
                                             still the one recorded, removes every recorded path

The trainer holds the pipe's only write end (non-inheritable, and replaced by /dev/null in a
forked child), so the guard reads EOF exactly when the trainer is gone or closes it: one code
path for a normal end, an exception, exit 75, exit 130 (`os._exit`, which runs no `finally`),
and a SIGKILL of the trainer alone. A SIGKILL of the guard too (a cgroup's kill, which takes
the servers with it) leaves `RUN_DIR/servers/launched.json` for the next launch
(`servers.stop_stale`), which ends groups by the same rule (`leftover_groups`).

A group is named by its leader's pid and start time (`/proc/PID/stat`, clock ticks since boot):
pids are reused, so a pid alone is never killed. This module imports the standard library only
(the guard starts in ~40 ms).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, NamedTuple


class Proc(NamedTuple):
    """One process as `/proc/PID/stat` says: its group, session and start time."""

    pgrp: int
    sid: int
    started: int


def start_time(pid: int) -> int:
    """A process's start time in clock ticks since boot (0 if it is gone): with its pid, what
    names one process for good (pids are reused)."""
    proc = _read_stat(pid)
    return proc.started if proc is not None else 0


def _read_stat(pid: int) -> Proc | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # fields[0] is stat's field 3 (the state): ppid, pgrp, session, ... starttime is field 22
    return Proc(int(fields[2]), int(fields[3]), int(fields[19]))


def process_table() -> dict[int, Proc]:
    """Every process this one can see, by pid."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            proc = _read_stat(int(entry.name))
            if proc is not None:
                table[int(entry.name)] = proc
    return table


def leftover_groups(
    recorded: Iterable[tuple[int, int]], table: Mapping[int, Proc], own_pgrp: int
) -> list[int]:
    """Of the recorded groups (`(leader pid, leader start time)`, each a session the launch
    started), those still alive in `table`: the leader is the recorded process (same start
    time, still leading its group), or the leader is gone and members of its session remain
    (started after it: vLLM's engine or worker outliving the server's process; Linux reuses no
    pid while a group of that id lives, so such members are the recorded group's). A pid
    that is another process's now, a start time of 0 (unknown) and `own_pgrp` are never
    returned."""
    found = []
    for pgid, started in recorded:
        if pgid == own_pgrp or pgid <= 1 or not started or pgid in found:
            continue
        leader = table.get(pgid)
        if leader is not None:
            if leader.started == started and leader.pgrp == pgid:
                found.append(pgid)
            continue  # the pid is another process's: the recorded group ended before
        if any(p.pgrp == pgid and p.sid == pgid and p.started >= started for p in table.values()):
            found.append(pgid)
    return found


def end_groups(recorded: Iterable[tuple[int, int]]) -> list[int]:
    """SIGKILLs each recorded group still alive (`leftover_groups`; SIGCONT first, for a
    stopped one); the groups signalled."""
    groups = leftover_groups(recorded, process_table(), os.getpgrp())
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    return groups


# -- the trainer's side -------------------------------------------------------------------------

_OPEN: set[int] = set()
"""Write ends of this process's lifelines: a forked child drops them (`_after_fork`), or a
child living on would keep the guard from ever reading EOF."""


def _after_fork() -> None:
    if not _OPEN:
        return
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in _OPEN:
        with contextlib.suppress(OSError):
            os.dup2(null, fd, inheritable=False)  # the pipe released, the number still valid
    os.close(null)
    _OPEN.clear()


os.register_at_fork(after_in_child=_after_fork)


class Lifeline:
    """A guard process that ends what this one records, once this one is gone (see the module
    docstring). `close` is the orderly end: the guard then does the same, finding the groups
    already stopped (`servers.stop`) and removing the paths."""

    def __init__(self, log: Path | None = None) -> None:
        out: IO[bytes] | int = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # no Ctrl-C or scheduler signal to the trainer's group
                close_fds=True,  # holds nothing of the trainer's (the run dir's lock)
            )
        finally:
            if not isinstance(out, int):
                out.close()
        assert self.process.stdin is not None
        self._pipe: IO[bytes] | None = self.process.stdin
        _OPEN.add(self._pipe.fileno())
        self._lock = threading.Lock()

    def watch_group(self, pid: int, started: int) -> None:
        """Ends process group `pid` (its leader started at `started`) when this process ends."""
        self._send({"group": pid, "started": started})

    def watch_path(self, path: str | Path) -> None:
        """Removes `path` (a folder) when this process ends."""
        self._send({"path": str(path)})

    def _send(self, row: dict[str, object]) -> None:
        with self._lock:
            if self._pipe is None:
                raise RuntimeError("the lifeline is closed")
            self._pipe.write(json.dumps(row).encode() + b"\n")
            self._pipe.flush()

    def close(self, timeout_s: float = 30.0) -> None:
        """The orderly end: the guard cleans up now; waits for it (bounded)."""
        with self._lock:
            pipe, self._pipe = self._pipe, None
        if pipe is None:
            return
        _OPEN.discard(pipe.fileno())
        with contextlib.suppress(OSError):
            pipe.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout_s)


def watched_dir(lifeline: Lifeline, parent: str = "", prefix: str = "asyncrl-") -> str:
    """A fresh folder under `parent` (made where missing; "": the system's temporary
    directory) that `lifeline` removes when this process ends."""
    if parent:
        os.makedirs(parent, exist_ok=True)
    path = tempfile.mkdtemp(prefix=prefix, dir=parent or None)
    lifeline.watch_path(path)
    return path


# -- the guard ----------------------------------------------------------------------------------


def guard(rows: IO[bytes]) -> None:
    """Reads the recorded groups and paths until EOF, then ends and removes them."""
    groups: list[tuple[int, int]] = []
    paths: list[str] = []
    for line in rows:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by the trainer's death
        if "group" in row:
            groups.append((int(row["group"]), int(row["started"])))
        elif "path" in row:
            paths.append(str(row["path"]))
    ended = end_groups(groups)
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    if ended:
        print(f"asyncrl lifeline: ended process group(s) {ended} the launch left", flush=True)


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)  # it ends at EOF, after its cleanup
    guard(sys.stdin.buffer)


if __name__ == "__main__":
    main()
