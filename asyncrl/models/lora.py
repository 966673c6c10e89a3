"""LoRA adapters (`model.lora.*`) through Hugging Face `peft`.

With `model.lora.rank` > 0 the policy is wrapped in peft's adapters once the engine and the
evaluator have copied the plain model (`apply_lora`, from `build_algorithm`): the base
weights are frozen, only the adapters train. What changes downstream:

- the optimizer holds the adapters' parameters only (`trainable_parameters`);
- the `model` checkpoint part is `AdapterWeights`: the adapters' tensors alone. The base is
  rebuilt from the config on every launch, as the KL reference always was, and its identity
  (`base_sha256`: the weights files under `model.path`, or the preset's initial tensors) is in
  the trainer's state, so a resume on another base is refused naming `model.path`;
- the KL reference is the same model with the adapter switched off (no copy);
- generation gets the merged weights under the base model's own names (`merged_weights`), so
  every engine and backend loads them as it loads a fully fine-tuned model's.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from asyncrl.checkpoint.store import CheckpointError
from asyncrl.config import Config, ConfigError, LoraConfig, ModelConfig

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.gguf")
"""The files under `model.path` whose bytes are the base model's identity."""


def is_lora(model: nn.Module) -> bool:
    """Whether `model` is wrapped in peft adapters."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def peft_config(lora: LoraConfig, modules_to_save: list[str] | None = None) -> Any:
    from peft import LoraConfig as PeftLoraConfig  # only LoRA runs import peft

    targets = lora.target_modules
    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules="all-linear" if targets == ["all-linear"] else list(targets),
        bias="none",
        modules_to_save=modules_to_save,
    )


def wrap(model: nn.Module, lora: LoraConfig, seed: int, **kwargs: Any) -> nn.Module:
    """`model` with adapters of `lora` (its base frozen), initialised as a function of `seed`
    (peft draws the A matrices; B starts at zero, so the wrapped model computes what the base
    does)."""
    from peft import get_peft_model
    from peft.tuners.lora import Linear, LoraLayer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = get_peft_model(model, peft_config(lora, **kwargs))
    others = sorted(
        name
        for name, module in wrapped.named_modules()
        if isinstance(module, LoraLayer) and not isinstance(module, Linear)
    )
    if others:  # merged_weights computes Linear layers' deltas only
        raise ConfigError(
            f"model.lora.target_modules: {others[0]} is not a linear layer; adapters go on "
            "linear layers only (e.g. q_proj, v_proj, or all-linear)"
        )
    head = wrapped.get_output_embeddings()
    if isinstance(head, LoraLayer) and getattr(model.config, "tie_word_embeddings", False):
        raise ConfigError(
            "model.lora.target_modules: the output layer is tied to the input embeddings "
            "here; an adapter on it would untie them in the merged model"
        )
    return wrapped


def base_sha256(config: ModelConfig, model: nn.Module) -> str:
    """The base model's identity: SHA-256 (16 hex digits) of the weights files under
    `model.path` (names and bytes), or of the initial tensors (the preset's: a function of its
    keys and `run.seed`; or a `model.path` without such files)."""
    digest = hashlib.sha256()
    files = sorted({f for pattern in WEIGHT_FILES for f in Path(config.path).glob(pattern)})
    if config.path and files:
        for file in files:
            digest.update(file.name.encode())
            with file.open("rb") as handle:
                while block := handle.read(1 << 24):
                    digest.update(block)
        return digest.hexdigest()[:16]
    for name, tensor in sorted(plain_state_dict(model).items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


ADAPTER_KEY = re.compile(r"^(?:base_model\.model\.)?(.*\.lora_[AB])\.[^.]+\.weight$")


def split_generation_weights(
    state: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A wrapped model's `generation_weights(merged=False)` as (the base's weights under the
    base model's own names, the adapters under the names `PeftModel.save_pretrained` writes:
    `base_model.model.<module>.lora_A.weight`), for an engine that loads the base once and the
    adapters per version (vLLM's LoRA requests)."""
    base, adapters = {}, {}
    for name, tensor in state.items():
        match = ADAPTER_KEY.match(name)
        if match:
            adapters[f"base_model.model.{match.group(1)}.weight"] = tensor
            continue
        plain = _plain_name(name.removeprefix("base_model.model."))
        if plain is not None:
            base[plain] = tensor
    return base, adapters


def apply_lora(policy: Any, config: ModelConfig, seed: int) -> None:
    """Wraps `policy.model` in the adapters of `model.lora` (nothing with `rank` 0) and records
    the base's identity in `policy.base_sha256`."""
    if not config.lora.rank:
        return
    policy.base_sha256 = base_sha256(config, policy.model)
    policy.model = wrap(policy.model, config.lora, seed)


def trainable_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """The parameters an optimizer steps: all of a fully trained model, a LoRA model's
    adapters (and the modules it saves whole)."""
    return (p for p in model.parameters() if p.requires_grad)


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters by name, as live tensors (the checkpointer copies them)."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model: nn.Module, state: dict[str, Any], what: str) -> None:
    """Copies `trainable_state` back; refuses another set of names or shapes, naming `what`."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(state) != set(params):
        missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        raise CheckpointError(
            f"its {what} holds {len(state)} tensors, this run's adapters {len(params)} "
            f"(missing {missing[:2]}, unexpected {extra[:2]}): model.lora.* must be the run's "
            "own (a fully fine-tuned run's checkpoint does not resume with adapters)"
        )
    for name, param in params.items():
        saved = state[name]
        if tuple(saved.shape) != tuple(param.shape):
            raise CheckpointError(
                f"its {what} tensor {name} is {list(saved.shape)} there, "
                f"{list(param.shape)} here (model.lora.rank changed?)"
            )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name])


class AdapterWeights:
    """The `model` checkpoint part of a LoRA run: the adapters' tensors, megabytes instead of
    the model's gigabytes."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return trainable_state(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_trainable_state(self.model, state, "model part")


def checkpoint_part(model: nn.Module) -> Any:
    """What the checkpoint's `model` part saves of `model`: the adapters of a LoRA model, the
    whole model otherwise."""
    return AdapterWeights(model) if is_lora(model) else model


def _plain_name(name: str) -> str | None:
    """A base model's own name for a tensor of a wrapped model (None for an adapter's)."""
    parts = name.split(".")
    if any(p.startswith("lora_") for p in parts):
        return None
    return ".".join(p for p in parts if p != "base_layer")


def base_module(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a peft wrapper (adapters injected), or `model` itself."""
    return model.get_base_model() if is_lora(model) else model  # type: ignore[operator]


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state dict under the base model's names, without the adapters (the base's
    weights; its own state dict if it has none). `model` may be a peft wrapper or a module
    inside one."""
    out = {}
    for name, tensor in base_module(model).state_dict().items():
        plain = _plain_name(name)
        if plain is not None:
            out[plain] = tensor
    return out


@torch.no_grad()
def merged_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights generation loads: the base's under its own names, each adapted layer's
    weight merged (`W + scale * B @ A`, a new tensor; the others are the live base tensors)."""
    if not is_lora(model):
        return model.state_dict()
    from peft.tuners.lora import LoraLayer

    out = plain_state_dict(model)
    for name, module in base_module(model).named_modules():
        if isinstance(module, LoraLayer) and not module.disable_adapters:
            key = f"{name}.weight"
            for adapter in module.active_adapters:
                if adapter in module.lora_A:  # one layer's delta at a time: no model-sized set
                    delta = module.get_delta_weight(adapter)  # type: ignore[attr-defined]
                    out[key] = out[key] + delta.to(out[key].dtype)
    return out


def adapters_in_engine(config: Config) -> bool:
    """Whether generation applies the adapters itself on the frozen base, in this process
    (`rollout.backend=threads`): the torch engine runs peft's forward on the trainer's own base
    weights, vLLM with `rollout.vllm.lora_requests` (in process or on its servers) serves them
    as LoRA requests over a base it loads once. Otherwise (vLLM without it, Ray workers,
    `model.lora.merge_for_generation`) generation loads the merged weights of each version."""
    rollout, lora = config.rollout, config.model.lora
    engine_does = rollout.engine == "torch" or (
        rollout.engine in ("vllm", "vllm_server") and rollout.vllm.lora_requests
    )
    in_process = engine_does and rollout.backend == "threads"
    return bool(lora.rank) and in_process and not lora.merge_for_generation


def generation_weights(model: nn.Module, merged: bool) -> dict[str, torch.Tensor]:
    """A LoRA model's weights as generation loads them: `merged_weights`, or (for an engine
    that holds the adapters itself) its whole state dict, where every frozen base weight is
    the trainer's own `nn.Parameter` (a weight sync shares it instead of copying: it never
    changes) and the adapters are live tensors like any trained weight."""
    if merged:
        return merged_weights(model)
    return {
        name: t if isinstance(t, nn.Parameter) and not t.requires_grad else t.detach()
        for name, t in model.state_dict(keep_vars=True).items()
    }


def frozen_memo(model: nn.Module, device: torch.device, dtype: torch.dtype) -> dict[int, Any]:
    """A `copy.deepcopy` memo that makes the copy share `model`'s frozen parameters already on
    `device` in `dtype` (a LoRA model's base: an engine's copy then costs its adapters only)."""
    if device.type == "cuda" and device.index is None:  # parameters say cuda:N
        device = torch.device("cuda", torch.cuda.current_device())
    return {
        id(p): p
        for p in model.parameters()
        if not p.requires_grad and p.device == device and p.dtype == dtype
    }


def check_base(saved: str | None, now: str | None, config: ModelConfig) -> None:
    """Refuses to resume a LoRA run's adapters on another base model than they were trained
    on (the base is rebuilt from the config, not saved)."""
    if saved is not None and saved != now:
        where = f"model.path={config.path!r}" if config.path else "the preset (model.*, run.seed)"
        raise CheckpointError(
            f"the adapters were trained on a base model with weights sha256 {saved}, but "
            f"{where} gives {now}: resume on the base the run started from (model.path)"
        )


def save_final(
    model: nn.Module,
    directory: Path,
    state_dict: dict[str, Any] | None,
    with_adapter: bool = True,
) -> None:
    """The run's `final_model/` (a `save_pretrained` directory: `state_dict`, else the model's
    own weights); a LoRA model's is the base with its adapters merged, and its adapters alone
    go to `final_adapter/` beside it (loads with `PeftModel.from_pretrained`)."""
    if not is_lora(model):
        model.save_pretrained(directory, state_dict=state_dict)  # type: ignore[operator]
        return
    base_module(model).save_pretrained(directory, state_dict=merged_weights(model))  # type: ignore[operator]
    if with_adapter:
        model.save_pretrained(directory.parent / "final_adapter")  # type: ignore[operator]
