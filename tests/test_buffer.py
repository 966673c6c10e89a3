"""The replay buffer: exactly N groups per target, ordered, bounded, resumable."""

import threading
import time

import pytest
import torch

from asyncrl.core.buffer import BufferOverflow, ReplayBuffer
from asyncrl.core.types import Group, PromptTicket


def group(ordinal: int, n: int = 3, reward: float = 0.5) -> Group:
    ticket = PromptTicket(ordinal, ordinal // n, 0, ordinal, ordinal * 10)
    return Group(
        ticket=ticket,
        prompt_ids=[5, 6, ordinal],
        completion_ids=torch.tensor([[7, 2], [8, 2]]),
        completion_mask=torch.tensor([[True, True], [True, True]]),
        behaviour_logprobs=torch.tensor([[-1.0, -0.5], [-2.0, -0.25]]),
        rewards=torch.tensor([reward, 1.0 - reward]),
        version_min=ordinal // n,
        version_max=ordinal // n,
    )


def test_sample_returns_exactly_the_targets_n_groups_ordered_by_ordinal():
    buffer = ReplayBuffer(num_prompts_per_step=3, capacity=6)
    for k in (4, 2, 5, 0, 3, 1):
        buffer.add(group(k))
    assert [g.ordinal for g in buffer.sample(1)] == [3, 4, 5]
    assert [g.ordinal for g in buffer.sample(0)] == [0, 1, 2]
    assert len(buffer) == 0


def test_sample_waits_until_the_last_group_of_its_target_arrives():
    buffer = ReplayBuffer(num_prompts_per_step=3, capacity=3)
    buffer.add(group(0))
    buffer.add(group(2))
    got: list[list[int]] = []
    waiter = threading.Thread(target=lambda: got.append([g.ordinal for g in buffer.sample(0)]))
    waiter.start()
    time.sleep(0.2)
    assert not got and waiter.is_alive()
    buffer.add(group(1))
    waiter.join(timeout=60)  # returns as soon as the group lands; the bound only stops a hang
    assert got == [[0, 1, 2]]


def test_buffer_refuses_more_than_a_plus_one_steps_of_groups():
    buffer = ReplayBuffer(num_prompts_per_step=3, capacity=6)
    assert buffer.capacity == 6
    for k in range(6):
        buffer.add(group(k))
    with pytest.raises(BufferOverflow, match="buffer full"):
        buffer.add(group(6))


def test_buffer_refuses_a_group_it_already_holds():
    buffer = ReplayBuffer(num_prompts_per_step=3, capacity=6)
    buffer.add(group(1))
    with pytest.raises(BufferOverflow, match="ordinal 1 is already buffered"):
        buffer.add(group(1))


def test_a_failing_check_aborts_the_wait():
    buffer = ReplayBuffer(num_prompts_per_step=3, capacity=3)

    def check() -> None:
        raise RuntimeError("worker died")

    with pytest.raises(RuntimeError, match="worker died"):
        buffer.sample(0, check=check)


def test_state_dict_round_trips_every_group_field():
    buffer = ReplayBuffer(num_prompts_per_step=3, capacity=6)
    originals = [group(k, reward=0.1 * k) for k in (0, 1, 4)]
    for g in originals:
        buffer.add(g)
    restored = ReplayBuffer(num_prompts_per_step=3, capacity=6)
    restored.load_state_dict(buffer.state_dict())
    assert restored.counts_by_target() == {0: 2, 1: 1}
    for k, original in zip((0, 1), originals[:2], strict=True):
        (copy,) = [g for g in restored.state_dict()["groups"] if g["ticket"]["ordinal"] == k]
        assert copy["prompt_ids"] == original.prompt_ids
        assert torch.equal(copy["behaviour_logprobs"], original.behaviour_logprobs)
        assert torch.equal(copy["rewards"], original.rewards)


def test_the_wait_check_runs_without_the_buffer_lock_held():
    # `check` takes the collector's lock, and the collector takes the buffer's lock to add a
    # group: calling `check` while holding the buffer's lock could deadlock the two threads.
    buffer = ReplayBuffer(num_prompts_per_step=3, capacity=3)
    seen: list[bool] = []

    def check() -> None:
        other = threading.Thread(target=buffer.add, args=(group(len(seen)),))
        other.start()
        other.join(timeout=2)
        seen.append(not other.is_alive())  # the other thread could take the buffer's lock

    assert [g.ordinal for g in buffer.sample(0, check=check)] == [0, 1, 2]
    assert seen and all(seen)
