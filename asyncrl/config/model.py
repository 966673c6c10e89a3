"""The `model.*` section: which model the run trains, and `model.lora.*`, its LoRA adapters."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from asyncrl.config.base import NEVER_CHANGES, ConfigError
from asyncrl.config.base import require as _require


@dataclass
class LoraConfig:
    """`model.lora.*`: LoRA adapters (through `peft`) instead of training every weight. The
    base model stays frozen; the optimizer, the checkpoints and the KL reference (the base with
    the adapter switched off) hold or cost the adapter only. See docs/lora.md."""

    rank: int = field(default=0, metadata=NEVER_CHANGES)
    """The adapters' rank r; 0 trains every weight (no adapter)."""
    alpha: int = field(default=32, metadata=NEVER_CHANGES)
    """The adapters' scale is `alpha / rank` (peft's `lora_alpha`)."""
    dropout: float = field(default=0.0, metadata=NEVER_CHANGES)
    """Dropout on the adapters' input while training (peft's `lora_dropout`); refused in
    deterministic mode (its random draws are not part of the checkpoint)."""
    target_modules: list[str] = field(
        default_factory=lambda: ["all-linear"], metadata=NEVER_CHANGES
    )
    """Module names (or name suffixes) that get an adapter, as peft matches them; `all-linear`
    is every linear layer but the output layer."""
    merge_for_generation: bool = field(default=False, metadata=NEVER_CHANGES)
    """`false`: the torch engine in the trainer's process runs peft's forward on the trainer's
    own frozen base (no second copy of it where `rollout.device` and `rollout.dtype` are the
    trainer's weights'); `true`: it loads each version's merged
    weights, as vLLM and Ray workers always do. Measured in `benchmarks/lora.py`."""

    def validate(self) -> None:
        _require(self.rank >= 0, "model.lora.rank", self.rank, ">= 0 (0: no adapter)")
        _require(self.alpha > 0, "model.lora.alpha", self.alpha, "> 0")
        _require(0 <= self.dropout < 1, "model.lora.dropout", self.dropout, "in [0, 1)")
        _require(
            bool(self.target_modules) and all(self.target_modules),
            "model.lora.target_modules",
            self.target_modules,
            "a non-empty list of module names",
        )


@dataclass
class ModelConfig:
    preset: Literal["tiny"] = field(default="tiny", metadata=NEVER_CHANGES)
    """Built-in architecture used when `path` is empty: `tiny` is a Llama-style causal LM built
    from a config in code, with a character tokenizer over the task's alphabet."""
    path: str = field(default="", metadata=NEVER_CHANGES)
    """A local Hugging Face model directory (`save_pretrained` format, with its tokenizer).
    Empty means: build `preset` from scratch."""
    hidden_size: int = field(default=128, metadata=NEVER_CHANGES)
    """Width of the `tiny` preset."""
    num_layers: int = field(default=2, metadata=NEVER_CHANGES)
    """Transformer blocks of the `tiny` preset."""
    num_heads: int = field(default=4, metadata=NEVER_CHANGES)
    """Attention heads of the `tiny` preset."""
    max_seq_len: int = field(default=64, metadata=NEVER_CHANGES)
    """Longest prompt + completion the `tiny` preset accepts, in tokens."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters, `model.lora.*` (`rank` 0: none)."""

    def validate(self) -> None:
        self.lora.validate()
        for key in ("hidden_size", "num_layers", "num_heads", "max_seq_len"):
            _require(getattr(self, key) >= 1, f"model.{key}", getattr(self, key), ">= 1")
        _require(
            self.hidden_size % self.num_heads == 0,
            "model.hidden_size",
            self.hidden_size,
            f"a multiple of model.num_heads={self.num_heads}",
        )
        if self.path and not Path(self.path).is_dir():
            raise ConfigError(
                f"model.path: {self.path!r} is not a directory; give a local model directory "
                "saved with save_pretrained, or leave it empty to build model.preset"
            )
