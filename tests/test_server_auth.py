"""Launched vLLM servers require a secret of their launch on every route, and listen on loopback
(issue 63, defect 7): vLLM's `--api-key` guards only `/v1`, `/v2`, `/inference` and `/cohere`,
so `/collective_rpc`, `/pause` and the rest of the dev-mode routes were open to any local user.
Here: the middleware (`server_auth.RequireSecret`) called as ASGI, the launch command and
environment, and attaching to stand-ins (`fake_vllm.py`) that require a secret or do not. The
real servers' 401s are in tests/test_vllm_servers.py."""

from __future__ import annotations

import ast
import asyncio
import sys
from pathlib import Path

import attached
import pytest
from attached import batch
from fake_vllm import FakeVLLM

from asyncrl.config import ConfigError
from asyncrl.rollout import server_auth, servers
from asyncrl.rollout.lifeline import Lifeline
from asyncrl.rollout.server_auth import SECRET_ENV, RequireSecret

policy, attach_to = attached.policy, attached.attach_to  # fixtures
ROUTES = ("/health", "/collective_rpc", "/v1/load_lora_adapter", "/pause", "/resume",
          "/update_weight_version", "/weight_info", "/abort_requests", "/server_info",
          "/is_paused", "/v1/completions", "/metrics", "/docs", "//v1/models")  # fmt: skip


def call(path: str, method: str = "POST", headers=(), kind: str = "http"):
    """One request through `app`: (the status sent, whether the inner app was reached)."""
    reached, sent = [], []

    async def inner(scope, receive, send):
        reached.append(scope["path"])

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    scope = {"type": kind, "path": path, "method": method, "headers": list(headers)}
    asyncio.run(RequireSecret(inner)(scope, receive, send))
    status = next((m.get("status") or m.get("code") for m in sent), None)
    return status, bool(reached)


@pytest.fixture
def guard(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    return None


def test_every_path_and_method_needs_the_secret(guard):
    right = [(b"authorization", b"Bearer s3cret")]
    for path in ROUTES:
        for method in ("GET", "POST", "OPTIONS"):
            assert call(path, method) == (401, False), (path, method)
            assert call(path, method, [(b"authorization", b"Bearer wrong")]) == (401, False)
            assert call(path, method, [(b"authorization", b"s3cret")]) == (401, False)
            assert call(path, method, right) == (None, True), (path, method)
    assert call("/v1/realtime", kind="websocket") == (1008, False)
    assert call("/v1/realtime", headers=right, kind="websocket") == (None, True)


def test_a_server_with_no_secret_set_does_not_start(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(RuntimeError, match=SECRET_ENV):
        RequireSecret(lambda *a: None)


def test_launched_servers_listen_on_loopback_with_the_guard_and_the_secret_kept_off_their_command():
    command = servers.server_command("/m", 8000, "float32", {})
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--middleware") + 1] == "asyncrl.rollout.server_auth.RequireSecret"
    env = servers.server_env("s3cret")
    assert env[SECRET_ENV] == env["VLLM_API_KEY"] == "s3cret"  # every route; vLLM's own /v1
    assert not any("s3cret" in part for part in command)  # /proc/PID/cmdline: every user's


def test_what_runs_inside_the_server_or_the_guard_imports_the_standard_library_only():
    for module in (server_auth.__file__, sys.modules[Lifeline.__module__].__file__):
        path = Path(str(module))
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top == "__future__" or top in sys.stdlib_module_names, (path, name)


@pytest.fixture
def guarded():
    fake = FakeVLLM(secret="s3cret").start()
    yield fake
    fake.stop()


def test_an_attached_server_that_requires_a_secret_gets_it_on_every_request(
    guarded, attach_to, monkeypatch, capsys
):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ConfigError, match=f"requires a secret: set {SECRET_ENV}"):
        attach_to([guarded])
    monkeypatch.setenv(SECRET_ENV, "wrong")
    with pytest.raises(ConfigError, match="the one set is refused"):
        attach_to([guarded])
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    refused = len(guarded.refused)
    engine, _ = attach_to([guarded])
    engine.generate(batch())
    assert guarded.completions > 0 and ("POST", "/collective_rpc") in guarded.calls
    assert guarded.refused[refused:] == ["/is_paused"]  # the probe without it, alone refused
    assert "WARNING" not in capsys.readouterr().out


def test_attaching_to_a_server_whose_dev_routes_answer_anyone_warns_what_they_allow(
    attach_to, capsys
):
    fake = FakeVLLM().start()
    try:
        attach_to([fake])
    finally:
        fake.stop()
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "WARNING" in x]
    assert f"{fake.url} answers vLLM's dev-mode routes without a secret" in line
    assert "/collective_rpc" in line and "--middleware" in line
