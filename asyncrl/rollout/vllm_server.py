"""vLLM's OpenAI-compatible servers as a generation engine (`rollout.engine=vllm_server`):
servers asyncrl launches (`rollout.servers.launch`) or servers you run (`rollout.servers.urls`).

    requests ─▶ jobs (jobs.py) ─▶ POST /v1/completions, streamed: prompt token ids, n, seed,
               logprobs=0, return_token_ids ─▶ tokens and log-probs as they arrive
    weights version v ─▶ per server: /pause?mode=keep, /collective_rpc reload_weights (a
               safetensors file under the run dir), /update_weight_version v, /resume

Each batch's jobs are spread over the live servers, least loaded first, all in flight at once
(each server batches its own). Every token of a stream is kept as it arrives: a server that
dies mid-stream (the connection drops, or nothing arrives and `/health` does not answer for
`rollout.servers.health_timeout_s`) hands its jobs on from their last received token
(`jobs.continue_job`: the same prefix and seeding rule as a partial generation's), to another
server or to its own restart; no token that arrived is asked for again. A launched server that
died is restarted (`rollout.servers.max_restarts`); before it serves, it loads the batch's
weights version.

Weights: each server holds one version, and says which (`server_leases`: the run, the launch
and the version, in vLLM's weight-version string). Before a batch's first request to a server,
that string is read back from the server, never assumed: a server restarted by its supervisor
(its initial weights), reloaded by someone else, or attached anew holds no version of this
launch and is loaded before it samples; a server another run holds fails the batch (one server
serves one run). An attached server found dead is asked for `/health` at each batch's start
and used again once it answers. Requests a killed launch of this run left running on an
attached server are aborted at attach; another's are not.

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

import httpx

from asyncrl.faults import fault_point, server_fault_point
from asyncrl.models.lora import is_lora, split_generation_weights
from asyncrl.rollout.engine import (
    EngineCapabilities,
    EngineSpec,
    GenerationOutput,
    GenerationRequest,
)
from asyncrl.rollout.jobs import (
    Job,
    Piece,
    assemble_output,
    continue_job,
    merge_pieces,
    plan_jobs,
    sample_ended,
)
from asyncrl.rollout.lifeline import Lifeline
from asyncrl.rollout.server_auth import SECRET_ENV
from asyncrl.rollout.server_leases import claim, make_tag, read_back, release, write_tag
from asyncrl.rollout.servers import (
    SERVERS_DIR,
    Server,
    ServerDown,
    ServerError,
    attach,
    launch,
    log_tail,
    stop,
    stop_stale,
    wait_healthy,
    write_record,
)
from asyncrl.rollout.vllm_engine import (
    LoraAdapters,
    VLLMGenerationEngine,
    write_model_dir,
    write_reload_file,
)
from asyncrl.rollout.weight_sync import WeightSource, weights_to_load


class ProtocolError(RuntimeError):
    """A server answered against asyncrl's contract (a stop token not ours): not retried."""


class StreamBroken(Exception):
    """A job's stream stopped before its end; `received` holds what arrived."""

    def __init__(self, received: dict[int, Piece], cause: BaseException) -> None:
        super().__init__(repr(cause))
        self.received = received
        self.cause = cause


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
        scratch = spec.scratch_dir or None
        if scratch:
            os.makedirs(scratch, exist_ok=True)
        self._dir = tempfile.mkdtemp(prefix="asyncrl-vllm-server-", dir=scratch)
        weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)
        # ends the servers and this copy however this process ends (os._exit and SIGKILL too)
        self._lifeline = Lifeline(self.directory / "lifeline.log")
        self._lifeline.watch_path(self._dir)
        self._reload_dir = os.path.join(self._dir, "reload")
        # a LoRA run (`rollout.vllm.lora_requests`): the base once, each version's adapters
        # through /v1/load_lora_adapter, its requests addressed to them (`v{version}`)
        self._lora = LoraAdapters(spec.model, self._dir) if is_lora(spec.model) else None
        if self._lora is not None:
            self.vllm["max_lora_rank"] = self._lora.max_rank
        self._base_file = False
        self._file_version: int | None = None
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
        """Makes `server` hold weights version `version`: at batch `batch`'s first job on it,
        the version it holds is read back from it (`server_leases.read_back`: ServerError
        where another run holds it), and where it is not `version` it is loaded through
        vLLM's RL routes."""
        with server.lock:  # the server's first job of a batch loads; the others wait for it
            if not server.alive:
                raise ServerDown(f"{server.name()} is down")
            if server.checked != batch:
                server.version = read_back(server, self.run_id, self.launch_id, self.health_timeout)
                if server.version is None and not server.launched:
                    server.base = False  # restarted, perhaps: a LoRA run's base loads again
                server.checked = batch
            if server.version != version:
                self._load_locked(server, version)

    def _load_locked(self, server: Server, version: int) -> None:
        assert self._file_version == version  # written by this batch's `generate`
        started = time.perf_counter()
        previous, server.version = server.version, None  # a load that fails halfway: none
        if self._lora is None:
            self._reload(server, version)
        else:
            if not server.base:  # attached: the base is loaded once
                self._reload(server, version)
                server.base = True
            write_tag(server, self._tag(None))  # changing: no version until it is done
            # in place: a name a killed trainer (or a load cut short) left is replaced
            load = {"lora_name": f"v{version}", "lora_path": self._lora.path(version),
                    "load_inplace": True}  # fmt: skip
            server.post("/v1/load_lora_adapter", load, timeout=max(self.health_timeout, 600.0))
            if previous is not None:  # in-flight requests of it: none (a batch loads first)
                try:
                    server.post("/v1/unload_lora_adapter", {"lora_name": f"v{previous}"})
                except ServerDown:
                    raise
                except ServerError:  # not there (a restart): nothing to unload
                    pass
            write_tag(server, self._tag(version))
        server.version = version
        with self._lock:
            self._counters["server_pause_s"] += time.perf_counter() - started

    def _reload(self, server: Server, version: int) -> None:
        """The reload file's weights into `server` (a LoRA run's: its base): pause (in-flight
        requests kept), reload, tag the version, resume."""
        quick = self.health_timeout  # a hung server is found as a hung stream is
        server.post("/pause", timeout=quick, mode="keep")
        try:
            write_tag(server, self._tag(None), timeout=quick)  # a load cut short: no version
            server.post(
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": self._reload_dir}},
                timeout=max(quick, 600.0),
            )
            write_tag(server, self._tag(version), timeout=quick)
        finally:
            server.post("/resume", timeout=quick)  # never left paused

    def _tag(self, version: int | None) -> str:
        return make_tag(self.run_id, self.launch_id, version)

    def _write_version(self, version: int, state: dict[str, Any]) -> None:
        """Version `version` as the servers read it: the reload file, or for a LoRA run its
        adapters' folder (and the base's reload file once, for attached servers)."""
        started = time.perf_counter()
        if self._lora is None:
            write_reload_file(state, self._reload_dir)
        else:
            base, adapters = split_generation_weights(state)
            if not self._base_file and not all(s.base for s in self.servers):
                write_reload_file(base, self._reload_dir)  # frozen: the same in every version
                self._base_file = True
            self._lora.write(version, adapters)
        self._file_version = version
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
            version, state = weights_to_load(self.weights, version, self._file_version)
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
        """One job as one streamed completion on `server`: per sample, the tokens, their
        log-probs and whether it ended. StreamBroken (with what arrived) if the stream stops
        before its end."""
        received: dict[int, Piece] = {}
        try:
            self._load_on(server, version, batch)
            body = {
                "model": server.model if self._lora is None else f"v{version}",
                "prompt": job.prompt,
                "n": job.n,
                "seed": job.seed % (1 << 63),
                "max_tokens": job.max_tokens,
                "temperature": self.temperature,
                "logprobs": 0,
                "stream": True,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
                "stop_token_ids": [self.eos_id],
                "ignore_eos": False,
            }
            # the reply's headers within the health timeout (vLLM sends them at once, even
            # for a queued request); then no read timeout: a busy server's stream may be
            # silent while requests ahead of it in its queue run, and a hung one is found by
            # `_watch` (its /health), which cuts it
            timeout = httpx.Timeout(self.health_timeout, connect=10.0)
            with (
                server.client.stream(
                    "POST", server.url + "/v1/completions", json=body, timeout=timeout
                ) as reply,
                server.watching(reply),
            ):
                reply.request.extensions["timeout"]["read"] = None  # httpcore reads it here
                if reply.status_code != 200:  # a request it refuses: not retried
                    raise ServerError(
                        f"{server.name()}: /v1/completions: {reply.status_code} "
                        f"{reply.read().decode(errors='replace')[:500]}"
                    )
                ended: set[int] = set()
                for line in reply.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:  # vLLM's engine failed mid-stream
                        raise ServerDown(f"{server.name()}: {chunk['error']}")
                    for choice in chunk["choices"]:
                        sample = job.samples[choice["index"]]
                        ids = [int(t) for t in choice.get("token_ids") or []]
                        lps = [float(x) for x in (choice.get("logprobs") or {}).get(
                            "token_logprobs") or []]  # fmt: skip
                        if len(ids) != len(lps):
                            raise ServerError(
                                f"{server.name()}: {len(ids)} token ids but {len(lps)} "
                                "log-probs in one chunk"
                            )
                        have, have_lps, _ = received.get(sample, ([], [], False))
                        have, have_lps = have + ids, have_lps + lps
                        reason = choice.get("finish_reason")
                        if reason == "stop" and not (have and have[-1] == self.eos_id):
                            raise ProtocolError(
                                f"{server.name()} stopped a sample on token {have[-1:]}, not "
                                f"on eos {self.eos_id}: its stop tokens are not asyncrl's"
                            )
                        done = reason not in (None, "abort") and sample_ended(
                            have, len(job.prefix), self.eos_id, job.end
                        )
                        received[sample] = (have, have_lps, done)  # before an abort's raise
                        with self._lock:
                            self._counters["server_tokens_received"] += len(ids)
                        if reason == "abort":  # aborted elsewhere (another client)
                            raise ServerDown(f"{server.name()} aborted a request")
                        if reason is not None:
                            ended.add(sample)
                        for _ in ids:
                            server_fault_point(
                                "server.tokens_received", server.signal, server=server.index,
                                version=version,
                            )  # fmt: skip
                if len(ended) < job.n:
                    raise ServerDown(f"{server.name()}: the stream ended before its samples")
        except (httpx.TransportError, ServerDown, OSError) as err:
            raise StreamBroken(received, err) from err
        return received


def run_id_of(run_dir: Path) -> str:
    """The run's id (`RUN_DIR/run.json`), which the servers it holds carry (`server_leases`);
    a fresh one for an engine outside a run dir."""
    try:
        return str(json.loads((run_dir / "run.json").read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return secrets.token_hex(8)
