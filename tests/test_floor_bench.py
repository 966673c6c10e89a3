"""benchmarks/floor.py's counting: the model's products from its config, an ideal decode that
runs only the samples still generating, and a group's completion summed over its chunks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from floor import (
    Floor,
    Shapes,
    busy_shares,
    completions_by_ordinal,
    covered,
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
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    assert completions_by_ordinal(tmp_path) == {0: [7, 4], 1: [4, 2]}


class RowCountingFloor(Floor):
    """A training product "takes" a second per row."""

    def training_s(self, weights: list[torch.Tensor], rows: int) -> float:
        return float(rows)


def test_the_training_floor_counts_only_the_rows_trained(tmp_path):
    spans = [{"kind": "generate", "ordinals": [0, 1], "token_counts": [[4, 4], [3, 5]]}]
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
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
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
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
