"""The verifiers demo's warm start (`make verifiers-demo`, asyncrl/examples/verifiers_demo.py):
a few supervised steps on calculator episodes done right, rendered token for token as the
run's endpoint renders verifiers' requests (the harness's tools captured from one real
episode), so that the RL run starts from a model that calls the tool at all."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WARM_FIRST = 200
"""The warm start's questions are the train split's from here on: the RL run's tasks are its
first 200 (`agent.args.num_tasks` of the config), the test split is the held-out one."""
WARM_TASKS = 32
"""Transcripts the warm start trains on: 4 steps of `WARM_BATCH`. Measured on 32 test tasks,
greedy (AMD EPYC, 2 cores, 2026-12-07): the prepared model 0.34 accurate with the tool in 12.5%
of its episodes after these 4 steps at 1e-5; 0.25 and 0% after 2 steps (16 transcripts);
1.00 and 100% after 6 steps at 3e-5 (48), which leaves the RL run nothing to learn."""
WARM_EPOCHS = 1
WARM_BATCH = 8
WARM_LR = 1e-5
WARM_SEED = 0
WARM_RECORD = "warm_start.json"


@dataclass(frozen=True)
class Transcript:
    """One warm-start episode as the run's endpoint would hold it: the tokens of the whole
    conversation (the first request's prompt, the call, the tool's answer, the final reply), and
    which of them the model wrote (`trained`: the call and the reply, each with its end of
    turn)."""

    ids: list[int]
    trained: list[bool]


def capture_tools(model_dir: Path, prompt: list[int]) -> list[dict[str, Any]]:
    """The tools verifiers' harness lists in its requests, as the run's endpoint rendered them:
    `prompt` is the prompt of one real episode of the train split's first task against
    `model_dir` (`verifiers_demo.first_prompt`), its `<tools>` lines read back as JSON. Raises
    unless the chat template renders the question with those tools to exactly the prompt's
    tokens (so transcripts rendered with them are the tokens a run sees)."""
    from asyncrl_calculator.arithmetic import QUESTION, questions
    from transformers import AutoTokenizer

    from asyncrl.rollout.chat_tokens import ChatTokens

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    text = str(tokenizer.decode(prompt))
    if "<tools>\n" not in text or "\n</tools>" not in text:
        raise RuntimeError(f"the episode's prompt lists no tools:\n{text}")
    listed = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    tools = [json.loads(line) for line in listed.split("\n")]
    expression, _ = next(questions("train", 1))
    user = {"role": "user", "content": QUESTION.format(expression=expression)}
    chat = ChatTokens(tokenizer, int(tokenizer.eos_token_id))
    rendered = chat.render([user], tools)
    if rendered != prompt:
        raise RuntimeError(
            "the question rendered with the captured tools is not the episode's prompt:\n"
            f"{tokenizer.decode(rendered)}\n---\n{text}"
        )
    return tools


def transcript(chat: Any, tools: list[dict[str, Any]], expression: str, answer: int) -> Transcript:
    """A calculator episode done right, token by token as the endpoint renders it
    (`ChatTokens`: the prompt of the first request, each later turn continued from the
    history): the question; the call `calc_calculate(expression)` as the template writes an
    assistant's tool call; the calculator's answer; the reply "EXPRESSION = ANSWER"."""
    from asyncrl_calculator.arithmetic import QUESTION, calculate

    user = {"role": "user", "content": QUESTION.format(expression=expression)}
    call = {"name": "calc_calculate", "arguments": {"expression": expression}}
    assistant = {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": call}]}  # fmt: skip
    opening = chat.template([user], True, tools)
    whole = chat.template([user, assistant], False, tools)
    end_text = str(chat.tokenizer.decode([chat.eos_id]))
    call_text = whole[len(opening) :].split(end_text)[0]  # after "<|im_start|>assistant\n"
    result = calculate(expression)
    tool = {"role": "tool", "content": result, "name": "calc_calculate"}
    reply = f"{expression} = {result}"
    parts: list[tuple[list[int], bool]] = [
        (chat.render([user], tools), False),
        ([*chat.encode(call_text), chat.eos_id], True),
        (chat.reply_ids([user, assistant, tool], 1, True, tools), False),
        ([*chat.encode(reply), chat.eos_id], True),
    ]
    if str(answer) != result:
        raise RuntimeError(f"{expression}: the calculator says {result}, the task {answer}")
    ids = [i for part, _ in parts for i in part]
    trained = [t for part, t in parts for _ in part]
    return Transcript(ids, trained)


def warm_settings(model_dir: Path) -> dict[str, Any]:
    """What a warm start of `model_dir` records, its outcome aside."""
    return {
        "from": str(model_dir),
        "tasks": WARM_TASKS,
        "first": WARM_FIRST,
        "epochs": WARM_EPOCHS,
        "batch": WARM_BATCH,
        "lr": WARM_LR,
        "seed": WARM_SEED,
    }


def warm_start(model_dir: Path, out: Path, prompt: list[int], log: Any = print) -> dict[str, Any]:
    """Supervised fine-tuning of `model_dir` on `WARM_TASKS` transcripts (`transcript`) of the
    train split's questions from `WARM_FIRST` on, written to `out` (weights in fp32, the
    tokenizer and its template as they were): every parameter, AdamW at `WARM_LR`, batches of
    `WARM_BATCH`, `WARM_EPOCHS` epochs, the loss the mean over the model's own tokens (the
    calls and the replies); `prompt` is a real episode's prompt, as `capture_tools` takes it.
    Returns what `out/warm_start.json` records."""
    import random

    import torch
    from asyncrl_calculator.arithmetic import questions
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.rollout.chat_tokens import ChatTokens

    start = time.perf_counter()
    tools = capture_tools(model_dir, prompt)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    chat = ChatTokens(tokenizer, int(tokenizer.eos_token_id))
    drawn = list(questions("train", WARM_FIRST + WARM_TASKS))[WARM_FIRST:]
    transcripts = [transcript(chat, tools, e, a) for e, a in drawn]
    torch.manual_seed(WARM_SEED)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                                 dtype=torch.float32)  # fmt: skip
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARM_LR, weight_decay=0.0)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else chat.eos_id)
    order = random.Random(WARM_SEED)
    losses = []
    for epoch in range(WARM_EPOCHS):
        batch_order = list(range(len(transcripts)))
        order.shuffle(batch_order)
        for first in range(0, len(batch_order), WARM_BATCH):
            batch = [transcripts[i] for i in batch_order[first : first + WARM_BATCH]]
            width = max(len(t.ids) for t in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            labels = torch.full((len(batch), width), -100, dtype=torch.long)
            for row, t in enumerate(batch):
                ids[row, : len(t.ids)] = torch.tensor(t.ids)
                mask[row, : len(t.ids)] = 1
                kept = torch.tensor(t.trained)
                labels[row, : len(t.ids)] = torch.where(kept, torch.tensor(t.ids), -100)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            log(f"warm start: epoch {epoch + 1}/{WARM_EPOCHS}, step {len(losses)}, "
                f"loss {losses[-1]:.4f}")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    record = {**warm_settings(model_dir), "losses": losses,
              "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip
    (out / WARM_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return record
