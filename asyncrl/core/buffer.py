"""The replay buffer: finished groups keyed by target step.

`sample(t)` hands the trainer exactly the N groups stamped with target t, ordered by ordinal,
waiting until all of them are in (under the lossless schedule they are ordinals
[t*N, (t+1)*N); after a lossy resume, whatever the schedule gave t). The collector admits a
target only inside the window, so the buffer never holds more than (A + 1) * N groups; `add`
enforces that bound rather than trusting it.

Thread-safe through one condition variable; no other runtime. A Ray deployment wraps this
class as it is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from asyncrl.core.types import Group, PromptTicket


class Buffer(Protocol):
    """What the collector and trainer use of a replay buffer: `ReplayBuffer` itself, or a
    client of one running elsewhere (the Ray backend's `BufferClient`)."""

    capacity: int
    num_prompts_per_step: int

    def __len__(self) -> int: ...
    def add(self, group: Group) -> None: ...
    def sample(
        self, target_step: int, check: Callable[[], None] | None = None, poll_s: float = 0.05
    ) -> list[Group]: ...
    def counts_by_target(self) -> dict[int, int]: ...
    def ordinals_and_targets(self) -> list[tuple[int, int]]: ...
    def discard(self, ordinals: list[int]) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class BufferOverflow(RuntimeError):
    """A group arrived that the window should never have admitted."""


class ReplayBuffer:
    def __init__(self, num_prompts_per_step: int, capacity: int) -> None:
        """`capacity` is `(A+1)*N` (`RolloutConfig.buffer_capacity`): with the window checked
        at admission, no more groups can ever be buffered at once."""
        self.num_prompts_per_step = num_prompts_per_step
        self.capacity = capacity
        self._groups: dict[int, Group] = {}  # ordinal -> group
        self._cond = threading.Condition()

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def add(self, group: Group) -> None:
        with self._cond:
            if group.ordinal in self._groups:
                raise BufferOverflow(f"ordinal {group.ordinal} is already buffered")
            if len(self._groups) >= self.capacity:
                raise BufferOverflow(
                    f"buffer full ({self.capacity} groups) when ordinal {group.ordinal} arrived"
                )
            self._groups[group.ordinal] = group
            self._cond.notify_all()

    def counts_by_target(self) -> dict[int, int]:
        with self._cond:
            counts: dict[int, int] = {}
            for group in self._groups.values():
                counts[group.target_step] = counts.get(group.target_step, 0) + 1
            return dict(sorted(counts.items()))

    def _count(self, target_step: int) -> int:
        return sum(1 for g in self._groups.values() if g.target_step == target_step)

    def try_sample(self, target_step: int, wait_s: float = 0.0) -> list[Group] | None:
        """Removes and returns the N groups of `target_step`, ordered by ordinal, if they are
        all buffered within `wait_s` seconds; else None and nothing changes."""
        with self._cond:
            if self._count(target_step) < self.num_prompts_per_step and wait_s > 0:
                self._cond.wait(timeout=wait_s)
            if self._count(target_step) < self.num_prompts_per_step:
                return None
            ordinals = sorted(k for k, g in self._groups.items() if g.target_step == target_step)
            groups = [self._groups.pop(k) for k in ordinals]
            self._cond.notify_all()
            return groups

    def sample(
        self,
        target_step: int,
        check: Callable[[], None] | None = None,
        poll_s: float = 0.05,
    ) -> list[Group]:
        """Removes and returns the N groups of `target_step`, ordered by ordinal. Blocks until
        they are all buffered; `check` is called while waiting and may raise to abort (for
        example when the generation worker died or a preemption signal arrived)."""
        while (groups := self.try_sample(target_step, poll_s)) is None:
            if check is not None:
                check()  # outside the lock: `check` may take the collector's lock
        return groups

    def size(self) -> int:
        """Groups buffered now (`len`, as a method a remote shell can call)."""
        return len(self)

    def ordinals_and_targets(self) -> list[tuple[int, int]]:
        with self._cond:
            return [(k, self._groups[k].target_step) for k in sorted(self._groups)]

    def discard(self, ordinals: list[int]) -> None:
        """Deletes buffered groups (the `drop_incomplete` resume policy does)."""
        with self._cond:
            for k in ordinals:
                del self._groups[k]

    def state_dict(self) -> dict[str, Any]:
        """The buffered groups, ordered by ordinal: JSON-able metadata plus tensors."""
        with self._cond:
            return {"groups": [group_state(self._groups[k]) for k in sorted(self._groups)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._cond:
            self._groups = {}
            for item in state["groups"]:
                group = group_from_state(item)
                self._groups[group.ordinal] = group
            self._cond.notify_all()


def tokens_per_group(state: dict[str, Any]) -> dict[int, int]:
    """Buffered ordinal -> its group's generated tokens, read off a buffer's saved state."""
    return {
        int(item["ticket"]["ordinal"]): int(torch.as_tensor(item["completion_mask"]).sum())
        for item in state["groups"]
    }


def group_state(group: Group) -> dict[str, Any]:
    """A group as a checkpoint's (and a rank broadcast's) state: JSON-able fields and tensors.
    The optional tensors are there only when set, so a group without them is saved as it
    was before they existed, and a state without them loads them as None (`row_samples`
    included: no segments)."""
    versions = group.token_versions
    return {
        "ticket": vars(group.ticket).copy(),
        "prompt_ids": list(group.prompt_ids),
        "completion_ids": group.completion_ids.clone(),
        "completion_mask": group.completion_mask.clone(),
        "behaviour_logprobs": group.behaviour_logprobs.clone(),
        "rewards": group.rewards.clone(),
        "version_min": group.version_min,
        "version_max": group.version_max,
        "generation_s": group.generation_s,
        **({} if versions is None else {"token_versions": versions.clone()}),
        **({} if group.loss_mask is None else {"loss_mask": group.loss_mask.clone()}),
        **({} if group.row_samples is None else {"row_samples": group.row_samples.clone()}),
        **(
            {"reward_components": {k: v.clone() for k, v in group.reward_components.items()}}
            if group.reward_components
            else {}
        ),
    }


def group_from_state(item: dict[str, Any]) -> Group:
    fields = dict(item)
    fields["ticket"] = PromptTicket(**item["ticket"])
    for key in ("completion_ids", "completion_mask", "behaviour_logprobs", "rewards"):
        fields[key] = torch.as_tensor(item[key])
    for key in ("token_versions", "loss_mask", "row_samples"):
        if key in item:
            fields[key] = torch.as_tensor(item[key])
    if "reward_components" in item:
        fields["reward_components"] = {
            k: torch.as_tensor(v) for k, v in item["reward_components"].items()
        }
    return Group(**fields)
