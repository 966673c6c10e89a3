"""benchmarks/prompt_styles.py on a scratch model: each style's overrides reach the evaluation
(a style with demonstrations is evaluated on prompts that have them, a longer limit lets the
completions run longer), and the last line names the style with the best pass@1."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import datasets
import pytest
import yaml

from asyncrl.models.scratch import save_scratch_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import prompt_styles


def test_each_style_is_evaluated_with_its_overrides_and_the_best_is_named_last(tmp_path, capsys):
    model = save_scratch_model(tmp_path / "model", arch="qwen2", seed=1)
    rows = [
        {"messages": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b),
         "solution": f"{a} + {b} = {a + b}, so \\boxed{{{a + b}}}."}
        for a in range(5) for b in range(5)
    ]  # fmt: skip
    data = tmp_path / "sums.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(data))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": str(model)},
        "data": {"task": "hf", "path": str(data), "messages_key": "messages", "reward_fn": "math"},
        "rollout": {"max_new_tokens": 4, "temperature": 0.5, "dtype": "float32"},
        "eval": {"path": str(data), "num_samples": 0, "batch_prompts": 8},
    }))  # fmt: skip
    seen: list[tuple[int, int]] = []
    measure = prompt_styles.measure

    def spy(path, overrides, examples, samples):
        from asyncrl.config.keys import load_config
        from asyncrl.rollout.evaluation import eval_examples

        held_out = eval_examples(load_config(path, overrides))
        seen.append((len(held_out[0].messages or ()), load_config(path, overrides).rollout
                     .max_new_tokens))  # fmt: skip
        return measure(path, overrides, examples, samples)

    prompt_styles.measure = spy
    try:
        prompt_styles.main([
            "--config", str(config), "--examples", "6", "--samples", "2",
            "--style", "plain=", "--style", "long=rollout.max_new_tokens=12",
            "--style", "shown=data.fewshot=1 data.fewshot_key=solution",
        ])  # fmt: skip
    finally:
        prompt_styles.measure = measure
    assert seen == [(1, 4), (1, 12), (3, 4)]
    lines = capsys.readouterr().out.strip().splitlines()
    figures = {}
    for name, line in zip(("plain", "long", "shown"), lines[:3], strict=True):
        m = re.fullmatch(
            rf"{name}: pass@1 ([\d.]+) \(\+-[\d.]+\) pass@2 [\d.]+ greedy [\d.]+ tokens "
            r"([\d.]+) of (\d+), \d+ s",
            line,
        )
        assert m, line
        figures[name] = float(m[1])
        assert 0 < float(m[2]) <= int(m[3])
    best = max(figures, key=lambda k: figures[k])
    assert lines[-1].startswith(f"prompt_styles: best {best} pass@1 {figures[best]:.3f}")
    with pytest.raises(SystemExit):
        prompt_styles.main(["--config", str(config)])  # a style is required
