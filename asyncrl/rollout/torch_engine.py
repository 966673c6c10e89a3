"""asyncrl's own generation engine (`rollout.engine=torch`): batched sampling with a KV cache
on a private copy of a Hugging Face causal LM. Each fresh request's prompt is prefilled once,
and its cache is shared out to the request's G samples; a continued request (partial
generations: `prefixes`) prefills each unfinished sample's prompt and tokens so far as a row
of its own, and nothing is generated for a finished sample. `max_tokens` caps the new tokens
per sample of one call (a chunk).

The engine loads the version a batch asks for (by default the newest published) from its
`WeightSource` at the start of the call, so every token of a call comes from one weights
version. Sampling noise comes per request from `noise_seed`: sample i of a request draws its
token j (counted from the sample's start, wherever a chunk began) by inverting the CDF at
`u[i, j]`, where `u = rand(G, max_new_tokens)` under a generator seeded with `noise_seed`. A
request therefore samples the same tokens whatever batch it lands in and however it is cut
into chunks (up to the floating-point effects of batching and re-prefilling on the logits).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from asyncrl.faults import fault_point
from asyncrl.models.device import DTYPES
from asyncrl.models.logprobs import keeps_logits
from asyncrl.models.lora import base_module, frozen_memo
from asyncrl.models.policy import left_pad, position_ids
from asyncrl.rollout.engine import (
    EngineCapabilities,
    EngineSpec,
    GenerationOutput,
    GenerationRequest,
)
from asyncrl.rollout.weight_sync import WeightSource, weights_to_load


@dataclass
class _Carry:
    """The decoding state a chunk ended in, for the next chunk of the same samples: valid
    only with the same weights version, and only for rows whose key it lists."""

    version: int
    rows: dict[tuple[int, int, int], int]
    """(noise seed, sample, tokens generated so far) -> row of the tensors below."""
    cache: Any
    attention: torch.Tensor
    positions: torch.Tensor
    pending: torch.Tensor
    """Each row's last sampled token: not yet run through the model."""


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draws one token per row: the first index whose CDF reaches `u`. [B, V], [B] -> [B]."""
    cdf = probs.cumsum(dim=-1)
    threshold = (uniforms * cdf[:, -1]).unsqueeze(-1)
    index = torch.searchsorted(cdf, threshold).squeeze(-1)
    return index.clamp(max=probs.shape[-1] - 1)


class TorchGenerationEngine:
    """Autoregressive sampling with a KV cache on a private copy of the model; the trainer's
    copy and this one share no memory but a LoRA model's frozen base (`frozen_memo`). Weights
    are loaded strictly: a key mismatch between what is published and the model is an error,
    never silently skipped."""

    capabilities: ClassVar[EngineCapabilities] = EngineCapabilities(
        pinned_versions=True,
        batch_invariant_noise=True,
        per_request_seeds=True,
        continue_from_prefix=True,
        turn_limits=True,
        stops_early=True,
    )

    def __init__(self, spec: EngineSpec, weights: WeightSource) -> None:
        self.device = torch.device(spec.device)
        dtype = DTYPES[spec.dtype]
        memo = frozen_memo(spec.model, self.device, dtype)  # a LoRA base: never changes
        self._model = copy.deepcopy(spec.model, memo).eval()
        self._model.requires_grad_(False)
        self._model.to(device=self.device, dtype=dtype)
        self.eos_id = spec.eos_id
        self.pad_id = spec.pad_id
        self.max_new_tokens = spec.max_new_tokens
        self.temperature = spec.temperature
        self.weights = weights
        self._loaded: int | None = None  # the version the private model holds
        self._keeps_logits = keeps_logits(base_module(self._model))  # type: ignore[arg-type]
        self._keep_cache = spec.keep_cache_between_chunks
        self._carry: _Carry | None = None
        self._stopped = False  # `stop_generating`: for good

    def stop_generating(self) -> None:
        """Ends the call in progress after the token being sampled, and every later call at
        once: each returns the tokens it has, its unfinished samples reported unfinished, to be
        continued from their prefixes elsewhere (a Ray worker on a node being drained). Safe
        to call from another thread."""
        self._stopped = True

    def metrics(self) -> dict[str, float]:
        return {}

    def _load(self, version: int | None) -> int:
        wanted, state = weights_to_load(self.weights, version, self._loaded)
        if state is not None:
            # the published copy becomes the model's weights: no second copy (tensors of
            # another dtype or device than the model's are an error of the sync, not cast)
            self._check_placement(state)
            self._model.load_state_dict(state, strict=True, assign=True)
            self._loaded = wanted
        return wanted

    def _check_placement(self, state: dict[str, torch.Tensor]) -> None:
        expected = next(self._model.parameters())
        for name, tensor in state.items():
            if tensor.is_floating_point() and (
                tensor.dtype != expected.dtype or tensor.device != expected.device
            ):
                raise RuntimeError(
                    f"published weight {name} is {tensor.dtype} on {tensor.device}; this engine "
                    f"runs {expected.dtype} on {expected.device} (rollout.dtype, rollout.device)"
                )

    @torch.inference_mode()
    def generate(
        self,
        requests: list[GenerationRequest],
        version: int | None = None,
        max_tokens: int | None = None,
    ) -> list[GenerationOutput]:
        """Samples every request in one batch with weights `version` (default: the newest), at
        most `max_tokens` new tokens per sample (default: to EOS or max_new_tokens)."""
        version = self._load(version)
        uniforms = torch.cat(
            [
                torch.rand(
                    r.num_samples,
                    self.max_new_tokens,
                    generator=torch.Generator().manual_seed(r.noise_seed),
                )
                for r in requests
            ]
        )  # drawn on the CPU: the same noise on every device
        done_before = torch.tensor(
            [done for r in requests for done in r.done_before(self.max_new_tokens)],
            dtype=torch.bool,
        )
        rows = torch.nonzero(~done_before).squeeze(-1)
        continued = any(r.prefixes for r in requests)
        tokens = torch.full((len(done_before), 0), self.pad_id, dtype=torch.int64)
        logprobs, mask = torch.zeros(tokens.shape), torch.zeros(tokens.shape, dtype=torch.bool)
        finished = done_before.clone()
        if len(rows) and not self._stopped:
            sampled = self._sample(requests, rows, uniforms, continued, max_tokens, version)
            new_tokens, new_logprobs, new_mask, new_finished = (t.cpu() for t in sampled)
            width = new_tokens.shape[1]
            tokens = torch.full((len(done_before), width), self.pad_id, dtype=torch.int64)
            logprobs = torch.zeros(len(done_before), width)
            mask = torch.zeros(len(done_before), width, dtype=torch.bool)
            tokens[rows], logprobs[rows], mask[rows] = new_tokens, new_logprobs, new_mask
            finished[rows] = new_finished
        outputs, start = [], 0
        for r in requests:
            at = slice(start, start + r.num_samples)
            outputs.append(
                GenerationOutput(tokens[at], mask[at], logprobs[at], version, finished[at])
            )
            start += r.num_samples
        return outputs

    def _prefill(
        self, requests: list[GenerationRequest], rows: torch.Tensor, continued: bool
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The model's output over each row's input, its attention mask and positions, and the
        tokens each row has already generated. Fresh requests: each prompt is prefilled once
        and its KV cache indexed out to the request's samples. Continued requests: each
        unfinished sample's prompt and prefix, as one row."""
        request_of = torch.repeat_interleave(
            torch.arange(len(requests)), torch.tensor([r.num_samples for r in requests])
        )
        sample_of = torch.cat([torch.arange(r.num_samples) for r in requests])
        carry, self._carry = self._carry, None  # used at most once
        if continued:
            kept = self._from_carry(carry, requests, rows, request_of, sample_of)
            if kept is not None:
                return kept
            inputs, offsets = [], []
            for row in rows.tolist():
                r = requests[int(request_of[row])]
                prefix = list(r.prefixes[int(sample_of[row])]) if r.prefixes else []
                inputs.append(list(r.prompt_ids) + prefix)
                offsets.append(len(prefix))
            out, attention, positions = self._run_prefill(inputs)
            return out, attention, positions, torch.tensor(offsets, dtype=torch.int64)
        out, attention, positions = self._run_prefill([r.prompt_ids for r in requests])
        index = request_of[rows].to(self.device)
        out.past_key_values.batch_select_indices(index)
        out.logits = out.logits[index]
        return out, attention[index], positions[index], torch.zeros(len(rows), dtype=torch.int64)

    def _run_prefill(self, inputs: list[list[int]]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """One left-padded forward pass over `inputs` with a KV cache, keeping only the last
        position's logits where the model allows it."""
        input_ids, attention = (t.to(self.device) for t in left_pad(inputs, self.pad_id))
        positions = position_ids(attention)
        keep = {"logits_to_keep": 1} if self._keeps_logits else {}
        out = self._model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            **keep,
        )
        return out, attention, positions

    def _from_carry(
        self,
        carry: _Carry | None,
        requests: list[GenerationRequest],
        rows: torch.Tensor,
        request_of: torch.Tensor,
        sample_of: torch.Tensor,
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The previous chunk's state for exactly these rows, their pending tokens run through
        the model; None if it does not hold every row (or holds other weights)."""
        if carry is None or carry.version != self._loaded:
            return None
        keys, offsets = [], []
        for row in rows.tolist():
            r, sample = requests[int(request_of[row])], int(sample_of[row])
            done = len(r.prefixes[sample]) if r.prefixes else 0
            keys.append((r.noise_seed, sample, done))
            offsets.append(done)
        if not all(k in carry.rows for k in keys):
            return None
        index = torch.tensor([carry.rows[k] for k in keys], device=self.device)
        carry.cache.batch_select_indices(index)
        attention = torch.cat(
            [carry.attention[index], torch.ones(len(keys), 1, dtype=carry.attention.dtype,
                                                device=self.device)], dim=1
        )  # fmt: skip
        positions = carry.positions[index][:, -1:] + 1
        out = self._model(
            input_ids=carry.pending[index].unsqueeze(-1),
            attention_mask=attention,
            position_ids=positions,
            past_key_values=carry.cache,
            use_cache=True,
        )
        return out, attention, positions, torch.tensor(offsets, dtype=torch.int64)

    def _sample(
        self,
        requests: list[GenerationRequest],
        rows: torch.Tensor,
        uniforms: torch.Tensor,
        continued: bool,
        max_tokens: int | None,
        version: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decodes the batch's unfinished samples (`rows` of the flattened requests) together.
        Row i draws its token j (counted from the sample's start) at `uniforms[i, j]`."""
        out, attention, positions, offsets = self._prefill(requests, rows, continued)
        uniforms = uniforms[rows].to(self.device)
        offsets = offsets.to(self.device)
        limits = torch.tensor(
            [r.limit(i, self.max_new_tokens) for r in requests for i in range(r.num_samples)]
        )[rows.cpu()].to(self.device)
        room = limits - offsets  # tokens each row may still add (>= 1)
        steps = min(max_tokens or self.max_new_tokens, int(room.max()))
        batch = len(rows)
        tokens = torch.full((batch, steps), self.pad_id, dtype=torch.int64, device=self.device)
        logprobs = torch.zeros(batch, steps, device=self.device)
        masks = torch.zeros(batch, steps, dtype=torch.bool, device=self.device)
        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        live = torch.arange(batch, device=self.device)
        """The rows the cache and `out` hold (positions in the batch): only unfinished ones,
        as a row that finishes is compacted out of the cache before the next pass."""
        width = 0
        for step in range(steps):
            if self._stopped:  # handed back: the tokens so far, every live row unfinished
                break
            fault_point("engine.decode_step")
            scale = self.temperature or 1.0  # 0: greedy (the evaluation's), log-probs at 1
            step_logprobs = torch.log_softmax(out.logits[:, -1].float() / scale, -1)
            column = (offsets[live] + step).clamp(max=self.max_new_tokens - 1)
            if self.temperature:
                token = sample_inverse_cdf(step_logprobs.exp(), uniforms[live, column])
            else:
                token = step_logprobs.argmax(-1)
            tokens[live, step] = token
            logprobs[live, step] = step_logprobs.gather(-1, token.unsqueeze(-1)).squeeze(-1)
            masks[live, step] = True
            width = step + 1
            ends = (token == self.eos_id) | (step + 1 >= room[live])
            finished[live] = ends
            if bool(ends.all()):
                break
            if step == steps - 1:  # the chunk ends with samples to continue
                if self._keep_cache and not self._stopped:
                    self._keep(requests, rows, live, out, attention, positions, token, ends,
                               offsets[live] + step + 1, version)  # fmt: skip
                break
            if bool(ends.any()):  # the finished rows leave the batch (and its cache)
                going = torch.nonzero(~ends).squeeze(-1)
                out.past_key_values.batch_select_indices(going)
                live, token = live[going], token[going]
                attention, positions = attention[going], positions[going]
            attention = torch.cat([attention, attention.new_ones(len(live), 1)], dim=1)
            positions = positions[:, -1:] + 1
            out = self._model(
                input_ids=token.unsqueeze(-1),
                attention_mask=attention,
                position_ids=positions,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
        return tokens[:, :width], logprobs[:, :width], masks[:, :width], finished

    def _keep(
        self,
        requests: list[GenerationRequest],
        rows: torch.Tensor,
        live: torch.Tensor,
        out: Any,
        attention: torch.Tensor,
        positions: torch.Tensor,
        pending: torch.Tensor,
        finished: torch.Tensor,
        lengths: torch.Tensor,
        version: int,
    ) -> None:
        """Keeps the cache of the unfinished rows for the next chunk (row i of the cache is
        the batch's row `live[i]`)."""
        seeds = [r.noise_seed for r in requests for _ in range(r.num_samples)]
        samples = [i for r in requests for i in range(r.num_samples)]
        flat = rows.tolist()
        keys = {
            (seeds[flat[at]], samples[flat[at]], int(lengths[i])): i
            for i, at in enumerate(live.tolist())
            if not bool(finished[i])
        }
        self._carry = _Carry(version, keys, out.past_key_values, attention, positions, pending)
