"""A character-level tokenizer built offline with `tokenizers`, wrapped as a real
`PreTrainedTokenizerFast` so that it saves, loads and behaves like any Hugging Face tokenizer.

One token per character of an alphabet (the task's own characters, for the `tiny` preset), plus
four special tokens. A small alphabet keeps the tiny model's vocabulary small: `sort_digits`
needs 15 tokens, which is what lets RL from a random init learn it in minutes on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"


def build_char_tokenizer(characters: Iterable[str]) -> PreTrainedTokenizerFast:
    """Returns a character tokenizer: ids 0..3 are `<pad>`, `<s>`, `</s>`, `<unk>`, then one id
    per distinct character, in sorted order. `decode` joins characters without separators."""
    alphabet = sorted(set(characters))
    if any(len(c) != 1 for c in alphabet):
        raise ValueError("the alphabet must be single characters")
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK, *alphabet])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
    )
