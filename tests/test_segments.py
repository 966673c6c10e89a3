"""A sample trained as more than one row (issue #64, item 3): where an agent rewrote its history,
its sample continues in a new *segment*, a row of its own (`Group.row_samples`), and every row
of a sample is trained with that sample's advantage.

The oracles: a group without segments trains bit for bit as before (the same groups with
`row_samples` spelled out, and the formulas the algorithms used before segments existed); a
step with a sample split into two rows gives the loss and gradients of a slow loop that
computes, row by row, the clipped surrogate with the advantage of the row's sample (GRPO,
RLOO; PPO with its per-row terminal reward), and the same loop with the segment given the next
sample's advantage (the bug to catch) does not.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import small_config
from test_micro_batches import COMMON, worst_relative_error
from test_micro_batches import groups as groups

from asyncrl.algos import grpo, ppo
from asyncrl.algos.grpo import varied_groups
from asyncrl.algos.update import select, shortest_first, stack_groups
from asyncrl.checkpoint.snapshot import Snapshot, decode, encode
from asyncrl.checkpoint.store import CheckpointStore
from asyncrl.core.buffer import ReplayBuffer, group_from_state, group_state
from asyncrl.core.types import Group
from asyncrl.models.critic import completion_values
from asyncrl.models.logprobs import completion_logprobs
from asyncrl.train.components import build_components
from asyncrl.train.records import step_record, tokens_digest

PLAIN = ("algo.kl_coef=0", "algo.entropy_coef=0")  # the oracles compute the surrogate alone
SPLIT_SAMPLE = 1  # the sample of the middle group that has two rows
TAIL = 2  # the new segment's first tokens: its own prompt tail, attended to, not trained


def with_segment(group: Group, donor: Group, donor_row: int, sample: int, tail: int) -> Group:
    """`group` with a second row for `sample`, right after its first: `donor`'s row
    `donor_row`, whose first `tail` tokens are the segment's prompt tail (in
    `completion_mask`, out of `loss_mask`)."""
    width = max(group.completion_ids.shape[1], donor.completion_ids.shape[1])
    at = sample + 1

    def insert(own: torch.Tensor, extra: torch.Tensor, value: float | bool) -> torch.Tensor:
        own = torch.nn.functional.pad(own, (0, width - own.shape[1]), value=value)
        extra = torch.nn.functional.pad(extra, (0, width - extra.shape[0]), value=value)
        return torch.cat([own[:at], extra.unsqueeze(0), own[at:]])

    extra_mask = donor.completion_mask[donor_row]
    trained = extra_mask.clone()
    trained[:tail] = False
    samples = torch.arange(group.num_samples)
    return dataclasses.replace(
        group,
        completion_ids=insert(group.completion_ids, donor.completion_ids[donor_row], 0),
        completion_mask=insert(group.completion_mask, extra_mask, False),
        behaviour_logprobs=insert(
            group.behaviour_logprobs, donor.behaviour_logprobs[donor_row], 0.0
        ),
        loss_mask=insert(group.policy_mask, trained, False),
        token_versions=None,
        row_samples=torch.cat([samples[:at], samples[sample : sample + 1], samples[at:]]),
    )


@pytest.fixture(scope="module")
def segmented(groups):
    """The step [g0, g1 with sample 1 in two rows, g2]: 13 rows, sample 1's second row a
    6-token completion whose first 2 tokens are its prompt tail; the rewards give samples 1
    and 2 of the middle group different advantages. Its tensors are copies (the engine's are
    inference tensors, which the reference loops' autograd cannot save)."""
    groups = [group_from_state(group_state(g)) for g in groups]
    donor_row = int(groups[2].completion_mask.sum(1).argmax())
    assert int(groups[2].completion_mask[donor_row].sum()) > TAIL + 2
    middle = dataclasses.replace(groups[1], rewards=torch.tensor([0.0, 1.0, 0.25, 0.5]))
    middle = with_segment(middle, groups[2], donor_row, SPLIT_SAMPLE, TAIL)
    assert middle.row_samples.tolist() == [0, 1, 1, 2, 3]
    return [groups[0], middle, groups[2]]


def step_gradients(algo, groups, step=3):
    """`algo.step`'s metrics and the gradients each of its optimizers stepped with, by
    optimizer (the policy's, and PPO's critic's)."""
    seen: dict[str, list[dict[str, torch.Tensor]]] = {"policy": [], "critic": []}
    owners = [("policy", algo.optimizer, algo.model)]
    if hasattr(algo, "critic_optimizer"):
        owners.append(("critic", algo.critic_optimizer, algo.critic))
    handles = []
    for name, optimizer, model in owners:

        def record(opt, args, kwargs, name=name, model=model):
            seen[name].append(
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            )

        handles.append(optimizer.register_step_pre_hook(record))
    metrics = algo.step(groups, step)
    for handle in handles:
        handle.remove()
    return metrics, seen


def build(*keys):
    return build_components(small_config(*COMMON, *keys)).algo


# --- groups without segments: bit for bit as before


def old_shortest_first(rows, mask, group_size):
    """`shortest_first` as it was before segments (every group `group_size` rows)."""
    if len(rows) == 0:
        return rows
    columns = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    widths = (mask[rows].bool() * columns).amax(dim=1).view(-1, group_size)
    order = widths.argsort(dim=1, stable=True)
    return rows.view(-1, group_size).gather(1, order).flatten()


def the_old_path(monkeypatch, group_size):
    """The algorithms' formulas before segments: per-sample values reshaped to rows, a group's
    rows found by `repeat_interleave(G)` and `view(-1, G)`, RLOO's entropy scale taken over
    the [B, 1] advantages."""
    flat = lambda values, batch: values.reshape(-1)  # noqa: E731
    monkeypatch.setattr(grpo, "per_row", flat)
    monkeypatch.setattr(ppo, "per_row", flat)
    monkeypatch.setattr(
        grpo, "shortest_first", lambda rows, mask, _: old_shortest_first(rows, mask, group_size)
    )

    def trained_rows(self, batch):
        if not getattr(self.config.options, "skip_zero_variance_groups", False):
            return slice(None)
        rewards = batch["rewards"]
        return varied_groups(rewards).repeat_interleave(rewards.shape[1]).nonzero().flatten()

    monkeypatch.setattr(grpo.GRPO, "_trained_rows", trained_rows)
    from asyncrl.algos import rloo

    entropy_coef = rloo.RLOO.entropy_coef
    monkeypatch.setattr(
        rloo.RLOO, "entropy_coef", lambda self, adv: entropy_coef(self, adv.reshape(-1, 1))
    )


NO_SEGMENT_CASES = {
    # micro-batches of 3 rows: each group's rows shortest first; one uniform group skipped
    "grpo": ("algo.name=grpo", "train.micro_batch_size=3", "algo.skip_zero_variance_groups=true"),
    "rloo": ("algo.name=rloo", "train.micro_batch_size=5"),  # KL, entropy scaled by A's std
    "ppo": ("algo.name=ppo", "algo.num_minibatches=2"),
}


@pytest.mark.parametrize("case", list(NO_SEGMENT_CASES))
def test_groups_without_segments_train_bit_for_bit_as_before(groups, case, monkeypatch):
    keys = NO_SEGMENT_CASES[case]
    groups = [*groups[:2], dataclasses.replace(groups[2], rewards=torch.full((4,), 0.5))]
    metrics, grads = step_gradients(build(*keys), groups)
    assert grads["policy"] and any(float(g.norm()) > 0 for g in grads["policy"][0].values())
    spelled_out = [dataclasses.replace(g, row_samples=torch.arange(g.num_samples)) for g in groups]
    with_field = step_gradients(build(*keys), spelled_out)
    the_old_path(monkeypatch, group_size=4)
    before = step_gradients(build(*keys), groups)
    for other in (with_field, before):
        assert other[0] == metrics
        for name in grads:
            assert len(other[1][name]) == len(grads[name])
            for want, got in zip(grads[name], other[1][name], strict=True):
                assert all(torch.equal(want[k], got[k]) for k in want), name
    if case == "grpo":
        assert metrics["trained_rows"] == 8


def test_the_bit_for_bit_comparison_catches_a_changed_advantage(groups):
    """Negative control for the test above: one advantage off by 1e-6 of a row changes bits."""
    keys = NO_SEGMENT_CASES["grpo"]
    metrics, grads = step_gradients(build(*keys), groups)
    nudged = [*groups[:2], dataclasses.replace(groups[2], rewards=groups[2].rewards + 1e-6)]
    other, other_grads = step_gradients(build(*keys), nudged)
    assert other != metrics or any(
        not torch.equal(grads["policy"][0][k], other_grads["policy"][0][k])
        for k in grads["policy"][0]
    )


# --- a sample in two rows: the slow reference loop


def grpo_advantages(rewards: list[float]) -> list[float]:
    """Hand-computed: `(r - mean) / (population std + 1e-6)`."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + 1e-6) for r in rewards]


def rloo_advantages(rewards: list[float]) -> list[float]:
    """Hand-computed: each reward minus the mean of the others."""
    return [r - (sum(rewards) - r) / (len(rewards) - 1) for r in rewards]


def row_samples_of(group: Group) -> list[int]:
    return list(range(group.num_rows)) if group.row_samples is None else group.row_samples.tolist()


def surrogate_loop(algo, groups, advantages_of, wrong_sample=None):
    """The clipped surrogate of a step, a row at a time: each row's own forward pass, the
    ratio against its behaviour log-probs, the advantage of the row's sample (with
    `wrong_sample`, the segment row gets that sample's instead), summed over its trained
    tokens, over the step's trained tokens (every row's)."""
    eps = algo.config.clip_eps
    total = sum(int(g.policy_mask.sum()) for g in groups)
    loss = torch.zeros(())
    for g in groups:
        advantages = advantages_of(g.rewards.tolist())
        seen: set[int] = set()
        for row, sample in enumerate(row_samples_of(g)):
            if sample in seen and wrong_sample is not None:
                sample = wrong_sample
            seen.add(sample)
            logprobs, _ = completion_logprobs(
                algo.model,
                [g.prompt_ids],
                g.completion_ids[row : row + 1],
                g.completion_mask[row : row + 1],
                algo.temperature,
                algo.pad_id,
            )
            ratio = torch.exp(logprobs[0] - g.behaviour_logprobs[row])
            a = advantages[sample]
            term = torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
            loss = loss - term[g.policy_mask[row]].sum() / total
    return loss


def oracle_gradients(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize(
    ("name", "advantages_of"), [("grpo", grpo_advantages), ("rloo", rloo_advantages)]
)
def test_each_row_is_trained_with_its_samples_advantage(segmented, name, advantages_of):
    algo = build(f"algo.name={name}", *PLAIN)
    algo.model.train()
    loss = surrogate_loop(algo, segmented, advantages_of)
    want = oracle_gradients(algo.model, loss)
    metrics, grads = step_gradients(algo, segmented)
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert worst_relative_error([want], grads["policy"]) <= 1e-5
    # negative control: the segment trained with the next sample's advantage
    wrong = surrogate_loop(algo, segmented, advantages_of, SPLIT_SAMPLE + 1).item()
    assert abs(wrong - metrics["loss"]) > 1e3 * 1e-5 * abs(metrics["loss"])


def test_ppo_ends_each_row_with_its_samples_reward(segmented):
    """PPO with gamma = lam = 1 and no whitening: the advantage of a trained token is its
    row's terminal reward (its sample's) minus V(s_t); one update, so pi_old is the policy and
    the ratio is 1, the surrogate weighted by `min(pi_old / pi_behaviour, tis_cap)`."""
    algo = build("algo.name=ppo", *PLAIN, "algo.lam=1", "algo.normalize_advantages=false")
    assert algo.options.gamma == 1.0 and algo.options.tis_cap > 0
    algo.model.train()
    algo.critic.train()

    def loop(wrong_sample=None):
        total = sum(int(g.policy_mask.sum()) for g in segmented)
        loss = torch.zeros(())
        for g in segmented:
            seen: set[int] = set()
            for row, sample in enumerate(row_samples_of(g)):
                if sample in seen and wrong_sample is not None:
                    sample = wrong_sample
                seen.add(sample)
                ids, mask = g.completion_ids[row : row + 1], g.completion_mask[row : row + 1]
                logprobs, _ = completion_logprobs(
                    algo.model, [g.prompt_ids], ids, mask, algo.temperature, algo.pad_id
                )
                with torch.no_grad():
                    values = completion_values(algo.critic, [g.prompt_ids], ids, mask, algo.pad_id)
                trained = g.policy_mask[row]
                advantage = float(g.rewards[sample]) - values[0][trained]
                logp = logprobs[0][trained]
                ratio = torch.exp(logp - logp.detach())
                weight = torch.exp(logp.detach() - g.behaviour_logprobs[row][trained]).clamp(
                    max=algo.options.tis_cap
                )
                eps = algo.config.clip_eps
                term = torch.minimum(ratio * advantage, ratio.clamp(1 - eps, 1 + eps) * advantage)
                loss = loss - (weight * term).sum() / total
        return loss

    loss = loop()
    want = oracle_gradients(algo.model, loss)
    metrics, grads = step_gradients(algo, segmented)
    assert metrics["policy_loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert worst_relative_error([want], grads["policy"]) <= 1e-5
    assert metrics["reward_mean"] == pytest.approx(
        float(torch.stack([g.rewards for g in segmented]).mean())
    )  # over the 12 samples, not the 13 rows
    wrong = loop(SPLIT_SAMPLE + 1).item()
    assert abs(wrong - metrics["policy_loss"]) > 1e3 * 1e-5 * abs(metrics["policy_loss"])


def test_the_batch_maps_each_row_to_its_sample_and_select_carries_it(segmented):
    batch = stack_groups(segmented, 0)
    assert batch["row_samples"].tolist() == [0, 1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10, 11]
    assert batch["rewards"].shape == (3, 4) and len(batch["prompts"]) == 13
    assert batch["prompts"][4:9] == [segmented[1].prompt_ids] * 5
    assert int(batch["completion_mask"].sum()) == sum(int(g.policy_mask.sum()) for g in segmented)
    assert int(batch["token_mask"][6].sum()) == int(batch["completion_mask"][6].sum()) + TAIL
    part = select(batch, torch.tensor([6, 12]))
    assert part["row_samples"].tolist() == [5, 11]
    plain = stack_groups([dataclasses.replace(g, row_samples=None) for g in (segmented[0],)], 0)
    assert torch.equal(plain["row_samples"], torch.arange(4))


def test_each_rank_is_sent_its_rows_with_their_samples(segmented):
    """What GRPO scatters to 3 ranks (`row_shares`, through the wire codec): each rank's block
    of the 13 rows, with the row's index into the step's samples and its advantage."""
    from asyncrl.algos.parallel import received_share, row_shares, share_rows
    from asyncrl.distributed import wire

    batch = stack_groups(segmented, 0)
    advantages = torch.randn(3, 4).reshape(-1)[batch["row_samples"]].unsqueeze(1)
    shares = row_shares(select(batch, slice(None)), {"advantages": advantages}, {}, 3)
    for rank, sent in enumerate(shares):
        share = received_share(wire.unpack(*wire.pack(sent)))
        own = share_rows(13, rank, 3)
        assert torch.equal(share["row_samples"], batch["row_samples"][own])
        assert torch.equal(share["advantages"], advantages[own])
        assert share["prompts"] == batch["prompts"][own]


def test_micro_batches_do_not_change_a_step_with_segments(segmented):
    _, whole = step_gradients(build("algo.name=grpo", "train.micro_batch_size=0"), segmented)
    for size in (2, 5):
        _, split = step_gradients(
            build("algo.name=grpo", f"train.micro_batch_size={size}"), segmented
        )
        assert worst_relative_error(whole["policy"], split["policy"]) <= 1e-6, size


# --- which rows a step trains, and in what order


def test_a_uniform_group_is_skipped_with_every_one_of_its_rows(segmented):
    """13 rows; the segmented group's 5 are all left out when its rewards are equal, and all
    trained when they are not."""
    skip = ("algo.name=grpo", "algo.skip_zero_variance_groups=true", *PLAIN)
    uniform = [segmented[0], dataclasses.replace(segmented[1], rewards=torch.ones(4)), segmented[2]]
    metrics, _ = step_gradients(build(*skip), uniform)
    assert metrics["trained_rows"] == 8  # not 9: the segment row goes with its group
    record = step_record(3, 0, uniform, metrics)
    assert record["skipped_ordinals"] == [segmented[1].ordinal]
    other = [*segmented[:2], dataclasses.replace(segmented[2], rewards=torch.ones(4))]
    metrics, _ = step_gradients(build(*skip), other)
    assert metrics["trained_rows"] == 9


def test_the_passes_see_a_groups_rows_together_shortest_first(segmented, monkeypatch):
    """GRPO's share of the step (the first `select`): every row once, each group's rows
    contiguous, in group order, each group's ordered by width."""
    seen: list[dict] = []
    real = grpo.select

    def spy(batch, rows):
        part = real(batch, rows)
        seen.append(part)
        return part

    monkeypatch.setattr(grpo, "select", spy)
    step_gradients(build("algo.name=grpo", "train.micro_batch_size=2"), segmented)
    share = seen[0]
    samples = share["row_samples"].tolist()
    assert sorted(samples) == [0, 1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10, 11]
    groups_in_order = [s // 4 for s in samples]
    assert groups_in_order == sorted(groups_in_order)
    widths = share["completion_mask"].long().cumsum(1).argmax(1).tolist()
    for group in range(3):
        own = [w for w, g in zip(widths, groups_in_order, strict=True) if g == group]
        assert own == sorted(own)


def test_shortest_first_with_groups_of_different_row_counts():
    """Hand-computed: groups of 2, 3 and 1 rows (row 4 left out); widths are last real columns,
    ties keep their order."""
    mask = torch.tensor(
        [
            [1, 1, 1, 0],  # row 0, group 0: 3
            [1, 0, 0, 0],  # row 1, group 0: 1
            [1, 1, 0, 0],  # row 2, group 1: 2
            [1, 1, 1, 1],  # row 3, group 1: 4
            [1, 0, 0, 0],  # row 4, group 1: 1 (left out)
            [0, 1, 0, 0],  # row 5, group 1: 2 (after row 2: stable)
            [1, 1, 1, 1],  # row 6, group 2: 4
        ]
    ).bool()
    groups = torch.tensor([0, 0, 1, 1, 1, 1, 2])
    rows = torch.tensor([0, 1, 2, 3, 5, 6])
    assert shortest_first(rows, mask, groups).tolist() == [1, 0, 2, 5, 3, 6]


# --- the group's contract and its checkpoints


def test_a_group_whose_shapes_do_not_fit_together_is_refused(segmented):
    middle = segmented[1]
    for rows in ([0, 1, 2, 3], [0, 1, 1, 3, 3], [0, 2, 2, 2, 3], [1, 1, 2, 3, 3], [0, 1, 0, 2, 3]):
        with pytest.raises(ValueError, match="row_samples"):
            dataclasses.replace(middle, row_samples=torch.tensor(rows))
    with pytest.raises(ValueError, match="no row_samples"):
        dataclasses.replace(middle, row_samples=None)
    with pytest.raises(ValueError, match="rewards"):
        dataclasses.replace(middle, reward_components={"x": torch.zeros(5)})
    with pytest.raises(ValueError, match="loss_mask"):
        dataclasses.replace(middle, loss_mask=middle.loss_mask[:4])
    assert (middle.num_samples, middle.num_rows, middle.num_generations) == (4, 5, 4)


def test_a_buffer_with_segment_groups_round_trips_through_a_checkpoint(segmented, tmp_path):
    buffer = ReplayBuffer(num_prompts_per_step=3, capacity=3)
    for group in segmented:
        buffer.add(group)
    store = CheckpointStore(tmp_path, run_id="r")
    parts = {"trainer": {"step": 0}, "buffer": buffer.state_dict()}
    store.save(0, encode(Snapshot(parts, {})), "hash")
    verified, _ = store.latest()
    restored = ReplayBuffer(num_prompts_per_step=3, capacity=3)
    restored.load_state_dict(decode(verified).parts["buffer"])
    back = restored.sample(0)
    assert back[0].row_samples is None
    assert back[1].row_samples.dtype == torch.int64
    assert back[1].row_samples.tolist() == [0, 1, 1, 2, 3]
    for want, got in zip(segmented, back, strict=True):
        assert tokens_digest([want]) == tokens_digest([got])
        assert torch.equal(want.rewards, got.rewards)


def test_a_group_saved_before_row_samples_loads_without_segments(groups):
    state = group_state(groups[0])
    assert "row_samples" not in state  # a group without segments is saved as before
    assert group_from_state(state).row_samples is None


def test_the_tokens_digest_tells_which_sample_a_row_trains(segmented):
    """The same 5 rows with the segment given to sample 2 instead of 1 train other advantages:
    the step's digest must differ."""
    middle = segmented[1]
    other = dataclasses.replace(middle, row_samples=torch.tensor([0, 1, 2, 2, 3]))
    assert tokens_digest([middle]) != tokens_digest([other])
