"""Real Hugging Face model directories from scratch, offline: a byte-level BPE tokenizer trained
in code and a Qwen2- or Llama-architecture causal LM with a random init, saved with
`save_pretrained` — what `model.path` loads, with no download.

Tests and benchmarks use it to train the same kind of directory a user points `model.path` at
(the `tiny` preset is a character tokenizer and a Llama built in memory, never loaded from
disk). The tokenizer is what GPT-2 and Qwen2 use — `ByteLevel` pre-tokenizer and decoder over
BPE — so any text round-trips, but it is trained on a small corpus generated here (the
`sort_digits` prompts and answers, digit strings, a few sentences and chat turns), hence a
small vocabulary: parameter counts are nearly all transformer blocks, not embeddings.

    python -m asyncrl.models.scratch DIR --arch qwen2 --params 75M

`<|endoftext|>` is the eos and pad token (as in Qwen2); with `chat=True` the tokenizer also
has `<|im_start|>` / `<|im_end|>` and a ChatML template.
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from asyncrl.tasks.source import sort_digits_examples

Arch = Literal["qwen2", "llama"]
EOS = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou are provided with function signatures within "
    "<tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{\\"name\\": \\"\' }}{{- tool_call.name }}'
    "{{- '\\\", \\\"arguments\\\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5's chat template with tools, shortened (no default system prompt without tools): a
system message listing the tools, an assistant's calls as `<tool_call>` JSON blocks, the
tools' answers as a user turn of `<tool_response>` blocks. For agent runs (docs/agents.md)."""
SENTENCES = [
    "Sort the digits in increasing order.",
    "The answer is the sorted sequence of digits.",
    "You are a helpful assistant.",
    "What is the sum of two and three? The answer is five.",
    "A model is trained with reinforcement learning from its own samples.",
]
SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Qwen2's pre-tokenization split (one token per digit). transformers >= 5 rebuilds the
pipeline of a `qwen2` model's tokenizer with it whatever `tokenizer.json` says, so ours must
use it too, or the tokenizer would encode differently once loaded."""


def default_corpus(num_lines: int = 2000, seed: int = 0) -> Iterator[str]:
    """Lines covering the built-in task: its prompts and answers (`31524=`, `12345`) for 1-12
    digits, free digit strings, a few sentences and ChatML turns. Deterministic in `seed`."""
    rng = random.Random(seed)
    for num_digits in range(1, 13):
        for example in sort_digits_examples(num_digits, num_lines // 12):
            yield example.prompt + example.answer
    for _ in range(num_lines):
        yield "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 16)))
    for sentence in SENTENCES:
        yield sentence
        yield f"{IM_START}user\n{sentence}{IM_END}\n{IM_START}assistant\n"


def train_tokenizer(
    vocab_size: int = 512, corpus: Iterable[str] | None = None, chat: bool = True
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with up to `vocab_size` tokens (the special tokens, 256 byte
    tokens, then merges learned from `corpus`; a small corpus may give fewer), wrapped as a
    `PreTrainedTokenizerFast`. Its pipeline is Qwen2's (NFC, `SPLIT_REGEX`, byte-level). It adds
    no special tokens when encoding; `<|endoftext|>` is its eos and pad token. Left padding, as
    the policy generates."""
    specials = [EOS, IM_START, IM_END] if chat else [EOS]
    core = Tokenizer(models.BPE())
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus if corpus is not None else default_corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS,
        pad_token=EOS,
        padding_side="left",
        model_max_length=1 << 30,
    )
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@dataclass(frozen=True)
class Shape:
    """A transformer's size. `num_heads` must divide `hidden_size` and `num_kv_heads` divide
    `num_heads`."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int


def model_config(
    arch: Arch, shape: Shape, vocab_size: int, max_position_embeddings: int, eos_id: int
) -> Qwen2Config | LlamaConfig:
    """The Hugging Face config of `arch` at `shape`. Qwen2 ties input and output embeddings (as
    Qwen2-0.5B does), Llama does not (as Llama 2 does), so both code paths get exercised."""
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    raise ValueError(f"arch must be 'qwen2' or 'llama', got {arch!r}")


def build_model(
    arch: Arch, shape: Shape, vocab_size: int, max_position_embeddings: int, eos_id: int, seed: int
) -> PreTrainedModel:
    """A randomly initialised causal LM; the init is a function of `seed`."""
    config = model_config(arch, shape, vocab_size, max_position_embeddings, eos_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if isinstance(config, Qwen2Config):
            return Qwen2ForCausalLM(config)
        return LlamaForCausalLM(config)


def count_parameters(arch: Arch, shape: Shape, vocab_size: int) -> int:
    """Parameters of `build_model(arch, shape, vocab_size, ...)`, by formula (a test checks it
    against a built model): per block, the q/k/v/o projections (Qwen2: q/k/v with biases),
    the gated MLP and two RMSNorms; then the embedding, the final norm and, for Llama, an
    untied output layer."""
    h, inter = shape.hidden_size, shape.intermediate_size
    kv_width = shape.num_kv_heads * (h // shape.num_heads)
    attention = 2 * h * h + 2 * h * kv_width
    if arch == "qwen2":
        attention += h + 2 * kv_width
    per_layer = attention + 3 * h * inter + 2 * h
    embeddings = vocab_size * h * (1 if arch == "qwen2" else 2)
    return shape.num_layers * per_layer + embeddings + h


def shape_for(num_params: int, arch: Arch = "qwen2", vocab_size: int = 512) -> Shape:
    """A shape of about `num_params` parameters (within 10% where any width allows it): head
    size 32 below width 256 and 64 from it, 2 query heads per KV head, an MLP 8/3 as wide
    (rounded to 64), and of those the width closest to 48 × depth (between Qwen2-0.5B's 37 and
    Qwen2-1.5B's 55)."""
    candidates = []
    for hidden in [64, 128, 192, *range(256, 4097, 128)]:
        head = 32 if hidden < 256 else 64
        heads = hidden // head
        kv_heads = heads // 2 if heads % 2 == 0 else heads
        inter = max(64, round(hidden * 8 / 3 / 64) * 64)
        one, two = (
            count_parameters(arch, Shape(hidden, n, heads, kv_heads, inter), vocab_size)
            for n in (1, 2)
        )
        layers = max(1, round((num_params - (2 * one - two)) / (two - one)))
        shape = Shape(hidden, layers, heads, kv_heads, inter)
        error = abs(math.log(count_parameters(arch, shape, vocab_size) / num_params))
        aspect = abs(math.log(hidden / layers / 48))
        candidates.append((max(error, 0.1), aspect, error, shape))
    return min(candidates, key=lambda c: c[:3])[3]


def save_scratch_model(
    path: str | Path,
    arch: Arch = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 512,
    seed: int = 0,
    corpus: Iterable[str] | None = None,
    chat: bool = True,
) -> Path:
    """Trains a tokenizer (`train_tokenizer(vocab_size, corpus, chat)`), builds a random `arch`
    causal LM whose vocabulary is that tokenizer's size, and `save_pretrained`s both to `path`
    (created if needed). Returns `path`. The defaults are a ~100k-parameter model that saves in
    well under a second. `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained(path)` load it,
    and so does `model.path=PATH`."""
    path = Path(path)
    tokenizer = train_tokenizer(vocab_size, corpus, chat)
    shape = Shape(hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size)
    eos_id = int(tokenizer.eos_token_id)
    model = build_model(arch, shape, len(tokenizer), max_position_embeddings, eos_id, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def parse_count(text: str) -> int:
    """`75M` -> 75_000_000; also `k`/`K`, `G`/`B` and plain integers."""
    scale = {"k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9}.get(text[-1:].lower())
    return int(float(text[:-1]) * scale) if scale else int(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m asyncrl.models.scratch",
        description="Save a randomly initialised Qwen2/Llama model and a BPE tokenizer, offline.",
    )
    parser.add_argument("path", help="output directory")
    parser.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    parser.add_argument("--params", default="1M", help="target parameter count, e.g. 75M")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--max-position-embeddings", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    tokenizer_size = len(train_tokenizer(args.vocab_size))
    shape = shape_for(parse_count(args.params), args.arch, tokenizer_size)
    save_scratch_model(
        args.path,
        args.arch,
        shape.hidden_size,
        shape.num_layers,
        shape.num_heads,
        shape.num_kv_heads,
        shape.intermediate_size,
        args.vocab_size,
        args.max_position_embeddings,
        args.seed,
    )
    total = count_parameters(args.arch, shape, tokenizer_size)
    print(f"{args.path}: {args.arch} {shape}, vocab {tokenizer_size}, {total / 1e6:.2f}M params")


if __name__ == "__main__":
    main()
