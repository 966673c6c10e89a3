"""Twenty SIGKILLs at random moments placed by the run's state: after a random number of new
steps and a random fraction of a second more (benchmarks/chaos.py; `make chaos` runs 200)."""

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import chaos  # noqa: E402
import launcher  # noqa: E402
from chaos import ChaosViolation, run_chaos  # noqa: E402


@pytest.fixture(autouse=True)
def forked_launches(monkeypatch):
    """Each launch a real process forked from the pre-imported launcher (tests/launcher.py)."""
    monkeypatch.setattr(chaos, "POPEN", launcher.popen)


def test_twenty_random_kills_keep_i1_i3_and_i4(tmp_path):
    # with micro-batches: each step's 16 sequences in forward/backward passes of 5, 5, 5, 1
    result = run_chaos(
        trials=20, root=tmp_path, seed=7, log=lambda _: None, extra=["train.micro_batch_size=5"]
    )
    assert result["kills"] == 20
    # the precondition: most kills hit a run that then resumed from a checkpoint (launches
    # killed after 0-12 new steps with a checkpoint every 3), on a machine of any speed
    assert result["resumed"] >= 10, result
    print(f"chaos: {result['kills']} kills over {result['runs']} runs: I1, I3, I4 held")


def test_the_same_checker_catches_a_lossy_resume_policy(tmp_path):
    # Kills right after a checkpoint with prompts in flight became durable, resumed under
    # keep_incomplete: the in-flight prompts are skipped and the checker must say so.
    with pytest.raises(ChaosViolation, match="never trained"):
        run_chaos(
            trials=2,
            root=tmp_path,
            log=lambda _: None,
            extra=["checkpoint.resume_policy=keep_incomplete", "run.max_num_steps=40"],
            fault="checkpoint.parent_fsynced[in_flight]",
        )


def test_random_kills_of_multi_turn_episodes_keep_i9(tmp_path):
    # the multi-turn shape (`--episodes`: a user's environment that journals its steps); six
    # kills here, `benchmarks/chaos.py --episodes --trials 30` for the sweep
    result = run_chaos(trials=6, root=tmp_path, seed=3, log=lambda _: None, episodes=True)
    assert result["kills"] == 6
    assert result["resumed"] >= 2, result  # the precondition: resumes from checkpoints
