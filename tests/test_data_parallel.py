"""Data-parallel training (`train.num_processes`): P ranks give one rank's gradients.

The oracle is the one-process algorithm on the same groups; 2 and 3 real rank processes
(`torch.distributed` on gloo, FSDP2-sharded policy, critic and reference) must reduce to the
same gradients for every optimizer step of a training step, within float summation order,
whatever the micro-batching (3 ranks over 12 rows with micro-batches of 3 rows need stand-in
passes). A negative control averages the ranks' gradients (FSDP2's default) instead of summing
them, and the comparison must catch it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import launcher
import pytest
import torch
from rank_gradients import step_gradients
from test_micro_batches import ALGOS, COMMON, worst_relative_error
from test_micro_batches import groups as groups

from asyncrl.algos.parallel import rank_micro_batches, rank_rows
from asyncrl.algos.update import micro_batches

HELPER = Path(__file__).with_name("rank_gradients.py")
CASES = {
    "grpo": ALGOS["grpo"],
    "ppo": ALGOS["ppo"],
    "ppo-minibatches-epochs": ALGOS["ppo-minibatches-epochs"],
    "grpo-full-passes": ALGOS["grpo-full-passes"],
}


def ranks_gradients(tmp_path, groups, cases, world_size, average=False):
    """What `world_size` real rank processes compute for each case (a list of overrides), one
    freshly built algorithm after the other on one process group: rank 0's records."""
    groups_file, out = tmp_path / "groups.pt", tmp_path / f"out-{world_size}-{average}.pt"
    torch.save(groups, groups_file)
    spec = json.dumps({"cases": cases, "average": average})
    env = {
        **os.environ,
        "ASYNCRL_RENDEZVOUS": str(tmp_path / f"rendezvous-{world_size}-{average}"),
        "WORLD_SIZE": str(world_size),
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": str(HELPER.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "PYTHONWARNINGS": "ignore",
    }
    procs = [
        launcher.popen(
            [sys.executable, str(HELPER), str(groups_file), str(out), spec],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    errors = [p.communicate(timeout=600)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(errors)[-3000:]
    return torch.load(out, weights_only=False)


def settings(case, micro_batch_size, world_size):
    return [
        "run.max_num_steps=6",
        "rollout.num_prompts_per_step=4",
        "rollout.num_generations_per_prompt=4",
        *COMMON,
        *CASES[case],
        f"train.micro_batch_size={micro_batch_size}",
        f"train.num_processes={world_size}",
    ]


LAYOUTS = {2: (0,), 3: (0, 3)}
"""Ranks -> micro-batch sizes: 12 rows on 2 ranks in one pass each; on 3 ranks in one pass
each, and in passes of 3 rows (4 rows per rank: 2 passes, one of them of 1 row)."""


@pytest.mark.slow
def test_two_and_three_ranks_give_the_one_process_gradients(groups, tmp_path):
    oracles = {case: step_gradients(groups, settings(case, 0, 1)) for case in CASES}
    for case, (oracle, _) in oracles.items():
        assert oracle and any(float(g.norm()) > 0 for g in oracle[0].values()), case
    for world_size, sizes in LAYOUTS.items():
        layouts = [(case, size) for case in CASES for size in sizes]
        cases = [settings(case, size, world_size) for case, size in layouts]
        results = ranks_gradients(tmp_path, groups, cases, world_size)
        for (case, size), (grads, metrics) in zip(layouts, results, strict=True):
            oracle, whole = oracles[case]
            error = worst_relative_error(oracle, grads)
            label = f"{case}, {world_size} ranks, micro_batch_size={size}"
            assert error <= 1e-6, f"{label}: relative gradient error {error:.2e}"
            for key in ("loss", "entropy", "reward_mean", "num_tokens"):
                assert metrics[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), (label, key)
            assert metrics.get("mismatch_tokens") == whole.get("mismatch_tokens"), label


@pytest.mark.slow
def test_averaging_the_ranks_gradients_would_be_caught(groups, tmp_path):
    """Negative control: FSDP2's default reduction (the mean over ranks) is not the step's
    gradient once the loss is divided by the global normaliser, and the comparison says so."""
    oracle, _ = step_gradients(groups, settings("grpo", 0, 1))
    ((grads, _),) = ranks_gradients(tmp_path, groups, [settings("grpo", 0, 2)], 2, average=True)
    assert worst_relative_error(oracle, grads) > 0.4  # half the gradient: error 0.5


def test_ranks_split_a_steps_rows_into_contiguous_blocks_with_equal_pass_counts():
    for num_rows in range(1, 20):
        for world_size in (1, 2, 3, 5):
            blocks = [rank_rows(num_rows, r, world_size) for r in range(world_size)]
            covered = [i for b in blocks for i in range(b.start, b.stop)]
            assert covered == list(range(num_rows))  # every row once, in rank order
            for micro_batch_size in (0, 1, 3):
                lists = [
                    rank_micro_batches(num_rows, micro_batch_size, r, world_size)
                    for r in range(world_size)
                ]
                assert len({len(batches) for batches in lists}) == 1  # the same passes
                real = [
                    i
                    for batches in lists
                    for m in batches
                    if m.real
                    for i in range(m.rows.start, m.rows.stop)
                ]
                assert real == list(range(num_rows))
                assert all(
                    m.rows.stop - m.rows.start <= (micro_batch_size or num_rows or 1)
                    for batches in lists
                    for m in batches
                )
    # one rank: exactly the one-process micro-batches
    assert [m.rows for m in rank_micro_batches(12, 5, 0, 1)] == micro_batches(12, 5)


def test_each_rank_is_sent_its_own_rows_alone_and_every_pass_it_runs_finds_them(groups):
    """What GRPO scatters (`row_shares`), through the wire codec: rank r gets exactly rows
    `share_rows(B, r, P)` of the batch (a rank with none gets row 0 for its stand-in passes),
    each distinct prompt once, and every micro-batch `rank_micro_batches` gives it lies in
    them."""
    from asyncrl.algos.parallel import received_share, row_shares, share_rows
    from asyncrl.algos.update import select, stack_groups
    from asyncrl.distributed import wire

    batch = stack_groups(groups, 0)
    num_rows, samples = len(batch["prompts"]), groups[0].num_generations
    advantages = torch.arange(num_rows, dtype=torch.float32).reshape(-1, 1)
    rows = select(batch, slice(None))
    for world_size in (1, 2, 3, 5, num_rows + 2):
        shares = row_shares(rows, {"advantages": advantages}, {"normaliser": 7.0}, world_size)
        assert len(shares) == world_size
        for rank, sent in enumerate(shares):
            share = received_share(wire.unpack(*wire.pack(sent)))
            own = share_rows(num_rows, rank, world_size) if world_size > 1 else slice(0, num_rows)
            assert (share["num_rows"], share["offset"], share["normaliser"]) == (
                num_rows, own.start, 7.0,
            )  # fmt: skip
            for key in ("completion_ids", "completion_mask", "behaviour_logprobs"):
                assert torch.equal(share[key], batch[key][own]), (world_size, rank, key)
            assert torch.equal(share["advantages"], advantages[own])
            assert share["prompts"] == batch["prompts"][own]
            if world_size > 1:  # each group's prompt once, not once per sample
                touched = {i // samples for i in range(own.start, own.stop)}
                assert len(sent["distinct_prompts"]) <= len(touched)
            for micro in rank_micro_batches(num_rows, 3, rank, world_size):
                assert own.start <= micro.rows.start < micro.rows.stop <= own.stop


@pytest.mark.slow
def test_two_ranks_give_an_episode_steps_one_process_gradients(tmp_path):
    """Multi-turn episodes (environment tokens attended to, not trained) on 2 ranks."""
    from helpers import SMALL
    from test_episodes import EPISODE_STEP, play_batch

    _, _, episode_groups = play_batch()
    oracle, whole = step_gradients(episode_groups, [*SMALL, *EPISODE_STEP])
    case = [*SMALL, *EPISODE_STEP, "train.num_processes=2", "train.micro_batch_size=3"]
    ((grads, metrics),) = ranks_gradients(tmp_path, episode_groups, [case], 2)
    assert worst_relative_error(oracle, grads) <= 1e-6
    assert metrics["loss"] == pytest.approx(whole["loss"], rel=1e-5)
