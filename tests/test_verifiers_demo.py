"""The verifiers demo (`asyncrl.examples.verifiers_demo`, `make verifiers-demo`): its chat
template (the tools listed, a hermes call that the endpoint's parser reads back and the
template renders again), its report's figures from a synthetic run dir, and (slow) its
held-out evaluation run end to end on agent_math's tiny model, through the endpoint, the torch
engine and verifiers' own harness."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from asyncrl.agents.tool_calls import parse_hermes, template_messages
from asyncrl.examples import verifiers_demo as demo
from asyncrl.examples import verifiers_warm_start as warm_start
from asyncrl.models.scratch import TOOL_CHAT_TEMPLATE, train_tokenizer


def render(messages, generation=False):
    result = render_jinja_template(
        [messages],
        tools=demo.EXAMPLE_TOOLS,
        chat_template=demo.chat_template(),
        add_generation_prompt=generation,
    )
    return str(result[0][0])


def test_the_template_lists_the_tools_and_shows_the_call_in_its_system_turn():
    text = render(demo.example_conversation()[:1], generation=True)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n" + demo.SYSTEM_TEXT + "\n\n# Tools")
    assert json.dumps(demo.EXAMPLE_TOOLS[0]) in system
    assert text.endswith(
        "<|im_start|>user\nWhat is 37 * 12? Use the calculator tool, then give "
        "the final answer as a number.<|im_end|>\n<|im_start|>assistant\n"
    )
    # TOOL_CHAT_TEMPLATE's only change: the default system text
    plain = render_jinja_template([demo.example_conversation()], tools=demo.EXAMPLE_TOOLS,
                                  chat_template=TOOL_CHAT_TEMPLATE)[0][0]  # fmt: skip
    assert str(plain).replace("You are a helpful assistant.", demo.SYSTEM_TEXT, 1) == render(
        demo.example_conversation()
    )
    # a request's own system message replaces it
    own = render([{"role": "system", "content": "Be brief."}, *demo.example_conversation()[:1]])
    assert own.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert demo.SYSTEM_TEXT not in own


def test_a_tool_call_round_trips_through_the_endpoints_parser_and_the_template():
    messages = demo.example_conversation()
    text = render(messages)
    before = render(messages[:1], generation=True)
    completion = text[len(before) :].split("<|im_end|>")[0]  # what the model would write
    content, calls = parse_hermes(completion)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("calc_calculate", {"expression": "37 * 12"})
    ]
    # the agent sends the parsed call back (OpenAI's wire form): rendered, the same text again
    wire = {"role": "assistant", "content": content, "tool_calls": calls}
    again = template_messages([*messages[:1], wire, {"role": "tool", "tool_call_id": calls[0]["id"],
                                                     "content": "444"}])  # fmt: skip
    assert render(again) == text[: text.index("<|im_start|>assistant\n37")]
    # the system text's example is a call too: the model that copies it is parsed
    example = demo.SYSTEM_TEXT[demo.SYSTEM_TEXT.index("<tool_call>") :]
    example = example[: example.index("</tool_call>") + len("</tool_call>")]
    assert json.loads(parse_hermes(example)[1][0]["function"]["arguments"]) == {
        "expression": "5 + 7"
    }


def test_check_template_passes_a_chatml_tokenizer_and_refuses_a_template_without_tools():
    tokenizer = train_tokenizer(400, chat=True)
    tokenizer.chat_template = demo.chat_template()
    demo.check_template(tokenizer)
    tokenizer.chat_template = (  # SmolLM2's own: ChatML, no tools
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
        "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    )
    with pytest.raises(ValueError, match="tools are not listed"):
        demo.check_template(tokenizer)


def write_run(run_dir: Path, steps: int = 8) -> None:
    """A synthetic run dir: config.yaml, metrics.jsonl (step 3 recorded twice: its last record
    counts; a record without the rubric's parts is skipped), heldout.json."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("model:\n  path: data/verifiers_demo/model\n")
    lines = [{"event": "start"}]
    for step in range(steps):
        lines.append({"step": step, "reward_mean": 0.0, "reward/correct": step / 10,
                      "reward/used_tool": step / 20})  # fmt: skip
        if step == 3:
            lines.append({"step": 3, "reward/correct": 0.9, "reward/used_tool": 0.8})
    lines.append({"step": steps, "reward_mean": 0.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    held = {"accuracy": 0.1, "tool_use": 0.125, "reward": 0.1125, "episodes": 64,
            "tools_executed": 8, "calls": 80, "seconds": 1.0}  # fmt: skip
    settings = {"n": demo.HELD_OUT, "max_calls": demo.MAX_CALLS,
                "call_tokens": demo.CALL_TOKENS, "episode_tokens": demo.EPISODE_TOKENS}  # fmt: skip
    after = {**held, "accuracy": 0.5, "tool_use": 0.75}
    (run_dir / demo.HELDOUT_FILE).write_text(
        json.dumps({"settings": settings, "before": held, "after": after})
    )


def test_the_report_reads_the_curve_and_the_held_out_figures(tmp_path):
    run = tmp_path / "run"
    write_run(run)
    points = demo.read_curve(run)
    assert [p.step for p in points] == list(range(8))
    assert (points[3].correct, points[3].used_tool) == (0.9, 0.8)
    first, last = demo.quarters(points)
    assert [p.step for p in first] == [0, 1] and [p.step for p in last] == [6, 7]
    # first quarter: correct (0 + 0.1) / 2, used_tool (0 + 0.05) / 2; last: 0.65, 0.325
    assert demo.curve_summary(points) == (
        "training (8 steps, first quarter -> last): correct 0.050 -> 0.650, "
        "used_tool 0.025 -> 0.325"
    )
    lines = demo.report(run).splitlines()  # from heldout.json: no evaluation
    assert lines[0] == (
        "held-out (64 test tasks, greedy): accuracy 0.100 -> 0.500, tool use 12% -> 75%"
    )
    assert lines[1] == demo.curve_summary(points)
    assert (run / "plots" / "verifiers.png").stat().st_size > 10_000
    assert demo.initial_model(run) == Path("data/verifiers_demo/model")


def test_a_run_without_the_rubrics_parts_has_no_curve(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward_mean": 1.0}) + "\n")
    assert demo.read_curve(run) == []
    with pytest.raises(SystemExit, match="no step records"):
        demo.report(run)


@pytest.mark.slow
def test_the_held_out_evaluation_runs_the_test_tasks_as_agent_runs(tmp_path):
    """agent_math's tiny model (its tools template, warm-started briefly) calls `calculate`,
    not the environment's `calc_calculate`: its figures are low, and what is checked is that
    every task ran as one episode through the endpoint and the rubric scored it."""
    from asyncrl.examples.agent_math import prepare

    files = prepare(tmp_path / "agent_math", test_rows=4, warm_steps=(20, 10))
    held = demo.evaluate(files["model"], "test", 4, max_calls=2, batch=4)
    assert held.episodes == 4
    assert 1 <= held.calls <= 8  # every episode called the model, at most max_calls times
    for value in (held.accuracy, held.tool_use):
        assert 0.0 <= value <= 1.0 and not math.isnan(value)
    assert held.reward == pytest.approx(held.accuracy + 0.1 * held.tool_use)


def chat_tokens():
    from asyncrl.rollout.chat_tokens import ChatTokens

    tokenizer = train_tokenizer(400, chat=True)
    tokenizer.chat_template = demo.chat_template()
    return ChatTokens(tokenizer, int(tokenizer.eos_token_id))


def test_a_warm_start_transcript_is_the_episode_the_endpoint_would_hold():
    """The tokens are the template's rendering of the whole episode (the prompt exactly as the
    endpoint renders the first request), and the trained ones are the model's own turns: the
    call the endpoint's parser reads back, the reply with the answer, each closed by its end
    of turn; the question's, the tools' and the tool answer's tokens are not trained."""
    chat = chat_tokens()
    tokenizer = chat.tokenizer
    t = warm_start.transcript(chat, demo.EXAMPLE_TOOLS, "37 * 12", 444)
    assert len(t.ids) == len(t.trained)
    question = {"role": "user", "content": "What is 37 * 12? Use the calculator tool, then give "
                "the final answer as a number."}  # fmt: skip
    prompt = chat.render([question], demo.EXAMPLE_TOOLS)
    assert t.ids[: len(prompt)] == prompt and not any(t.trained[: len(prompt)])
    whole = chat.template([*demo.example_conversation()], False, demo.EXAMPLE_TOOLS)
    assert tokenizer.decode(t.ids) == whole.rstrip("\n")
    # the trained tokens: two spans, the call and the reply, each ending at the turn's end
    spans, run = [], []
    for token, trained in zip(t.ids, t.trained, strict=True):
        if trained:
            run.append(token)
        elif run:
            spans.append(run)
            run = []
    spans.append(run)
    assert [s[-1] for s in spans] == [chat.eos_id, chat.eos_id]
    call_text, reply = (tokenizer.decode(s[:-1]) for s in spans)
    _, calls = parse_hermes(call_text)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"expression": "37 * 12"}]
    assert reply == "37 * 12 = 444"
    # between them, the tool's answer as the endpoint continues the history (not trained)
    between = t.ids[len(prompt) + len(spans[0]) : len(t.ids) - len(spans[1])]
    assert "<tool_response>\n444\n</tool_response>" in tokenizer.decode(between)
    with pytest.raises(RuntimeError, match="the calculator says 444"):
        warm_start.transcript(chat, demo.EXAMPLE_TOOLS, "37 * 12", 445)


def test_the_report_names_the_model_before_the_warm_start(tmp_path):
    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / warm_start.WARM_RECORD).write_text(json.dumps({"from": str(tmp_path / "model")}))
    run = tmp_path / "run"
    write_run(run)
    (run / "config.yaml").write_text(f"model:\n  path: {warm}\n")
    saved = json.loads((run / demo.HELDOUT_FILE).read_text())
    saved["prepared"] = {**saved["before"], "accuracy": 0.0, "tool_use": 0.0}
    (run / demo.HELDOUT_FILE).write_text(json.dumps(saved))
    lines = demo.report(run).splitlines()
    assert lines[0] == "prepared model, before the warm start: accuracy 0.000, tool use 0%"
    assert lines[1].startswith("held-out (64 test tasks, greedy): accuracy 0.100 -> 0.500")
    # a heldout.json without the prepared model's figures is evaluated again, not misread
    del saved["prepared"]
    (run / demo.HELDOUT_FILE).write_text(json.dumps(saved))
    with pytest.raises(Exception):  # noqa: B017 (no model there to evaluate)
        demo.report(run)


@pytest.mark.slow
def test_the_warm_start_captures_the_harness_tools_and_trains_on_their_rendering(
    tmp_path, monkeypatch
):
    """On agent_math's tiny model: the tools are captured from a real episode of verifiers'
    harness (the environment's `calc_calculate`, its description the tool's docstring), the
    question re-rendered with them is that episode's prompt token for token, and a warm start
    on 8 transcripts lowers the loss on them and writes a model that loads."""
    from asyncrl.examples.agent_math import prepare
    from asyncrl.models.policy import load_pretrained_policy

    files = prepare(tmp_path / "agent_math", test_rows=4, warm_steps=(20, 10))
    prompt = demo.first_prompt(files["model"])
    tools = warm_start.capture_tools(files["model"], prompt)
    assert [t["function"]["name"] for t in tools] == ["calc_calculate"]
    assert tools[0]["function"]["description"].startswith("Evaluate an arithmetic expression")
    assert len(prompt) > 20
    monkeypatch.setattr(warm_start, "WARM_TASKS", 8)
    monkeypatch.setattr(warm_start, "WARM_BATCH", 4)
    monkeypatch.setattr(warm_start, "WARM_EPOCHS", 3)
    monkeypatch.setattr(warm_start, "WARM_LR", 1e-3)
    record = warm_start.warm_start(files["model"], tmp_path / "warm", prompt, log=lambda _: None)
    assert len(record["losses"]) == 6
    assert record["losses"][-1] < record["losses"][0]
    assert demo.warmed_from(tmp_path / "warm") == files["model"]
    assert load_pretrained_policy(tmp_path / "warm").tokenizer.chat_template is not None
