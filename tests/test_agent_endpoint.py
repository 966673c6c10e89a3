"""The run's OpenAI-compatible endpoint (`asyncrl.agents.endpoint`) over a scripted backend,
spoken to by real clients: the `openai` client (plain and streamed chat, text completions,
models), the OpenAI Agents SDK running an agent with a function tool, raw httpx for the bodies
a client would not send, and `curl` in a process of its own. The backend here is a fake that
renders with a Qwen2.5-style template and answers scripted texts, so what the endpoint makes of
a completion is checked against the completion itself."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from test_agent_tool_calls import WEATHER_CALL, qwen_tokenizer

from asyncrl.agents.calls import CallRefused, ChatCall, Completion, TextCall
from asyncrl.agents.endpoint import MAX_STREAM_DELTAS, AgentEndpoint, text_pieces
from asyncrl.agents.tool_calls import parse_hermes

SECRET = "s3cret-for-tests"
MODEL = "asyncrl-policy"
TOKENIZER = qwen_tokenizer()
IM_END = TOKENIZER.convert_tokens_to_ids("<|im_end|>")
ACCENTED = "Größe: 42 ✓ — déjà vu, 10 × 3 = 30."  # multi-byte characters: split byte tokens


def completion_of(text: str, prompt_ids: list[int], finish: str = "stop") -> Completion:
    """`text` as the engine would have generated it: its tokens, then the end of turn."""
    ids = TOKENIZER.encode(text) + ([IM_END] if finish == "stop" else [])
    logprobs = [-0.01 * (i + 1) for i in range(len(ids))]
    return Completion(ids, logprobs, text, finish, prompt_ids)


class ScriptedBackend:
    """Answers each call with the next scripted reply (a text, or a CallRefused to raise); the
    calls it got are kept, in order."""

    model_name = MODEL

    def __init__(self, *replies: str | CallRefused, keys: tuple[str, ...] = ("s0",)) -> None:
        self.replies = list(replies)
        self.keys = set(keys)
        self.calls: list[ChatCall | TextCall] = []

    def known(self, sample_key: str) -> bool:
        return sample_key in self.keys

    def _next(self, call: ChatCall | TextCall, prompt: str) -> Completion:
        self.calls.append(call)
        reply = self.replies.pop(0) if self.replies else "Done."
        if isinstance(reply, CallRefused):
            raise reply
        return completion_of(reply, TOKENIZER.encode(prompt))

    async def chat(self, call: ChatCall) -> Completion:
        prompt = TOKENIZER.apply_chat_template(
            call.messages, tools=call.tools, tokenize=False, add_generation_prompt=True
        )
        return self._next(call, prompt)

    async def complete(self, call: TextCall) -> Completion:
        return self._next(call, call.prompt)


@pytest.fixture
def serve():
    """`serve(backend) -> AgentEndpoint`, started; stopped after the test."""
    started: list[AgentEndpoint] = []

    def start(backend: Any) -> AgentEndpoint:
        endpoint = AgentEndpoint(backend, TOKENIZER, SECRET)
        endpoint.start()
        started.append(endpoint)
        return endpoint

    yield start
    for endpoint in started:
        endpoint.stop()


def client(endpoint: AgentEndpoint, key: str = "s0", api_key: str = SECRET) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=endpoint.base_url(key), api_key=api_key, max_retries=0)


ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_a_chat_completion_carries_the_backends_completion(serve):
    backend = ScriptedBackend(ACCENTED)
    endpoint = serve(backend)

    async def ask() -> Any:
        return await client(endpoint).chat.completions.create(
            model="anything", messages=ASK, max_completion_tokens=64, temperature=0.3, seed=7
        )

    response = asyncio.run(ask())
    choice = response.choices[0]
    assert choice.message.content == ACCENTED and choice.message.tool_calls is None
    assert choice.finish_reason == "stop" and choice.logprobs is None
    assert response.model == MODEL
    (call,) = backend.calls
    assert call == ChatCall("s0", ASK, None, 64)  # temperature and seed: the run's, ignored
    expected = completion_of(ACCENTED, [])
    assert response.usage.completion_tokens == len(expected.token_ids)
    prompt = TOKENIZER.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    assert response.usage.prompt_tokens == len(TOKENIZER.encode(prompt))


def test_logprobs_and_token_ids_are_the_sampled_ones_when_asked(serve):
    backend = ScriptedBackend(ACCENTED)
    endpoint = serve(backend)

    async def ask() -> Any:
        return await client(endpoint).chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=32,
            logprobs=True,
            extra_body={"return_token_ids": True},
        )

    response = asyncio.run(ask())
    expected = completion_of(ACCENTED, [])
    rows = response.choices[0].logprobs.content
    assert [r.logprob for r in rows] == expected.logprobs
    assert [r.token for r in rows] == [TOKENIZER.decode([t]) for t in expected.token_ids]
    assert all(r.top_logprobs == [] for r in rows)
    assert response.choices[0].model_extra["token_ids"] == expected.token_ids
    assert response.model_extra["prompt_token_ids"] == TOKENIZER.encode(
        TOKENIZER.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    )
    assert backend.calls[0].max_tokens == 32  # max_tokens, where max_completion_tokens is absent


async def _stream_chat(endpoint: AgentEndpoint, **kwargs: Any) -> list[Any]:
    stream = await client(endpoint).chat.completions.create(
        model=MODEL, messages=ASK, stream=True, **kwargs
    )
    return [chunk async for chunk in stream]


def test_a_streamed_chat_joins_to_the_plain_one_delta_by_delta(serve):
    endpoint = serve(ScriptedBackend(ACCENTED, ACCENTED))

    async def both() -> tuple[Any, list[Any]]:
        plain = await client(endpoint).chat.completions.create(model=MODEL, messages=ASK)
        chunks = await _stream_chat(endpoint, stream_options={"include_usage": True}, logprobs=True)
        return plain, chunks

    plain, chunks = asyncio.run(both())
    deltas = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert "".join(deltas) == plain.choices[0].message.content == ACCENTED
    assert len(deltas) > 10  # token by token, not the whole text at once
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        completion_of(ACCENTED, []).token_ids
    )
    streamed = [
        r.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for r in c.choices[0].logprobs.content
    ]
    assert streamed == completion_of(ACCENTED, []).logprobs  # every token's, the end's too


def test_a_long_completion_streams_in_bounded_deltas_that_still_join_exactly():
    text = (ACCENTED + " ") * 40
    completion = completion_of(text, [])
    pieces = text_pieces(TOKENIZER, completion)
    assert "".join(p for p, _, _ in pieces) == text
    assert len(completion.token_ids) > 4 * MAX_STREAM_DELTAS
    assert len(pieces) <= MAX_STREAM_DELTAS
    assert [(a, b) for _, a, b in pieces] == list(
        zip([0] + [b for _, _, b in pieces[:-1]], [b for _, _, b in pieces], strict=True)
    )  # the token ranges tile the completion
    assert pieces[-1][2] == len(completion.token_ids)


def test_tool_calls_are_parsed_and_arrive_streamed_too(serve):
    text = f"I will look it up.\n{WEATHER_CALL}"
    endpoint = serve(ScriptedBackend(text, text))

    async def both() -> tuple[Any, list[Any]]:
        plain = await client(endpoint).chat.completions.create(model=MODEL, messages=ASK)
        return plain, await _stream_chat(endpoint)

    plain, chunks = asyncio.run(both())
    message = plain.choices[0].message
    assert plain.choices[0].finish_reason == "tool_calls"
    assert message.content == "I will look it up."
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    seed_free = parse_hermes(text)[1][0]["id"]
    assert call.id.startswith("call_") and call.id != seed_free  # seeded by the prompt tokens
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "I will look it up." and "<tool_call>" not in content
    streamed = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(t.id, t.function.name, t.function.arguments) for t in streamed] == [
        (call.id, call.function.name, call.function.arguments)
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_choice_none_parses_nothing(serve):
    endpoint = serve(ScriptedBackend(WEATHER_CALL))

    async def ask() -> Any:
        return await client(endpoint).chat.completions.create(
            model=MODEL, messages=ASK, tool_choice="none"
        )

    message = asyncio.run(ask()).choices[0].message
    assert message.content == WEATHER_CALL and not message.tool_calls


def test_text_completions_plain_and_streamed_and_models_listed(serve):
    backend = ScriptedBackend(ACCENTED, ACCENTED)
    endpoint = serve(backend)

    async def ask() -> tuple[Any, list[Any], Any, Any]:
        c = client(endpoint)
        plain = await c.completions.create(
            model=MODEL, prompt="Q: 2+2?\nA:", max_tokens=8, logprobs=0
        )
        stream = await c.completions.create(model=MODEL, prompt="Q: 2+2?\nA:", stream=True)
        chunks = [chunk async for chunk in stream]
        root = openai.AsyncOpenAI(base_url=endpoint.url + "/v1", api_key=SECRET, max_retries=0)
        return plain, chunks, await c.models.list(), await root.models.list()

    plain, chunks, scoped, root = asyncio.run(ask())
    assert plain.choices[0].text == ACCENTED and plain.object == "text_completion"
    assert plain.choices[0].logprobs.token_logprobs == completion_of(ACCENTED, []).logprobs
    assert "".join(c.choices[0].text for c in chunks) == ACCENTED
    assert backend.calls[0] == TextCall("s0", "Q: 2+2?\nA:", 8)
    assert [m.id for m in scoped.data] == [m.id for m in root.data] == [MODEL]


@pytest.mark.parametrize("streamed", [False, True])
def test_an_agent_of_the_agents_sdk_calls_its_tool_and_sends_the_result_back(serve, streamed):
    """The OpenAI Agents SDK, as a user's agent would run it: the model's first completion is a
    hermes tool call, the SDK runs the tool with the parsed arguments and sends its result
    back; the backend's second call holds the assistant's call (arguments a dict) and the
    tool's answer, ids matching. Streamed too: the SDK rebuilds the call from the deltas."""
    set_tracing_disabled(True)
    backend = ScriptedBackend(WEATHER_CALL, "It is sunny in Paris.")
    endpoint = serve(backend)
    ran: list[tuple[str, int]] = []

    @function_tool
    def get_weather(city: str, days: int) -> str:
        """The weather in a city."""
        ran.append((city, days))
        return f"sunny in {city} for {days} days"

    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client(endpoint))
    agent = Agent(name="weather", instructions="Use tools.", model=model, tools=[get_weather])

    async def run() -> Any:
        if not streamed:
            return await Runner.run(agent, "Weather in Paris?")
        result = Runner.run_streamed(agent, "Weather in Paris?")
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())

    assert result.final_output == "It is sunny in Paris."
    assert ran == [("Paris", 2)]
    first, second = backend.calls
    assert isinstance(first, ChatCall) and isinstance(second, ChatCall)
    assert first.tools and first.tools[0]["function"]["name"] == "get_weather"
    assistant, tool = second.messages[-2:]
    (call,) = assistant["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
    assert tool == {
        "role": "tool",
        "content": "sunny in Paris for 2 days",
        "tool_call_id": call["id"],
    }


def test_every_route_needs_the_secret(serve):
    backend = ScriptedBackend()
    endpoint = serve(backend)
    routes = [
        ("GET", "/v1/models"),
        ("GET", "/s/s0/v1/models"),
        ("GET", "/nothing/here"),
        ("POST", "/s/s0/v1/chat/completions"),
        ("POST", "/s/s0/v1/completions"),
    ]

    async def knock() -> list[tuple[int, dict]]:
        answers = []
        async with httpx.AsyncClient(base_url=endpoint.url) as http:
            for method, path in routes:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": SECRET}):
                    r = await http.request(method, path, headers=headers, json={"messages": ASK})
                    answers.append((r.status_code, r.json()))
        return answers

    answers = asyncio.run(knock())
    assert len(answers) == 15 and {status for status, _ in answers} == {401}
    assert all(body["error"]["code"] == "invalid_api_key" for _, body in answers)
    assert backend.calls == []

    async def typed() -> None:
        with pytest.raises(openai.AuthenticationError):
            await client(endpoint, api_key="wrong").chat.completions.create(
                model=MODEL, messages=ASK
            )
        with pytest.raises(openai.AuthenticationError):
            await client(endpoint, api_key="wrong").models.list()

    asyncio.run(typed())


def test_an_unknown_sample_key_is_a_404_naming_it(serve):
    backend = ScriptedBackend()
    endpoint = serve(backend)

    async def ask() -> None:
        with pytest.raises(openai.NotFoundError, match="ended-run"):
            await client(endpoint, key="ended-run").chat.completions.create(
                model=MODEL, messages=ASK
            )
        with pytest.raises(openai.NotFoundError, match="ended-run"):
            await client(endpoint, key="ended-run").completions.create(model=MODEL, prompt="x")
        with pytest.raises(openai.NotFoundError, match="ended-run"):
            await client(endpoint, key="ended-run").models.list()
        async with httpx.AsyncClient(base_url=endpoint.url) as http:
            no_route = await http.get("/v1/nothing", headers={"Authorization": f"Bearer {SECRET}"})
        assert no_route.status_code == 404 and "/v1/nothing" in no_route.json()["error"]["message"]

    asyncio.run(ask())
    assert backend.calls == []


TOOL_CALL_BACK = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{city: Paris}"}}
    ],
}
MALFORMED = [
    ("chat/completions", b"{not json", "not JSON", None),
    ("chat/completions", b"[1, 2]", "JSON object", None),
    ("chat/completions", {"model": MODEL}, "messages", "messages"),
    ("chat/completions", {"messages": []}, "messages", "messages"),
    (
        "chat/completions",
        {"messages": [*ASK, {"role": "wizard", "content": "x"}]},
        "messages[1].role",
        "messages[1].role",
    ),
    (
        "chat/completions",
        {"messages": [*ASK, TOOL_CALL_BACK]},
        "messages[1].tool_calls[0].function.arguments",
        "messages[1].tool_calls[0].function.arguments",
    ),
    ("chat/completions", {"messages": ASK, "max_tokens": 0}, "max_tokens", "max_tokens"),
    (
        "chat/completions",
        {"messages": ASK, "max_completion_tokens": "9"},
        "max_completion_tokens",
        "max_completion_tokens",
    ),
    ("chat/completions", {"messages": ASK, "n": 2}, "n=1", "n"),
    (
        "chat/completions",
        {"messages": ASK, "tools": [{"type": "function", "function": {}}]},
        "tools[0].function.name",
        "tools[0].function.name",
    ),
    (
        "chat/completions",
        {"messages": ASK, "logprobs": True, "top_logprobs": 3},
        "only the sampled token's log-prob",
        "top_logprobs",
    ),
    (
        "chat/completions",
        {"messages": ASK, "tool_choice": "required"},
        "tool_choice",
        "tool_choice",
    ),
    ("chat/completions", {"messages": ASK, "stream": "yes"}, "stream", "stream"),
    ("completions", {"prompt": [1, 2, 3]}, "prompt", "prompt"),
    ("completions", {"prompt": "x", "n": 3}, "n=1", "n"),
    ("completions", {"prompt": "x", "logprobs": 5}, "sampled token", "logprobs"),
]


def test_a_malformed_body_is_a_400_naming_the_field_and_never_reaches_the_backend(serve):
    backend = ScriptedBackend()
    endpoint = serve(backend)

    async def post_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=endpoint.base_url("s0")) as http:
            answers = []
            for route, body, _, _ in MALFORMED:
                kwargs: dict[str, Any] = (
                    {"content": body} if isinstance(body, bytes) else {"json": body}
                )
                answers.append(
                    await http.post(route, headers={"Authorization": f"Bearer {SECRET}"}, **kwargs)
                )
        return answers

    for (_, body, words, param), answer in zip(MALFORMED, asyncio.run(post_all()), strict=True):
        error = answer.json()["error"]
        assert answer.status_code == 400, (body, error)
        assert words in error["message"] and error["param"] == param, (body, error)
        assert error["type"] == "invalid_request_error"
    assert backend.calls == []

    async def typed() -> None:
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.role"):
            await client(endpoint).chat.completions.create(
                model=MODEL, messages=[{"role": "x", "content": ""}]
            )

    asyncio.run(typed())


@pytest.mark.parametrize("status", [400, 409, 429])
def test_a_refused_call_answers_the_backends_status_and_message(serve, status):
    refusal = CallRefused(status, "agent.max_calls=8 reached: the agent run is ended", "limit")
    endpoint = serve(ScriptedBackend(refusal))

    async def ask() -> httpx.Response:
        async with httpx.AsyncClient(base_url=endpoint.base_url("s0")) as http:
            return await http.post(
                "chat/completions",
                json={"messages": ASK},
                headers={"Authorization": f"Bearer {SECRET}"},
            )

    answer = asyncio.run(ask())
    assert answer.status_code == status
    assert answer.json()["error"]["message"] == refusal.message
    assert answer.json()["error"]["code"] == "limit"


class Gathering(ScriptedBackend):
    """Answers no call until `expected` calls are pending at once: a server that handled one
    request at a time would never get there (each call fails after `wait_s`)."""

    def __init__(self, expected: int, wait_s: float = 10.0) -> None:
        super().__init__(keys=tuple(f"s{i}" for i in range(expected)))
        self.expected, self.wait_s = expected, wait_s
        self.pending = self.most_pending = 0
        self.all_here: asyncio.Event | None = None

    async def chat(self, call: ChatCall) -> Completion:
        self.all_here = self.all_here or asyncio.Event()
        self.pending += 1
        self.most_pending = max(self.most_pending, self.pending)
        if self.pending == self.expected:
            self.all_here.set()
        await asyncio.wait_for(self.all_here.wait(), self.wait_s)
        self.pending -= 1
        return completion_of(f"answer to {call.sample_key}", [])


def test_concurrent_requests_are_pending_in_the_backend_together(serve):
    backend = Gathering(8)
    endpoint = serve(backend)

    async def ask_all() -> list[Any]:
        return await asyncio.gather(
            *(
                client(endpoint, key=f"s{i}").chat.completions.create(model=MODEL, messages=ASK)
                for i in range(8)
            )
        )

    answers = asyncio.run(ask_all())
    assert backend.most_pending == 8
    assert [a.choices[0].message.content for a in answers] == [f"answer to s{i}" for i in range(8)]


def test_stop_is_bounded_with_a_call_still_in_the_backend():
    """A backend call that never ends must not hang the run's shutdown."""
    backend = Gathering(2, wait_s=60.0)  # one call of two: it waits for the other, a minute
    endpoint = AgentEndpoint(backend, TOKENIZER, SECRET)
    endpoint.start()
    answered: list[Any] = []

    def ask() -> None:
        try:
            answered.append(
                httpx.post(
                    endpoint.base_url("s0") + "/chat/completions",
                    json={"messages": ASK},
                    timeout=30,
                    headers={"Authorization": f"Bearer {SECRET}"},
                )
            )
        except httpx.HTTPError as e:
            answered.append(e)

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    deadline = time.monotonic() + 10
    while backend.pending == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert backend.pending == 1
    start = time.monotonic()
    endpoint.stop(timeout_s=0.5)
    assert time.monotonic() - start < 3.0
    asker.join(5)
    assert answered and not asker.is_alive()  # the client was answered or cut off, not left


def curl(endpoint: AgentEndpoint, route: str, body: str, key: str = SECRET) -> str:
    command = [
        "curl",
        "-sS",
        "-N",
        "-H",
        f"Authorization: Bearer {key}",
        "-H",
        "Content-Type: application/json",
        "-d",
        body,
        "-w",
        "\n%{http_code}",
        endpoint.base_url("s0") + route,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, check=True).stdout


@pytest.mark.slow
def test_curl_gets_401_400_and_an_sse_stream_ending_in_done(serve):
    endpoint = serve(ScriptedBackend(f"Checking.\n{WEATHER_CALL}"))
    chat = json.dumps({"model": MODEL, "messages": ASK})

    denied = curl(endpoint, "/chat/completions", chat, key="wrong")
    assert denied.endswith("\n401") and "invalid_api_key" in denied
    malformed = curl(endpoint, "/chat/completions", json.dumps({"messages": ASK, "n": 4}))
    assert (
        malformed.endswith("\n400")
        and json.loads(malformed.rsplit("\n", 1)[0])["error"]["param"] == "n"
    )

    streamed = curl(endpoint, "/chat/completions", json.dumps({"messages": ASK, "stream": True}))
    body, status = streamed.rsplit("\n", 1)
    assert status == "200"
    lines = [line for line in body.splitlines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    calls = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls") or []]
    assert [t["function"]["name"] for t in calls] == ["get_weather"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
