"""Ending a tool loop: which calls count as answered, what is dropped, and the answer grammar."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest

from agentserve.engine.request import FinishReason, Guide, RequestOutput
from agentserve.model.guided import GuidedDecoding
from agentserve.model.loader import default_cache_root, load_tokenizer, resolve_model_dir
from agentserve.server.protocol import Message
from agentserve.server.tool_loop import EchoWatch, answer_guide, answered_calls, call_key, decide, merged
from agentserve.server.tool_parsers import ToolCall, extract, get_parser

GW = ToolCall("get_weather", json.dumps({"city": "Paris"}))
C2F = ToolCall("celsius_to_fahrenheit", json.dumps({"celsius": 21}))


def call(call_id: str, name: str, arguments: str | dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def messages(*raw: dict) -> list[Message]:
    return [Message(**m) for m in raw]


CONVERSATION = messages(
    {"role": "user", "content": "Temperature in Paris in Fahrenheit?"},
    {"role": "assistant", "tool_calls": [call("a", "get_weather", '{"city": "Paris"}')]},
    {"role": "tool", "tool_call_id": "a", "content": '{"celsius": 21}'},
    {"role": "assistant", "tool_calls": [call("b", "celsius_to_fahrenheit", {"celsius": 21.0}),
                                         call("c", "get_weather", {"city": "Oslo"})]},
    {"role": "tool", "tool_call_id": "b", "content": '{"fahrenheit": 69.8}'},  # c is not answered yet
)


def test_answered_calls_are_those_with_a_tool_result():
    assert answered_calls(CONVERSATION) == {call_key(GW.name, GW.arguments), call_key(C2F.name, C2F.arguments)}


def test_equal_arguments_compare_as_json_values():
    assert call_key("f", '{"a": 21, "b": {"x": [1.0, "s"]}}') == call_key("f", {"b": {"x": [1, "s"]}, "a": 21.0})
    assert call_key("f", '{"a": 21.5}') != call_key("f", '{"a": 21}')
    assert call_key("f", '{"a": true}') != call_key("f", '{"a": 1}')
    assert call_key("f", "not json") is None


def test_repeats_are_dropped_and_new_calls_kept_in_order():
    oslo = ToolCall("get_weather", json.dumps({"city": "Oslo"}))
    d = decide((GW, oslo, C2F), None, answered_calls(CONVERSATION))
    assert d.calls == (oslo,) and d.dropped == (GW, C2F) and not d.ask_answer
    assert d.record() == {"dropped_repeated_calls": [{"name": GW.name, "arguments": GW.arguments},
                                                     {"name": C2F.name, "arguments": C2F.arguments}],
                          "answered_without_tools": False}


def test_nothing_new_asks_for_the_answer_unless_text_came_first():
    answered = answered_calls(CONVERSATION)
    assert decide((C2F, GW, C2F), None, answered).ask_answer
    assert not decide((C2F,), "Converting again.", answered).ask_answer  # that text is the reply
    assert not decide((), "The answer is 69.8 F.", answered).ask_answer  # no calls: nothing to end
    assert not decide((C2F,), None, frozenset()).ask_answer


def line(c: ToolCall) -> str:
    return json.dumps({"name": c.name, "arguments": json.loads(c.arguments)}) + "\n"


def grow(watch: EchoWatch, text: str, step: int = 3) -> int | None:
    """The watch over `text` as it arrives a few characters at a time: the first cut, if any."""
    for i in range(step, len(text) + step, step):
        if (end := watch.cut(text[:i])) is not None:
            return end
    return None


@pytest.mark.parametrize("parser", ["json", "hermes"])
def test_a_reply_cycling_through_answered_calls_is_cut_after_the_repeat(parser):
    # The watch reads the tools as the parsers take them (the offered ones by name).
    tools = {n: {"name": n, "parameters": {"type": "object"}} for n in (GW.name, C2F.name)}
    fmt = line if parser == "json" else (lambda c: f"<tool_call>\n{line(c).strip()}\n</tool_call>\n")
    answered = answered_calls(CONVERSATION)
    watch = lambda: EchoWatch(get_parser(parser), tools, answered)  # noqa: E731
    echo = fmt(C2F) + fmt(GW) + fmt(C2F)
    text = echo + fmt(GW) + fmt(C2F)
    end = grow(watch(), text)
    # cut at a line end within the repeat (hermes parses a call whose closing tag is to come)
    assert end is not None and len(echo) - len(fmt(C2F)) < end < len(echo) and text[end] == "\n"
    assert extract(get_parser(parser), text[:end], tools).calls == (C2F, GW, C2F)
    assert grow(watch(), fmt(C2F) + fmt(GW)) is None  # no call twice: it may still ask for something new
    oslo = ToolCall("get_weather", json.dumps({"city": "Oslo", "units": "C"}))
    assert grow(watch(), fmt(oslo) + fmt(GW) + fmt(oslo) + fmt(GW)) is None  # twice, but not answered
    assert grow(watch(), "Converting again.\n" + echo + echo) is None  # text first: that is the reply
    assert grow(EchoWatch(get_parser(parser), tools, frozenset()), echo + echo) is None


def out(**kw) -> RequestOutput:
    base = dict(request_id="r", new_token_ids=(), finished=True, finish_reason=FinishReason.STOP,
                num_prompt_tokens=300, num_reused_tokens=256, num_prefilled_tokens=44, num_generated_tokens=40,
                num_recomputed_tokens=0, arrival_time=1.0, first_scheduled_time=1.1, first_token_time=1.5)
    return RequestOutput(**{**base, **kw})


def test_merged_usage_counts_both_generations_and_the_client_prompt_once():
    reply = out(finish_reason=FinishReason.STOP)
    answer = out(num_prompt_tokens=200, num_reused_tokens=192, num_prefilled_tokens=8, num_generated_tokens=25,
                 finish_reason=FinishReason.LENGTH, arrival_time=3.0, first_token_time=3.2)
    m = merged(reply, answer)
    assert (m.num_prompt_tokens, m.num_reused_tokens, m.num_prefilled_tokens) == (300, 256, 44)
    assert m.num_generated_tokens == 65 and m.num_recomputed_tokens == 8
    assert m.finish_reason is FinishReason.LENGTH and m.first_token_time == 1.5


@pytest.fixture(scope="module")
def ll_tokenizer() -> llguidance.LLTokenizer:
    tokenizer = load_tokenizer(resolve_model_dir("smollm2-135m", default_cache_root()))
    return llguidance.hf.from_tokenizer(tokenizer)


def accepts(ll_tokenizer: llguidance.LLTokenizer, guide: Guide, text: str) -> bool:
    """Whether the grammar takes text as a whole reply, token by token as decoding would."""
    matcher = llguidance.LLMatcher(ll_tokenizer, GuidedDecoding.grammar(guide))
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(ll_tokenizer.tokenize_str(text)) and matcher.is_accepting()


@pytest.mark.parametrize("text, ok", [
    ("The temperature in Paris is 69.8 °F.", True),
    ("21 °C is 69.8 °F.\n\nBoth tools agree: {x} is a set.", True),
    ("Ça fait 69,8 °F.", True),
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', False),
    ('Here it is:\n{"name**: "celsius_to_fahrenheit"}', False),  # what the model wrote to get its call out
    ("Here:\n```json\n[1]\n```", False),
    ("Calling <tool_call> now", False),
    ("<function=get_weather>", False),
    ("\nThe answer", False),
    ("", False),
])
def test_answer_grammar_admits_prose_only(ll_tokenizer, text, ok):
    assert accepts(ll_tokenizer, answer_guide(), text) is ok
