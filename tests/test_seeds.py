"""The run's derived seeds (`asyncrl.core.seeds`): fixed functions of their inputs. A change
to one would make a resumed run draw other noise than the checkpoint's run (I5), so the values
are pinned, computed here by hand from SHA-256."""

import hashlib

from asyncrl.core.seeds import continued_seed, derived_seed, eval_seed, noise_seed


def by_hand(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") % 2**63


def test_each_seed_is_the_sha256_of_its_tag_and_inputs():
    assert noise_seed(0, 5) == by_hand("asyncrl-noise:0:5") == 1752090238228993653
    assert eval_seed(3, 1) == by_hand("asyncrl-eval:3:1") == 6788015077088749104
    assert continued_seed(11, 2, 7) == by_hand("asyncrl-continued:11:2:7") == 2818159474935748776


def test_seeds_with_other_tags_or_inputs_differ():
    seeds = {noise_seed(0, 5), eval_seed(0, 5), noise_seed(0, 6), noise_seed(1, 5)}
    assert len(seeds) == 4
    assert all(0 <= s < 2**63 for s in seeds)
    assert derived_seed("t", 1, 23) != derived_seed("t", 12, 3)  # the separator counts
