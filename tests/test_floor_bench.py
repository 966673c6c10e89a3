"""benchmarks/floor.py's counting: the model's products from its config, an ideal decode that
runs only the samples still generating, and a group's completion summed over its chunks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrl.config import LoraConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from floor import busy_shares, covered
from floor_counts import (
    Floor,
    Passes,
    Shapes,
    completions_by_ordinal,
    generate_part,
    train_part,
)

H, INTER, LAYERS, HEADS, KV, VOCAB = 16, 32, 2, 4, 2, 50


def tiny() -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV, vocab_size=VOCAB, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def test_the_products_are_the_models_linear_layers_counted_from_its_config():
    shapes = Shapes.of(tiny())
    head_dim = H // HEADS
    per_layer = 2 * H * H + 2 * H * KV * head_dim + 3 * H * INTER  # q, o; k, v; gate, up, down
    assert len(shapes.body) == 7 * LAYERS
    assert shapes.linear_flops(shapes.body, 10) == 2 * 10 * LAYERS * per_layer
    assert tuple(shapes.head.shape) == (VOCAB, H)  # the tied output layer, counted apart
    assert (shapes.layers, shapes.heads, shapes.head_dim) == (LAYERS, HEADS, head_dim)


def write_timeline(run: Path, spans: list[dict[str, object]]) -> None:
    (run / "timeline.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))


class CountingFloor(Floor):
    """A decode pass "takes" as many seconds as it has samples; every prefill takes none."""

    def decode_step_s(self, batch: int) -> float:
        return float(batch)

    def forward_s(self, weights: list[torch.Tensor], rows: int) -> float:
        return 0.0


def test_the_ideal_decode_runs_only_the_samples_still_generating():
    floor = CountingFloor(Shapes.of(tiny()), torch.float32, repeats=1)
    span = {"seconds": 9.0, "ordinals": [4, 5], "token_counts": [[3, 1], [2]]}
    part = generate_part([span], {4: 7, 5: 6}, floor)
    # the prefill gives each sample's first token; then passes 1 and 2 run the samples longer
    # than 1 (two: 3 and 2 tokens) and longer than 2 (one): 3 sample-passes in all
    assert part.tokens == 6
    assert part.measured_s == 9.0
    # plus the attention's FLOPs at the prefill's rate (a prefill of no time: a vanishing share)
    assert part.floor_s == pytest.approx(3.0, abs=1e-6)
    assert part.flops > floor.shapes.linear_flops(floor.shapes.body, 7 + 6)


def test_a_groups_completion_is_summed_over_its_chunks(tmp_path):
    spans = [
        {"kind": "generate", "ordinals": [0, 1], "token_counts": [[4, 4], [4, 2]]},
        {"kind": "train", "step": 0},
        {"kind": "generate", "ordinals": [0], "token_counts": [[3, 0]]},
    ]
    write_timeline(tmp_path, spans)
    assert completions_by_ordinal(tmp_path) == {0: [7, 4], 1: [4, 2]}


class RowCountingFloor(Floor):
    """A training product "takes" a second per row (two thirds without the weight's gradient,
    a third forward alone), whatever its weights."""

    def training_s(self, weights: list[torch.Tensor], rows: int, weight_grad: bool = True) -> float:
        return float(rows) if weight_grad else 2 * rows / 3

    def forward_s(self, weights: list[torch.Tensor], rows: int) -> float:
        return rows / 3


def test_the_training_floor_counts_only_the_rows_trained(tmp_path):
    spans = [{"kind": "generate", "ordinals": [0, 1], "token_counts": [[4, 4], [3, 5]]}]
    write_timeline(tmp_path, spans)
    floor = RowCountingFloor(Shapes.of(tiny()), torch.float32, repeats=1)
    step = {"step": 0, "train_s": 1.0, "prompt_ordinals": [0, 1], "dataset_indices": [0, 1]}
    lengths = [10, 20]  # prompt tokens of dataset rows 0 and 1
    whole = train_part(tmp_path, [step], lengths, floor)
    assert whole.tokens == 16
    skipping = {**step, "trained_rows": 2.0, "skipped_ordinals": [0]}
    part = train_part(tmp_path, [skipping], lengths, floor)
    assert part.tokens == 8  # group 1's completions alone
    # body rows 2 x 20 + 8, head rows 8, plus attention at the body's rate: rows of 23 and 25
    shapes = floor.shapes
    attention = floor.attention_flops(23 * 24 / 2 + 25 * 26 / 2) / shapes.linear_flops(
        shapes.body, 1
    )
    assert part.floor_s == pytest.approx(48 + 8 + attention)
    with pytest.raises(SystemExit, match="trained 4 rows"):
        train_part(tmp_path, [{**skipping, "trained_rows": 4.0}], lengths, floor)


def test_a_step_whose_every_group_was_skipped_adds_nothing_to_the_training_floor(tmp_path):
    spans = [{"kind": "generate", "ordinals": [0, 1], "token_counts": [[4, 4], [3, 5]]}]
    write_timeline(tmp_path, spans)
    floor = RowCountingFloor(Shapes.of(tiny()), torch.float32, repeats=1)
    step = {"step": 0, "train_s": 1.0, "prompt_ordinals": [0, 1], "dataset_indices": [0, 1]}
    lengths = [10, 20]
    none = {**step, "step": 1, "train_s": 0.01, "trained_rows": 0.0, "skipped_ordinals": [0, 1]}
    both = train_part(tmp_path, [step, none], lengths, floor)  # divided by zero before
    alone = train_part(tmp_path, [step], lengths, floor)
    assert (both.floor_s, both.flops, both.tokens) == (alone.floor_s, alone.flops, alone.tokens)
    assert both.measured_s == pytest.approx(1.01)


def test_the_busy_shares_are_the_union_and_the_overlap_of_the_two_sides_work():
    assert covered([(0, 2), (1, 3), (5, 6)], 0, 10) == 4
    assert covered([(-5, 1), (9, 20)], 0, 10) == 2  # clipped to the window
    assert covered([], 0, 10) == 0
    # steps 1-2 run from the end of step 0's pass (t=10) to the end of step 2's (t=30):
    # training 10-14 and 20-30, generating 12-18 and 19-25: nobody works from 18 to 19, so a
    # side works 10-18 and 19-30 = 19 s of 20; both at once 12-14 and 20-25 = 7 s
    timeline = [
        {"kind": "train", "step": 0, "start": 0.0, "seconds": 10.0},
        {"kind": "generate", "start": 12.0, "seconds": 6.0},
        {"kind": "train", "step": 1, "start": 10.0, "seconds": 4.0},
        {"kind": "generate", "start": 19.0, "seconds": 6.0},
        {"kind": "train", "step": 2, "start": 20.0, "seconds": 10.0},
    ]
    either, both = busy_shares(timeline, {1, 2})
    assert either == pytest.approx(19 / 20)
    assert both == pytest.approx(7 / 20)


def test_the_trainers_passes_are_counted_micro_batch_by_micro_batch():
    # (dataset index, prompt tokens, completion tokens): a group of two on prompt 0, one on 1
    rows = [(0, 10, 4), (0, 10, 3), (1, 20, 5)]
    # every row's prompt in its own pass: 14 + 13 + 25 body tokens, causal pairs n(n+1)/2
    assert Passes(2, shared_prompts=False).tokens(rows) == (52, 12, 105 + 91 + 325)
    # shared: micro-batch [0, 0] runs prompt 0 once (10 + 4 + 3), then [1] (20 + 5); pairs:
    # the prompt's own 10*11/2, then each completion token over the prompt and those before it
    shared = Passes(2, shared_prompts=True).tokens(rows)
    assert shared == (17 + 25, 12, 55 + (40 + 10) + (30 + 6) + 210 + (100 + 15))
    # a micro-batch of one row: prompt 0 runs twice
    assert Passes(1, shared_prompts=True).tokens(rows)[0] == 14 + 13 + 25
    assert Passes(0, shared_prompts=True).tokens(rows)[0] == 10 + 7 + 25  # one of all


def test_shared_prompts_and_the_reference_pass_change_the_training_floor(tmp_path):
    spans = [{"kind": "generate", "ordinals": [0, 1], "token_counts": [[4, 3], [5, 5]]}]
    write_timeline(tmp_path, spans)
    floor = RowCountingFloor(Shapes.of(tiny()), torch.float32, repeats=1)
    step = {"step": 0, "train_s": 1.0, "prompt_ordinals": [0, 1], "dataset_indices": [0, 1]}
    lengths = [10, 20]
    rows = [(0, 10, 4), (0, 10, 3), (1, 20, 5), (1, 20, 5)]
    # the body's rate: its forward and backward products' FLOPs of a row in a second
    rate = 3 * floor.shapes.linear_flops(floor.shapes.body, 1)

    def attention_s(passes: Passes) -> float:  # one pass's attention at the body's rate
        return floor.attention_flops(passes.tokens(rows)[2]) / rate

    each = train_part(tmp_path, [step], lengths, floor, Passes(2, shared_prompts=False))
    # body 14 + 13 + 25 + 25 and head 17 (a second a row each), attention forward and backward
    assert each.floor_s == pytest.approx(77 + 17 + 3 * attention_s(Passes(2, False)))
    shared = train_part(tmp_path, [step], lengths, floor, Passes(2, shared_prompts=True))
    assert shared.floor_s == pytest.approx(17 + 30 + 17 + 3 * attention_s(Passes(2, True)))
    assert shared.floor_s < each.floor_s
    referenced = train_part(tmp_path, [step], lengths, floor, Passes(2, True, reference=True))
    # plus a forward pass (a third of a second a row) over the same tokens, attention once
    extra = (47 + 17) / 3 + attention_s(Passes(2, True))
    assert referenced.floor_s == pytest.approx(shared.floor_s + extra)
    assert referenced.flops > shared.flops


def test_a_lora_run_trains_its_adapters_and_no_weight_of_the_frozen_base(tmp_path):
    lora = Shapes.of(tiny(), LoraConfig(rank=2))
    assert lora.frozen and not Shapes.of(tiny()).frozen
    assert len(lora.body) == 7 * LAYERS  # the base's linear layers, not the adapters
    assert len(lora.adapters) == 2 * 7 * LAYERS  # an A and a B on each (all-linear)
    assert {tuple(a.shape) for a in lora.adapters} >= {(2, H), (H, 2), (INTER, 2), (2, INTER)}
    spans = [{"kind": "generate", "ordinals": [0], "token_counts": [[4, 2]]}]
    write_timeline(tmp_path, spans)
    step = {"step": 0, "train_s": 1.0, "prompt_ordinals": [0], "dataset_indices": [0]}
    full = train_part(tmp_path, [step], [10], RowCountingFloor(Shapes.of(tiny()), torch.float32, 1))
    part = train_part(tmp_path, [step], [10], RowCountingFloor(lora, torch.float32, 1))
    # body 14 + 12 tokens, head 6: frozen, two thirds of a second a row; the adapters train
    # over the body's 26 tokens (a second a row); attention (x3) as before
    assert full.floor_s - part.floor_s == pytest.approx((26 + 6) / 3 - 26)


def test_a_products_time_is_measured_once_per_bucket_of_rows_and_scaled():
    floor = Floor(Shapes.of(tiny()), torch.float32, repeats=1)
    timed: list[int] = []

    def time_rows(weights: list[torch.Tensor], rows: int) -> float:
        timed.append(rows)
        return rows * (2.0 if rows < 200 else 1.0)  # seconds: small products run slower

    assert floor._scaled("k", floor.body, 1000, time_rows) == pytest.approx(1000)
    assert floor._scaled("k", floor.body, 1010, time_rows) == pytest.approx(1010)
    assert floor._scaled("k", floor.body, 50, time_rows) == pytest.approx(100)  # as it is
    assert floor._scaled("k", floor.body, 5000, time_rows) == pytest.approx(5000)
    assert floor._scaled("k", floor.body, 6000, time_rows) == pytest.approx(6000)
    assert floor._scaled("k", floor.body, 0, time_rows) == 0
    assert timed == [1024, 50, 2048]  # 1000 and 1010 share the bucket of 1024; 0 is 0


def test_each_pass_is_counted_at_its_own_rows_as_the_trainer_pads_it():
    # (dataset index, prompt tokens, completion tokens) in the trainer's order
    rows = [(0, 10, 3), (0, 10, 4), (1, 20, 5), (1, 20, 2)]
    # shared: a micro-batch's prompt once, then its rows up to the longest completion but its
    # last token (the prompt pass's last position predicts the first)
    assert Passes(2, shared_prompts=True).shapes(rows) == [(10, 0), (2 * 3, 7), (20, 0), (2 * 4, 7)]
    # one pass of all: both prompts left-padded to 20, every row up to 5 tokens
    assert Passes(0, shared_prompts=True).shapes(rows) == [(2 * 20, 0), (4 * 4, 14)]
    # a prompt a row: every row padded to its pass's longest prompt plus its longest completion
    assert Passes(2, shared_prompts=False).shapes(rows) == [(2 * 14, 7), (2 * 25, 7)]


def test_the_passes_products_are_timed_at_each_pass_in_the_trainers_order(tmp_path):
    # group 0's completions as generated (4 then 3); the trainer runs the shortest first
    spans = [{"kind": "generate", "ordinals": [0, 1], "token_counts": [[4, 3], [5, 2]]}]
    write_timeline(tmp_path, spans)
    floor = RowCountingFloor(Shapes.of(tiny()), torch.float32, repeats=1)
    step = {"step": 0, "train_s": 1.0, "prompt_ordinals": [0, 1], "dataset_indices": [0, 1]}
    passes = Passes(1, shared_prompts=True)
    part = train_part(tmp_path, [step], [10, 20], floor, passes)
    rows = [(0, 10, 3), (0, 10, 4), (1, 20, 2), (1, 20, 5)]
    # attention forward and backward (x3) at the body's rate (3 x a row's FLOPs a second)
    attention = floor.attention_flops(passes.tokens(rows)[2]) / floor.shapes.linear_flops(
        floor.shapes.body, 1
    )
    # a second a row: the floor's body and head tokens; the passes' padded rows (each prompt
    # again for each row, one micro-batch a row) and the same head
    assert part.floor_s == pytest.approx(10 + 3 + 10 + 4 + 20 + 2 + 20 + 5 + 14 + attention)
    assert part.passes_s == pytest.approx(10 + 2 + 10 + 3 + 20 + 1 + 20 + 4 + 14 + attention)
    # a group of four in passes of two: sorted, its rows run as [1, 2] and [4, 5] (unsorted,
    # [5, 2] and [4, 1]: 2 x 4 + 2 x 3 rows)
    write_timeline(
        tmp_path, [{"kind": "generate", "ordinals": [0], "token_counts": [[5, 2, 4, 1]]}]
    )
    one = {**step, "prompt_ordinals": [0], "dataset_indices": [0]}
    passes = Passes(2, shared_prompts=True)
    part = train_part(tmp_path, [one], [10, 20], floor, passes)
    rows = [(0, 10, 1), (0, 10, 2), (0, 10, 4), (0, 10, 5)]
    attention = floor.attention_flops(passes.tokens(rows)[2]) / floor.shapes.linear_flops(
        floor.shapes.body, 1
    )
    assert part.passes_s == pytest.approx(10 + 2 * 1 + 10 + 2 * 4 + 12 + attention)
