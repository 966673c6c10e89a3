"""vLLM's OpenAI-compatible servers as a generation engine (`rollout.engine=vllm_server`):
servers asyncrl launches (`rollout.servers.launch`) or servers you run (`rollout.servers.urls`).

    requests ─▶ jobs (jobs.py) ─▶ POST /v1/completions, streamed: prompt token ids, n, seed,
               logprobs=0, return_token_ids ─▶ tokens and log-probs as they arrive
    weights version v ─▶ per server: /pause?mode=keep, /collective_rpc reload_weights (a
               safetensors file under the run dir), /update_weight_version v, /resume

Each batch's jobs are spread over the live servers, least loaded first, all in flight at once
(each server batches its own). Every token of a stream is kept as it arrives (`server_stream`):
a server that dies mid-stream (the connection drops, or nothing arrives and `/health` does not
answer for `rollout.servers.health_timeout_s`) hands its jobs on from their last received token
(`jobs.continue_job`: the same prefix and seeding rule as a partial generation's), to another
server or to its own restart; no token that arrived is asked for again. A launched server that
died is restarted (`rollout.servers.max_restarts`); before it serves, it loads the batch's
weights version.

Weights: each server holds one version, and says which (`server_leases`: the run, the launch
and the version, in vLLM's weight-version string). Before a batch's first request to a server,
that string is read back from the server, never assumed: a server restarted by its supervisor
(its initial weights), reloaded by someone else, or attached anew holds no version of this
launch and is loaded before it samples (`server_weights`); a server another run holds fails the
batch (one server serves one run). An attached server found dead is asked for `/health` at each
batch's start and used again once it answers. Requests a killed launch of this run left running
on an attached server are aborted at attach (`server_attach` checks it can serve this run
first); another's are not.

Launched servers require a secret of this launch on every route (`server_auth`), listen on
127.0.0.1, and end with the launch however it ends (`lifeline`), as does the model's scratch
copy.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
import weakref
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, ClassVar

from asyncrl.faults import fault_point
from asyncrl.models.lora import is_lora
from asyncrl.rollout.engine import (
    EngineCapabilities,
    EngineSpec,
    GenerationOutput,
    GenerationRequest,
)
from asyncrl.rollout.jobs import Job, Piece, assemble_output, continue_job, merge_pieces, plan_jobs
from asyncrl.rollout.lifeline import Lifeline, watched_dir
from asyncrl.rollout.server_attach import attach
from asyncrl.rollout.server_auth import SECRET_ENV
from asyncrl.rollout.server_leases import claim, release
from asyncrl.rollout.server_stream import BREAKS, StreamBroken, completion_body, read_stream
from asyncrl.rollout.server_weights import ServerWeights
from asyncrl.rollout.servers import (
    SERVERS_DIR,
    Server,
    ServerError,
    launch,
    log_tail,
    stop,
    stop_stale,
    wait_healthy,
    write_record,
)
from asyncrl.rollout.vllm_engine import LoraAdapters, VLLMGenerationEngine, write_model_dir
from asyncrl.rollout.weight_sync import WeightSource, weights_to_load


class VLLMServerEngine:
    """Generation on vLLM servers (see the module docstring)."""

    # vLLM's, in process or on a server: the same requests (jobs.py), the same limits
    capabilities: ClassVar[EngineCapabilities] = VLLMGenerationEngine.capabilities
    missing_reasons: ClassVar[dict[str, str]] = VLLMGenerationEngine.missing_reasons

    def __init__(self, spec: EngineSpec, weights: WeightSource) -> None:
        options = dict(spec.options)
        self.vllm: dict[str, Any] = dict(options.get("vllm", {}))
        self.settings: dict[str, Any] = dict(options.get("servers", {}))
        self.eos_id = spec.eos_id
        self.pad_id = spec.pad_id
        self.max_new_tokens = spec.max_new_tokens
        self.temperature = spec.temperature
        self.dtype = spec.dtype
        self.weights = weights
        self.health_timeout = float(self.settings.get("health_timeout_s", 30.0))
        self._lock = threading.Lock()
        self._counters = {
            "engine_weight_updates": 0.0,
            "engine_weight_update_s": 0.0,
            "engine_start_s": 0.0,
            "server_pause_s": 0.0,
            "server_failovers": 0.0,
            "server_restarts": 0.0,
            "server_tokens_kept": 0.0,
            "server_tokens_received": 0.0,
        }
        started = time.perf_counter()
        run_dir = Path(options.get("run_dir") or tempfile.mkdtemp(prefix="asyncrl-servers-"))
        self.directory = run_dir / SERVERS_DIR
        self.directory.mkdir(parents=True, exist_ok=True)
        stopped = stop_stale(self.directory)  # what a SIGKILLed launch left (run dir locked)
        if stopped:
            print(f"asyncrl: stopped {len(stopped)} vLLM server(s) a killed launch left running")
        self.run_id = run_id_of(run_dir)
        self.launch_id = secrets.token_hex(4)  # a relaunch's version 7 is not this one's
        self._secret = secrets.token_urlsafe(32)  # launched servers' (never on a command line)
        self._batch = 0
        # ends the servers and this copy however this process ends (os._exit and SIGKILL too)
        self._lifeline = Lifeline(self.directory / "lifeline.log")
        self._dir = watched_dir(self._lifeline, spec.scratch_dir, "asyncrl-vllm-server-")
        weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)
        self._reload_dir = os.path.join(self._dir, "reload")
        # a LoRA run (`rollout.vllm.lora_requests`): the base once, each version's adapters
        # through /v1/load_lora_adapter, its requests addressed to them (`v{version}`)
        self._lora = LoraAdapters(spec.model, self._dir) if is_lora(spec.model) else None
        if self._lora is not None:
            self.vllm["max_lora_rank"] = self._lora.max_rank
        self._weights = ServerWeights(self._reload_dir, self._lora, self.run_id, self.launch_id)
        self._restarts: list[threading.Thread] = []
        self._restart_error: BaseException | None = None
        self._closing = False
        self.servers: list[Server] = []
        urls = list(self.settings.get("urls") or [])
        try:
            if urls:
                self._attach(spec, urls)
            else:
                self._launch(spec, int(self.settings.get("launch", 1)))
        except BaseException:
            self.shutdown()
            raise
        self._counters["engine_start_s"] = time.perf_counter() - started

    # -- servers ------------------------------------------------------------------------------

    def _launch(self, spec: EngineSpec, count: int) -> None:
        write_model_dir(spec, self._dir, with_weights=True)
        for index in range(count):
            server = Server(index, "", log=self.directory / f"server_{index}.log")
            self._start(server, count)
            self.servers.append(server)
        write_record(self.directory, self.servers)
        waited = wait_healthy(self.servers, float(self.settings.get("start_timeout_s", 600)))
        print(
            f"asyncrl: {count} vLLM server(s) up in {waited:.1f} s: "
            + ", ".join(s.url for s in self.servers)
            + f" (logs in {self.directory})"
        )

    def _attach(self, spec: EngineSpec, urls: list[str]) -> None:
        """Checks each server can serve this run (ConfigError naming `rollout.servers.urls`
        and the URL, in one line, where not), aborts what a killed trainer left running on it
        and resumes it if that trainer paused it; no version of ours is on it until the first
        batch loads one."""
        write_model_dir(spec, self._dir, with_weights=False)
        os.makedirs(self._reload_dir, exist_ok=True)
        shutil.copy(os.path.join(self._dir, "config.json"), self._reload_dir)
        with open(os.path.join(self._dir, "config.json")) as f:
            ours = json.load(f)  # as a launched server would get it (save_pretrained's)
        rank = self._lora.max_rank if self._lora is not None else 0
        secret = os.environ.get(SECRET_ENV, "")
        aborted = 0
        for index, url in enumerate(urls):
            server = attach(index, url, ours, self.dtype, rank, self.health_timeout, secret)
            self.servers.append(server)
            aborted += claim(server, self.run_id, self.launch_id, self.health_timeout)
        print(
            f"asyncrl: attached to {len(urls)} vLLM server(s): {', '.join(urls)}; "
            f"{aborted} request(s) left running aborted; this run's weights load into each "
            "before its first request"
        )

    def _restart(self, server: Server) -> None:
        """Kills what is left of a launched server and starts it again (its budget counted);
        ServerError once the budget is spent. Nothing starts once `shutdown` began."""
        budget = int(self.settings.get("max_restarts", 3))
        with self._lock:
            if self._closing:
                return
            if sum(s.restarts for s in self.servers) >= budget:
                server.signal(signal.SIGKILL)  # a hung one stops holding its streams
                raise ServerError(
                    f"{server.name()} died and the {budget} restarts of "
                    f"rollout.servers.max_restarts are used:\n{log_tail(server.log)}"
                )
            server.restarts += 1
            self._counters["server_restarts"] += 1
            server.signal(signal.SIGKILL)
            if server.process is not None:
                server.process.wait(30)
            self._start(server, len(self.servers))
            write_record(self.directory, self.servers)
        waited = wait_healthy([server], float(self.settings.get("start_timeout_s", 600)))
        print(f"asyncrl: {server.name()} restarted in {waited:.1f} s")

    def _start(self, server: Server, count: int) -> None:
        """(Re)starts a launched server, in the lifeline's care from its first instant."""
        launch(server, self._dir, self.dtype, self.vllm, self._secret, count)
        assert server.process is not None
        self._lifeline.watch_group(server.process.pid, server.started)

    def shutdown(self) -> None:
        """Stops the servers this run launched (after any restart in progress) and removes the
        scratch copy; attached ones are left running, released for another run. Once."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        for server in self.servers:
            if not server.launched and server.alive:
                try:
                    release(server, self.run_id, timeout=min(5.0, self.health_timeout))
                except ServerError as err:  # a dead one: its string is gone with it
                    print(f"asyncrl: {server.name()} not released: {err}")
        stop(self.servers)
        record = self.directory / "launched.json"
        if any(s.launched for s in self.servers) and record.exists():
            record.unlink()
        self._lifeline.close()

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counters)

    # -- weights ------------------------------------------------------------------------------

    def _load_on(self, server: Server, version: int, batch: int) -> None:
        """Makes `server` hold weights version `version`, read back at batch `batch`'s first
        job on it (`ServerWeights.load_on`)."""
        loading_s = self._weights.load_on(server, version, batch, self.health_timeout)
        if loading_s:
            with self._lock:
                self._counters["server_pause_s"] += loading_s

    def _write_version(self, version: int, state: dict[str, Any]) -> None:
        """Version `version` as the servers read it (`ServerWeights.write`)."""
        started = time.perf_counter()
        self._weights.write(version, state, self.servers)
        self._counters["engine_weight_updates"] += 1
        self._counters["engine_weight_update_s"] += time.perf_counter() - started

    # -- generation ---------------------------------------------------------------------------

    def generate(
        self,
        requests: list[GenerationRequest],
        version: int | None = None,
        max_tokens: int | None = None,
    ) -> list[GenerationOutput]:
        """Samples every request with one weights version, its jobs spread over the servers."""
        with self._lock:  # the version and its tensors taken at once: a later publish may
            # drop it from the sync before a server loads it (each loads from this file)
            version, state = weights_to_load(self.weights, version, self._weights.file_version)
            if state is not None:
                self._write_version(version, state)
            self._batch += 1
            batch = self._batch
        self._revive()
        jobs, done_before = plan_jobs(requests, self.max_new_tokens, max_tokens)
        pieces: dict[tuple[int, int], Piece] = {}
        finished = threading.Event()
        watchdog = threading.Thread(target=self._watch, args=(finished,), daemon=True)
        watchdog.start()
        try:
            self._run_jobs(jobs, version, batch, pieces)
        finally:
            finished.set()
            watchdog.join()
        fault_point("engine.decode_step")
        per_request: list[dict[int, Piece]] = [{} for _ in requests]
        for (request, sample), piece in pieces.items():
            per_request[request][sample] = piece
        return [
            assemble_output(request, per_request[i], done_before[i], version, self.pad_id)
            for i, request in enumerate(requests)
        ]

    def _run_jobs(
        self, jobs: list[Job], version: int, batch: int, pieces: dict[tuple[int, int], Piece]
    ) -> None:
        """Runs `jobs` to their ends over the live servers, all in flight at once, each
        sample's tokens into `pieces`; a broken stream's job continues from what arrived."""
        pending = list(jobs)
        running: dict[Future[dict[int, Piece]], tuple[Job, Server]] = {}
        load: dict[int, int] = {}
        failovers, most = 0, 8 + 4 * len(jobs)  # a server that keeps dropping streams
        with ThreadPoolExecutor(max_workers=max(1, min(len(jobs) + 1, 256))) as pool:
            while pending or running:
                live = [s for s in self.servers if s.alive]
                if not live and not running:
                    self._await_restart()
                    continue
                while pending and live:
                    job = pending.pop(0)
                    server = min(live, key=lambda s: (load.get(s.index, 0), s.index))
                    load[server.index] = load.get(server.index, 0) + job.n
                    future = pool.submit(self._run_job, server, job, version, batch)
                    running[future] = (job, server)
                done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for future in done:
                    job, server = running.pop(future)
                    load[server.index] -= job.n
                    try:
                        received = future.result()
                    except StreamBroken as broken:
                        failovers += 1
                        if failovers > most:
                            raise ServerError(
                                f"{failovers} streams broke in one batch (the last on "
                                f"{server.name()}: {broken.cause!r}); giving the batch up"
                            ) from broken.cause
                        received, rest = self._hand_on(job, broken.received)
                        pending.extend(rest)
                        self._lost(server, broken.cause, broken.received)
                    for sample, piece in received.items():
                        key = (job.request, sample)
                        pieces[key] = merge_pieces(pieces[key], piece) if key in pieces else piece

    def _watch(self, done: threading.Event) -> None:
        """While a batch runs: a server with open streams that does not answer `/health`
        within `rollout.servers.health_timeout_s` has its streams cut, so their jobs continue
        elsewhere (`_lost` then finds it dead). A busy server, silent on some streams while
        it works through its queue, answers `/health` and keeps them."""
        interval = min(1.0, self.health_timeout / 2)
        while not done.wait(interval):
            for server in self.servers:
                if server.streams and not server.healthy(self.health_timeout):
                    server.cut_streams()

    def _hand_on(self, job: Job, received: dict[int, Piece]) -> tuple[dict[int, Piece], list[Job]]:
        """A broken job: what arrived is kept, and the rest continues from it."""
        return received, continue_job(job, received)

    def _lost(self, server: Server, cause: BaseException, received: dict[int, Piece]) -> None:
        """A stream of `server` broke: it is dead unless `/health` still answers; a launched
        one is restarted."""
        kept = sum(len(ids) for ids, _, _ in received.values())
        with self._lock:
            self._counters["server_failovers"] += 1
            self._counters["server_tokens_kept"] += kept
        with server.lock:  # one death is handled once, whichever of its streams saw it
            # a break may be a restart that already answers /health: the next job on it reads
            # its weights back before it samples (`ServerWeights.load_on`)
            server.checked = -1
            if not server.alive or server.healthy(timeout=self.health_timeout):
                return  # handled already, or alive (the stream alone broke)
            server.alive = False
            server.cut_streams()  # its other streams break now, not at their own failure
        print(
            f"asyncrl: {server.name()} stopped answering ({cause!r}); its requests continue "
            f"from the {kept} token(s) received"
        )
        if server.launched:
            thread = threading.Thread(
                target=self._restart_in_background, args=(server,), daemon=True
            )
            self._restarts.append(thread)
            thread.start()

    def _restart_in_background(self, server: Server) -> None:
        try:
            self._restart(server)
        except BaseException as err:  # the generation thread raises it (`_await_restart`)
            print(f"asyncrl: {err}")
            self._restart_error = err

    def _revive(self) -> None:
        """An attached server found dead that answers `/health` again (its supervisor restarted
        it) is used again; what it holds is read back before it samples (`_load_on`)."""
        for server in self.servers:
            dead = not server.launched and not server.alive
            if dead and server.healthy(timeout=min(2.0, self.health_timeout)):
                server.version, server.alive = None, True
                print(f"asyncrl: {server.name()} answers again: used again")

    def _await_restart(self) -> None:
        """No server is live and nothing runs: waits for a restart in progress (or an attached
        server back); raises the restart's error, or ServerError when none is coming."""
        self._revive()
        while True:
            if self._restart_error is not None:
                raise self._restart_error
            if any(s.alive for s in self.servers):
                return
            self._restarts = [t for t in self._restarts if t.is_alive()]
            if not self._restarts:
                raise ServerError(
                    "no vLLM server is left to generate on: "
                    + "; ".join(s.name() for s in self.servers)
                )
            self._restarts[0].join(0.2)

    def _run_job(self, server: Server, job: Job, version: int, batch: int) -> dict[int, Piece]:
        """One job as one streamed completion on `server` once it holds `version`
        (`server_stream`): per sample, the tokens, their log-probs and whether it ended.
        StreamBroken (with what arrived) if the load or the stream breaks before its end."""
        received: dict[int, Piece] = {}
        try:
            self._load_on(server, version, batch)
            model = server.model if self._lora is None else f"v{version}"
            body = completion_body(job, model, self.temperature, self.eos_id)
            read_stream(
                server, job, body, received, self.eos_id, self.health_timeout, version,
                self._count_received,
            )  # fmt: skip
        except BREAKS as err:
            raise StreamBroken(received, err) from err
        return received

    def _count_received(self, tokens: int) -> None:
        with self._lock:
            self._counters["server_tokens_received"] += tokens


def run_id_of(run_dir: Path) -> str:
    """The run's id (`RUN_DIR/run.json`), which the servers it holds carry (`server_leases`);
    a fresh one for an engine outside a run dir."""
    try:
        return str(json.loads((run_dir / "run.json").read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return secrets.token_hex(8)
