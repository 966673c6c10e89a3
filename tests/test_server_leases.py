"""What an attached vLLM server holds is read back from it, never assumed (issue 63, defect 6),
and one server serves one run: the engine against stand-ins of vLLM's HTTP surface
(`fake_vllm.py`, a real HTTP server in this process), and the pure rules on vLLM's
weight-version string (`server_leases`)."""

from __future__ import annotations

import attached
import pytest
from attached import batch
from fake_vllm import FakeVLLM

from asyncrl.config import ConfigError
from asyncrl.rollout import server_leases, server_weights
from asyncrl.rollout.server_leases import (
    RELEASED,
    holder,
    lease_problem,
    loaded_version,
    make_tag,
    parse_tag,
)
from asyncrl.rollout.servers import ServerError

policy, fakes, attach_to = attached.policy, attached.fakes, attached.attach_to  # fixtures

# -- the rules, pure -----------------------------------------------------------------------------


def test_a_servers_string_names_the_run_the_launch_and_the_version_it_holds():
    assert parse_tag(make_tag("r1", "l1", 7)) == ("r1", "l1", 7)
    assert parse_tag(make_tag("r1", "l1", None)) == ("r1", "l1", None)
    for free in ("default", RELEASED, "7", "", "asyncrl::x:1"):
        assert parse_tag(free) is None and holder(free) is None, free
    assert loaded_version(make_tag("r1", "l1", 7), "r1", "l1") == 7
    # another launch of the same run (a relaunch after a kill) holds other weights as "7"
    assert loaded_version(make_tag("r1", "l0", 7), "r1", "l1") is None
    assert loaded_version("default", "r1", "l1") is None  # a restart: its initial weights


def test_only_another_runs_string_keeps_a_server_from_this_run():
    assert lease_problem("default", "r1") == ""
    assert lease_problem(RELEASED, "r1") == ""
    assert lease_problem(make_tag("r1", "old", 3), "r1") == ""  # a killed launch of this run
    problem = lease_problem(make_tag("r2", "l", 3), "r1", "http://h:1")
    assert "serves run r2" in problem and "one server serves one run" in problem
    assert (
        f'{{"new_version": "{RELEASED}"}}' in problem
        and "http://h:1/update_weight_version" in problem
    )


# -- the engine against stand-ins ----------------------------------------------------------------


def test_a_server_restarted_between_batches_is_reloaded_before_it_samples_again(fakes, attach_to):
    """Both batches ask for version 0. Between them server 0 is restarted by its supervisor
    (a new process on the same port: its initial weights, its string "default"): the second
    batch reads that back and reloads it before any request, instead of sampling the initial
    weights tagged as version 0."""
    engine, _ = attach_to(fakes)
    engine.generate(batch())
    assert all(f.reloads == 1 for f in fakes)
    port = fakes[0].port
    fakes[0].stop()
    fakes[0] = FakeVLLM(port).start()  # restarted: "default", weights of its own
    outputs = engine.generate(batch())
    assert fakes[0].reloads == 1 and fakes[1].reloads == 1  # server 1 held it: not reloaded
    assert loaded_version(fakes[0].weight_version, "run-a", engine.launch_id) == 0
    first_completion = fakes[0].calls.index(("POST", "/v1/completions"))
    assert ("POST", "/collective_rpc") in fakes[0].calls[:first_completion]
    assert all(o.weights_version == 0 for o in outputs)


def test_a_server_restarted_under_a_stream_reads_its_version_back_before_it_samples_again(
    fakes, attach_to
):
    """The review's case: a supervisor restarts the server while a stream is in flight, and it
    answers `/health` again at once, so the engine takes the break for the stream's alone and
    sends the continuation back to it. Its weights are read back first (its initial ones:
    reloaded) instead of sampling them tagged as the batch's version (I2)."""
    engine, _ = attach_to(fakes[:1])
    fakes[0].restart_in_stream = True
    outputs = engine.generate(batch(1))  # one stream: no other in flight across the restart
    calls = fakes[0].calls
    restarted = calls.index(("RESTART", ""))
    after = calls[restarted:]
    assert ("POST", "/v1/completions") in after, "the continuation went elsewhere"
    first_completion = after.index(("POST", "/v1/completions"))
    assert ("POST", "/collective_rpc") in after[:first_completion], "sampled without a reload"
    assert fakes[0].reloads == 2
    assert all(o.weights_version == 0 for o in outputs)


def test_an_attached_server_found_dead_is_used_again_once_it_answers(fakes, attach_to):
    """Server 0 goes down before a batch: the batch runs on server 1. Once it answers again
    (restarted), the next batch uses it, loaded first."""
    engine, _ = attach_to(fakes)
    port = fakes[0].port
    fakes[0].stop()
    engine.generate(batch())
    assert not engine.servers[0].alive
    fakes[0] = FakeVLLM(port).start()
    engine.generate(batch(8))
    assert engine.servers[0].alive
    assert fakes[0].completions > 0 and fakes[0].reloads == 1


def test_a_server_another_run_holds_is_refused_at_attach_and_its_requests_are_left_alone(
    fakes, attach_to
):
    """Run A holds both servers; run B's attach is refused in one line naming the key, the URL
    and run A, and nothing of A's is aborted. A killed launch of A (same run id) attaching
    again aborts what that launch left; when A ends, the servers are released and B may
    attach."""
    first, _ = attach_to(fakes, "run-a")
    first.generate(batch())
    with pytest.raises(ConfigError) as refused:
        attach_to(fakes, "run-b")
    (line,) = str(refused.value).splitlines()
    assert line.startswith(f"rollout.servers.urls: {fakes[0].url} cannot serve this run")
    assert "serves run run-a" in line
    assert all(f.aborts == 0 for f in fakes)  # run A's requests are not run B's to abort
    again, _ = attach_to(fakes, "run-a")  # a relaunch of run A: its killed launch's requests
    assert all(f.aborts == 1 for f in fakes)
    first.shutdown()
    again.shutdown()
    assert all(f.weight_version == RELEASED for f in fakes)
    other, _ = attach_to(fakes, "run-b")
    other.generate(batch())
    assert all(f.aborts == 1 for f in fakes)  # a free server's requests are not aborted either
    assert all(holder(f.weight_version) == "run-b" for f in fakes)


def test_a_server_taken_by_another_run_mid_run_fails_the_batch_naming_that_run(fakes, attach_to):
    engine, _ = attach_to(fakes)
    engine.generate(batch())
    fakes[1].weight_version = make_tag("run-z", "l", 5)  # another run loaded its weights
    with pytest.raises(ServerError, match="serves run run-z"):
        engine.generate(batch())


def test_a_load_cut_short_leaves_no_version_on_the_server(fakes, attach_to, monkeypatch):
    """The string names no version while the weights change: a load that fails after
    `reload_weights` leaves none, so the next batch reloads rather than trusting it."""
    engine, weights = attach_to(fakes[:1])
    engine.generate(batch())
    weights.publish(1, dict(weights.get(0)))
    real = server_leases.write_tag

    def fail_after_reload(server, text, timeout=30.0):
        if text.endswith(":1"):
            raise ServerError("cut short")
        real(server, text, timeout)

    monkeypatch.setattr(server_weights, "write_tag", fail_after_reload)
    with pytest.raises(ServerError, match="cut short"):
        engine.generate(batch())
    assert parse_tag(fakes[0].weight_version) == ("run-a", engine.launch_id, None)
