"""vLLM's OpenAI-compatible servers as processes and as HTTP endpoints: one server (`Server`:
its health, vLLM's RL control plane: pause, reload, weight version, resume), launching them
(`rollout.servers.launch`) and stopping what a run launched, also what a SIGKILLed launch left
(`stop_stale`, under the run dir's lock). Servers the user runs are attached by
`server_attach.py`.

    launched: python -m vllm.entrypoints.openai.api_server --model DIR --host 127.0.0.1
              --port P --middleware asyncrl.rollout.server_auth.RequireSecret ...
              (VLLM_SERVER_DEV_MODE=1: vLLM's RL routes; the launch's secret in its
              environment, required on every route), its own process group, its log in
              RUN_DIR/servers/server_N.log, its pid and group in RUN_DIR/servers/launched.json
              and with the launch's lifeline (`lifeline.py`), which ends it however the
              launch ends

The engine that sends them requests is `asyncrl/rollout/vllm_server.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from asyncrl.rollout.lifeline import end_groups, leftover_groups, process_table, start_time
from asyncrl.rollout.server_auth import SECRET_ENV, bearer

SERVERS_DIR = "servers"
"""`RUN_DIR/servers/`: the launched servers' logs and `launched.json`."""
RECORD = "launched.json"
STREAMS = httpx.Limits(max_connections=None, max_keepalive_connections=64)
SERVED_NAME = "asyncrl"
"""The model name launched servers answer to (`--served-model-name`)."""
MARK = "vllm.entrypoints.openai.api_server"
"""The module a launched server runs."""
GUARD = "asyncrl.rollout.server_auth.RequireSecret"
"""The middleware that makes a launched server require its launch's secret on every route."""


class ServerError(RuntimeError):
    """A server that cannot be started or used; the message names it (and its log)."""


class ServerDown(ServerError):
    """A server that did not answer (its connection refused, dropped or timed out): its work
    may continue elsewhere."""


@dataclass
class Server:
    """One server: its URL, and for a launched one its process and log."""

    index: int
    url: str
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    model: str = SERVED_NAME
    started: int = 0
    """A launched server's start time (`/proc/PID/stat`), recorded: a stale record's pid is
    stopped only if that process is still the one started."""
    version: int | None = None
    """The weights version loaded (None: not ours yet, or unknown)."""
    base: bool = False
    """A LoRA run's: it holds the run's frozen base (a launched one from its start; an attached
    one once the base was loaded into it)."""
    alive: bool = True
    restarts: int = 0
    checked: int = -1
    """The batch whose start read its weights back (`server_leases.read_back`)."""
    client: httpx.Client = field(
        default_factory=lambda: httpx.Client(timeout=600.0, limits=STREAMS)
    )
    """Its request streams: as many at once as a batch has jobs."""
    control: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=30.0))
    """Its `/health` and RL routes, apart from the streams (a full pool must not make a
    healthy server look dead)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while its weights change."""
    streams: set[socket.socket] = field(default_factory=set)
    """The sockets of its open request streams (read without a timeout: a stream may be
    silent for as long as the server is busy); `cut_streams` breaks them."""
    streams_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def launched(self) -> bool:
        return self.process is not None

    def authorize(self, secret: str) -> None:
        """Every request from now on carries `secret` (`server_auth`)."""
        for client in (self.client, self.control):
            client.headers.update(bearer(secret))

    def name(self) -> str:
        where = f", log {self.log}" if self.log else ""
        return f"server {self.index} ({self.url}{where})"

    def post(
        self, route: str, body: dict[str, Any] | None = None, timeout: float = 30.0, **params: Any
    ) -> Any:
        """POSTs to one of vLLM's routes: ServerDown when the server does not answer in
        `timeout`, ServerError naming the server and route when it refuses."""
        try:
            reply = self.control.post(
                self.url + route, json=body, params=params or None, timeout=timeout
            )
        except httpx.HTTPError as err:
            raise ServerDown(f"{self.name()}: POST {route} failed: {err!r}") from err
        return self._answer(route, reply)

    def get(self, route: str, timeout: float = 30.0, **params: Any) -> Any:
        """GETs one of vLLM's routes, as `post`."""
        try:
            reply = self.control.get(self.url + route, params=params or None, timeout=timeout)
        except httpx.HTTPError as err:
            raise ServerDown(f"{self.name()}: GET {route} failed: {err!r}") from err
        return self._answer(route, reply)

    def _answer(self, route: str, reply: httpx.Response) -> Any:
        if reply.status_code == 401:
            raise ServerError(
                f"{self.name()}: {route}: 401 Unauthorized: it requires a secret; set "
                f"{SECRET_ENV} to it in the trainer's environment"
            )
        if reply.status_code == 404:
            raise ServerError(
                f"{self.name()}: POST {route} is not served: start vLLM with "
                "VLLM_SERVER_DEV_MODE=1 (its RL routes: pause, resume, weight versions)"
            )
        if reply.status_code >= 400:
            raise ServerError(f"{self.name()}: POST {route}: {reply.status_code} {reply.text}")
        if not reply.content:
            return None
        try:
            return reply.json()
        except ValueError:  # a plain-text answer (`/v1/load_lora_adapter`'s)
            return reply.text

    def healthy(self, timeout: float) -> bool:
        try:
            return self.control.get(self.url + "/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    @contextlib.contextmanager
    def watching(self, reply: httpx.Response) -> Iterator[None]:
        """While open, `reply`'s stream is among those `cut_streams` breaks."""
        stream = reply.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is not None:
            with self.streams_lock:
                self.streams.add(sock)
            if not self.alive:  # declared dead meanwhile: not read at all
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        try:
            yield
        finally:
            with self.streams_lock:
                self.streams.discard(sock)

    def cut_streams(self) -> int:
        """Breaks its open streams (their readers get a transport error, as from a dead
        server); how many."""
        with self.streams_lock:
            streams = list(self.streams)
        for stream in streams:
            with contextlib.suppress(OSError):
                stream.shutdown(socket.SHUT_RDWR)
        return len(streams)

    def signal(self, sig: signal.Signals) -> None:
        """Sends `sig` to a launched server's whole process group (its engine and worker). Once
        its process is reaped its pid may be another's: then only while members of its group
        are left (`lifeline.leftover_groups`)."""
        if self.process is None:
            return
        pid, reaped = self.process.pid, self.process.returncode is not None
        if reaped and not leftover_groups([(pid, self.started)], process_table(), os.getpgrp()):
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def server_command(model_dir: str, port: int, dtype: str, vllm: dict[str, Any]) -> list[str]:
    """The launch command of one server on `model_dir` (token ids in and out: no tokenizer),
    with `rollout.vllm.*`."""
    command = [
        sys.executable, "-m", MARK, "--model", model_dir, "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--seed", "0",
        "--skip-tokenizer-init", "--return-tokens-as-token-ids",
        "--logprobs-mode", "processed_logprobs",
        "--max-num-seqs", str(int(vllm.get("max_num_seqs", 256))),
        "--disable-uvicorn-access-log", "--middleware", GUARD,
    ]  # fmt: skip
    if vllm.get("enforce_eager", True):
        command.append("--enforce-eager")
    command.append(
        "--enable-prefix-caching"
        if vllm.get("enable_prefix_caching", True)
        else "--no-enable-prefix-caching"
    )
    if vllm.get("kv_cache_bytes"):
        command += ["--kv-cache-memory-bytes", str(int(vllm["kv_cache_bytes"]))]
    if vllm.get("max_model_len"):
        command += ["--max-model-len", str(int(vllm["max_model_len"]))]
    if vllm.get("max_lora_rank"):  # a LoRA run's adapters, loaded per version at run time
        command += ["--enable-lora", "--max-lora-rank", str(int(vllm["max_lora_rank"])),
                    "--max-loras", "2"]  # fmt: skip
    return command


def server_env(secret: str, launched: int = 1) -> dict[str, str]:
    """A launched server's environment: vLLM's RL routes on, the launch's `secret` (in the
    environment, readable by this user only: a command line is every user's) required on
    every route (`GUARD`; vLLM's own `VLLM_API_KEY` on `/v1` too), and its share of this
    machine's cores (`OMP_NUM_THREADS`, unless set): two servers of 2 threads each on 2 cores
    decoded 110 tok/s at 100M here, of 1 thread each 539 (benchmarks/servers.py)."""
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", SECRET_ENV: secret, "VLLM_API_KEY": secret}
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter (LoRA runs)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, launched))))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the trainer shares the cores
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # the engine core in the server's process, not one more spawned (start-up 16.5 s against
    # 22.5 s here, the tiny model on 2 cores)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.pop("ASYNCRL_FAULT", None)  # the trainer's faults are not the server's
    return env


def launch(
    server: Server,
    model_dir: str,
    dtype: str,
    vllm: dict[str, Any],
    secret: str,
    launched: int = 1,
) -> None:
    """Starts (or restarts) a launched server at a free port on 127.0.0.1, in a process group
    of its own, requiring `secret` on every route; it is not `alive` until `wait_healthy` says
    so."""
    port = free_port()
    server.url = f"http://127.0.0.1:{port}"
    assert server.log is not None
    with open(server.log, "ab") as log:
        log.write(f"\n--- asyncrl: starting on port {port} ---\n".encode())
        log.flush()
        server.process = subprocess.Popen(
            server_command(model_dir, port, dtype, vllm),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=server_env(secret, launched),
            start_new_session=True,  # its own group: stopped whole, apart from the trainer's
        )
    server.version = None
    server.base = True  # started on the run's model folder: its weights (a LoRA run's base)
    server.alive = False
    server.started = start_time(server.process.pid)
    server.authorize(secret)


def wait_healthy(servers: list[Server], timeout: float) -> float:
    """Waits until every server answers `/health`; the seconds waited. ServerError naming the
    first that exited (its log's last lines) or that did not answer within `timeout`."""
    started = time.monotonic()
    waiting = list(servers)
    while waiting:
        for server in list(waiting):
            if server.process is not None and server.process.poll() is not None:
                raise ServerError(
                    f"{server.name()} exited with {server.process.returncode} while starting:\n"
                    + log_tail(server.log)
                )
            if server.healthy(timeout=2.0):
                server.alive = True
                waiting.remove(server)
        if waiting and time.monotonic() - started > timeout:
            names = ", ".join(s.name() for s in waiting)
            raise ServerError(
                f"{names}: no answer on /health after {timeout:.0f} s "
                "(rollout.servers.start_timeout_s)"
            )
        if waiting:
            time.sleep(0.5)
    return time.monotonic() - started


def log_tail(log: Path | None, lines: int = 15) -> str:
    if log is None or not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def write_record(directory: Path, servers: list[Server]) -> None:
    """`launched.json`: each launched server's pid (its process group) and port, so the next
    launch stops what a SIGKILLed one left."""
    rows = [
        {"index": s.index, "pid": s.process.pid, "started": s.started, "url": s.url}
        for s in servers
        if s.process is not None
    ]
    tmp = directory / (RECORD + ".tmp")
    tmp.write_text(json.dumps(rows))
    os.replace(tmp, directory / RECORD)


def stop_stale(directory: Path) -> list[int]:
    """Ends the process groups a killed launch's servers left running (`launched.json`), each
    only if it is still the group recorded (`lifeline.leftover_groups`: its leader's pid and
    start time, or members of its session outliving a dead leader); the groups ended. A
    recorded pid now another process's, or this process's own group, is left alone."""
    record = directory / RECORD
    if not record.exists():
        return []
    try:
        rows = json.loads(record.read_text())
        recorded = [(int(row["pid"]), int(row.get("started") or 0)) for row in rows]
    except (ValueError, KeyError, TypeError):
        recorded = []
    stopped = end_groups(recorded)
    record.unlink()
    return stopped


def stop(servers: list[Server], grace: float = 10.0) -> None:
    """Stops the launched servers (SIGTERM to each group, SIGKILL past `grace`); attached
    servers are left alone."""
    launched = [s for s in servers if s.process is not None and s.process.poll() is None]
    for server in launched:
        server.signal(signal.SIGCONT)  # a stopped (SIGSTOP) one could not exit
        server.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for server in launched:
        assert server.process is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.process.wait(max(0.1, deadline - time.monotonic()))
        server.signal(signal.SIGKILL)  # what is left of its group (its engine, its worker)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.process.wait(5)
    for server in servers:
        server.client.close()
        server.control.close()
