"""Generation engines: batched sampling behind the `GenerationEngine` protocol.

The torch engine keeps its own copy of the policy. The trainer publishes new weights with
`update_weights` (a copy, never blocking on generation); the engine loads the version a batch
asks for (by default the newest) at the start of the batch, so every token of a batch comes
from one weights version.

Sampling noise comes per request from `noise_seed`: sample i of a request draws token j by
inverting the CDF at `u[i, j]`, where `u = rand(G, max_new_tokens)` under a generator seeded
with `noise_seed`. A request therefore samples the same tokens whatever batch it lands in
(up to the floating-point effects of batching on the logits).
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from asyncrl.core.tensors import clone_state
from asyncrl.models.policy import left_pad, position_ids


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    num_samples: int
    noise_seed: int


@dataclass
class GenerationOutput:
    completion_ids: torch.Tensor  # [G, T] int64, pad after EOS
    completion_mask: torch.Tensor  # [G, T] bool, EOS included
    logprobs: torch.Tensor  # [G, T] float32 behaviour log-probs (0 where masked)
    weights_version: int


class GenerationEngine(Protocol):
    def generate(
        self, requests: list[GenerationRequest], version: int | None = None
    ) -> list[GenerationOutput]:
        """Samples every request in one batch with one weights version: `version` if given,
        else the newest published."""
        ...

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Publishes weights `version`; used from the next batch on. Must not block on a
        batch in progress."""
        ...

    @property
    def weights_version(self) -> int:
        """The version the next batch will use."""
        ...


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draws one token per row: the first index whose CDF reaches `u`. [B, V], [B] -> [B]."""
    cdf = probs.cumsum(dim=-1)
    threshold = (uniforms * cdf[:, -1]).unsqueeze(-1)
    index = torch.searchsorted(cdf, threshold).squeeze(-1)
    return index.clamp(max=probs.shape[-1] - 1)


class TorchGenerationEngine:
    """Autoregressive sampling with a KV cache on a private copy of a HF causal LM.

    Published weights are kept by version, the newest `max_versions` of them; `generate` uses
    the newest unless asked for a specific version (deterministic mode pins version
    `max(0, t - A)` for target t). The trainer's copy and this one never share memory.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        eos_id: int,
        pad_id: int,
        max_new_tokens: int,
        temperature: float,
        max_versions: int = 1,
    ) -> None:
        self._model = copy.deepcopy(model).eval()
        self._model.requires_grad_(False)
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.max_versions = max_versions
        self._lock = threading.Lock()
        self._published: dict[int, dict[str, torch.Tensor]] = {
            0: clone_state(self._model.state_dict())
        }
        self._loaded = 0  # the version the private model holds

    @property
    def weights_version(self) -> int:
        with self._lock:
            return max(self._published)

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        copied = clone_state(state)
        with self._lock:
            self._published[version] = copied
            for old in sorted(self._published)[: -self.max_versions]:
                del self._published[old]

    def published_versions(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every kept version's weights (deterministic checkpoints save the older ones)."""
        with self._lock:
            return dict(self._published)

    def _load(self, version: int | None) -> int:
        with self._lock:
            wanted = max(self._published) if version is None else version
            if wanted not in self._published:
                raise RuntimeError(
                    f"weights version {wanted} is no longer kept (have {sorted(self._published)})"
                )
            state = self._published[wanted]
        if wanted != self._loaded:
            self._model.load_state_dict(state, strict=False)
            self._loaded = wanted
        return wanted

    @torch.inference_mode()
    def generate(
        self, requests: list[GenerationRequest], version: int | None = None
    ) -> list[GenerationOutput]:
        """Samples every request in one batch with weights `version` (default: the newest)."""
        version = self._load(version)
        prompts = [r.prompt_ids for r in requests for _ in range(r.num_samples)]
        uniforms = torch.cat(
            [
                torch.rand(
                    r.num_samples,
                    self.max_new_tokens,
                    generator=torch.Generator().manual_seed(r.noise_seed),
                )
                for r in requests
            ]
        )
        tokens, logprobs, mask = self._sample(prompts, uniforms)
        outputs, start = [], 0
        for r in requests:
            rows = slice(start, start + r.num_samples)
            outputs.append(
                GenerationOutput(tokens[rows], mask[rows], logprobs[rows], weights_version=version)
            )
            start += r.num_samples
        return outputs

    def _sample(
        self, prompts: list[list[int]], uniforms: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        input_ids, attention = left_pad(prompts, self.pad_id)
        positions = position_ids(attention)
        batch = len(prompts)
        finished = torch.zeros(batch, dtype=torch.bool)
        tokens, logprobs, masks = [], [], []
        out = self._model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True
        )
        for step in range(self.max_new_tokens):
            step_logprobs = torch.log_softmax(out.logits[:, -1].float() / self.temperature, -1)
            token = sample_inverse_cdf(step_logprobs.exp(), uniforms[:, step])
            token = torch.where(finished, torch.full_like(token, self.pad_id), token)
            chosen = step_logprobs.gather(-1, token.unsqueeze(-1)).squeeze(-1)
            alive = ~finished
            tokens.append(token)
            logprobs.append(torch.where(alive, chosen, torch.zeros_like(chosen)))
            masks.append(alive)
            finished = finished | (token == self.eos_id)
            if bool(finished.all()) or step == self.max_new_tokens - 1:
                break
            attention = torch.cat([attention, alive.long().unsqueeze(-1)], dim=1)
            positions = positions[:, -1:] + 1
            out = self._model(
                input_ids=token.unsqueeze(-1),
                attention_mask=attention,
                position_ids=positions,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
        return torch.stack(tokens, 1), torch.stack(logprobs, 1), torch.stack(masks, 1)
