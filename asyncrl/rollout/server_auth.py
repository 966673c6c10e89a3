"""A secret on every route of a vLLM server, for the server's own process: vLLM's `--api-key`
(or `VLLM_API_KEY`) guards only paths under `/v1`, `/v2`, `/inference` and `/cohere`
(`vllm/entrypoints/serve/middleware/authenticate.py`, `GUARDED_PREFIX`), which leaves the
dev-mode routes asyncrl drives open: `/collective_rpc` (any worker method, `reload_weights`
from any path), `/pause`, `/resume`, `/update_weight_version`, `/abort_requests`,
`/server_info`. This ASGI middleware, given to the server as `--middleware
asyncrl.rollout.server_auth.RequireSecret`, answers 401 to every request (any path, any method,
websockets closed) that does not carry `Authorization: Bearer <secret>`, the secret read from
`ASYNCRL_SERVER_SECRET` in the server's environment (an environment is readable by its user
only; a command line, by every user: never `--api-key SECRET`). A server started without the
variable does not start. Standard library only: it runs inside vLLM's process.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

SECRET_ENV = "ASYNCRL_SERVER_SECRET"
"""The secret a server requires (`RequireSecret`), and for attached servers the one asyncrl
sends them."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
App = Callable[
    [Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
    Awaitable[None],
]


def bearer(secret: str) -> dict[str, str]:
    """The header a client sends."""
    return {"Authorization": f"Bearer {secret}"}


def authorized(headers: Iterable[tuple[bytes, bytes]], digest: bytes) -> bool:
    """Whether ASGI `headers` carry the bearer token whose SHA-256 is `digest` (compared in
    constant time)."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                given = hashlib.sha256(token.strip().encode()).digest()
                return hmac.compare_digest(given, digest)
    return False


class RequireSecret:
    """See the module docstring."""

    def __init__(self, app: App) -> None:
        secret = os.environ.get(SECRET_ENV, "")
        if not secret:
            raise RuntimeError(f"{SECRET_ENV} is not set: a server with no secret is not started")
        self.app = app
        self.digest = hashlib.sha256(secret.encode()).digest()

    async def __call__(
        self,
        scope: Scope,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] not in ("http", "websocket") or authorized(
            scope.get("headers") or [], self.digest
        ):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            body = b'{"error": "Unauthorized"}'
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})  # fmt: skip
            await send({"type": "http.response.body", "body": body})
