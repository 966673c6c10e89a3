"""The prompt stream: ordinal -> (epoch, position) -> row, a pure function (I1 at unit level)."""

import os
import subprocess
import sys

import pytest

from asyncrl.core.stream import PromptStream, epoch_permutation


def test_ordinals_are_handed_out_contiguously_with_target_k_div_n():
    stream = PromptStream(num_rows=10, num_prompts_per_step=4, seed=3)
    tickets = [stream.take() for _ in range(25)]
    assert [t.ordinal for t in tickets] == list(range(25))
    assert [t.target_step for t in tickets] == [k // 4 for k in range(25)]
    assert stream.cursor == 25


def test_each_epoch_visits_every_row_exactly_once_across_epoch_boundaries():
    stream = PromptStream(num_rows=7, num_prompts_per_step=3, seed=1)
    tickets = [stream.take() for _ in range(21)]
    for epoch in range(3):
        rows = [t.dataset_index for t in tickets if t.epoch == epoch]
        assert sorted(rows) == list(range(7))
        assert [t.position for t in tickets if t.epoch == epoch] == list(range(7))


def test_permutation_is_a_pure_function_of_seed_and_epoch():
    assert epoch_permutation(5, 2, 100) == epoch_permutation(5, 2, 100)
    assert epoch_permutation(5, 2, 100) != epoch_permutation(5, 3, 100)
    assert epoch_permutation(5, 2, 100) != epoch_permutation(6, 2, 100)
    # pinned values: a change to the permutation breaks every saved run's dataset order
    assert epoch_permutation(0, 0, 8) == [4, 1, 3, 7, 0, 2, 6, 5]


@pytest.mark.slow
def test_permutation_does_not_depend_on_the_process_hash_seed():
    code = "from asyncrl.core.stream import epoch_permutation; print(epoch_permutation(3, 1, 50))"
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for hash_seed in ("1", "2")
    }
    assert outputs == {f"{epoch_permutation(3, 1, 50)}\n"}


def test_ticket_of_any_ordinal_does_not_move_the_cursor_and_matches_take():
    a = PromptStream(num_rows=5, num_prompts_per_step=2, seed=9)
    b = PromptStream(num_rows=5, num_prompts_per_step=2, seed=9)
    looked_up = [a.ticket(k) for k in (13, 2, 7)]
    assert a.cursor == 0
    taken = [b.take() for _ in range(14)]
    assert looked_up == [taken[13], taken[2], taken[7]]


def test_a_restored_cursor_continues_the_same_sequence():
    a = PromptStream(num_rows=6, num_prompts_per_step=2, seed=4)
    for _ in range(9):
        a.take()
    b = PromptStream(num_rows=6, num_prompts_per_step=2, seed=4)
    b.load_state_dict(a.state_dict())
    assert [b.take() for _ in range(8)] == [a.take() for _ in range(8)]


def test_a_stream_state_is_loaded_only_onto_the_same_rows():
    from asyncrl.core.stream import DataChanged

    saved = PromptStream(10, 2, seed=0, data_sha256="ab" * 32).state_dict()
    PromptStream(10, 2, seed=0, data_sha256="ab" * 32).load_state_dict(saved)
    with pytest.raises(DataChanged, match=r"cut on 10 examples .*now has 11"):
        PromptStream(11, 2, seed=0, data_sha256="ab" * 32).load_state_dict(saved)
    with pytest.raises(DataChanged, match=r"sha256 abababababababab.*sha256 cdcdcdcdcdcdcdcd"):
        PromptStream(10, 2, seed=0, data_sha256="cd" * 32).load_state_dict(saved)
    older = {k: v for k, v in saved.items() if k not in ("num_rows", "data_sha256")}
    PromptStream(11, 2, seed=0, data_sha256="cd" * 32).load_state_dict(older)  # not judged
