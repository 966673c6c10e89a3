"""Advantage estimators. Pure tensor functions."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's group-normalised advantage.

    rewards: [N, G], one row per prompt group. Returns [N, G]:
    `(r - mean_g(r)) / (std_g(r) + eps)`, with the population std (divide by G). A group whose
    samples all got the same reward has zero advantage: it carries no learning signal.
    """
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def scaled_group_advantages(
    rewards: torch.Tensor, scale: str = "group", eps: float = 1e-6
) -> torch.Tensor:
    """`r - mean_g(r)` per group, divided as `algo.scale_rewards` says: `group` by the group's
    std (exactly `group_advantages`), `batch` by the std of all of `rewards`, `none` not at
    all. rewards: [N, G] -> [N, G]; population stds."""
    if scale == "group":
        return group_advantages(rewards, eps)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "batch":
        return centred / (rewards.std(unbiased=False) + eps)
    if scale == "none":
        return centred
    raise ValueError(f"unknown reward scaling {scale!r}")


def last_token(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: true at each row's last real token (where its episode ends). A row with no
    real token has none."""
    mask = mask.bool()
    index = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, index, -1).max(dim=1).values  # [B]
    return index == last.unsqueeze(1)


def terminal_rewards(sequence_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The token-level reward of an outcome-rewarded completion: each row's sequence reward
    [B] on its last real token, 0 elsewhere. [B] x [B, T] -> [B, T]."""
    return last_token(mask).to(sequence_rewards.dtype) * sequence_rewards.unsqueeze(1)


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    last_values: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016), vectorised over the batch.

    rewards, values, dones: [B, T]; `values[:, t]` is V(s_t), `dones[:, t]` says the episode
    ended with step t (nothing after it is bootstrapped); last_values: [B], V of the state
    after step T-1, used only where step T-1 is not an episode end (a truncated rollout).
    Returns (advantages, returns), both [B, T], with returns = advantages + values, the
    critic's regression target:

        delta_t = r_t + gamma * V(s_{t+1}) * (1 - done_t) - V(s_t)
        A_t     = delta_t + gamma * lam * (1 - done_t) * A_{t+1}
    """
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(last_values)
    next_value = last_values
    for t in reversed(range(rewards.shape[1])):
        live = 1.0 - dones[:, t].to(rewards.dtype)
        delta = rewards[:, t] + gamma * next_value * live - values[:, t]
        running = delta + gamma * lam * live * running
        advantages[:, t] = running
        next_value = values[:, t]
    return advantages, advantages + values


def _is_prefix(mask: torch.Tensor) -> bool:
    """Each row's true positions come first, with no gap."""
    counts = mask.sum(dim=1, keepdim=True)
    return bool(torch.equal(mask, torch.arange(mask.shape[1], device=mask.device) < counts))


def pack(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's true positions moved to its front, in order: (index [B, T'], packed mask
    [B, T']) with `T'` the most true positions of a row; `x.gather(1, index)` packs a tensor.
    The index of a packed padding position names one of the row's false positions."""
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices
    width = int(mask.sum(dim=1).max()) if mask.numel() else 0
    packed = torch.arange(width, device=mask.device) < mask.sum(dim=1, keepdim=True)
    return order[:, :width], packed


def unpack(
    values: torch.Tensor, index: torch.Tensor, packed: torch.Tensor, width: int
) -> torch.Tensor:
    """The inverse of `pack` for a [B, T'] tensor: [B, width], each value back at its
    position, zero elsewhere."""
    out = torch.zeros(index.shape[0], width, dtype=values.dtype, device=values.device)
    return out.scatter(1, index, values * packed.to(values.dtype))


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Normalises `values` to mean 0, std 1 over the positions where `mask` is true (population
    std); masked positions become 0. PPO's advantage normalisation over a batch of tokens."""
    mask = mask.bool()
    real = values[mask]
    mean = real.mean()
    std = real.std(unbiased=False) if real.numel() > 1 else values.new_zeros(())
    return torch.where(mask, (values - mean) / (std + eps), torch.zeros_like(values))


def ppo_advantages(
    sequence_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    normalize: bool,
    token_penalty: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's advantages for outcome-rewarded completions, one episode per row.

    sequence_rewards: [B]; values: [B, T] V(s_t) from the critic; mask: [B, T] the policy's
    tokens; token_penalty: [B, T] subtracted from each token's reward (the KL penalty, when it
    goes in the reward). Each episode ends at its last real token, so nothing is bootstrapped
    past it. GAE runs over the policy's tokens alone, in order: where a multi-turn episode has
    environment tokens between turns (masked out), the policy token before them is followed by
    the one after them. Returns (advantages, returns, raw advantages), [B, T] each, zero at
    masked positions; `advantages` are whitened when `normalize`.
    """
    mask = mask.bool()
    if not _is_prefix(mask):  # gaps: GAE over the packed policy tokens, scattered back
        index, packed = pack(mask)
        penalty = None if token_penalty is None else token_penalty.gather(1, index)
        _, ret, raw = ppo_advantages(
            sequence_rewards, values.gather(1, index), packed, gamma, lam, False, penalty
        )
        width = mask.shape[1]
        raw, ret = unpack(raw, index, packed, width), unpack(ret, index, packed, width)
        return (whiten(raw, mask) if normalize else raw), ret, raw
    real = mask.to(values.dtype)
    rewards = terminal_rewards(sequence_rewards, mask)
    if token_penalty is not None:
        rewards = rewards - token_penalty * real
    raw, returns = gae(
        rewards, values * real, last_token(mask), values.new_zeros(len(values)), gamma, lam
    )
    raw, returns = raw * real, returns * real
    return (whiten(raw, mask) if normalize else raw), returns, raw
