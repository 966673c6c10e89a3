"""The look-ahead window and the staleness bound (I2 at unit level)."""

import pytest

from asyncrl.core.window import is_admissible, staleness


def test_synchronous_window_admits_target_t_only_once_version_t_exists():
    assert is_admissible(target_step=3, weights_version=3, window=0)
    assert not is_admissible(target_step=4, weights_version=3, window=0)


@pytest.mark.parametrize("age", [0, 1, 2, 5])
def test_every_admitted_group_is_trained_within_the_age_bound(age):
    # Simulate: the trainer at version v trains step v; the collector admits with the version
    # it sees. Whatever target is admitted, its staleness at training time is in [0, age].
    for version in range(10):
        for target in range(20):
            if is_admissible(target, version, age) and target >= version:
                assert 0 <= staleness(target, version) <= age


def test_window_holds_exactly_a_plus_one_targets_ahead_of_the_trainer():
    version = 7
    admitted = [t for t in range(version, version + 10) if is_admissible(t, version, 2)]
    assert admitted == [7, 8, 9]
