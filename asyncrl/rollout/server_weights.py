"""Weights versions into vLLM servers: each version is written once, as the files the servers
read (`write`), and loaded into a server through vLLM's RL routes only where the version it
holds, read back from the server itself (`server_leases.read_back`), is not the one a batch
samples (`load_on`):

    full weights: /pause?mode=keep ─▶ tag "changing" ─▶ /collective_rpc reload_weights (the
                  reload file) ─▶ tag v ─▶ /resume (always)
    LoRA:         the frozen base as above, once per server ─▶ tag "changing" ─▶
                  /v1/load_lora_adapter v{v} (in place) ─▶ unload the previous ─▶ tag v

A load cut short leaves the tag with no version, so the next batch loads again rather than
trust it.
"""

from __future__ import annotations

import time
from typing import Any

from asyncrl.models.lora import split_generation_weights
from asyncrl.rollout.server_leases import make_tag, read_back, write_tag
from asyncrl.rollout.servers import Server, ServerDown, ServerError
from asyncrl.rollout.vllm_engine import LoraAdapters, write_reload_file


class ServerWeights:
    """The weights versions of one launch (`run_id`, `launch_id`) on its servers: the reload
    file under `reload_dir`, a LoRA run's adapters (`lora`) beside it."""

    def __init__(
        self, reload_dir: str, lora: LoraAdapters | None, run_id: str, launch_id: str
    ) -> None:
        self.reload_dir = reload_dir
        self.lora = lora
        self.run_id = run_id
        self.launch_id = launch_id
        self.file_version: int | None = None
        """The version the files hold (None: none written yet)."""
        self._base_file = False

    def write(self, version: int, state: dict[str, Any], servers: list[Server]) -> None:
        """Version `version` as the servers read it: the reload file, or for a LoRA run its
        adapters' folder (and the base's reload file once, where a server of `servers` does
        not hold the base yet: an attached one)."""
        if self.lora is None:
            write_reload_file(state, self.reload_dir)
        else:
            base, adapters = split_generation_weights(state)
            if not self._base_file and not all(s.base for s in servers):
                write_reload_file(base, self.reload_dir)  # frozen: the same in every version
                self._base_file = True
            self.lora.write(version, adapters)
        self.file_version = version

    def load_on(self, server: Server, version: int, batch: int, timeout_s: float) -> float:
        """Makes `server` hold weights version `version` (the one `write` wrote last): at batch
        `batch`'s first job on it, the version it holds is read back from it (ServerError where
        another run holds it), and where it is not `version` it is loaded; the seconds that
        load took (0.0: none was needed). ServerDown where `server` is down or does not answer
        within `timeout_s` (a hung server is found as a hung stream is)."""
        with server.lock:  # the server's first job of a batch loads; the others wait for it
            if not server.alive:
                raise ServerDown(f"{server.name()} is down")
            if server.checked != batch:
                server.version = read_back(server, self.run_id, self.launch_id, timeout_s)
                if server.version is None and not server.launched:
                    server.base = False  # restarted, perhaps: a LoRA run's base loads again
                server.checked = batch
            if server.version == version:
                return 0.0
            started = time.perf_counter()
            self._load_locked(server, version, timeout_s)
            return time.perf_counter() - started

    def tag(self, version: int | None) -> str:
        """This launch's string for a server holding `version` (None: changing)."""
        return make_tag(self.run_id, self.launch_id, version)

    def _load_locked(self, server: Server, version: int, timeout_s: float) -> None:
        assert self.file_version == version  # written by this batch's `generate`
        previous, server.version = server.version, None  # a load that fails halfway: none
        if self.lora is None:
            self._reload(server, version, timeout_s)
        else:
            if not server.base:  # attached: the base is loaded once
                self._reload(server, version, timeout_s)
                server.base = True
            write_tag(server, self.tag(None))  # changing: no version until it is done
            # in place: a name a killed trainer (or a load cut short) left is replaced
            load = {"lora_name": f"v{version}", "lora_path": self.lora.path(version),
                    "load_inplace": True}  # fmt: skip
            server.post("/v1/load_lora_adapter", load, timeout=max(timeout_s, 600.0))
            if previous is not None:  # in-flight requests of it: none (a batch loads first)
                try:
                    server.post("/v1/unload_lora_adapter", {"lora_name": f"v{previous}"})
                except ServerDown:
                    raise
                except ServerError:  # not there (a restart): nothing to unload
                    pass
            write_tag(server, self.tag(version))
        server.version = version

    def _reload(self, server: Server, version: int, quick: float) -> None:
        """The reload file's weights into `server` (a LoRA run's: its base): pause (in-flight
        requests kept), reload, tag the version, resume."""
        server.post("/pause", timeout=quick, mode="keep")
        try:
            write_tag(server, self.tag(None), timeout=quick)  # a load cut short: no version
            server.post(
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": self.reload_dir}},
                timeout=max(quick, 600.0),
            )
            write_tag(server, self.tag(version), timeout=quick)
        finally:
            server.post("/resume", timeout=quick)  # never left paused
