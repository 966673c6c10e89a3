"""The zygote of `tests/launcher.py`: imports the heavy libraries once, then forks launches.

Started as `python tests/zygote_main.py FD` with one end of a Unix socket pair as FD. Each
request is a JSON command (module or script, argv, environment, working directory) with three
file descriptors (stdin, stdout, stderr). The zygote forks twice: the middle process writes the
launch's pid and exits at once, so the launch is reparented to the test process (the child
subreaper), and the zygote replies with the pid once that has happened. The launch sets up its
streams, environment, `sys.path` and argv as a fresh `python -m MODULE` would have them and runs
the module as `__main__`; its end is the interpreter's own. The zygote itself never computes and
starts no thread, so a fork copies a quiet process.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import time
import warnings
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if p not in ("", HERE)]
_inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
BASE_PATH = [p for p in sys.path if p not in _inherited]
"""`sys.path` as a fresh interpreter has it before its script's folder and PYTHONPATH."""

sys.path.insert(0, HERE)
from launcher import PRELOAD, PRELOAD_VAR, STARTUP_VARS, _recv, _send  # noqa: E402

sys.path.remove(HERE)

_extra = [m for m in os.environ.pop(PRELOAD_VAR, "").split(",") if m]
for name in (*PRELOAD, *_extra):  # one not installed here is imported by the launch needing it
    with contextlib.suppress(Exception):
        importlib.import_module(name)
del sys.modules["launcher"]


def _streams(unbuffered: bool) -> None:
    """New `sys.stdin/stdout/stderr` over fds 0-2, buffered as a fresh interpreter's are."""
    encoding = sys.stdout.encoding if sys.stdout is not None else "utf-8"
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=encoding
    )
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(
            io.BufferedWriter(raw),
            encoding=encoding,
            errors="backslashreplace" if fd == 2 else "strict",
            line_buffering=fd == 2 or os.isatty(fd),
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _become(command: dict, fds: list[int]) -> None:
    """In the launch: its streams, environment, folder, path, warnings and argv."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    env = command["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(command["cwd"])
    _streams(bool(env.get("PYTHONUNBUFFERED")))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = os.getcwd() if command["kind"] == "module" else str(Path(command["target"]).parent)
    sys.path[:] = [first, *extra, *BASE_PATH]
    warnings.resetwarnings()
    warnings.simplefilter("ignore", DeprecationWarning)
    warnings.simplefilter("ignore", PendingDeprecationWarning)
    warnings.simplefilter("ignore", ImportWarning)
    warnings.simplefilter("ignore", ResourceWarning)
    options = [o for o in env.get("PYTHONWARNINGS", "").split(",") if o]
    if options:
        warnings._processoptions(options)  # type: ignore[attr-defined]  # as -W does
    if "numpy" in sys.modules:  # a fresh interpreter seeds NumPy's global generator anew
        sys.modules["numpy"].random.seed()


def serve(sock: socket.socket) -> tuple[dict, list[int]] | None:
    """Forks launches until the test process closes the socket; in a launch, returns its
    command (the zygote itself returns None at the end)."""
    while True:
        try:
            command, fds = _recv(sock)
        except (EOFError, ConnectionError):
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        read, write = os.pipe()
        middle = os.fork()
        if middle == 0:
            middle = os.getpid()
            launch = os.fork()
            if launch == 0:
                os.close(read)
                os.close(write)
                sock.close()
                while os.getppid() == middle:  # until the middle process is gone (~ms)
                    time.sleep(0.0002)
                return command, fds
            os.write(write, str(launch).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            pid = pipe.read().decode()
        os.waitpid(middle, 0)  # the launch is the subreaper's now
        for fd in fds:
            os.close(fd)
        _send(sock, {"pid": int(pid)} if pid else {"error": "fork failed"}, [])


def serve_listening(control: socket.socket, path: str, test_vars: dict) -> tuple | None:
    """The rank zygote (`python tests/zygote_main.py FD --listen PATH VARS`): forks, for any
    process that connects to PATH (an `asyncrl train` launch starting its trainer ranks:
    `launcher.spawn`), a launch that stays the child of a *waiter*: the waiter sends the
    launch's pid, then its exit status once it has reaped it, so the process that asked can
    poll, wait and read the status as a parent would. A command whose start-up variables differ
    from the test process's (VARS) is answered `fresh` (the asker starts it with subprocess).
    Each launch is appended to PATH.jsonl (driver, pid, waiter) so the tests can find it.
    Returns in a launch its command; None once the test process closes FD."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the waiters
    while True:
        ready, _, _ = select.select([server, control], [], [])
        if control in ready:
            return None
        conn, _ = server.accept()
        try:
            command, fds = _recv(conn)
        except (EOFError, ConnectionError):
            conn.close()
            continue
        env = command["env"]
        if {k: v for k, v in env.items() if k.startswith(STARTUP_VARS)} != test_vars:
            with contextlib.suppress(OSError):
                _send(conn, {"fresh": True}, [])
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:  # the waiter
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            server.close()
            control.close()
            launch = os.fork()
            if launch == 0:
                conn.close()
                return command, fds
            for fd in fds:
                os.close(fd)
            with open(path + ".jsonl", "a") as log:
                driver = env.get("ASYNCRL_PARENT_PID", "")
                entry = {"driver": driver, "pid": launch, "waiter": os.getpid()}
                log.write(json.dumps(entry) + "\n")  # one write: a reader sees it whole
            with contextlib.suppress(OSError):
                _send(conn, {"pid": launch}, [])
            _, status = os.waitpid(launch, 0)
            with contextlib.suppress(OSError):
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)}, [])
            os._exit(0)
        for fd in fds:
            os.close(fd)
        conn.close()


_control = socket.socket(fileno=int(sys.argv[1]))
if len(sys.argv) > 2 and sys.argv[2] == "--listen":
    launched = serve_listening(_control, sys.argv[3], json.loads(sys.argv[4]))
else:
    launched = serve(_control)
del _control
if launched is None:
    sys.exit(0)
_become(*launched)
_command = launched[0]
sys.argv = [_command["target"], *_command["argv"]]
del launched
if _command["kind"] == "module":  # what `python -m` runs (argv[0] becomes the module's file)
    runpy._run_module_as_main(_command["target"], alter_argv=True)  # type: ignore[attr-defined]
else:
    runpy.run_path(_command["target"], run_name="__main__")
