"""Resume policies as pure plans, starting with the seed's scenario: NeMo RL async PPO, batch
of 7 prompt groups, resuming at step 11 with 5 of its 7 groups in the checkpoint."""

from asyncrl.core.resume import SavedLedger, plan_resume
from asyncrl.core.stream import PromptStream

N = 7
# Step 11 trains ordinals 77..83. The checkpoint holds 77..81 (5/7) finished; 82 and 83 were
# still generating; the stream had handed out everything below 84.
SEED = SavedLedger(
    step=11,
    num_prompts_per_step=N,
    cursor=84,
    in_flight=[(82, 11), (83, 11)],
    buffered=[(k, 11) for k in range(77, 82)],
)


def new_prompts(plan, cursor: int) -> dict[int, list[int]]:
    """Which fresh ordinals (from the cursor on) each target gets before full steps resume."""
    out: dict[int, list[int]] = {}
    for i, target in enumerate(plan.fills):
        out.setdefault(target, []).append(cursor + i)
    return out


def test_seed_scenario_drop_incomplete_bins_5_groups_and_takes_7_new_prompts():
    plan = plan_resume(SEED, "drop_incomplete")
    assert plan.messages == ["Dropping incomplete restored targets: 11=5/7"]
    assert plan.discarded == [77, 78, 79, 80, 81]
    assert plan.skipped == [82, 83]
    assert new_prompts(plan, SEED.cursor) == {11: [84, 85, 86, 87, 88, 89, 90]}
    assert plan.kept == [] and plan.redispatched == []
    assert plan.num_regenerated == 7  # 5 finished groups binned + 2 in flight, all paid again


def test_seed_scenario_keep_incomplete_keeps_5_and_takes_2_new_prompts():
    plan = plan_resume(SEED, "keep_incomplete")
    assert plan.messages == ["Incomplete target 11: 5/7"]
    assert plan.kept == [77, 78, 79, 80, 81]
    assert plan.skipped == [82, 83]
    assert new_prompts(plan, SEED.cursor) == {11: [84, 85]}
    assert plan.discarded == []
    assert plan.num_regenerated == 2


def test_seed_scenario_lossless_reissues_the_2_in_flight_prompts_and_skips_nothing():
    plan = plan_resume(SEED, "lossless")
    assert plan.kept == [77, 78, 79, 80, 81]
    assert plan.redispatched == [(82, 11), (83, 11)]
    assert plan.skipped == [] and plan.discarded == [] and plan.fills == []
    assert plan.messages == []
    assert plan.num_regenerated == 2


def test_both_lossy_policies_train_seven_groups_at_step_11_but_different_ones():
    # "Both branches end up training on 7 prompt groups ... deleting the rows does not buy a
    # better batch, it only changes which prompts fill it."
    keep, drop = plan_resume(SEED, "keep_incomplete"), plan_resume(SEED, "drop_incomplete")
    keep_batch = keep.kept + new_prompts(keep, 84)[11]
    drop_batch = drop.kept + new_prompts(drop, 84)[11]
    assert len(keep_batch) == len(drop_batch) == N
    assert keep_batch == [77, 78, 79, 80, 81, 84, 85]
    assert drop_batch == [84, 85, 86, 87, 88, 89, 90]


def test_a_lossy_refill_continues_with_full_steps_after_the_short_targets():
    # A=1: target 12 was also started (2 buffered, 1 in flight) when the checkpoint landed.
    saved = SavedLedger(
        step=11,
        num_prompts_per_step=N,
        cursor=87,
        in_flight=[(82, 11), (83, 11), (86, 12)],
        buffered=[(k, 11) for k in range(77, 82)] + [(84, 12), (85, 12)],
    )
    plan = plan_resume(saved, "drop_incomplete")
    assert plan.messages == ["Dropping incomplete restored targets: 11=5/7, 12=2/7"]
    assert plan.fills == [11] * 7 + [12] * 7 and plan.next_target == 13
    stream = PromptStream(num_rows=1000, num_prompts_per_step=N, seed=0)
    stream.cursor = saved.cursor
    stream.schedule.refill(saved.cursor, plan.fills, plan.next_target)
    targets = [stream.take().target_step for _ in range(21)]
    assert targets == [11] * 7 + [12] * 7 + [13] * 7


def test_the_seed_scenario_through_the_real_ledger_and_buffer():
    # The same numbers, but from the objects a checkpoint restores, not hand-built tuples.
    import torch

    from asyncrl.core.buffer import ReplayBuffer
    from asyncrl.core.ledger import Ledger
    from asyncrl.core.types import Group

    stream = PromptStream(num_rows=500, num_prompts_per_step=N, seed=1)
    ledger = Ledger(stream)
    stream.cursor = 77
    buffer = ReplayBuffer(N, capacity=2 * N)
    tickets = ledger.admit(weights_version=11, window=0, max_count=N, end_target=10**6)
    assert [t.ordinal for t in tickets] == list(range(77, 84))
    for ticket in tickets[:5]:
        ids, mask = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool)
        buffer.add(Group(ticket, [1], ids, mask, torch.zeros(2, 1), torch.zeros(2), 11, 11))
        ledger.complete(ticket.ordinal)
    restored = Ledger(PromptStream(num_rows=500, num_prompts_per_step=N, seed=1))
    restored.stream.load_state_dict(ledger.stream.state_dict())
    restored.load_state_dict(ledger.state_dict())
    saved = restored.saved(11, buffer.ordinals_and_targets())
    assert saved == SEED
    again = restored.admit(weights_version=11, window=0, max_count=N, end_target=10**6)
    assert [(t.ordinal, t.target_step) for t in again] == [(82, 11), (83, 11)]
