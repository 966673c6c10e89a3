"""Between the OpenAI wire format and a chat template's, both ways, with no HTTP: tool calls
parsed out of a completion's text (`TOOL_PARSERS`, chosen by `agent.tool_parser`), and a
request's messages turned into what the chat template takes (`template_messages`).

The hermes format is the one Qwen2.5/Qwen3 and Hermes chat templates both teach and render:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

so a tool call parsed from a completion, sent back by the agent in its next request and
rendered by the template gives the same text again (`tests/test_agent_tool_calls.py` checks
it). Tool-call ids are a hash of the completion, never random: the agent's next request carries
them back, and a replay of the run after a kill must see the very same requests.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Protocol

from asyncrl.agents.calls import Message

ToolCall = dict[str, Any]
"""OpenAI's wire form: `{"id", "type": "function", "function": {"name", "arguments": "<JSON
string>"}}`."""

HERMES_BLOCK = re.compile(r"<tool_call>((?:(?!<tool_call>).)*?)</tool_call>", re.DOTALL)
"""A block, innermost: a `<tool_call>` never closed does not swallow the next block."""

ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
"""A request's roles -> the chat template's (templates know no `developer`)."""


class FieldError(ValueError):
    """A request field that is malformed; `param` names it as OpenAI's error body does
    (`messages[2].tool_calls[0].function.arguments`), and so does the message."""

    def __init__(self, param: str, problem: str) -> None:
        super().__init__(f"{param}: {problem}")
        self.param = param


class ToolParser(Protocol):
    def __call__(self, text: str, id_seed: str = "") -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a completion's text. `id_seed` is mixed into the ids (the
        endpoint passes a digest of the completion's prompt tokens, so two turns of one agent
        run that happen to write the same call still get distinct ids)."""
        ...


def call_id(text: str, index: int, id_seed: str = "") -> str:
    """The id of the `index`-th tool call of a completion: a function of the completion alone."""
    digest = hashlib.sha256(f"{id_seed}\x00{text}\x00{index}".encode()).hexdigest()
    return "call_" + digest[:24]


def _hermes_call(block: str) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of one block's JSON, or None where it is no call: not JSON, not an
    object, no string `name`, or `arguments` neither absent nor an object."""
    try:
        parsed = json.loads(block)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return parsed["name"], arguments


def parse_hermes(text: str, id_seed: str = "") -> tuple[str | None, list[ToolCall]]:
    """The `<tool_call>...</tool_call>` blocks of `text` as OpenAI tool calls, in order, and the
    text outside them as content, stripped (None when that is empty). A block that is no call
    (its JSON does not parse, is not an object, lacks a string `name`, or has `arguments` that
    are not an object) is not an error: the model wrote text, so it stays in the content, as
    does a block never closed (a completion cut at max_tokens). With no call parsed the text is
    returned unchanged, not stripped: what the agent sends back is what was generated."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    start = 0
    for match in HERMES_BLOCK.finditer(text):
        call = _hermes_call(match.group(1))
        if call is None:
            continue
        name, arguments = call
        kept.append(text[start : match.start()])
        start = match.end()
        calls.append(
            {
                "id": call_id(text, len(calls), id_seed),
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
            }
        )
    if not calls:
        return text, []
    kept.append(text[start:])
    content = "".join(kept).strip()
    return content or None, calls


def parse_none(text: str, id_seed: str = "") -> tuple[str | None, list[ToolCall]]:
    """No tool calls: the whole text is content (a model that calls no tools, or a format the
    agent parses itself)."""
    return text, []


TOOL_PARSERS: dict[str, ToolParser] = {"hermes": parse_hermes, "none": parse_none}


def tool_parser(name: str) -> ToolParser:
    """The parser `agent.tool_parser` names."""
    if name not in TOOL_PARSERS:
        raise ValueError(
            f"agent.tool_parser={name!r} is not a known tool-call format: one of "
            f"{sorted(TOOL_PARSERS)}"
        )
    return TOOL_PARSERS[name]


def _text(content: Any, field: str) -> str:
    """A message's content as one string: a string as is, null as "", a list of text parts
    joined with newlines (as vLLM joins them)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(field, "must be a string, null or a list of text parts")
    texts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise FieldError(f"{field}[{k}]", 'only text parts ({"type": "text"}) are served')
        if not isinstance(part.get("text"), str):
            raise FieldError(f"{field}[{k}].text", "must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


def _template_tool_call(call: Any, field: str) -> dict[str, Any]:
    """One assistant tool call, its arguments a dict (what chat templates render)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise FieldError(f"{field}.function", "must be an object")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise FieldError(f"{field}.function.name", "must be a non-empty string")
    arguments = function.get("arguments")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise FieldError(f"{field}.function.arguments", "must be a JSON object, as a string")
    out: dict[str, Any] = {
        "type": "function",
        "function": {"name": function["name"], "arguments": parsed},
    }
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def template_message(message: Any, i: int) -> Message:
    """`messages[i]` of a request in the chat template's form (`template_messages`)."""
    if not isinstance(message, dict):
        raise FieldError(f"messages[{i}]", "must be an object")
    role = message.get("role")
    if role not in ROLES:
        raise FieldError(f"messages[{i}].role", f"must be one of {sorted(ROLES)}, not {role!r}")
    if "content" not in message and role != "assistant":
        raise FieldError(f"messages[{i}].content", "is required")
    out: Message = {
        "role": ROLES[role],
        "content": _text(message.get("content"), f"messages[{i}].content"),
    }
    if role == "assistant" and message.get("tool_calls"):
        calls = message["tool_calls"]
        if not isinstance(calls, list):
            raise FieldError(f"messages[{i}].tool_calls", "must be a list")
        out["tool_calls"] = [
            _template_tool_call(call, f"messages[{i}].tool_calls[{j}]")
            for j, call in enumerate(calls)
        ]
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise FieldError(f"messages[{i}].tool_call_id", "must be a string")
        out["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def template_messages(messages: list[Any]) -> list[Message]:
    """A request's `messages` (OpenAI's wire form) as chat templates take them: assistant tool
    calls' `arguments` JSON strings parsed to dicts, content given as text parts joined to one
    string, `content: null` as "", `developer` as `system`, a tool message's `tool_call_id` and
    any message's `name` kept; every other key dropped. Raises `FieldError` (a ValueError)
    naming the first malformed field: an unknown role (`messages[i].role`), arguments that are
    not a JSON object (`messages[i].tool_calls[j].function.arguments`), a part that is not text
    (`messages[i].content[k]`)."""
    return [template_message(message, i) for i, message in enumerate(messages)]
