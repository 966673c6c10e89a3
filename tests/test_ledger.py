"""The ledger: every ordinal is pending, in flight or buffered, and admission never strands a
pulled ticket."""

from asyncrl.core.ledger import Ledger
from asyncrl.core.stream import PromptStream


def ledger(n: int = 3) -> Ledger:
    return Ledger(PromptStream(num_rows=50, num_prompts_per_step=n, seed=0))


def test_admission_stops_at_the_window_edge_without_pulling_past_it():
    led = ledger()
    tickets = led.admit(weights_version=0, max_age_steps=1, max_count=100)
    assert [t.ordinal for t in tickets] == [0, 1, 2, 3, 4, 5]  # targets 0 and 1
    assert led.stream.cursor == 6  # nothing pulled for target 2
    assert led.admit(weights_version=0, max_age_steps=1, max_count=100) == []
    assert [t.ordinal for t in led.admit(1, 1, 100)] == [6, 7, 8]


def test_completed_ordinals_leave_flight_and_the_rest_are_saved_as_in_flight():
    led = ledger()
    led.admit(weights_version=0, max_age_steps=0, max_count=3)
    led.complete(1)
    assert sorted(led.in_flight) == [0, 2]
    assert led.state_dict()["in_flight"] == [[0, 0], [2, 0]]
    assert led.state_dict()["stream"]["cursor"] == 3


def test_restored_in_flight_ordinals_are_dispatched_again_first_to_their_own_targets():
    led = ledger()
    led.admit(weights_version=1, max_age_steps=1, max_count=9)  # ordinals 0..5
    for k in (0, 1, 2, 4):
        led.complete(k)
    restored = ledger()
    restored.load_state_dict(led.state_dict())
    again = restored.admit(weights_version=1, max_age_steps=1, max_count=4)
    assert [(t.ordinal, t.target_step) for t in again] == [(3, 1), (5, 1), (6, 2), (7, 2)]
    assert again[0] == led.stream.ticket(3)  # same dataset row as the first time


def test_a_failed_batch_goes_back_to_the_front_of_the_queue():
    led = ledger()
    first = led.admit(weights_version=0, max_age_steps=1, max_count=2)
    led.fail(first)
    assert led.in_flight == {}
    assert [t.ordinal for t in led.admit(0, 1, 3)] == [0, 1, 2]
