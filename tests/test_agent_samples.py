"""The tokens of an agent run (`asyncrl.agents.samples`) and its log (`agent_log`): pure,
milliseconds. Oracles: hand-written token lists, and the chat template's own rendering of the
conversation so far at every call."""

from __future__ import annotations

import json

import pytest

from asyncrl.agents.agent_log import AgentLog, call_key
from asyncrl.agents.samples import SampleTokens, canonical, request_hash
from asyncrl.models.scratch import TOOL_CHAT_TEMPLATE, train_tokenizer
from asyncrl.rollout.chat_tokens import ChatTokens


def fake_render(messages, tools):
    """A token per message (its length), then 99 (the assistant's opening)."""
    return [len(m["content"]) for m in messages] + [99]


def fake_reply(history, n, ended, tools):
    return ([] if ended else [7]) + [len(m["content"]) for m in history[-n:]] + [99]


def test_a_call_that_continues_the_messages_continues_the_sample_with_the_exact_tokens():
    s = SampleTokens()
    m1 = [{"role": "user", "content": "abc"}]
    first = s.open_chat(m1, None, fake_render, fake_reply)
    assert first.new_segment and first.prompt_ids == [3, 99]
    s.record(
        first, [50, 51, 2], [-0.5, -0.6, -0.7], 4, True, m1, {"role": "assistant", "content": "xy"}
    )
    m2 = [
        *m1,
        {"role": "assistant", "content": "xy", "refusal": None},
        {"role": "user", "content": "hello"},
    ]
    second = s.open_chat(m2, None, fake_render, fake_reply)
    # the completion as sampled (50 51 2), not the rendering of "xy"; then the reply's tokens
    assert not second.new_segment and second.prompt_ids == [3, 99, 50, 51, 2, 5, 99]
    s.record(second, [60], [-1.0], 5, False, m2, {"role": "assistant", "content": "z"})
    (seg,) = s.segments
    assert seg.tokens == [3, 99, 50, 51, 2, 5, 99, 60]
    assert seg.policy == [False, False, True, True, True, False, False, True]
    assert seg.logprobs == [0, 0, -0.5, -0.6, -0.7, 0, 0, -1.0]
    assert seg.versions == [-1, -1, 4, 4, 4, -1, -1, 5]
    # a cut-off turn (not ended) gets its end of turn (7 here) before the reply
    m3 = [*m2, {"role": "assistant", "content": "z"}, {"role": "user", "content": "q"}]
    assert s.open_chat(m3, None, fake_render, fake_reply).prompt_ids[-3:] == [7, 1, 99]


def test_a_rewritten_history_starts_a_new_segment_and_is_counted():
    s = SampleTokens()
    m1 = [{"role": "user", "content": "abc"}]
    s.record(s.open_chat(m1, None, fake_render, fake_reply), [50], [-0.1], 0, True, m1,
             {"role": "assistant", "content": "xy"})  # fmt: skip
    edited = [*m1, {"role": "assistant", "content": "EDITED"}, {"role": "user", "content": "q"}]
    opening = s.open_chat(edited, None, fake_render, fake_reply)
    assert opening.new_segment and opening.prompt_ids == [3, 6, 1, 99]
    s.record(opening, [70], [-0.2], 1, True, edited, {"role": "assistant", "content": "w"})
    assert s.breaks == 1 and len(s.segments) == 2
    assert s.segments[1].tokens == [3, 6, 1, 99, 70] and s.segments[1].policy[-1]
    # other tools than the last call's: a new segment too
    again = [*edited, {"role": "assistant", "content": "w"}, {"role": "user", "content": "r"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert s.open_chat(again, tools, fake_render, fake_reply).new_segment


def test_canonical_messages_ignore_client_fields_and_argument_encoding():
    a = {"role": "assistant", "content": None, "refusal": None,
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": '{"x": 1}'}}]}  # fmt: skip
    b = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
    }
    assert canonical(a) == canonical(b)
    c = json.loads(json.dumps(b))
    c["tool_calls"][0]["function"]["arguments"] = {"x": 2}
    assert canonical(a) != canonical(c)


def test_every_call_boundary_is_the_templates_own_rendering_of_the_conversation():
    """Oracle: `apply_chat_template(messages so far, tools, add_generation_prompt=True)` at each
    call, decoded, equals the sample's tokens so far decoded, where the completions are the
    canonical encodings of their text (so rendering them reproduces them)."""
    tok = train_tokenizer(400, chat=True)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    chat = ChatTokens(tok, eos)
    tools = [{"type": "function", "function": {"name": "calculate", "parameters": {}}}]
    s = SampleTokens()
    messages = [{"role": "user", "content": "What is 3 times 4?"}]
    answers = [
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function",
                         "function": {"name": "calculate", "arguments": {"expression": "3*4"}}}]},
        {"role": "assistant", "content": "The answer is 12."},
    ]  # fmt: skip
    replies = [[{"role": "tool", "content": "12", "tool_call_id": "a"}], []]
    for answer, reply in zip(answers, replies, strict=True):
        opening = s.open_chat(messages, tools, chat.render, chat.reply_ids)
        expected = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                           tokenize=False)  # fmt: skip
        assert tok.decode(opening.prompt_ids) == expected
        # what a model would have sampled: the template's rendering of the answer, then <|im_end|>
        full = tok.apply_chat_template([*messages, answer], tools=tools, tokenize=False)
        text = full[len(expected) :]
        completion = tok(text[: text.rindex("<|im_end|>")], add_special_tokens=False)["input_ids"]
        completion = [*completion, eos]
        s.record(opening, completion, [-0.1] * len(completion), 0, True, messages, answer, tools)
        messages = [*messages, answer, *reply]
    assert s.breaks == 0 and len(s.segments) == 1
    # the loss mask: exactly the completions' tokens
    assert s.segments[0].num_sampled == s.num_sampled


def test_the_request_hash_covers_the_prompt_and_the_cap():
    assert request_hash([1, 2], 8) == request_hash([1, 2], 8)
    assert request_hash([1, 2], 8) != request_hash([1, 3], 8)
    assert request_hash([1, 2], 8) != request_hash([1, 2], 9)


def test_the_agent_log_is_read_back_from_the_mark_for_the_reopened_ordinals(tmp_path):
    path = tmp_path / "agent_calls.jsonl"
    log = AgentLog(path)
    log.append({"kind": "completion", "key": call_key(0, 0, 0, 0), "hash": "h", "tokens": [1]})
    log.landed(0)
    assert log.mark() == path.stat().st_size  # ordinal 0 landed: nothing before is needed
    mark_before = log.mark()
    log.append({"kind": "begun", "key": call_key(1, 0, 0, 0), "hash": "a"})
    log.append({"kind": "completion", "key": call_key(1, 0, 0, 0), "hash": "a", "tokens": [5]})
    log.append({"kind": "begun", "key": call_key(1, 0, 0, 1), "hash": "b"})  # killed mid-pass
    log.append({"kind": "tool_begun", "key": "2:0:0:t0", "hash": "t"})
    log.sync()
    assert log.mark() == mark_before and log.num_syncs == 1
    with open(path, "a") as f:
        f.write('{"kind": "completion", "key": "1:0:0:1", "tok')  # a torn last line
    again = AgentLog(path)
    again.load(log.mark(), lambda ordinal: ordinal in (1, 2))
    assert set(again.completions) == {"1:0:0:0"}
    assert again.pending() == {"replayable": 1, "regenerated": 1, "tools_repeated": 1}
    again.append({"kind": "completion", "key": "1:0:0:1", "hash": "b", "tokens": [6]})
    lines = path.read_text().splitlines()
    assert json.loads(lines[-1])["key"] == "1:0:0:1"  # the torn line was ended, not joined
    assert json.loads(lines[-2])["kind"] == "tool_begun" or "tok" in lines[-2]


@pytest.mark.parametrize("offset", [0, 10**9])
def test_loading_from_any_offset_never_fails(tmp_path, offset):
    log = AgentLog(tmp_path / "a.jsonl")
    log.append({"kind": "completion", "key": "3:0:0:0", "hash": "h", "tokens": []})
    again = AgentLog(tmp_path / "a.jsonl")
    again.load(offset, lambda o: True)
    assert len(again.completions) == (1 if offset == 0 else 0)
