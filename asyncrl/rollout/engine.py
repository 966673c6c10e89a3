"""The `GenerationEngine` protocol (STYLE.md rule 16), the engines' declared capabilities and
the registry that `rollout.engine` picks from.

`rollout.engine` says *which* engine samples (`torch` today), `rollout.backend` *where* it
runs (a thread here, or Ray actors); the two are independent. An engine gets its weights from
a `WeightSource` (`asyncrl/rollout/weight_sync.py`), never from the trainer directly.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from asyncrl.config import Config, ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from asyncrl.rollout.weight_sync import WeightSource


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    num_samples: int
    noise_seed: int
    prefixes: tuple[tuple[int, ...], ...] = ()
    """Continue from a partial generation: each sample's tokens so far (empty: start fresh).
    Sample i's token j still draws noise `(noise_seed, i, j)`, wherever it was cut."""
    finished: tuple[bool, ...] = ()
    """Per sample, with `prefixes`: already finished, so nothing more is generated for it."""
    limits: tuple[int, ...] = ()
    """Per sample (episodes): the length (prefix included) at which this call stops the
    sample, reported finished: its turn ends there. Empty: `max_new_tokens`."""

    def limit(self, sample: int, max_new_tokens: int) -> int:
        """The length at which sample `sample` stops in this call."""
        if self.limits and self.limits[sample]:
            return min(int(self.limits[sample]), max_new_tokens)
        return max_new_tokens

    def done_before(self, max_new_tokens: int) -> list[bool]:
        """Per sample: nothing to generate in this call, because it finished, or its prefix
        already holds `max_new_tokens` (lowered on a forced resume) or its limit. Every
        engine's rule."""
        if not self.prefixes:
            return [self.limit(i, max_new_tokens) <= 0 for i in range(self.num_samples)]
        finished = self.finished or (False,) * self.num_samples
        return [
            bool(finished[i]) or len(self.prefixes[i]) >= self.limit(i, max_new_tokens)
            for i in range(self.num_samples)
        ]


@dataclass
class GenerationOutput:
    """The tokens one `generate` call added, per sample (for a continued request: the new
    tokens only, after each sample's prefix)."""

    completion_ids: torch.Tensor  # [G, T] int64, pad after EOS
    completion_mask: torch.Tensor  # [G, T] bool, EOS included
    logprobs: torch.Tensor  # [G, T] float32 behaviour log-probs (0 where masked)
    weights_version: int
    finished: torch.Tensor | None = None
    """[G] bool: the sample sampled EOS or reached max_new_tokens (None: all finished)."""

    def finished_rows(self) -> torch.Tensor:
        if self.finished is None:
            return torch.ones(self.completion_ids.shape[0], dtype=torch.bool)
        return self.finished


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can guarantee; a config that needs more is refused at start."""

    pinned_versions: bool = False
    """Generates a batch with a given older weights version on request, not just the newest."""
    batch_invariant_noise: bool = False
    """A request samples the same tokens whatever batch it lands in (bitwise)."""
    per_request_seeds: bool = False
    """Each request's sampling noise comes from its own seed, so a regenerated group draws the
    same noise."""
    continue_from_prefix: bool = False
    """Continues a partial completion from its prefix (for partial generations)."""
    turn_limits: bool = False
    """Stops each sample at its own length (`GenerationRequest.limits`: multi-turn episodes)."""
    stops_early: bool = False
    """Has `stop_generating()`: the call in progress returns the tokens it has at once, its
    samples unfinished (a Ray worker on a node being drained hands its work back)."""


@dataclass(frozen=True)
class EngineSpec:
    """What every engine is built from."""

    model: PreTrainedModel  # the architecture; its weights come from the WeightSource
    eos_id: int
    pad_id: int
    max_new_tokens: int
    temperature: float
    device: str = "cpu"
    """Where the engine generates (`rollout.device`)."""
    dtype: str = "float32"
    """The engine's weights and compute (`rollout.dtype`)."""
    keep_cache_between_chunks: bool = True
    """Chunked generation: an engine may keep a chunk's KV cache for the next chunk of the
    same samples in the same process, instead of prefilling their prefixes again. Off in
    deterministic mode: a resumed run has no cache to keep, and must compute what the
    uninterrupted run computed."""
    options: dict[str, Any] = field(default_factory=dict)
    """The engine's own settings (`rollout.vllm.*` for `rollout.engine=vllm`)."""
    scratch_dir: str = ""
    """Where an engine may write files of its own (vLLM's copy of the model): the run dir's
    `.scratch/`. The vLLM engines' lifelines remove their copies however the process ends
    (SIGKILL too); what a kill of the lifeline too leaves is emptied under the run dir's lock
    at the next launch. "" is the system's temporary directory."""


class GenerationEngine(Protocol):
    capabilities: ClassVar[EngineCapabilities]

    def generate(
        self,
        requests: list[GenerationRequest],
        version: int | None = None,
        max_tokens: int | None = None,
    ) -> list[GenerationOutput]:
        """Samples every request in one batch with one weights version: `version` if given,
        else the newest published; at most `max_tokens` new tokens per sample if given (a
        chunk: unfinished samples are continued by a later call with their prefixes)."""
        ...

    def metrics(self) -> dict[str, float]:
        """Cumulative engine counters for the step records (may be empty)."""
        ...


ENGINES: dict[str, str] = {
    "torch": "asyncrl.rollout.torch_engine:TorchGenerationEngine",
    "vllm": "asyncrl.rollout.vllm_engine:VLLMGenerationEngine",
    "vllm_server": "asyncrl.rollout.vllm_server:VLLMServerEngine",
}
"""`rollout.engine` -> `module:Class`; each class is built as `Class(spec, weights)`."""


def engine_class(name: str) -> type[GenerationEngine]:
    module, _, attr = ENGINES[name].partition(":")
    cls: type[GenerationEngine] = getattr(importlib.import_module(module), attr)
    return cls


def build_engine(name: str, spec: EngineSpec, weights: WeightSource) -> GenerationEngine:
    make: Any = engine_class(name)  # every engine class is built as Class(spec, weights)
    engine: GenerationEngine = make(spec, weights)
    return engine


def engine_options(config: Config) -> dict[str, Any]:
    """`EngineSpec.options` for the engine `rollout.engine` names."""
    if config.rollout.engine == "vllm":
        return asdict(config.rollout.vllm)
    if config.rollout.engine == "vllm_server":  # and the run dir (`_engine_spec`)
        return {"vllm": asdict(config.rollout.vllm), "servers": asdict(config.rollout.servers)}
    return {}


def required_capabilities(config: Config) -> dict[str, str]:
    """capability -> the config setting that needs it."""
    needs: dict[str, str] = {}
    if config.run.deterministic:
        for capability in ("pinned_versions", "batch_invariant_noise", "per_request_seeds"):
            needs[capability] = "run.deterministic=true"
    if config.env.name:
        needs["turn_limits"] = f"env.name={config.env.name}"
        needs["continue_from_prefix"] = f"env.name={config.env.name}"
    if config.rollout.chunk_tokens:
        needs["continue_from_prefix"] = f"rollout.chunk_tokens={config.rollout.chunk_tokens}"
        if not config.rollout.update_weights_mid_generation:  # a sample keeps its version
            needs["pinned_versions"] = f"rollout.chunk_tokens={config.rollout.chunk_tokens}"
    return needs


def check_capabilities(
    config: Config, capabilities: EngineCapabilities, reasons: dict[str, str] | None = None
) -> None:
    """Refuses, at start, a config that needs a capability the engine lacks, naming both (and
    why the engine lacks it, where it says)."""
    for capability, setting in required_capabilities(config).items():
        if not getattr(capabilities, capability):
            doc = {f.name: f.name.replace("_", " ") for f in fields(EngineCapabilities)}
            why = (reasons or {}).get(capability)
            raise ConfigError(
                f"{setting} needs an engine with {doc[capability]}; rollout.engine="
                f"{config.rollout.engine} does not have it{f': {why}' if why else ''} (choose "
                "another rollout.engine, or turn the setting off)"
            )


def check_engine(config: Config) -> None:
    """`check_capabilities` for the engine `rollout.engine` names, without importing more
    than its class."""
    cls = engine_class(config.rollout.engine)
    check_capabilities(config, cls.capabilities, getattr(cls, "missing_reasons", None))
