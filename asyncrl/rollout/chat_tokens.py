"""Messages to tokens for turns of a conversation, token in, token out: the opening rendered
by the tokenizer's chat template, and each later reply as the template continues the history
after the assistant's end-of-turn token, so a conversation's tokens are the ones the engine
sampled and the ones the replies encoded to, never re-tokenized. A tokenizer without a chat
template renders its messages' text.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from asyncrl.core.episodes import Message


class ChatTokens:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_id: int) -> None:
        self.tokenizer = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self.eos_id = turn_end_id(tokenizer, eos_id) if self.chat else eos_id
        """The token an assistant turn ends with: the template's own end of turn where it is a
        special token (`turn_end_id`), else the model's eos."""

    def render(
        self, messages: list[Message], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The opening messages as the prompt of an assistant turn (with the `tools` the
        template describes to the model, where given: agent runs)."""
        if self.chat:
            encoded: Any = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, **_tools(tools)
            )
            ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
            return [int(x) for x in ids]
        return self.encode("".join(m["content"] for m in messages))

    def reply_ids(
        self,
        history: list[Message],
        num_reply: int,
        ended: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The tokens of a reply, the last `num_reply` messages of `history`, as the history
        continues it: the chat template's text after the assistant's end-of-turn token, up to
        the next assistant turn's opening (an end-of-turn token first, where the turn was cut
        off: `ended` False). A template that does not extend a conversation turn by turn is a
        `ValueError`."""
        eos = [] if ended else [self.eos_id]
        reply = history[len(history) - num_reply :]
        if not self.chat:
            return eos + self.encode("".join(m["content"] for m in reply))
        before = self.template(history[: len(history) - num_reply], False, tools)
        after = self.template(history, True, tools)
        if not after.startswith(before):
            raise ValueError(
                "the chat template does not extend the history turn by turn (its rendering of "
                "a longer conversation does not start with the shorter one's), so replies "
                "cannot be appended as tokens"
            )
        eos_text = str(self.tokenizer.decode([self.eos_id]))
        tail = before[before.rindex(eos_text) + len(eos_text) :] if eos_text in before else ""
        return eos + self.encode(tail + after[len(before) :])

    def encode(self, text: str) -> list[int]:
        return [int(x) for x in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def template(
        self, messages: list[Message], generation: bool, tools: list[dict[str, Any]] | None = None
    ) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation, tokenize=False, **_tools(tools)
            )
        )


def _tools(tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """`tools=` for the chat template where there are any (a template without tool support
    is never handed the argument)."""
    return {"tools": tools} if tools else {}


def turn_end_id(tokenizer: PreTrainedTokenizerBase, eos_id: int) -> int:
    """The token a chat template closes an assistant message with (`<|im_end|>` in ChatML),
    where it is a special or added token of its own; else `eos_id`. Generation stops an
    episode's turn there, so the tokens are the template's (an instruct model's eos is usually
    this token; a base tokenizer's `<|endoftext|>` is not)."""
    marker = "ASYNCRL-TURN-END-MARKER"
    text = str(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}],
            tokenize=False,
        )
    )
    suffix = text[text.index(marker) + len(marker) :] if marker in text else ""
    ids = tokenizer(suffix, add_special_tokens=False)["input_ids"] if suffix else []
    added = set(getattr(tokenizer, "added_tokens_decoder", {})) | set(tokenizer.all_special_ids)
    if ids and int(ids[0]) in added:  # a token of its own, not text
        return int(ids[0])
    return eos_id
