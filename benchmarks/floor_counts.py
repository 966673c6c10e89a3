"""The model of `benchmarks/floor.py`: what a step's matrix products take on this machine.

`Shapes` are the model's products (from its config, LoRA adapters included), `Floor` times
them here at given row counts, `Passes` says what the trainer's passes run over a step's rows,
and `train_part` and `generate_part` put a run's measured seconds against the products of its
own tokens. The run it measures, and what it prints: `benchmarks/floor.py`.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from asyncrl.algos.update import micro_batches
from asyncrl.train.records import read_jsonl

SCALE_ROWS = 2048
"""Products over more rows are timed at this many and scaled (see `Floor._scaled`)."""
BUCKET_ROWS = 128
"""Products over at least this many rows (and at most SCALE_ROWS) are timed at the row count
rounded up to a multiple of it, once, and scaled down by their rows (see `Floor._scaled`)."""
PASS_ROWS = 16
"""The finer bucket of the products timed at each training pass's own rows
(`Floor.at_pass_shapes`): a pass of SmolLM2 runs 80-320 rows, where the rate still grows with
them."""


def best_of(repeats: int, work: Callable[[], Any]) -> float:
    work()  # warm: the first call allocates
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


@dataclass
class Shapes:
    """The model's matrix products: (in, out) of every linear layer of the body, the output
    layer's, and what attention needs."""

    body: list[torch.Tensor]
    head: torch.Tensor
    layers: int
    heads: int
    head_dim: int
    adapters: list[torch.Tensor] = field(default_factory=list)
    """A LoRA run's adapter matrices (A [r, in] and B [out, r] of each adapted layer): they
    train, and the body and the output layer are frozen (no weight gradient)."""

    @classmethod
    def of(cls, model: Any, lora: Any = None) -> Shapes:  # a transformers PreTrainedModel
        """The products of `model`, or with `lora` (a `model.lora` section of rank > 0) of the
        model wrapped in its adapters as the run wraps it."""
        config = model.config
        head = model.get_output_embeddings()
        adapters: list[torch.Tensor] = []
        if lora is not None and lora.rank:
            from asyncrl.models.lora import wrap

            named = list(wrap(model, lora, seed=0).named_modules())
            adapters = [
                m.weight for n, m in named if isinstance(m, torch.nn.Linear) and ".lora_" in n
            ]
            linears = [m for n, m in named if isinstance(m, torch.nn.Linear) and ".lora_" not in n]
        else:
            linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        body = [m.weight for m in linears if m is not head]
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(body, head.weight, config.num_hidden_layers, heads, head_dim, adapters)

    @property
    def frozen(self) -> bool:
        """Whether the body and the output layer are frozen (LoRA): no weight gradients."""
        return bool(self.adapters)

    def linear_flops(self, weights: list[torch.Tensor], rows: int) -> float:
        return 2.0 * rows * sum(w.numel() for w in weights)


class Floor:
    """Times the model's products on this machine (`dtype`, the current thread count)."""

    def __init__(self, shapes: Shapes, dtype: torch.dtype, repeats: int) -> None:
        self.shapes = shapes
        self.dtype = dtype
        self.repeats = repeats
        self.bucket = BUCKET_ROWS
        self.body = [w.detach().to(dtype).contiguous() for w in shapes.body]
        self.head = shapes.head.detach().to(dtype).contiguous()
        self.adapters = [w.detach().to(dtype).contiguous() for w in shapes.adapters]
        self._decode: dict[int, float] = {}
        self._per_row: dict[tuple[Any, ...], float] = {}

    def _scaled(self, kind: str, weights: list[torch.Tensor], rows: int, time_rows: Any) -> float:
        """`time_rows(weights, rows)`: timed as it is below `self.bucket` (BUCKET_ROWS) rows; up
        to SCALE_ROWS, timed once at the rows rounded up to a multiple of the bucket and scaled
        down by the rows (a run's steps then share a few timings: one per bucket, not one per
        step); past SCALE_ROWS, timed at SCALE_ROWS and scaled by the rows (a product's time
        grows linearly there)."""
        timed = SCALE_ROWS if rows > SCALE_ROWS else -(-rows // self.bucket) * self.bucket
        if rows < self.bucket:
            timed = rows
        key = (kind, timed, *map(id, weights))
        if key not in self._per_row:
            self._per_row[key] = time_rows(weights, timed) / timed if timed else 0.0
        return self._per_row[key] * rows

    def at_pass_shapes(self) -> Floor:
        """This floor timing products in buckets of PASS_ROWS rows, so that a training pass's
        products are timed near its own rows (the same weights and timings)."""
        fine = copy.copy(self)
        fine.bucket = PASS_ROWS
        return fine

    def forward_s(self, weights: list[torch.Tensor], rows: int) -> float:
        """The forward products of `weights` over `rows` rows."""
        return self._scaled("forward", weights, rows, self._forward_s)

    def training_s(self, weights: list[torch.Tensor], rows: int, weight_grad: bool = True) -> float:
        """Forward, the input's gradient and (`weight_grad`) the weight's gradient of each
        product."""
        if not weight_grad:
            return self._scaled(
                "frozen", weights, rows, partial(self._training_s, weight_grad=False)
            )
        return self._scaled("training", weights, rows, self._training_s)

    @torch.inference_mode()
    def _forward_s(self, weights: list[torch.Tensor], rows: int) -> float:
        if rows == 0:
            return 0.0
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=self.dtype) for w in weights}
        return best_of(
            self.repeats,
            lambda: [torch.nn.functional.linear(inputs[w.shape[1]], w) for w in weights],
        )

    @torch.inference_mode()
    def _training_s(
        self, weights: list[torch.Tensor], rows: int, weight_grad: bool = True
    ) -> float:
        if rows == 0:
            return 0.0
        x = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=self.dtype) for w in weights}
        dy = {w.shape[0]: torch.randn(rows, w.shape[0], dtype=self.dtype) for w in weights}

        def work() -> None:
            for w in weights:
                torch.nn.functional.linear(x[w.shape[1]], w)
                dy[w.shape[0]] @ w
                if weight_grad:
                    dy[w.shape[0]].t() @ x[w.shape[1]]

        return best_of(self.repeats, work)

    def decode_step_s(self, batch: int) -> float:
        """One decode pass's products (body, output layer, and the adapters where the engine
        runs them) for `batch` samples."""
        if batch not in self._decode:
            self._decode[batch] = self.forward_s([*self.decode_weights(), self.head], batch)
        return self._decode[batch]

    def decode_weights(self) -> list[torch.Tensor]:
        """The body's products a generation pass runs: with adapters in the engine (peft's
        forward on the frozen base) the adapters' too."""
        return [*self.body, *self.adapters]

    def attention_flops(self, pairs: float) -> float:
        """Q.K and attention.V over `pairs` (query, key) pairs, forward, every layer."""
        return 4.0 * pairs * self.shapes.heads * self.shapes.head_dim * self.shapes.layers


@dataclass
class Part:
    name: str
    measured_s: float
    floor_s: float
    flops: float
    tokens: int
    """Completion tokens, over the steps (then per step)."""
    passes_s: float = 0.0
    """Training: the floor's products timed at each pass's own rows, as the trainer pads them
    (`Passes.shapes`), instead of the step's rows at once; the same attention."""

    @property
    def ratio(self) -> float:
        return self.measured_s / self.floor_s if self.floor_s else float("nan")


@dataclass(frozen=True)
class Passes:
    """What the trainer's passes over a step's trained rows are (from the run's config)."""

    micro_batch_size: int = 0
    """`train.micro_batch_size`: consecutive slices of this many rows (0: one of all)."""
    shared_prompts: bool = False
    """`train.shared_prompts`: each distinct prompt of a micro-batch runs once."""
    reference: bool = False
    """`algo.kl_coef` > 0: the KL reference's forward pass over the same tokens."""

    @classmethod
    def of(cls, config: Any) -> Passes:
        return cls(
            config.train.micro_batch_size,
            config.train.shared_prompts,
            getattr(config.algo, "kl_coef", 0.0) > 0,
        )

    def tokens(self, rows: list[tuple[int, int, int]]) -> tuple[int, int, float]:
        """For `rows` (dataset index, prompt tokens, completion tokens) in the trainer's order:
        the tokens through the body, through the output layer, and the (query, key) pairs of
        causal attention, over the micro-batches."""
        body, head, pairs = 0, 0, 0.0
        for cut in micro_batches(len(rows), self.micro_batch_size):  # the trainer's own cut
            part = rows[cut]
            head += sum(c for _, _, c in part)
            if not self.shared_prompts:
                body += sum(p + c for _, p, c in part)
                pairs += sum((p + c) * (p + c + 1) / 2 for _, p, c in part)
                continue
            distinct = [r for i, r in enumerate(part) if i == 0 or part[i - 1][0] != r[0]]
            body += sum(p for _, p, _ in distinct) + sum(c for _, _, c in part)
            pairs += sum(p * (p + 1) / 2 for _, p, _ in distinct)  # each prompt's own pass
            pairs += sum(c * p + c * (c + 1) / 2 for _, p, c in part)  # the completions'
        return body, head, pairs

    def shapes(self, rows: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
        """For `rows` (dataset index, prompt tokens, completion tokens) in the trainer's order,
        each pass's (rows through the body as the pass pads them, completion tokens through
        the output layer): with `shared_prompts`, a micro-batch's prompt pass (its distinct
        prompts left-padded to the longest) and its completion pass (every row up to the
        longest completion but its last token, `used_width`); else one pass of every row
        padded to the longest prompt plus the longest completion."""
        shapes = []
        for cut in micro_batches(len(rows), self.micro_batch_size):
            part = rows[cut]
            longest = max(c for _, _, c in part)
            head = sum(c for _, _, c in part)
            if not self.shared_prompts:
                shapes.append((len(part) * (max(p for _, p, _ in part) + longest), head))
                continue
            distinct = [r for i, r in enumerate(part) if i == 0 or part[i - 1][0] != r[0]]
            shapes.append((len(distinct) * max(p for _, p, _ in distinct), 0))
            shapes.append((len(part) * (longest - 1), head))
        return shapes


def train_part(
    run: Path,
    steps: list[dict[str, Any]],
    lengths: list[int],
    floor: Floor,
    passes: Passes = Passes(),
) -> Part:
    """Training over `steps` (their metrics records) against the products of their tokens,
    counted as `passes` runs them; and (`Part.passes_s`) the same products at each pass's own
    rows."""
    measured = sum(r["train_s"] for r in steps)
    floor_s, flops, tokens, passes_s = 0.0, 0.0, 0, 0.0
    fine = floor.at_pass_shapes()
    spans = completions_by_ordinal(run)
    shapes = floor.shapes
    trains = not shapes.frozen  # the body's and the output layer's weight gradients
    per_token = 3 if trains else 2  # forward, input gradient (, weight gradient)
    for record in steps:
        rows = []
        skipped = set(record.get("skipped_ordinals", ()))
        for ordinal, index in zip(
            record["prompt_ordinals"], record["dataset_indices"], strict=True
        ):
            if ordinal not in skipped:  # the trainer's order: a group's shortest rows first
                rows += [(index, lengths[index], n) for n in sorted(spans[ordinal])]
        if "trained_rows" in record and len(rows) != record["trained_rows"]:
            raise SystemExit(
                f"{run}: step {record['step']} trained {record['trained_rows']:.0f} rows but "
                f"its groups less `skipped_ordinals` have {len(rows)} (a run from before the "
                "record named the groups left out?)"
            )
        if not rows:  # every group skipped (no reward variance): no product ran, none counted
            continue
        body_rows, head_rows, pairs = passes.tokens(rows)
        tokens += head_rows
        body_flops = per_token * shapes.linear_flops(shapes.body, body_rows)
        step_flops = (
            body_flops
            + per_token * shapes.linear_flops([shapes.head], head_rows)
            + 3 * shapes.linear_flops(shapes.adapters, body_rows)
        )
        body_s = floor.training_s(floor.body, body_rows, trains)
        rate = body_flops / body_s
        attention = 3 * floor.attention_flops(pairs)
        if passes.reference:  # the frozen reference's forward (adapters off, in a LoRA run)
            attention += floor.attention_flops(pairs)
            step_flops += shapes.linear_flops(shapes.body, body_rows) + shapes.linear_flops(
                [shapes.head], head_rows
            )
        floor_s += attention / rate
        floor_s += products_s(floor, body_rows, head_rows, trains, passes.reference)
        passes_s += attention / rate
        for body, head in passes.shapes(rows):
            passes_s += products_s(fine, body, head, trains, passes.reference)
        flops += step_flops + attention
    return Part("train", measured, floor_s, flops, tokens, passes_s)


def products_s(floor: Floor, body: int, head: int, trains: bool, reference: bool) -> float:
    """A training pass's products over `body` rows through the body and `head` through the
    output layer: forward and backward (the weights' gradients where they `trains`, else the
    adapters' over the body's rows), and (`reference`) the KL reference's forward."""
    seconds = floor.training_s(floor.body, body, trains) + floor.training_s(
        [floor.head], head, trains
    )
    if floor.adapters:
        seconds += floor.training_s(floor.adapters, body)
    if reference:
        seconds += floor.forward_s(floor.body, body) + floor.forward_s([floor.head], head)
    return seconds


def completions_by_ordinal(run: Path) -> dict[int, list[int]]:
    """Each group's completion lengths (the sum over its chunks), by prompt ordinal."""
    found: dict[int, list[int]] = {}
    for span in read_jsonl(run / "timeline.jsonl"):
        if span["kind"] != "generate":
            continue
        for ordinal, counts in zip(span["ordinals"], span["token_counts"], strict=True):
            before = found.get(ordinal, [0] * len(counts))
            found[ordinal] = [a + b for a, b in zip(before, counts, strict=True)]
    return found


def generate_part(spans: list[dict[str, Any]], prompts: dict[int, int], floor: Floor) -> Part:
    """The generate calls `spans` against an ideal decode of the same samples."""
    measured = sum(s["seconds"] for s in spans)
    floor_s, flops, tokens = 0.0, 0.0, 0
    decode_shapes = [*floor.shapes.body, *floor.shapes.adapters]
    for span in spans:
        lengths = [prompts[o] for o in span["ordinals"]]
        samples = [
            (p, n) for p, counts in zip(lengths, span["token_counts"], strict=True) for n in counts
        ]
        tokens += sum(n for _, n in samples)
        prefill = sum(lengths)
        body_s = floor.forward_s(floor.decode_weights(), prefill)
        prefill_s = body_s + floor.forward_s([floor.head], len(lengths))
        prefill_flops = floor.shapes.linear_flops(decode_shapes, prefill)
        rate = prefill_flops / max(body_s, 1e-9)
        attention = floor.attention_flops(sum(p * (p + 1) / 2 for p in lengths))
        longest = max((n for _, n in samples), default=0)
        decode_s, decode_flops, pairs = 0.0, 0.0, 0.0
        for k in range(1, longest):  # the forward pass over token k-1 gives token k's logits
            alive = [(p, n) for p, n in samples if n > k]
            decode_s += floor.decode_step_s(len(alive))
            decode_flops += floor.shapes.linear_flops(
                [*decode_shapes, floor.shapes.head], len(alive)
            )
            pairs += sum(p + k for p, _ in alive)
        attention += floor.attention_flops(pairs)
        floor_s += prefill_s + decode_s + attention / rate
        flops += prefill_flops + decode_flops + attention
    return Part("generate", measured, floor_s, flops, tokens)
