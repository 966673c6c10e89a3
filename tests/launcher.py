"""Real processes that start in milliseconds: a pre-imported launcher for the end-to-end tests.

A test that starts `python -m asyncrl.cli train ...` used to pay for a new interpreter that
imports torch, transformers and the rest again, seconds a launch, hundreds of launches a suite.
Here a *zygote* process imports those libraries once (and nothing of asyncrl, whose modules read
their environment at import: `ASYNCRL_FAULT`) and forks each launch from them:

- the launch is a real process with its own pid: SIGKILL kills it, a fault point kills it, and
  what it left on disk is what a killed process leaves;
- it is reparented to the test's process (the test process is the "child subreaper", Linux's
  `PR_SET_CHILD_SUBREAPER`), so `poll`, `wait` and the exit status are the kernel's own, read
  with `waitpid`, as `subprocess.Popen` reads them;
- it gets the test's argv, environment, working directory and standard streams, and runs the
  module as `python -m` does (`runpy`, `__main__`), ending through the interpreter's own exit:
  atexit handlers, non-daemon threads joined, streams flushed;
- two zygotes with different hash seeds take turns, so that a run and its resume do not share
  one `PYTHONHASHSEED` (a fresh interpreter draws a new one; an order that depends on it would
  otherwise look deterministic here and not in a user's resume).

`popen` and `run` take `subprocess`'s arguments; a command that is not `python -m MODULE` or
`python SCRIPT.py` (torchrun, `python -c`) goes to `subprocess` unchanged. With
`ASYNCRL_TEST_NO_ZYGOTE=1` every launch is a fresh interpreter (the old way, to compare).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed",
    "torch.nn.functional",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
    "tokenizers",
    "safetensors.torch",
    "yaml",
    "orjson",
    "rich.console",
    "tqdm",
    "pebble",
    "matplotlib",
    "matplotlib.pyplot",
    "datasets",
    "peft",
)
"""What every launch would import anyway (the zygote imports each that is installed)."""
PRELOAD_VAR = "ASYNCRL_TEST_ZYGOTE_PRELOAD"
"""A zygote's own variable: more modules to import (`vllm`, for the launches that run it: any
argument names vLLM, as `rollout.engine=vllm` or a script `vllm_*.py` does)."""

_PR_SET_CHILD_SUBREAPER = 36
ENABLED = os.environ.get("ASYNCRL_TEST_NO_ZYGOTE", "") not in ("1", "true")


def _send(sock: socket.socket, payload: dict, fds: list[int]) -> None:
    data = json.dumps(payload).encode()
    socket.send_fds(sock, [struct.pack("!I", len(data)) + data], fds)


def _recv(sock: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _, _ = socket.recv_fds(sock, 4 + 65536, 3)
    if not head:
        raise EOFError
    (size,) = struct.unpack("!I", head[:4])
    data = head[4:]
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            raise EOFError
        data += more
    return json.loads(data), fds


class _Signals:
    """`subprocess.Popen`'s signals, for a handle with `pid` and `poll`."""

    pid: int

    def poll(self) -> int | None:
        raise NotImplementedError

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Process(_Signals):
    """The handle of one launch: `subprocess.Popen`'s `pid`, `returncode`, `poll`, `wait`,
    `communicate`, `send_signal`, `kill` and `terminate` (a pipe's output is read in a thread,
    so a chatty process never blocks on a full pipe; `communicate` returns it)."""

    def __init__(self, args: list[str], pid: int, pipes: dict[str, int], text: bool) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._text = text
        self._chunks: dict[str, list[bytes]] = {name: [] for name in pipes}
        self._readers = [
            threading.Thread(target=self._read, args=(name, fd), daemon=True)
            for name, fd in pipes.items()
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, name: str, fd: int) -> None:
        with os.fdopen(fd, "rb", buffering=0) as stream:
            while chunk := stream.read(65536):
                self._chunks[name].append(chunk)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode

    def _output(self, name: str) -> Any:
        if name not in self._chunks:
            return None
        out = b"".join(self._chunks[name])
        return out.decode(errors="replace") if self._text else out

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._output("stdout"), self._output("stderr")

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wait()


class Zygote:
    """One pre-imported interpreter that forks launches on request (`tests/zygote_main.py`)."""

    def __init__(self, hash_seed: str, listen: str = "", preload: str = "") -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONWARNINGS": "ignore"}
        env[PRELOAD_VAR] = preload
        mode = ["--listen", listen, json.dumps(_startup_vars(os.environ))] if listen else []
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).with_name("zygote_main.py")),
                str(theirs.fileno()),
                *mode,
            ],
            pass_fds=[theirs.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()

    def fork(self, command: dict, fds: list[int]) -> int:
        with self.lock:
            _send(self.sock, command, fds)
            reply, _ = _recv(self.sock)
        if "error" in reply:
            raise RuntimeError(f"the test launcher could not start {command['argv']}: {reply}")
        return int(reply["pid"])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self.proc.poll() is None:
            self.proc.kill()


LAUNCHED: list[str] = []
"""Every command forked so far (the fast tier's guard in tests/conftest.py reads it)."""
_zygotes: list[Zygote] = []
_turn = 0
_lock = threading.Lock()


_vllm_zygote: Zygote | None = None
_subreaper = False


def _hash_seed() -> str:
    """A zygote's hash seed: the test process's own where it fixed one, else a random one."""
    return os.environ.get("PYTHONHASHSEED") or str(int.from_bytes(os.urandom(2), "big"))


def _become_subreaper() -> None:
    """Makes this process the child subreaper: a launch, once its zygote's middle process has
    exited, is reparented here, so its exit status is ours to read."""
    global _subreaper
    if not _subreaper:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
        _subreaper = True


def _zygote(vllm: bool = False) -> Zygote:
    """The next zygote in turn; for a launch that runs vLLM, one that has imported it too (9 s
    of imports a launch), started on first need."""
    global _turn, _vllm_zygote
    with _lock:
        _become_subreaper()
        if vllm:
            if _vllm_zygote is None:
                _vllm_zygote = Zygote(_hash_seed(), preload="vllm")
            return _vllm_zygote
        if not _zygotes:
            if "PYTHONHASHSEED" in os.environ:  # the test process fixed it: so do its launches
                _zygotes.append(Zygote(os.environ["PYTHONHASHSEED"]))
            else:
                seed = int.from_bytes(os.urandom(2), "big")
                _zygotes.extend([Zygote(str(seed)), Zygote(str(seed + 1))])
        _turn += 1
        return _zygotes[_turn % len(_zygotes)]


def shutdown() -> None:
    """Stops the zygotes (the launches they forked are the test's own to end)."""
    global _vllm_zygote
    with _lock:
        for zygote in _zygotes:
            zygote.close()
        _zygotes.clear()
        if _vllm_zygote is not None:
            _vllm_zygote.close()
            _vllm_zygote = None
        for zygote, sock in _rank_zygotes.values():
            zygote.close()
            shutil.rmtree(Path(sock).parent, ignore_errors=True)
        _rank_zygotes.clear()


# --- the trainer ranks a launch starts ----------------------------------------------------------

SPAWN_VAR = "ASYNCRL_TEST_SPAWN"
"""The product's test-only seam (`asyncrl/train/ranks.py`): a launch whose environment names
this file there starts its trainer ranks with `spawn` below instead of `subprocess.Popen`."""
RANK_ZYGOTE_VAR = "ASYNCRL_TEST_RANK_ZYGOTE"
"""Where `spawn` finds the rank zygote: the path of its listening socket."""
_rank_zygotes: dict[str, tuple[Zygote, str]] = {}
"""The rank zygotes, by the test process's start-up variables when each started (JSON), with
their sockets: a zygote answers `fresh` to a launch whose start-up variables differ from the
ones it started with, and the test process's own may change under it (importing vLLM sets
`TORCHINDUCTOR_*` and `PYTORCH_*` ones), so a changed set gets a zygote of its own."""


def _rank_zygote_env() -> dict[str, str]:
    """The variables that let a launch's trainer ranks be forked from a rank zygote (started
    on first need, one for each set of the test process's start-up variables): `asyncrl
    train` with `train.num_processes` > 1 starts each rank > 0 as `python -m
    asyncrl.train.ranks`, a fresh interpreter that imports torch and transformers again (6 s
    here), unless `ASYNCRL_TEST_SPAWN` names a file whose `spawn` starts it."""
    key = json.dumps(_startup_vars(os.environ), sort_keys=True)
    with _lock:
        if key not in _rank_zygotes:
            import tempfile

            sock = str(Path(tempfile.mkdtemp(prefix="asyncrl-ranks-z-")) / "sock")
            _rank_zygotes[key] = (Zygote(_hash_seed(), listen=sock), sock)
        sock = _rank_zygotes[key][1]
    return {SPAWN_VAR: str(Path(__file__).resolve()), RANK_ZYGOTE_VAR: sock}


def rank_pids(driver: int) -> list[int]:
    """PIDs of the live processes the rank zygotes forked for the launch `driver` (its
    `ASYNCRL_PARENT_PID`): a forked process's /proc/PID/environ is the zygote's, so it is found
    in the zygotes' own lists, checked against /proc (alive, not a zombie, still its waiter's
    child, so a reused pid is never counted)."""
    entries = []
    for _, sock in list(_rank_zygotes.values()):
        if os.path.exists(sock + ".jsonl"):
            with open(sock + ".jsonl") as log:
                entries += [json.loads(line) for line in log if line.endswith("\n")]
    found = []
    for entry in entries:
        if entry["driver"] != str(driver):
            continue
        try:
            stat = Path(f"/proc/{entry['pid']}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state not in ("Z", "X") and int(ppid) == entry["waiter"]:
            found.append(entry["pid"])
    return found


class Waited(_Signals):
    """(In a launch.) `subprocess.Popen`'s handle on a process the rank zygote forked: its
    waiter, the launch's parent, sends the exit status over the connection once it reaped it."""

    def __init__(self, args: list[str], pid: int, sock: socket.socket) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._sock = sock

    def poll(self) -> int | None:
        return self._read(0.0)

    def _read(self, timeout: float | None) -> int | None:
        import select

        if self.returncode is None:
            ready, _, _ = select.select([self._sock], [], [], timeout)
            if ready:
                try:
                    reply, _ = _recv(self._sock)
                    self.returncode = int(reply["exit"])
                except (EOFError, ConnectionError):  # its waiter was killed: it is gone too
                    self.returncode = -signal.SIGKILL
                self._sock.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._read(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code


def spawn(args: list[str], env: dict[str, str]) -> Any:
    """(In a launch, called by `asyncrl.train.ranks.launch` through `ASYNCRL_TEST_SPAWN`.)
    `subprocess.Popen(args, env=env)` for a trainer rank, forked from the rank zygote where it
    can be: a real process with the launch's standard streams, environment and folder, whose
    exit status comes back as a child's would."""
    form = _forkable(args)
    where = env.get(RANK_ZYGOTE_VAR, "")
    deadline = time.monotonic() + 120  # a zygote still importing binds its socket after
    starting = where and os.path.isdir(os.path.dirname(where))
    while starting and not os.path.exists(where) and time.monotonic() < deadline:
        time.sleep(0.01)
    if form is None or not where or not os.path.exists(where):
        return subprocess.Popen(args, env=env)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(where)
    kind, target = form
    command = {
        "kind": kind,
        "target": target,
        "argv": args[3:] if kind == "module" else args[2:],
        "env": env,
        "cwd": os.getcwd(),
    }
    _send(sock, command, [0, 1, 2])
    reply, _ = _recv(sock)
    if "fresh" in reply:
        sock.close()
        return subprocess.Popen(args, env=env)
    return Waited(args, int(reply["pid"]), sock)


def _forkable(args: list[str]) -> tuple[str, str] | None:
    """("module", NAME) for `python -m NAME ...`, ("script", PATH) for `python PATH.py ...`."""
    if not args or Path(args[0]).name != Path(sys.executable).name or len(args) < 2:
        return None
    if args[1] == "-m" and len(args) > 2:
        return "module", args[2]
    if args[1].endswith(".py") and not args[1].startswith("-"):
        return "script", args[1]
    return None


STARTUP_VARS = (
    "PYTHONHASHSEED", "PYTHONOPTIMIZE", "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTHONHOME",
    "OMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO", "TORCH", "PYTORCH", "CUDA_", "HF_",
    "TRANSFORMERS_", "TOKENIZERS_", "LD_",
)  # fmt: skip
"""Variables read when an interpreter or a preloaded library starts: a launch whose environment
sets one of them otherwise than the test process's (`PYTHONHASHSEED`, `OMP_NUM_THREADS`) gets a
fresh interpreter, where it takes effect."""


LOG = os.environ.get("ASYNCRL_TEST_LAUNCH_LOG", "")
"""With `ASYNCRL_TEST_LAUNCH_LOG=FILE`, each launch appends a JSON line to FILE: the test, the
command, and whether it was forked (docs/testing.md counts the suite's launches with it)."""


def _log(args: list[str], forked: bool) -> None:
    if LOG:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        with open(LOG, "a") as out:
            out.write(json.dumps({"test": test, "argv": args[1:6], "forked": forked}) + "\n")


def _startup_vars(env: Any) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_VARS)}


def _stream(target: Any, default: int, opened: list[int]) -> tuple[int, int | None]:
    """(the child's fd, our read end if it is a pipe) for DEVNULL, PIPE, a file, an fd."""
    if target is None:
        return default, None
    if target == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        opened.append(fd)
        return fd, None
    if target == subprocess.PIPE:
        read, write = os.pipe()
        opened.append(write)
        return write, read
    return (target if isinstance(target, int) else target.fileno()), None


def popen(
    args: list[Any],
    *,
    env: dict[str, str] | None = None,
    cwd: Any = None,
    stdout: Any = None,
    stderr: Any = None,
    stdin: Any = None,
    text: bool = False,
    **kwargs: Any,
) -> Any:
    """`subprocess.Popen(args, ...)`, forked from a pre-imported zygote where `args` is a
    Python module or script (stdin is then /dev/null); other commands, stdin, and other keyword
    arguments go to `subprocess.Popen` itself."""
    args = [str(a) for a in args]
    form = _forkable(args)
    fresh = not ENABLED or form is None or kwargs or stdin not in (None, subprocess.DEVNULL)
    fresh = fresh or (env is not None and _startup_vars(env) != _startup_vars(os.environ))
    _log(args, forked=not fresh)
    if ENABLED and form is not None and SPAWN_VAR not in (os.environ if env is None else env):
        env = {**(os.environ if env is None else env), **_rank_zygote_env()}  # "": opted out
    if fresh:
        return subprocess.Popen(
            args, env=env, cwd=cwd, stdout=stdout, stderr=stderr, stdin=stdin, text=text, **kwargs
        )
    opened: list[int] = []
    pipes: dict[str, int] = {}
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        opened.append(null)
        out, read = _stream(stdout, 1, opened)
        if read is not None:
            pipes["stdout"] = read
        if stderr == subprocess.STDOUT:
            err = out
        else:
            err, read = _stream(stderr, 2, opened)
            if read is not None:
                pipes["stderr"] = read
        kind, target = form
        command = {
            "kind": kind,
            "target": target,
            "argv": args[3:] if kind == "module" else args[2:],
            "env": dict(os.environ if env is None else env),
            "cwd": str(cwd or os.getcwd()),
        }
        pid = _zygote(any("vllm" in a for a in args)).fork(command, [null, out, err])
        LAUNCHED.append(" ".join(args)[:200])
    except BaseException:
        for fd in pipes.values():
            os.close(fd)
        raise
    finally:
        for fd in opened:
            with contextlib.suppress(OSError):
                os.close(fd)
    return Process(args, pid, pipes, text)


def run(
    args: list[Any],
    *,
    capture_output: bool = False,
    timeout: float | None = None,
    text: bool = False,
    env: dict[str, str] | None = None,
    cwd: Any = None,
    check: bool = False,
    stdout: Any = None,
    stderr: Any = None,
    **kwargs: Any,
) -> subprocess.CompletedProcess:
    """`subprocess.run` through `popen` (other keyword arguments: `subprocess.run` itself)."""
    if kwargs:
        return subprocess.run(
            [str(a) for a in args], capture_output=capture_output, timeout=timeout, text=text,
            env=env, cwd=cwd, check=check, stdout=stdout, stderr=stderr, **kwargs,
        )  # fmt: skip
    if capture_output:
        stdout = stderr = subprocess.PIPE
    proc = popen(args, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done
