"""Evaluation: the current weights on prompts training never sees, without disturbing training.

Every `eval.every_steps` steps the trainer hands the weights it just published to an
`Evaluator`, which generates `eval.num_samples` samples per evaluation prompt (and one greedy
decode) on a private engine copy, scores them with the run's reward, and returns `eval/...`
metrics for the step's record. It takes no ordinal from the stream, touches no buffer or
ledger, and draws its noise from its own per-prompt seeds (the same at every evaluation, so
curves compare like with like) through private generators: a deterministic run trains the
same bits with evaluation on or off (a test checks it).

Metrics: `eval/reward_mean` (all samples), `eval/pass@1` (mean share of a prompt's samples
that pass: reward >= `eval.pass_threshold`), `eval/pass@k` (share of prompts with a passing
sample among k), `eval/greedy_reward`, `eval/greedy_pass`, `eval/reward/NAME` per reward
component, `eval/completion_tokens`, `eval/reward_failures` (reward calls that failed: their
samples count 0 and do not pass), `eval/num_examples`, `eval/seconds`, and the standard errors
over prompts of pass@1 and the greedy pass rate (`eval/stderr/pass@1`,
`eval/stderr/greedy_pass`). `eval.num_samples=0` decodes greedily only (no `eval/reward_mean`
or `eval/pass@...`; every evaluation has `eval/num_examples`). With `eval.at_start` the
initial weights are evaluated too, before the first step (an `eval` event with `version` 0).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.config import Config, ConfigError, RolloutConfig
from asyncrl.core.seeds import eval_seed
from asyncrl.core.types import PromptTicket
from asyncrl.models.device import DTYPES
from asyncrl.models.policy import Policy
from asyncrl.rollout.engine import EngineSpec, GenerationRequest
from asyncrl.rollout.reward_pool import RewardPool
from asyncrl.rollout.scorer import Scored, Scorer
from asyncrl.rollout.torch_engine import TorchGenerationEngine
from asyncrl.rollout.weight_sync import CopyWeightSync
from asyncrl.tasks.examples import Example, Task, examples_sha256
from asyncrl.tasks.prompts import encode_prompts
from asyncrl.tasks.source import read_jsonl_examples, sort_digits_examples


def eval_examples(config: Config) -> list[Example]:
    """The evaluation prompts: `eval.path` (read as `data.task` reads), else `data.path`'s
    split `eval.split`, else for `sort_digits` a generated set without any training prompt
    (256 rows, or `eval.max_examples`); the first `eval.max_examples` of them if set."""
    data, ev = config.data, config.eval
    limit = ev.max_examples
    if data.task == "sort_digits" and not ev.path:
        training = {e.prompt for e in sort_digits_examples(data.num_digits, data.num_examples)}
        wanted = limit or 256
        drawn = sort_digits_examples(data.num_digits, 4 * wanted + 64, held_out=True)
        examples = [e for e in drawn if e.prompt not in training][:wanted]
        if not examples:
            raise ConfigError(
                f"eval.path: every held-out sort_digits prompt is a training prompt too "
                f"(data.num_digits={data.num_digits} allows only 10^{data.num_digits}); give "
                "evaluation prompts as eval.path"
            )
    elif data.task == "jsonl" or (data.task == "sort_digits" and ev.path):
        if not ev.path:
            raise ConfigError("eval.path: required with data.task=jsonl (a .jsonl file)")
        examples = read_jsonl_examples(ev.path)
    else:
        from asyncrl.tasks.hf_data import read_hf_examples, with_fewshot

        if ev.path:
            split = "train" if Path(ev.path).is_file() else ev.split  # a file is one split
            examples = read_hf_examples(data, ev.path, split, "eval.path", limit)
        elif Path(data.path).is_file():
            raise ConfigError(
                f"eval.path: data.path {data.path} is one file (split train only); give the "
                "evaluation prompts as eval.path"
            )
        else:
            examples = read_hf_examples(data, data.path, ev.split, "eval.split", limit)
        return with_fewshot(data, examples, "eval")
    return examples[:limit] if limit else examples


class EvaluationGivenUp(Exception):
    """A preemption notice came during the evaluation (`Evaluator.give_up`): it was given up,
    its figures are not reported. A resume does not evaluate those weights again; `asyncrl
    eval DIR --checkpoint step_N` gives the same figures (the same prompts and seeds)."""


@dataclass
class PromptResult:
    """One evaluation prompt's samples: rewards [k], reward components, generated tokens, and
    whether its reward call failed (then the rewards are zeros)."""

    rewards: torch.Tensor
    components: dict[str, torch.Tensor]
    tokens: int
    failed: bool = False


class Evaluator:
    """Evaluates weights on `examples` with a private copy of `model` (the architecture; the
    weights come with each `evaluate` call), on `train.device` (the driver's, where the
    trainer's weights are, whatever the backend) in `rollout.dtype`."""

    def __init__(
        self,
        config: Config,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        task: Task,
        examples: Sequence[Example],
        pool: RewardPool,
        eos_id: int,
        pad_id: int,
    ) -> None:
        self.config = config.eval
        self.seed = config.run.seed
        self.max_num_steps = config.run.max_num_steps
        rollout = config.rollout
        max_len = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.prompts = encode_prompts(list(examples), tokenizer, rollout.max_new_tokens, max_len)
        self.scorer = Scorer(task, tokenizer, pool, examples)
        self.identity = {"num_rows": len(examples), "data_sha256": examples_sha256(list(examples))}
        """What the evaluation prompts are: in the trainer's checkpoint part, so a resume can
        tell the eval figures before and after it apart (refused in deterministic mode)."""
        device = config.train.device
        self.weights = CopyWeightSync(1, device, DTYPES[rollout.dtype])
        spec = EngineSpec(
            model,
            eos_id,
            pad_id,
            rollout.max_new_tokens,
            self.config.temperature,
            device,
            rollout.dtype,
            keep_cache_between_chunks=False,
        )
        self.engine = TorchGenerationEngine(spec, self.weights)
        self.given_up = False

    def give_up(self) -> None:
        """Ends the evaluation in progress at the token being sampled, and every later one at
        once (`EvaluationGivenUp`): a preemption notice, the run is stopping. From a signal
        handler or any thread: it only sets flags."""
        self.given_up = True
        self.engine.stop_generating()

    def due(self, version: int) -> bool:
        """Whether weights `version` (after step version-1) are evaluated: every
        `every_steps`-th, and the last."""
        every = self.config.every_steps
        return bool(every) and (version % every == 0 or version == self.max_num_steps)

    def evaluate(self, version: int, weights: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """The `eval/...` metrics of `weights` (published to the private engine as `version`).
        Raises `EvaluationGivenUp` once `give_up` was called."""
        start = time.perf_counter()
        self._check()
        self.weights.publish(version, weights)
        k = self.config.num_samples
        metrics = {"eval/reward_failures": 0.0}
        if k:
            metrics = self._summary(self._run(version, k, self.config.temperature), k)
        if self.config.greedy:
            greedy = self._run(version, 1, 0.0)
            rewards = torch.cat([p.rewards for p in greedy])
            passes = torch.cat([self._passes(p) for p in greedy])
            if not k:  # the greedy decode alone: its completions' counts and components
                metrics = {**self._summary(greedy, 1), **metrics}
                for key in ("eval/reward_mean", "eval/pass@1", "eval/stderr/pass@1"):
                    metrics.pop(key)  # sampled figures: there are none
            metrics["eval/greedy_reward"] = float(rewards.mean())
            metrics["eval/greedy_pass"] = float(passes.float().mean())
            metrics["eval/stderr/greedy_pass"] = standard_error(passes.float())
            metrics["eval/reward_failures"] += sum(p.failed for p in greedy)
        metrics["eval/seconds"] = time.perf_counter() - start
        return metrics

    def _summary(self, sampled: list[PromptResult], k: int) -> dict[str, float]:
        rewards = torch.stack([p.rewards for p in sampled])  # [prompts, k]
        passes = torch.stack([self._passes(p) for p in sampled]).float()
        metrics = {
            "eval/reward_mean": float(rewards.mean()),
            "eval/pass@1": float(passes.mean()),
            "eval/stderr/pass@1": standard_error(passes.mean(1)),
            f"eval/pass@{k}": float((passes.sum(1) > 0).float().mean()),
            "eval/completion_tokens": sum(p.tokens for p in sampled) / rewards.numel(),
            "eval/reward_failures": float(sum(p.failed for p in sampled)),
            "eval/num_examples": float(len(sampled)),
        }
        for name in sorted({n for p in sampled for n in p.components}):
            parts = [p.components[name] for p in sampled if name in p.components]
            metrics[f"eval/reward/{name}"] = float(torch.cat(parts).mean())
        return metrics

    def _passes(self, result: PromptResult) -> torch.Tensor:
        """[k] bool: the samples whose `correct` component (when the reward has one: a format
        bonus is no pass), or else reward, reaches `eval.pass_threshold`."""
        scores = result.components.get("correct", result.rewards)
        return scores >= self.config.pass_threshold

    def _run(self, version: int, samples: int, temperature: float) -> list[PromptResult]:
        """Every evaluation prompt's `samples` samples at `temperature` (0: greedy), scored."""
        out: list[PromptResult] = []
        batch = self.config.batch_prompts
        with self._temperature(temperature):
            for first in range(0, len(self.prompts), batch):
                indices = list(range(first, min(first + batch, len(self.prompts))))
                requests = [
                    GenerationRequest(self.prompts[i], samples, eval_seed(self.seed, i))
                    for i in indices
                ]
                outputs = self.engine.generate(requests, version)
                self._check()  # before scoring: a given-up batch's samples are cut short
                tickets = [PromptTicket(-1 - i, -1, 0, i, i) for i in indices]  # no ordinal
                results = self.scorer.results(list(zip(tickets, outputs, strict=True)))
                for result, output in zip(results, outputs, strict=True):
                    tokens = int(output.completion_mask.sum())
                    if isinstance(result, Scored):
                        out.append(PromptResult(result.rewards, result.components, tokens))
                    else:  # counted, scored as failed: an evaluation never stops training
                        out.append(PromptResult(torch.zeros(samples), {}, tokens, failed=True))
        return out

    def _check(self) -> None:
        if self.given_up:
            raise EvaluationGivenUp("given up at a preemption notice")

    @contextlib.contextmanager
    def _temperature(self, temperature: float) -> Iterator[None]:
        """The engine samples at `temperature` inside the block (0: greedy)."""
        saved, self.engine.temperature = self.engine.temperature, temperature
        try:
            yield
        finally:
            self.engine.temperature = saved


def task_reward_pool(task: Task, rollout: RolloutConfig) -> RewardPool:
    """The pool that scores `task`'s reward as `rollout.reward_workers` and
    `rollout.reward_timeout_s` say (training's and evaluation's share one)."""
    return RewardPool(
        task.reward_target, task.reward_kwargs, rollout.reward_workers, rollout.reward_timeout_s
    )


def build_evaluator(config: Config, policy: Policy, task: Task, pool: RewardPool) -> Evaluator:
    """The evaluation of `config.eval` over `eval_examples(config)`, scoring with `pool`."""
    return Evaluator(
        config,
        policy.model,
        policy.tokenizer,
        task,
        eval_examples(config),
        pool,
        policy.eos_id,
        policy.pad_id,
    )


def standard_error(per_prompt: torch.Tensor) -> float:
    """The standard error of the mean of one value per prompt (the prompts are the sample):
    `std / sqrt(n)`, 0 for one prompt."""
    n = per_prompt.numel()
    return float(per_prompt.std(unbiased=True) / n**0.5) if n > 1 else 0.0


def is_eval_record(record: Mapping[str, object]) -> bool:
    """Whether a step record holds an evaluation (a greedy-only one has no `eval/reward_mean`)."""
    return any(key.startswith("eval/") for key in record)


def eval_line(record: Mapping[str, float]) -> str:
    """One line for the terminal: a step record's evaluation results."""
    passes = " ".join(
        f"{key[5:]}={record[key]:.3f}" for key in record if key.startswith("eval/pass@")
    )
    greedy = f" greedy={record['eval/greedy_reward']:.3f}" if "eval/greedy_reward" in record else ""
    reward = f"reward={record['eval/reward_mean']:.3f} " if "eval/reward_mean" in record else ""
    when = "of the initial weights" if record["step"] < 0 else f"after step {record['step']}"
    return (
        f"eval {when}: {reward}{passes}{greedy} ({int(record['eval/num_examples'])} prompts, "
        f"{record['eval/seconds']:.1f} s)"
    ).replace(":  ", ": ")
