"""A batch of `GenerationRequest`s as the requests a vLLM engine sends, and what comes back as
`GenerationOutput`s: shared by vLLM in process (`vllm_engine.py`) and on servers
(`vllm_server.py`). Plain data and arithmetic: unit-tested without vLLM (tests/test_jobs.py).

A fresh request is one job with n = G samples and seed = its noise seed (vLLM gives sample i
seed + i). A continued sample (partial generations, an episode's next turn) is a job of its own
over prompt + prefix, n = 1, seeded by (noise seed, sample, tokens so far): wherever a sample
was cut, its next token draws the same noise. Each job ends its samples at EOS or at `end`
tokens (`max_new_tokens`, or an episode turn's limit: `GenerationRequest.limits`). A job cut
short (a server died mid-stream) continues the same way from the tokens that arrived:
`continue_job`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.core.seeds import continued_seed
from asyncrl.rollout.engine import GenerationOutput, GenerationRequest


@dataclass(frozen=True)
class Job:
    """One engine request: `samples` of request `request`, over its prompt and, for a
    continued sample (n = 1), that sample's tokens so far; at most `max_tokens` new tokens
    each."""

    request: int
    samples: tuple[int, ...]
    prompt_ids: tuple[int, ...]
    prefix: tuple[int, ...]
    """A continued sample's tokens so far (n = 1); () for a fresh request."""
    seed: int
    max_tokens: int
    noise_seed: int
    end: int
    """The length (prefix included) at which its samples end in this call: `max_new_tokens`,
    or an episode turn's limit (`GenerationRequest.limits`); reported finished there."""

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def prompt(self) -> list[int]:
        """The token ids the engine is given."""
        return list(self.prompt_ids + self.prefix)


Piece = tuple[list[int], list[float], bool]
"""What a job gave one sample: new token ids, their log-probs, and whether it ended."""


def plan_jobs(
    requests: list[GenerationRequest], max_new_tokens: int, max_tokens: int | None
) -> tuple[list[Job], list[list[bool]]]:
    """The jobs of a batch, and per request the samples with nothing to generate (finished,
    or at their limit: `GenerationRequest.done_before`)."""
    jobs: list[Job] = []
    done_before: list[list[bool]] = []
    for index, request in enumerate(requests):
        g = request.num_samples
        done = request.done_before(max_new_tokens)
        done_before.append(done)
        prompt = tuple(request.prompt_ids)
        ends = [request.limit(i, max_new_tokens) for i in range(g)]
        if not request.prefixes and len(set(ends)) == 1:  # one job, seeded as a group
            if not all(done):
                budget = min(max_tokens or ends[0], ends[0])
                jobs.append(Job(index, tuple(range(g)), prompt, (), request.noise_seed, budget,
                                request.noise_seed, ends[0]))  # fmt: skip
            continue
        # continued samples, and first turns whose limits differ: one job per sample
        for i in range(g):
            if not done[i]:
                prefix = tuple(request.prefixes[i]) if request.prefixes else ()
                room = ends[i] - len(prefix)
                jobs.append(_continued(index, i, prompt, prefix, request.noise_seed,
                                       min(max_tokens or room, room), ends[i]))  # fmt: skip
    return jobs, done_before


def _continued(
    request: int, sample: int, prompt: tuple[int, ...], prefix: tuple[int, ...],
    noise_seed: int, budget: int, end: int,
) -> Job:  # fmt: skip
    seed = continued_seed(noise_seed, sample, len(prefix))
    return Job(request, (sample,), prompt, prefix, seed, budget, noise_seed, end)


def continue_job(job: Job, received: dict[int, Piece]) -> list[Job]:
    """What is left of `job` after its stream stopped with `received` (per sample: the tokens
    that arrived, and whether the sample ended): one continued job per unfinished sample, from
    its last received token, with the rest of the job's budget. No received token is asked
    for again."""
    rest: list[Job] = []
    for sample in job.samples:
        ids, _, ended = received.get(sample, ([], [], False))
        if not ended and len(ids) < job.max_tokens:
            prefix = job.prefix + tuple(ids)
            rest.append(_continued(job.request, sample, job.prompt_ids, prefix, job.noise_seed,
                                   job.max_tokens - len(ids), job.end))  # fmt: skip
    return rest


def merge_pieces(first: Piece, then: Piece) -> Piece:
    """A sample's tokens from a job, then from its continuation."""
    return first[0] + then[0], first[1] + then[1], then[2]


def assemble_output(
    request: GenerationRequest,
    samples: dict[int, Piece],
    done_before: list[bool],
    version: int,
    pad_id: int,
) -> GenerationOutput:
    """The `GenerationOutput` of one request: each sample's new tokens, padded."""
    g = request.num_samples
    width = max((len(ids) for ids, _, _ in samples.values()), default=0)
    tokens = torch.full((g, width), pad_id, dtype=torch.long)
    mask = torch.zeros((g, width), dtype=torch.bool)
    logprobs = torch.zeros((g, width), dtype=torch.float32)
    finished = torch.tensor(done_before, dtype=torch.bool)
    for i, (ids, lps, ended) in samples.items():
        tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[i, : len(ids)] = True
        logprobs[i, : len(ids)] = torch.tensor(lps, dtype=torch.float32)
        finished[i] = ended
    return GenerationOutput(tokens, mask, logprobs, version, finished)


def sample_ended(ids: list[int], so_far: int, eos_id: int, end: int) -> bool:
    """A sample ends at EOS or at `end` tokens in all (its prefix included: `Job.end`, the
    run's `max_new_tokens` or its episode turn's limit)."""
    return bool(ids and ids[-1] == eos_id) or so_far + len(ids) >= end
