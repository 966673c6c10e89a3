"""The agent example's files (`make agent-demo`): the math chat word problems as Parquet chat
rows, and a tiny Qwen2 model whose chat template has tools (`TOOL_CHAT_TEMPLATE`), warm-started
to call a calculator in part of its runs, all generated offline.

    python -m asyncrl.examples.agent_math data/agent_math

writes `train.parquet` and `test.parquet` (math_chat's rows: `{"messages": [{"role": "user",
...}], "answer": "7"}`) and `model/`, which `configs/agent_demo.yaml` trains with the agents of
`asyncrl.examples.agents`. A model from scratch would never write a `<tool_call>`, so it is
first fitted to transcripts of that agent (`warm_start`, ~400 steps of cross-entropy on the
assistant's tokens): in `TOOL_SHARE` of them the assistant calls `calculate` with the
problem's expression and copies the tool's answer into `\\boxed{}`; in the rest it answers at
once with a random digit (right one time in ten). Fresh samples then call the tool in about
30% of runs (`tool_call_share`, printed) and are right ~90% of the time when they do, ~10%
when they do not: what RL has to find. Same files for the same arguments (seeded, one
thread's arithmetic); existing files are kept, the model written whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers.utils.chat_template_utils import render_jinja_template

from asyncrl.examples.math_chat import SYSTEM_PROMPT, TEMPLATES, chat_row, problems
from asyncrl.models.scratch import TOOL_CHAT_TEMPLATE, save_scratch_model
from asyncrl.tasks.tools import calculate

CALCULATE_DESCRIPTION = "Evaluates an arithmetic expression: numbers, + - * / and parentheses."
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": CALCULATE_DESCRIPTION,
            "parameters": {
                "properties": {"expression": {"title": "Expression", "type": "string"}},
                "required": ["expression"],
                "title": "calculate_args",
                "type": "object",
                "additionalProperties": False,
            },
            "strict": True,
        },
    }
]
"""The `tools` of a request of either example agent, exactly as the Agents SDK sends its
`calculate` function tool (a test checks it): the warm start renders its transcripts with these,
so the model is trained on the very system prompt its runs will see."""
TOOL_SHARE = 0.35
"""The share of warm-start transcripts that call the tool (a fresh sample then calls it in
about as many runs: `tool_call_share`)."""
WARM_LR = 6e-3
"""The warm start's peak learning rate (AdamW, betas 0.9 and 0.95: both faster to copy)."""
COPY_WEIGHT = 10.0
"""The loss weight of the digits a tool transcript copies (`warm_start`)."""
WARM_STEPS = (250, 150)
"""Warm-start steps on short conversations, then with the tools system prompt (`warm_start`)."""
TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
"""A tool call in a decoded completion (`tool_call_share`; the run's own count is its parser's)."""
MAX_POSITIONS = 640
"""`max_position_embeddings`: twice the longest 2-call conversation (`conversation_tokens`)
and then some (a test checks)."""


def expression(question: str) -> str:
    """The arithmetic of one of `problems()`' questions, `a+b`, `a-b` or `a*b`."""
    fields = {"{n}": r"\w+", "{t}": r"\w+", "{a}": r"(\d+)", "{b}": r"(\d+)"}
    for template, op in TEMPLATES:
        parts = re.split(r"(\{[ntab]\})", template)
        match = re.fullmatch("".join(fields.get(p, re.escape(p)) for p in parts), question)
        if match:
            return f"{match[1]}{op}{match[2]}"
    raise ValueError(f"not one of the generator's questions: {question!r}")


def opening(question: str, tools: bool = True) -> list[dict[str, Any]]:
    """The messages both example agents send first: the instructions and the question (without
    `tools`: the question alone, the warm start's short conversations)."""
    user = {"role": "user", "content": question}
    return [{"role": "system", "content": SYSTEM_PROMPT}, user] if tools else [user]


def transcript(
    question: str, answer: int, guess: int | None, tools: bool = True
) -> list[dict[str, Any]]:
    """One warm-start conversation: a direct `\\boxed{guess}`, or (guess None) a `calculate`
    call with the question's expression, the tool's answer, then `\\boxed{answer}`."""
    messages = opening(question, tools)
    if guess is not None:
        return [*messages, {"role": "assistant", "content": f"\\boxed{{{guess}}}"}]
    arguments = {"expression": expression(question)}
    call = {"type": "function", "function": {"name": "calculate", "arguments": arguments}}
    return [
        *messages,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": calculate(arguments["expression"])},
        {"role": "assistant", "content": f"\\boxed{{{answer}}}"},
    ]


def render(messages: list[dict[str, Any]], generation: bool, tools: bool = True) -> str:
    """`messages` (and `TOOLS`) as `TOOL_CHAT_TEMPLATE` renders them (transformers' own
    renderer: what the tokenizer's `apply_chat_template` runs)."""
    tools_arg: Any = TOOLS if tools else None
    result: Any = render_jinja_template(  # (texts, indices), whatever its annotation says
        [messages],
        tools=tools_arg,
        chat_template=TOOL_CHAT_TEMPLATE,
        add_generation_prompt=generation,
    )
    return str(result[0][0])


def corpus() -> Iterator[str]:
    """What the tokenizer is trained on: every problem's two transcripts, rendered."""
    for question, answer in problems():
        for guess in (None, answer):
            yield render(transcript(question, answer, guess), False)


def pieces(
    tokenizer: Any, messages: list[dict[str, Any]], tools: bool = True
) -> list[tuple[list[int], bool]]:
    """A conversation's tokens as the runtime builds them: (ids, sampled) pieces, each
    assistant turn's completion (its text and `<|im_end|>`) sampled, the text around it not,
    each piece encoded alone (the engine's tokens are never re-tokenized across turns)."""
    out, done = [], ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, after = render(messages[:i], True, tools), render(messages[: i + 1], False, tools)
        end = after.index("<|im_end|>", len(before)) + len("<|im_end|>")
        for text, sampled in ((before[len(done) :], False), (after[len(before) : end], True)):
            out.append((encode(tokenizer, text), sampled))
        done = after[:end]
    return out


def encode(tokenizer: Any, text: str) -> list[int]:
    return [int(x) for x in tokenizer(text, add_special_tokens=False)["input_ids"]]


def conversation_tokens(tokenizer: Any, question: str, answer: int) -> int:
    """Tokens of a 2-call run (a tool call, the tool's answer, the final answer)."""
    return sum(len(ids) for ids, _ in pieces(tokenizer, transcript(question, answer, None)))


def weighted_row(
    tokenizer: Any, question: str, answer: int, guess: int | None, tools: bool
) -> tuple[list[int], list[float]]:
    """A transcript's tokens and per-token loss weights: 0 off the sampled tokens, 1 on them,
    `COPY_WEIGHT` on the digits a tool transcript copies (into the call, into `\\boxed{}`)."""
    digits = set(tokenizer.convert_tokens_to_ids(list("0123456789")))
    copy = COPY_WEIGHT if guess is None else 1.0
    ids: list[int] = []
    weights: list[float] = []
    for part, sampled in pieces(tokenizer, transcript(question, answer, guess, tools), tools):
        ids += part
        weights += [(copy if t in digits else 1.0) * sampled for t in part]
    return ids, weights


def warm_start(
    model: Any, tokenizer: Any, rows: list[tuple[str, int]], seed: int, steps: tuple[int, int]
) -> list[float]:
    """Fits `model` in place to the agent's transcripts of `rows` (batches of 16, AdamW with 20
    warm-up steps to `WARM_LR`, down to a tenth of it over the last phase, cross-entropy on
    the sampled tokens, weighted); returns each step's loss, printing every 50th.

    A 2-layer model is slow to learn to copy (the question's numbers into the call, the tool's
    answer into `\\boxed{}`): behind the 170-token tools system prompt, with every token
    weighted 1, not in 800 steps; on short conversations with the copied digits' loss weighted
    up (`COPY_WEIGHT`) in 150-300 (seeds 0-3), and it carries over. So the first `steps[0]`
    steps are tool transcripts with no system prompt, the last `steps[1]` the real
    conversations, tool transcripts in `TOOL_SHARE` of them."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARM_LR, betas=(0.9, 0.95))
    decay = lambda s: 1 - 0.9 * max(0, s - steps[0]) / max(1, steps[1])  # noqa: E731
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20, decay(s))
    )
    pad = int(tokenizer.pad_token_id)
    encoded: dict[tuple[str, int | None, bool], tuple[list[int], list[float]]] = {}
    losses: list[float] = []
    model.train()
    for step in range(sum(steps)):
        tools = step >= steps[0]
        batch = []
        for question, answer in rng.sample(rows, 16):
            called = not tools or rng.random() < TOOL_SHARE
            guess = None if called else rng.randrange(10)
            key = (question, guess, tools)
            if key not in encoded:
                encoded[key] = weighted_row(tokenizer, question, answer, guess, tools)
            batch.append(encoded[key])
        loss = batch_loss(model, batch, pad)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if (step + 1) % 50 == 0 or step + 1 == sum(steps):
            phase = "the tools system prompt" if tools else "short conversations"
            print(
                f"warm start: step {step + 1}/{sum(steps)} ({phase}), loss {losses[-1]:.3f}",
                flush=True,
            )
    model.eval()
    return losses


def batch_loss(model: Any, batch: list[tuple[list[int], list[float]]], pad: int) -> torch.Tensor:
    """The weighted cross-entropy of a batch of (ids, weights) rows over its trained tokens.
    The rows' common prefix (the system prompt) is run once and its keys and values repeated
    for every row: the same loss and gradient as the padded batch, a third of the work."""
    width = min(len(ids) for ids, _ in batch)
    first_trained = min(next(i for i, x in enumerate(w) if x > 0) for _, w in batch)
    prefix = 0
    while prefix < min(width, first_trained - 1) and len({ids[prefix] for ids, _ in batch}) == 1:
        prefix += 1
    cache = None
    if prefix:
        cache = model(
            input_ids=torch.tensor([batch[0][0][:prefix]]), use_cache=True
        ).past_key_values
        cache.batch_repeat_interleave(len(batch))
    length = max(len(ids) for ids, _ in batch) - prefix
    ids = torch.tensor([r[prefix:] + [pad] * (length + prefix - len(r)) for r, _ in batch])
    weights = torch.tensor([w[prefix:] + [0.0] * (length + prefix - len(w)) for _, w in batch])
    mask = torch.tensor([[1] * len(r) + [0] * (length + prefix - len(r)) for r, _ in batch])
    logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    return -(logp * weights[:, 1:]).sum() / (weights[:, 1:] > 0).sum()


@torch.no_grad()
def sample(
    model: Any, tokenizer: Any, prompts: list[list[int]], seed: int, max_new: int = 40
) -> list[str]:
    """One completion per prompt at temperature 1 (no top-k/top-p), decoded up to its
    `<|im_end|>`; seeded."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    width = max(map(len, prompts))
    pad = int(tokenizer.pad_token_id)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new,
            eos_token_id=[end, int(tokenizer.eos_token_id)],
            pad_token_id=pad,
        )
    texts = []
    for row in out[:, width:].tolist():
        row = row[: row.index(end)] if end in row else row
        texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return texts


def called_tool(text: str) -> str | None:
    """The expression of a completion's parsed `calculate` call, or None."""
    match = TOOL_CALL.search(text)
    try:
        call = json.loads(match[1]) if match else None
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") != "calculate":
        return None
    arguments = call.get("arguments")
    return str(arguments.get("expression", "")) if isinstance(arguments, dict) else ""


def tool_call_share(
    model: Any, tokenizer: Any, rows: list[tuple[str, int]], seed: int
) -> dict[str, float]:
    """Fresh runs of the example agent, offline, one a row: the share whose first completion
    holds a parsed `calculate` call (`tool_call_share`), and the share answered right among
    those (`correct_calling`: the tool's answer given, one more sample) and among the others
    (`correct_direct`)."""
    prompt = lambda messages: encode(tokenizer, render(messages, True))  # noqa: E731
    firsts = sample(model, tokenizer, [prompt(opening(q)) for q, _ in rows], seed)
    calls = {i: e for i, e in enumerate(map(called_tool, firsts)) if e is not None}
    followed = [prompt(answered(rows[i][0], e)) for i, e in calls.items()]
    seconds = sample(model, tokenizer, followed, seed + 1) if followed else []
    right = lambda text, i: f"\\boxed{{{rows[i][1]}}}" in text  # noqa: E731
    direct = [i for i in range(len(rows)) if i not in calls]
    return {
        "tool_call_share": len(calls) / len(rows),
        "correct_calling": sum(map(right, seconds, calls)) / max(1, len(calls)),
        "correct_direct": sum(right(firsts[i], i) for i in direct) / max(1, len(direct)),
    }


def answered(question: str, expression: str) -> list[dict[str, Any]]:
    """The conversation after a `calculate(expression)` call and the tool's answer."""
    call = {"type": "function", "function": {"name": "calculate"}}
    call["function"]["arguments"] = {"expression": expression}  # type: ignore[index]
    return [
        *opening(question),
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": calculate(expression)},
    ]


def prepare(
    out: str | Path,
    test_rows: int = 64,
    seed: int = 0,
    warm_steps: tuple[int, int] = WARM_STEPS,
) -> dict[str, Path]:
    """Writes the example's files into `out` (kept if already there); returns their paths. The
    model is written whole or not at all (built in `model.tmp`, then renamed)."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / "train.parquet", "test": out / "test.parquet", "model": out / "model"}
    rows = list(problems(seed))
    for split, part in (("test", rows[:test_rows]), ("train", rows[test_rows:])):
        if not paths[split].exists():
            datasets.Dataset.from_list([chat_row(q, a) for q, a in part]).to_parquet(
                str(paths[split])
            )
    if not (paths["model"] / "config.json").exists():
        build_model(paths["model"], rows[test_rows:], rows[:test_rows], seed, warm_steps)
    return paths


def build_model(
    path: Path,
    train: list[tuple[str, int]],
    test: list[tuple[str, int]],
    seed: int,
    steps: tuple[int, int],
) -> dict[str, float]:
    """The scratch model with the tools template, warm-started on `train`, measured on `test`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_scratch_model(
        tmp,
        arch="qwen2",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=192,
        vocab_size=512,
        max_position_embeddings=MAX_POSITIONS,
        seed=seed,
        corpus=corpus(),
    )
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(tmp)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread's sums: the same weights whatever the core count
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            warm_start(model, tokenizer, train, seed, steps)
        measured = tool_call_share(model, tokenizer, test * 4, seed)
    finally:
        torch.set_num_threads(threads)
    print(
        f"warm start: fresh samples call the tool in {measured['tool_call_share']:.0%} of runs "
        f"(right {measured['correct_calling']:.0%} of those, {measured['correct_direct']:.0%} "
        f"of the others), {time.perf_counter() - start:.1f} s",
        flush=True,
    )
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, path)
    return measured


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m asyncrl.examples.agent_math",
        description="Write the agent example's Parquet data and warm-started tiny Qwen2 model.",
    )
    parser.add_argument("out", help="output directory, e.g. data/agent_math")
    parser.add_argument("--test-rows", type=int, default=64)
    args = parser.parse_args(argv)
    for name, path in prepare(args.out, args.test_rows).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
