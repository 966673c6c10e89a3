"""How often the initial model answers right under each prompt style: the evidence a recipe
search starts from (issue 66), before any training.

    .venv/bin/python benchmarks/prompt_styles.py \\
        --style "zero-shot=" \\
        --style "zero-shot 160=rollout.max_new_tokens=160" \\
        --style "fewshot 1=data.fewshot=1 data.fewshot_key=solution" \\
        --set data.path=data/word_problems/train.parquet --set eval.path=...

Each style is `NAME=OVERRIDES` (space-separated `section.key=value`, applied after `--set`'s
on `--config`). For each, the config's initial model (`model.path`, fp32, no adapters) is
evaluated as a run evaluates (`asyncrl.rollout.evaluation`: the same prompts, chat template
and reward) on the first `--examples` rows of `eval.path`: `--samples` samples a prompt at
`rollout.temperature` (the temperature the run samples at) and the greedy decode. A style
whose samples are never right gives GRPO's groups nothing to learn from. Prints one line per
style, then last:

    prompt_styles: best NAME pass@1 P (greedy G, tokens T of M)
"""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

import torch

from asyncrl.config.keys import load_config
from asyncrl.models.device import bound_onednn_cache
from asyncrl.models.policy import load_pretrained_policy
from asyncrl.rollout.evaluation import build_evaluator, task_reward_pool
from asyncrl.tasks.source import load_task

ROOT = Path(__file__).resolve().parents[1]


def measure(config_path: Path, overrides: list[str], examples: int, samples: int) -> dict:
    config = load_config(config_path, overrides)
    probe = [
        f"eval.max_examples={examples}",
        f"eval.num_samples={samples}",
        f"eval.temperature={config.rollout.temperature}",
        "eval.greedy=true",
    ]
    config = load_config(config_path, overrides + probe)
    torch.manual_seed(0)
    policy = load_pretrained_policy(config.model.path)
    task = load_task(config.data)
    pool = task_reward_pool(task, config.rollout)
    try:
        evaluator = build_evaluator(config, policy, task, pool)
        metrics = evaluator.evaluate(0, policy.model.state_dict())
    finally:
        pool.close()
    metrics["max_new_tokens"] = float(config.rollout.max_new_tokens)
    return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs/smol_math.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--style", action="append", required=True, metavar="NAME=OVERRIDES")
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    args = parser.parse_args(argv)
    bound_onednn_cache()
    results = []
    for style in args.style:
        name, _, extra = style.partition("=")
        start = time.perf_counter()
        m = measure(args.config, args.set + shlex.split(extra), args.examples, args.samples)
        results.append((name, m))
        print(
            f"{name}: pass@1 {m['eval/pass@1']:.3f} (+-{m['eval/stderr/pass@1']:.3f}) "
            f"pass@{args.samples} {m[f'eval/pass@{args.samples}']:.3f} greedy "
            f"{m['eval/greedy_pass']:.3f} tokens {m['eval/completion_tokens']:.1f} of "
            f"{m['max_new_tokens']:.0f}, {time.perf_counter() - start:.0f} s",
            flush=True,
        )
    name, m = max(results, key=lambda r: r[1]["eval/pass@1"])
    print(
        f"prompt_styles: best {name} pass@1 {m['eval/pass@1']:.3f} (greedy "
        f"{m['eval/greedy_pass']:.3f}, tokens {m['eval/completion_tokens']:.1f} of "
        f"{m['max_new_tokens']:.0f})"
    )


if __name__ == "__main__":
    main()
