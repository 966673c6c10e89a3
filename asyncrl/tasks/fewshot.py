"""Few-shot prompts from the training split (`data.fewshot=K`): K solved rows of the training
data put in front of each chat prompt, as user and assistant turns, before its own question.

A small model asked a question the standard zero-shot way may not know the answer's form (a
135M model writes until the length limit, and its box, if any, is cut); one solved example in
front teaches it. The demonstrations are drawn from the training split only, never the row's
own question (nor a row with the same prompt), and deterministically: row i of a split gets
the same K rows on every launch, in every run and seed (a string-seeded generator keyed by
the split's label and i; the run's seed orders the rows, not their prompts). They are part of
the rows themselves, so the dataset's identity (`examples_sha256`, DESIGN.md I8) covers them:
a resume with another `data.fewshot` or other demonstrations is refused like one on other
rows. Pure: lists in, lists out.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, replace

from asyncrl.config import ConfigError
from asyncrl.tasks.examples import Example, Message


@dataclass(frozen=True)
class Demonstration:
    """A training row as a solved example: its question's turns and the assistant's answer."""

    turns: tuple[Message, ...]
    """The row's messages without a leading system message."""
    response: str
    prompt: str
    """The row's prompt text, to keep a row's own question out of its demonstrations."""


def demonstration(example: Example, response: str) -> Demonstration:
    """`example` (a chat row) answered with `response`."""
    if example.messages is None:
        raise ConfigError(
            f"data.fewshot: {example.origin} is not a chat prompt; demonstrations are chat turns "
            "(set data.messages_key, or data.apply_chat_template=true for string prompts)"
        )
    turns = tuple(m for i, m in enumerate(example.messages) if i or m["role"] != "system")
    return Demonstration(turns, response, example.prompt)


def default_response(answer: str, math: bool) -> str:
    """A demonstration's answer when the data has no solution column (`data.fewshot_key`
    empty): for the `math` reward the answer boxed as it scores it, else the answer itself."""
    return f"The answer is \\boxed{{{answer}}}." if math else answer


def draw(
    label: str, index: int, prompt: str, pool: list[Demonstration], k: int, others: int
) -> list[int]:
    """The `k` pool rows in front of row `index` of split `label`: distinct, none with the
    row's own prompt (`others` rows of the pool have another one), in the order drawn. The
    same arguments give the same rows."""
    if others < k:
        raise ConfigError(
            f"data.fewshot: {k} demonstrations a prompt, but the training split has only "
            f"{others} rows with another prompt than {prompt[:60]!r}"
        )
    rng = random.Random(f"asyncrl-fewshot:{label}:{index}")
    chosen: list[int] = []
    while len(chosen) < k:
        j = rng.randrange(len(pool))
        if j not in chosen and pool[j].prompt != prompt:
            chosen.append(j)
    return chosen


def with_demonstrations(
    examples: list[Example], pool: list[Demonstration], k: int, label: str
) -> list[Example]:
    """Each of `examples` (split `label`'s rows, in order) with `k` demonstrations of `pool`
    (`draw`) after its system message, if any, and before its own turns; the answer and origin
    kept. `k` = 0 returns the rows unchanged."""
    if k <= 0:
        return examples
    counts = Counter(d.prompt for d in pool)
    out = []
    for i, example in enumerate(examples):
        if example.messages is None:
            demonstration(example, "")  # raises, naming the row
        assert example.messages is not None
        own = list(example.messages)
        system = own[:1] if own[0]["role"] == "system" else []
        shots: list[Message] = []
        others = len(pool) - counts[example.prompt]
        for j in draw(label, i, example.prompt, pool, k, others):
            shots.extend(pool[j].turns)
            shots.append({"role": "assistant", "content": pool[j].response})
        messages = tuple(system + shots + own[len(system) :])
        text = "\n".join(m["content"] for m in messages)
        out.append(replace(example, prompt=text, messages=messages))
    return out
