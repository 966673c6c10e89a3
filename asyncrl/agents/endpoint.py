"""The run's OpenAI-compatible endpoint: the HTTP layer an agent's `openai.AsyncOpenAI` talks
to. A FastAPI app (`make_app`) served by uvicorn on loopback in a daemon thread with its own
event loop (`AgentEndpoint`) — the well-kept server library, not a hand-rolled HTTP parser. It
checks a request, turns it into a `ChatCall`/`TextCall` (`asyncrl.agents.calls`) and awaits the
`AgentBackend`, which owns the tokens; then it writes the completion back in OpenAI's form.

    agent (openai client) --HTTP--> route: auth, parse, 400s --await--> backend.chat(call)
                                                                          | batched with the
    agent <-- JSON, or SSE chunks of the finished completion <-- Completion  | other pending
                                                                             calls per pass
Every handler is a coroutine and awaits the backend, so concurrent requests are pending in the
backend together (it batches them into engine passes). A completion is whole when the backend
returns it (it is in the run's log first: that is the design); `stream=true` then streams it.

Routes, each behind `Authorization: Bearer <secret>` (else 401; compared in constant time):
`GET /v1/models`, `GET /s/{key}/v1/models`, `POST /s/{key}/v1/chat/completions`,
`POST /s/{key}/v1/completions`. `{key}` is the sample key of one agent run (`base_url`); an
unknown or ended one is a 404 naming it. `POST /v1/chat/completions` and `POST /v1/completions`
take the key from `model` instead (`sample:KEY`, `SAMPLE_MODEL`), for clients that share one
base URL across runs. Every error body is OpenAI's
`{"error": {"message", "type", "param", "code"}}`, so the `openai` client raises its typed errors.

Honoured chat fields: `messages` (`template_messages`), `tools` (passed to the chat template),
`tool_choice` (absent, `"auto"`: tool calls are parsed with `agent.tool_parser`; `"none"`: the
tools are still rendered, as vLLM does, but nothing is parsed; `"required"` or a named function:
400, nothing constrains the decoding), `max_completion_tokens` or `max_tokens` (the first given;
the backend holds it to the run's limits), `stream`, `stream_options.include_usage`, `logprobs`
(the sampled token's only: `top_logprobs` > 0 is a 400), `return_token_ids` (vLLM's: the
response's `prompt_token_ids`, the choice's `token_ids`), `n` (1 only), `response_format` (absent
or `text` only: 400 otherwise). Text completions honour `prompt` (one string), `max_tokens`,
`stream`, `stream_options.include_usage`, `logprobs` (0 only: the sampled token's),
`return_token_ids`, `n` (1); `echo`, `suffix` and `best_of` > 1 are 400s.
Accepted and ignored — sampling is the run's, the same for every sample it trains on: `model`
(any name on the `/s/KEY/` routes; responses name `backend.model_name`), `temperature`,
`top_p`, `top_k`, `min_p`, `seed`, `stop`, `presence_penalty`, `frequency_penalty`,
`repetition_penalty`, `logit_bias`, `parallel_tool_calls` (every call written is parsed), `user`,
`metadata`, `store`, `service_tier`, `reasoning_effort`, `verbosity`, and any other field.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import threading
import time
from array import array
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import uvicorn
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response, StreamingResponse

from asyncrl.agents.calls import (
    SAMPLE_MODEL,
    AgentBackend,
    CallRefused,
    ChatCall,
    Completion,
    TextCall,
)
from asyncrl.agents.tool_calls import FieldError, ToolCall, ToolParser, template_messages
from asyncrl.agents.tool_calls import tool_parser as find_tool_parser
from asyncrl.rollout.server_auth import authorized

MAX_STREAM_DELTAS = 64
"""A streamed completion's content comes in at most this many deltas (a token each for short
ones): each delta decodes the tokens up to it, so this bounds the decoding to 64 passes."""

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    """An answer other than 200, in OpenAI's error form."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str = ""):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def json_response(body: Any, status: int = 200) -> Response:
    """JSON that allows a `-inf` log-prob (Starlette's JSONResponse refuses non-finite floats)."""
    return Response(json.dumps(body, ensure_ascii=False), status, media_type="application/json")


def error_response(error: ApiError) -> Response:
    kind = ERROR_TYPES.get(error.status, "server_error" if error.status >= 500 else "api_error")
    body = {
        "message": error.message,
        "type": kind,
        "param": error.param,
        "code": error.code or None,
    }
    return json_response({"error": body}, error.status)


class RequireBearer:
    """ASGI middleware: every HTTP request without `Authorization: Bearer <secret>` is a 401,
    whatever its path (an unknown path too: nothing is said to a caller without the secret)."""

    def __init__(self, app: Any, digest: bytes) -> None:
        self.app, self.digest = app, digest

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or authorized(scope.get("headers") or [], self.digest):
            await self.app(scope, receive, send)
            return
        refusal = ApiError(
            401,
            "missing or wrong API key: send Authorization: Bearer <secret>",
            code="invalid_api_key",
        )
        await error_response(refusal)(scope, receive, send)


@dataclass(frozen=True)
class Asked:
    """What a request asks of the response (the call itself goes to the backend)."""

    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    return_token_ids: bool = False
    parse_tools: bool = True


def _check(ok: bool, param: str, problem: str) -> None:
    if not ok:
        raise FieldError(param, problem)


def _optional(body: dict[str, Any], name: str, kind: type, what: str) -> Any:
    """`body[name]`, None where absent or null; a value of another type is a 400 naming it."""
    value = body.get(name)
    wrong = not isinstance(value, kind) or (isinstance(value, bool) and kind is int)
    _check(value is None or not wrong, name, f"must be {what}, not {value!r}")
    return value


def _positive(body: dict[str, Any], name: str) -> int | None:
    value = _optional(body, name, int, "a positive integer")
    _check(value is None or value >= 1, name, f"must be a positive integer, not {value}")
    return value


def _asked(body: dict[str, Any], logprobs: bool, parse_tools: bool = True) -> Asked:
    """The fields both APIs share: `n`, `stream`, `stream_options`, `return_token_ids`."""
    n = _optional(body, "n", int, "1")
    _check(n in (None, 1), "n", f"only n=1 is served (an agent run is one sample), not {n}")
    options = _optional(body, "stream_options", dict, "an object") or {}
    include_usage = options.get("include_usage")
    _check(include_usage in (None, True, False), "stream_options.include_usage", "not a boolean")
    return Asked(
        stream=bool(_optional(body, "stream", bool, "a boolean")),
        include_usage=bool(include_usage),
        logprobs=logprobs,
        return_token_ids=bool(_optional(body, "return_token_ids", bool, "a boolean")),
        parse_tools=parse_tools,
    )


def _check_tools(tools: list[Any]) -> None:
    for i, tool in enumerate(tools):
        ok = isinstance(tool, dict) and tool.get("type") == "function"
        _check(ok, f"tools[{i}].type", 'must be "function"')
        function = tool.get("function")
        _check(isinstance(function, dict), f"tools[{i}].function", "must be an object")
        name = function.get("name")
        _check(isinstance(name, str) and bool(name), f"tools[{i}].function.name", "not a name")
        schema = function.get("parameters", {})
        _check(isinstance(schema, dict), f"tools[{i}].function.parameters", "not an object")


UNCONSTRAINED = "is not served: nothing constrains the decoding"


def parse_chat(key: str, body: dict[str, Any]) -> tuple[ChatCall, Asked]:
    """A chat request's call and what it asks of the response; FieldError naming the field."""
    messages: Any = body.get("messages")
    _check(isinstance(messages, list) and bool(messages), "messages", "not a non-empty list")
    converted = template_messages(messages)
    tools = _optional(body, "tools", list, "a list of tools")
    _check_tools(tools or [])
    tool_choice = body.get("tool_choice")
    _check(tool_choice in (None, "auto", "none"), "tool_choice", f"{tool_choice!r} {UNCONSTRAINED}")
    response_format = _optional(body, "response_format", dict, "an object") or {"type": "text"}
    _check(response_format.get("type") == "text", "response_format", f"not text {UNCONSTRAINED}")
    top_logprobs = _optional(body, "top_logprobs", int, "an integer")
    _check(not top_logprobs, "top_logprobs", "only the sampled token's log-prob is served (0)")
    max_tokens = _positive(body, "max_completion_tokens")
    max_tokens = max_tokens if max_tokens is not None else _positive(body, "max_tokens")
    logprobs = bool(_optional(body, "logprobs", bool, "a boolean"))
    call = ChatCall(key, converted, tools, max_tokens)
    return call, _asked(body, logprobs, parse_tools=tool_choice != "none")


def parse_text(key: str, body: dict[str, Any]) -> tuple[TextCall, Asked]:
    """A text completion request's call and what it asks of the response."""
    prompt: Any = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    _check(isinstance(prompt, str), "prompt", "must be one prompt, as a string")
    logprobs = _optional(body, "logprobs", int, "0")
    _check(logprobs in (None, 0), "logprobs", "only the sampled token's log-prob is served (0)")
    _check(not body.get("echo"), "echo", "the prompt is not echoed")
    _check(body.get("suffix") is None, "suffix", "is not served")
    _check(_optional(body, "best_of", int, "1") in (None, 1), "best_of", "only 1 is served")
    call = TextCall(key, prompt, _positive(body, "max_tokens"))
    return call, _asked(body, logprobs is not None)


def _digest(*ids: list[int]) -> str:
    h = hashlib.sha256()
    for part in ids:
        h.update(array("q", part).tobytes() + b"|")
    return h.hexdigest()


def usage(c: Completion) -> dict[str, int]:
    n_prompt, n_completion = len(c.prompt_token_ids), len(c.token_ids)
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_completion,
        "total_tokens": n_prompt + n_completion,
    }


def token_logprobs(
    tokenizer: Any, c: Completion, start: int = 0, end: int | None = None
) -> list[dict[str, Any]]:
    """OpenAI's `logprobs.content` for tokens `[start, end)`: each token decoded alone, its
    sampled log-prob, no alternatives."""
    rows = []
    for token_id, logprob in zip(c.token_ids[start:end], c.logprobs[start:end], strict=True):
        token = tokenizer.decode([token_id])
        rows.append(
            {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}
        )
    return rows


def text_pieces(tokenizer: Any, c: Completion) -> list[tuple[str, int, int]]:
    """`c.text` cut into deltas `(text, first token, end token)` at token boundaries, at most
    MAX_STREAM_DELTAS. A boundary is taken where the tokens up to it decode to a prefix of
    `c.text` (not in the middle of a character); the last piece is the rest of the text, so the
    pieces join to exactly `c.text` whatever the tokenizer does."""
    n = len(c.token_ids)
    step = max(1, -(-n // MAX_STREAM_DELTAS))
    pieces: list[tuple[str, int, int]] = []
    emitted = first = 0
    for end in range(step, n, step):
        decoded = tokenizer.decode(c.token_ids[:end])
        if len(decoded) > emitted and c.text.startswith(decoded) and not decoded.endswith("\ufffd"):
            pieces.append((c.text[emitted : len(decoded)], first, end))
            emitted, first = len(decoded), end
    pieces.append((c.text[emitted:], first, n))
    return pieces


def sse(chunks: list[dict[str, Any]]) -> StreamingResponse:
    lines = [f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n" for chunk in chunks]
    lines.append("data: [DONE]\n\n")

    async def send() -> AsyncIterator[str]:
        for line in lines:
            yield line

    return StreamingResponse(
        send(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


class Responder:
    """One completion written in OpenAI's form, whole or as stream chunks."""

    def __init__(self, tokenizer: Any, model: str, c: Completion, asked: Asked, kind: str):
        self.tokenizer, self.c, self.asked = tokenizer, c, asked
        self.head = {
            "id": f"{kind}-{_digest(c.prompt_token_ids, c.token_ids)[:24]}",
            "created": int(time.time()),
            "model": model,
        }
        self.id_seed = _digest(c.prompt_token_ids)

    def extras(
        self, start: int = 0, end: int | None = None, text_api: bool = False
    ) -> dict[str, Any]:
        """A choice's `logprobs` and `token_ids` for tokens `[start, end)`, as asked."""
        out: dict[str, Any] = {"logprobs": None}
        if self.asked.logprobs and text_api:
            rows = token_logprobs(self.tokenizer, self.c, start, end)
            out["logprobs"] = {
                "tokens": [r["token"] for r in rows],
                "top_logprobs": None,
                "token_logprobs": [r["logprob"] for r in rows],
            }
        elif self.asked.logprobs:
            out["logprobs"] = {"content": token_logprobs(self.tokenizer, self.c, start, end)}
        if self.asked.return_token_ids:
            out["token_ids"] = self.c.token_ids[start:end]
        return out

    def whole(self, obj: str, choice: dict[str, Any], text_api: bool = False) -> dict[str, Any]:
        out = {
            **self.head,
            "object": obj,
            "usage": usage(self.c),
            "choices": [{"index": 0, **choice, **self.extras(text_api=text_api)}],
        }
        if self.asked.return_token_ids:
            out["prompt_token_ids"] = self.c.prompt_token_ids
        return out

    def chunk(self, obj: str, choice: dict[str, Any]) -> dict[str, Any]:
        return {
            **self.head,
            "object": obj,
            "choices": [{"index": 0, "logprobs": None, "finish_reason": None, **choice}],
        }

    def tail(self, obj: str, finish: dict[str, Any]) -> list[dict[str, Any]]:
        """The finishing chunk, then the usage chunk where asked."""
        chunks = [self.chunk(obj, finish)]
        if self.asked.include_usage:
            chunks.append({**self.head, "object": obj, "choices": [], "usage": usage(self.c)})
        return chunks

    def chat(self, parse: ToolParser) -> Response:
        content, calls = (
            parse(self.c.text, self.id_seed) if self.asked.parse_tools else (self.c.text, [])
        )
        finish = "tool_calls" if calls else self.c.finish_reason
        if not self.asked.stream:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choice = {"message": message, "finish_reason": finish}
            return json_response(self.whole("chat.completion", choice))
        return sse(self.chat_chunks(content, calls, finish))

    def chat_chunks(
        self, content: str | None, calls: list[ToolCall], finish: str
    ) -> list[dict[str, Any]]:
        """Role first; the content in deltas (in one where tool calls were parsed out of the
        text: the deltas carry the content only, never the raw call text), each delta with its
        tokens' log-probs and ids where asked; each tool call whole in a delta; the finish."""
        obj = "chat.completion.chunk"
        first = self.chunk(obj, {"delta": {"role": "assistant", "content": ""}})
        if self.asked.return_token_ids:
            first["prompt_token_ids"] = self.c.prompt_token_ids
        chunks = [first]
        pieces = (
            [(content or "", 0, len(self.c.token_ids))]
            if calls
            else text_pieces(self.tokenizer, self.c)
        )
        for text, start, end in pieces:
            if text or end > start:
                chunks.append(
                    self.chunk(obj, {"delta": {"content": text}, **self.extras(start, end)})
                )
        for index, call in enumerate(calls):
            chunks.append(self.chunk(obj, {"delta": {"tool_calls": [{"index": index, **call}]}}))
        return chunks + self.tail(obj, {"delta": {}, "finish_reason": finish})

    def text(self) -> Response:
        obj = "text_completion"
        if not self.asked.stream:
            choice = {"text": self.c.text, "finish_reason": self.c.finish_reason}
            return json_response(self.whole(obj, choice, text_api=True))
        chunks = [
            self.chunk(obj, {"text": text, **self.extras(start, end, text_api=True)})
            for text, start, end in text_pieces(self.tokenizer, self.c)
            if text or end > start
        ]
        return sse(chunks + self.tail(obj, {"text": "", "finish_reason": self.c.finish_reason}))


def make_app(
    backend: AgentBackend, tokenizer: Any, secret: str, tool_parser: str = "hermes"
) -> FastAPI:
    """The endpoint's routes (module docstring) over `backend`; `tokenizer` decodes tokens for
    log-probs and stream deltas; `tool_parser` names an entry of `TOOL_PARSERS`."""
    if not secret:
        raise ValueError("the agent endpoint needs a secret: an empty one would let anyone in")
    parse_tools = find_tool_parser(tool_parser)
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(RequireBearer, digest=hashlib.sha256(secret.encode()).digest())

    async def on_error(request: Request, error: Exception) -> Response:
        if isinstance(error, FieldError):
            error = ApiError(400, str(error), error.param)
        elif isinstance(error, StarletteHTTPException):  # no such route, method not allowed
            error = ApiError(error.status_code, f"{request.url.path}: {error.detail}")
        elif not isinstance(error, ApiError):
            error = ApiError(500, f"the endpoint failed: {error!r}")
        return error_response(error)

    for kind in (ApiError, FieldError, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, on_error)

    def models() -> Response:
        model = {"id": backend.model_name, "object": "model", "created": 0, "owned_by": "asyncrl"}
        return json_response({"object": "list", "data": [model]})

    def require_known(key: str) -> None:
        if not backend.known(key):
            message = f"no agent run {key!r} in this run (an unknown or ended sample key)"
            raise ApiError(404, message, "sample_key", "sample_not_found")

    async def read_body(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise ApiError(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    async def known_body(request: Request, key: str) -> dict[str, Any]:
        require_known(key)
        return await read_body(request)

    async def model_body(request: Request) -> tuple[str, dict[str, Any]]:
        """A request to the shared `/v1/...` routes: its sample key from `model`."""
        body = await read_body(request)
        model = body.get("model")
        if not isinstance(model, str) or not model.startswith(SAMPLE_MODEL):
            raise ApiError(
                404,
                f"a request to /v1/... names its agent run as model '{SAMPLE_MODEL}KEY' (got "
                f"{model!r}); or send it to /s/KEY/v1/...",
                "model",
                "sample_not_found",
            )
        key = model.removeprefix(SAMPLE_MODEL)
        require_known(key)
        return key, body

    async def answer(call: Callable[[], Any]) -> Completion:
        try:
            return await call()
        except CallRefused as refused:
            raise ApiError(refused.status, refused.message, None, refused.code) from None

    @app.get("/v1/models")
    async def list_models() -> Response:
        return models()

    @app.get("/s/{key:path}/v1/models")
    async def list_sample_models(key: str) -> Response:
        require_known(key)
        return models()

    async def chat_response(key: str, body: dict[str, Any]) -> Response:
        call, asked = parse_chat(key, body)
        completion = await answer(lambda: backend.chat(call))
        return Responder(tokenizer, backend.model_name, completion, asked, "chatcmpl").chat(
            parse_tools
        )

    async def text_response(key: str, body: dict[str, Any]) -> Response:
        call, asked = parse_text(key, body)
        completion = await answer(lambda: backend.complete(call))
        return Responder(tokenizer, backend.model_name, completion, asked, "cmpl").text()

    @app.post("/s/{key:path}/v1/chat/completions")
    async def chat(key: str, request: Request) -> Response:
        return await chat_response(key, await known_body(request, key))

    @app.post("/s/{key:path}/v1/completions")
    async def complete(key: str, request: Request) -> Response:
        return await text_response(key, await known_body(request, key))

    @app.post("/v1/chat/completions")
    async def chat_by_model(request: Request) -> Response:
        return await chat_response(*await model_body(request))

    @app.post("/v1/completions")
    async def complete_by_model(request: Request) -> Response:
        return await text_response(*await model_body(request))

    return app


class AgentEndpoint:
    """`make_app` served on `host` (loopback) by uvicorn, in a daemon thread that runs its own
    event loop (`loop`: the backend's coroutines run on it). Port 0 takes a free port. Use as
    `with AgentEndpoint(...) as endpoint:` or `start()` ... `stop()`."""

    def __init__(
        self,
        backend: AgentBackend,
        tokenizer: Any,
        secret: str,
        tool_parser: str = "hermes",
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.app = make_app(backend, tokenizer, secret, tool_parser)
        self.host, self.port = host, port
        self.url = ""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failure: BaseException | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The server's event loop (started)."""
        if self._loop is None:
            raise RuntimeError("the agent endpoint is not started")
        return self._loop

    def start(self, timeout_s: float = 30.0) -> str:
        """Binds, serves, and returns the root URL `http://HOST:PORT` once the server accepts
        connections; RuntimeError if it has not within `timeout_s`."""
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY on the connections of a TCP socket only
        # (`sock.proto`); without it a reply waits ~40 ms for the client's delayed ACK
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=1,
        )
        server = self._server = uvicorn.Server(config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._serve, args=(server, sock), daemon=True, name="asyncrl-agent-endpoint"
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop(1.0)
                raise RuntimeError(
                    f"the agent endpoint did not start on {self.host}:{self.port}: "
                    f"{self._failure!r}"
                )
            time.sleep(0.005)
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    def _serve(self, server: uvicorn.Server, sock: socket.socket) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(server.serve(sockets=[sock]))
        except BaseException as e:  # SystemExit too: uvicorn exits on a failed startup
            self._failure = e
        finally:  # a forced exit leaves requests running: end them, hang up on their clients
            for connection in list(server.server_state.connections):
                connection.transport.close()
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.wait(tasks, timeout=1.0) if tasks else asyncio.sleep(0))
            loop.run_until_complete(asyncio.sleep(0))  # the transports' close callbacks
            sock.close()
            loop.close()

    def base_url(self, sample_key: str) -> str:
        """What one agent run's `openai.AsyncOpenAI(base_url=..., api_key=secret)` is given."""
        if not self.url:
            raise RuntimeError("the agent endpoint is not started")
        return f"{self.url}/s/{quote(sample_key, safe='')}/v1"

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops serving within about `timeout_s`: uvicorn stops accepting, lets the requests
        still running finish for up to half of it, then cancels them (their clients get a 500
        or a closed connection); past `timeout_s` it is forced. Never waits much longer: the
        thread is a daemon."""
        if self._server is None or self._thread is None:
            return
        self._server.config.timeout_graceful_shutdown = max(0.05, timeout_s / 2)  # type: ignore[assignment]
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(2.0)
        self._server = None

    def __enter__(self) -> AgentEndpoint:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
