"""The replay buffer as a Ray actor: `ray.remote(ReplayBuffer)`, the core class unchanged, and
`BufferClient`, the `Buffer` interface the collector and trainer use, forwarded to it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from asyncrl.core.buffer import ReplayBuffer
from asyncrl.core.types import Group

RemoteReplayBuffer = ray.remote(ReplayBuffer)


class BufferClient:
    """The `ReplayBuffer` interface the collector and trainer use, forwarded to a
    `ray.remote(ReplayBuffer)` actor. No logic: every call is the core method, remotely."""

    def __init__(self, num_prompts_per_step: int, capacity: int) -> None:
        # on the driver's node: the buffer is the trainer's state, and goes where it goes (a
        # drained generation node must not take it along)
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.actor: Any = RemoteReplayBuffer.options(
            max_concurrency=4, num_cpus=0, scheduling_strategy=here
        ).remote(num_prompts_per_step, capacity)
        self.num_prompts_per_step = num_prompts_per_step
        self.capacity = capacity

    def __len__(self) -> int:
        return int(ray.get(self.actor.size.remote()))

    def add(self, group: Group) -> None:
        ray.get(self.actor.add.remote(group))

    def sample(
        self, target_step: int, check: Callable[[], None] | None = None, poll_s: float = 0.05
    ) -> list[Group]:
        while (groups := ray.get(self.actor.try_sample.remote(target_step, poll_s))) is None:
            if check is not None:
                check()
        return list(groups)

    def counts_by_target(self) -> dict[int, int]:
        return dict(ray.get(self.actor.counts_by_target.remote()))

    def ordinals_and_targets(self) -> list[tuple[int, int]]:
        return [tuple(x) for x in ray.get(self.actor.ordinals_and_targets.remote())]

    def discard(self, ordinals: list[int]) -> None:
        ray.get(self.actor.discard.remote(ordinals))

    def state_dict(self) -> dict[str, Any]:
        return dict(ray.get(self.actor.state_dict.remote()))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ray.get(self.actor.load_state_dict.remote(state))

    def shutdown(self) -> None:
        ray.kill(self.actor, no_restart=True)
