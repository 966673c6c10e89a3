"""The ledger: every ordinal is pending, in flight or buffered, and admission never strands a
pulled ticket."""

from asyncrl.core.ledger import Ledger
from asyncrl.core.stream import PromptStream


def ledger(n: int = 3) -> Ledger:
    return Ledger(PromptStream(num_rows=50, num_prompts_per_step=n, seed=0))


def test_admission_stops_at_the_window_edge_without_pulling_past_it():
    led = ledger()
    tickets = led.admit(weights_version=0, window=1, max_count=100, end_target=10**6)
    assert [t.ordinal for t in tickets] == [0, 1, 2, 3, 4, 5]  # targets 0 and 1
    assert led.stream.cursor == 6  # nothing pulled for target 2
    assert led.admit(weights_version=0, window=1, max_count=100, end_target=10**6) == []
    assert [t.ordinal for t in led.admit(1, 1, 100, 10**6)] == [6, 7, 8]


def test_completed_ordinals_leave_flight_and_the_rest_are_saved_as_in_flight():
    led = ledger()
    led.admit(weights_version=0, window=0, max_count=3, end_target=10**6)
    led.complete(1)
    assert sorted(led.in_flight) == [0, 2]
    assert led.state_dict()["in_flight"] == [[0, 0], [2, 0]]
    assert led.stream.state_dict()["cursor"] == 3


def test_restored_in_flight_ordinals_are_dispatched_again_first_to_their_own_targets():
    led = ledger()
    led.admit(weights_version=1, window=1, max_count=9, end_target=10**6)  # ordinals 0..5
    for k in (0, 1, 2, 4):
        led.complete(k)
    restored = ledger()
    restored.stream.load_state_dict(led.stream.state_dict())
    restored.load_state_dict(led.state_dict())
    again = restored.admit(weights_version=1, window=1, max_count=4, end_target=10**6)
    assert [(t.ordinal, t.target_step) for t in again] == [(3, 1), (5, 1), (6, 2), (7, 2)]
    assert again[0] == led.stream.ticket(3)  # same dataset row as the first time


def test_a_failed_batch_goes_back_to_the_front_of_the_queue():
    led = ledger()
    first = led.admit(weights_version=0, window=1, max_count=2, end_target=10**6)
    led.fail(first)
    assert led.in_flight == {}
    # the re-dispatched batch goes out again on its own (a deterministic run repeats it),
    # and only then fresh tickets
    assert [t.ordinal for t in led.admit(0, 1, 3, 10**6)] == [0, 1]
    assert [t.ordinal for t in led.admit(0, 1, 3, 10**6)] == [2, 3, 4]


def test_admission_stops_at_the_last_step_of_the_run():
    # max_num_steps=4 with A=3: version 0 may admit targets 0-3, and nothing for 4-7, which no
    # step will ever train
    led = ledger(n=2)
    tickets = led.admit(weights_version=3, window=3, max_count=100, end_target=4)
    assert sorted({t.target_step for t in tickets}) == [0, 1, 2, 3]
    assert led.stream.cursor == 8 and led.admit(9, 3, 100, end_target=4) == []


def test_a_lossy_plan_applied_to_the_ledger_skips_the_in_flight_and_refills_short_targets():
    from asyncrl.core.resume import plan_resume

    led = ledger(n=3)
    led.admit(weights_version=0, window=1, max_count=5, end_target=10**6)  # 0-4: targets 0, 1
    for k in (0, 1, 2, 3):
        led.complete(k)
    restored = ledger(n=3)
    restored.stream.load_state_dict(led.stream.state_dict())
    restored.load_state_dict(led.state_dict())
    saved = restored.saved(step=1, buffered=[(3, 1)])  # step 0 trained, ordinal 3 buffered
    assert saved.in_flight == [(4, 1)] and saved.cursor == 5
    lossless = plan_resume(saved, "lossless")
    restored.apply(lossless)
    assert [t.ordinal for t in restored.redispatch] == [4]  # lossless: dispatched again
    restored.apply(plan_resume(saved, "keep_incomplete"))
    again = restored.admit(weights_version=1, window=0, max_count=10, end_target=10**6)
    assert [(t.ordinal, t.target_step) for t in again] == [(5, 1), (6, 1)]  # 4 is skipped
