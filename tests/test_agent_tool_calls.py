"""Tool calls read from a completion's text (hermes `<tool_call>` blocks) and a request's
messages turned into the chat template's form: the pure half of the agent endpoint
(`asyncrl.agents.tool_calls`), checked against hand-written cases and against a Qwen2.5-style
chat template rendering what was parsed back into the very text it was parsed from."""

from __future__ import annotations

import json

import pytest

from asyncrl.agents.tool_calls import (
    TOOL_PARSERS,
    FieldError,
    call_id,
    parse_hermes,
    template_messages,
    tool_parser,
)
from asyncrl.models.scratch import SENTENCES, TOOL_CHAT_TEMPLATE, train_tokenizer

QWEN_TEMPLATE = TOOL_CHAT_TEMPLATE
"""Qwen2.5-Instruct's chat template with tools (`asyncrl.models.scratch`, shortened): how a
model of that family is taught to call tools and see their answers."""


def qwen_tokenizer():
    """A small byte-level BPE tokenizer with ChatML specials and the Qwen2.5-style template."""
    tokenizer = train_tokenizer(vocab_size=300, corpus=SENTENCES)
    tokenizer.chat_template = QWEN_TEMPLATE
    return tokenizer


WEATHER_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)


def test_hermes_blocks_become_openai_tool_calls_and_the_rest_is_the_content():
    text = f'Let me look.\n{WEATHER_CALL}\n<tool_call>\n{{"name": "now"}}\n</tool_call>'
    content, calls = parse_hermes(text)
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert calls[0]["type"] == "function"
    arguments = calls[0]["function"]["arguments"]
    assert isinstance(arguments, str) and json.loads(arguments) == {"city": "Paris", "days": 2}
    assert calls[1]["function"]["arguments"] == "{}"  # no arguments: an empty object
    assert content is not None and "<tool_call>" not in content


def test_only_tool_calls_leave_no_content_and_no_call_leaves_the_text_untouched():
    assert parse_hermes(f"\n{WEATHER_CALL}\n")[0] is None
    plain = "  The answer is 42.\n"
    assert parse_hermes(plain) == (plain, [])  # not stripped: it is what was generated


def test_tool_call_ids_are_a_function_of_the_completion_never_random():
    """The agent's next request carries the ids back, and a replay after a kill must see the
    same requests: a random (uuid) id would differ on the second parse."""
    text = f"{WEATHER_CALL}\n{WEATHER_CALL}"
    _, first = parse_hermes(text)
    _, again = parse_hermes(text)
    assert [c["id"] for c in first] == [c["id"] for c in again]
    assert first[0]["id"] != first[1]["id"]  # the same call twice: two ids
    assert first[0]["id"].startswith("call_") and first[0]["id"] == call_id(text, 0)
    _, seeded = parse_hermes(text, id_seed="another turn")
    assert seeded[0]["id"] != first[0]["id"]
    assert parse_hermes(WEATHER_CALL + " ")[1][0]["id"] != parse_hermes(WEATHER_CALL)[1][0]["id"]


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',  # arguments no object
        '<tool_call>\n["get_weather"]\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {}}',  # never closed: cut at length
    ],
)
def test_a_block_that_is_no_call_stays_in_the_content_beside_one_that_is(block):
    text = f"{block}\n{WEATHER_CALL}"
    content, calls = parse_hermes(text)
    assert content == block
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert parse_hermes(block) == (block, [])


def test_the_none_parser_parses_nothing_and_an_unknown_name_is_an_error_naming_the_key():
    assert TOOL_PARSERS["none"](WEATHER_CALL) == (WEATHER_CALL, [])
    assert tool_parser("hermes") is parse_hermes
    with pytest.raises(ValueError, match=r"agent\.tool_parser.*'xml'.*hermes.*none"):
        tool_parser("xml")


def test_request_messages_become_the_templates_form():
    wire = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}],
        },
        {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    assert template_messages(wire) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather\nin Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"},
        {"role": "assistant", "content": "Sunny."},
    ]


def _assistant_calling(arguments: object) -> dict:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "wizard", "content": "hi"}, "messages[1].role"),
        ({"content": "hi"}, "messages[1].role"),
        (_assistant_calling("not json"), "messages[1].tool_calls[0].function.arguments"),
        (_assistant_calling("[1, 2]"), "messages[1].tool_calls[0].function.arguments"),
        (_assistant_calling({"city": "Paris"}), "messages[1].tool_calls[0].function.arguments"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
            "messages[1].content[0]",
        ),
        ({"role": "user", "content": 7}, "messages[1].content"),
        ({"role": "user"}, "messages[1].content"),
        ({"role": "tool", "content": "sunny"}, "messages[1].tool_call_id"),
        ("hello", "messages[1]"),
    ],
)
def test_a_malformed_message_is_a_value_error_naming_the_field(message, param):
    with pytest.raises(ValueError) as raised:
        template_messages([{"role": "user", "content": "hi"}, message])
    assert isinstance(raised.value, FieldError) and raised.value.param == param
    assert str(raised.value).startswith(param + ":")


@pytest.mark.parametrize("content", ["Let me look.", ""])
def test_a_parsed_call_sent_back_renders_to_the_text_it_was_parsed_from(content):
    """The round trip an agent run makes: the model writes a `<tool_call>` block, the endpoint
    parses it into OpenAI's form, the agent sends it back, `template_messages` turns it into
    the template's form, and the Qwen-style template renders exactly what the model wrote."""
    text = (content + "\n" if content else "") + WEATHER_CALL + "\n" + WEATHER_CALL
    parsed_content, calls = parse_hermes(text)
    wire = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": parsed_content, "tool_calls": calls},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    rendered = qwen_tokenizer().apply_chat_template(
        template_messages(wire), tools=tools, tokenize=False
    )
    assert f"<|im_start|>assistant\n{text}<|im_end|>\n" in rendered
    assert "<tool_response>\nsunny\n</tool_response>" in rendered
    assert '"name": "get_weather"' in rendered.split("<tools>\n")[1]  # the tools were rendered
