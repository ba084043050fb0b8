"""Tool calling's pure half (service/tools.py): the grammar per tool_choice, the prompt fallback for templates
that do not render tools, parsing calls out of the generated text, and streaming them as OpenAI's deltas
whatever the text's chunking."""
from __future__ import annotations

import json

import pytest

from kvserve.service.tools import (CLOSE, OPEN, Tool, ToolCallStream, fallback_messages, parse_calls, render_call,
                                   tool_grammar)

WEATHER = Tool("get_weather", "Weather in a city", {"type": "object", "properties": {"city": {"type": "string"}},
                                                      "required": ["city"]})
TIME = Tool("get_time", None, {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]})
TEXT = (OPEN + '{"name": "get_weather", "arguments": {"city": "Pa\\"ris {x}"}}' + CLOSE + "\n"
        + OPEN + '{"name": "get_time", "arguments": {"tz": "UTC"}}' + CLOSE)


def test_grammar_per_tool_choice(smollm2_tokenizer):
    from kvserve.engine.structured.grammar import GrammarCompiler

    c = GrammarCompiler(smollm2_tokenizer, smollm2_tokenizer.vocab_size)

    def accepts(so, text) -> bool:
        m = c.compile(so).matcher()
        return m.consume_tokens(smollm2_tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()

    assert tool_grammar([WEATHER], "none", True) is None
    required = tool_grammar([WEATHER, TIME], "required", True)
    assert accepts(required, TEXT)
    assert not accepts(required, "Sunny.")
    assert not accepts(required, OPEN + '{"name": "get_weather", "arguments": {"town": "Paris"}}' + CLOSE)
    single = tool_grammar([WEATHER, TIME], "required", parallel=False)
    assert not accepts(single, TEXT) and accepts(single, TEXT.split("\n<tool_call>")[0])
    named = tool_grammar([WEATHER, TIME], "get_time", True)
    assert not accepts(named, TEXT.split("\n<tool_call>")[0])
    assert accepts(named, OPEN + '{"name": "get_time", "arguments": {"tz": "UTC"}}' + CLOSE)
    auto = tool_grammar([WEATHER, TIME], "auto", True)
    assert accepts(auto, "Sunny, 20 degrees.") and accepts(auto, TEXT) and not accepts(auto, "<b>bold</b>")
    auto_json = tool_grammar([WEATHER], "auto", True, answer_schema={"type": "object", "properties": {
        "answer": {"type": "string"}}, "required": ["answer"], "additionalProperties": False})
    assert accepts(auto_json, '{"answer": "sunny"}') and not accepts(auto_json, "sunny")
    c.shutdown()


def test_calls_are_parsed_and_a_cut_call_is_text():
    calls = parse_calls(TEXT)
    assert [(x.name, json.loads(x.arguments)) for x in calls] == [("get_weather", {"city": 'Pa"ris {x}'}),
                                                                   ("get_time", {"tz": "UTC"})]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    assert parse_calls("Sunny.") is None
    assert parse_calls(TEXT[:40]) is None  # cut by max_tokens in its first call: returned as text
    cut = parse_calls(TEXT[:-5])  # cut in the second call: the first stands
    assert [x.name for x in cut] == ["get_weather"]


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_calls_are_openai_deltas_whatever_the_chunking(step):
    s = ToolCallStream()
    deltas = [d for i in range(0, len(TEXT), step) for d in s.feed(TEXT[i:i + step])]
    heads = [d["tool_calls"][0] for d in deltas if "id" in d["tool_calls"][0]]
    assert [(h["index"], h["type"], h["function"]["name"], h["function"]["arguments"]) for h in heads] == [
        (0, "function", "get_weather", ""), (1, "function", "get_time", "")]
    args = {0: "", 1: ""}
    for d in deltas:
        tc = d["tool_calls"][0]
        args[tc["index"]] += tc["function"].get("arguments", "")
    assert json.loads(args[0]) == {"city": 'Pa"ris {x}'} and json.loads(args[1]) == {"tz": "UTC"}
    assert [c.arguments for c in s.calls] == [args[0], args[1]]


def test_an_answer_streams_as_content():
    s = ToolCallStream()
    assert s.feed("Sun") == [{"content": "Sun"}] and s.feed("ny.") == [{"content": "ny."}] and not s.calls


def test_the_fallback_prompt_describes_tools_and_writes_calls_and_results_back():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}},
                    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "20C"},
                {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}]
    out = fallback_messages(messages, [WEATHER, TIME])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]  # results in one user turn
    assert out[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == render_call("get_weather", '{"city": "Paris"}') + "\n" + render_call(
        "get_time", '{"tz": "CET"}')
    assert out[3]["content"] == "<tool_response>\n20C\n</tool_response>\n<tool_response>\n12:00\n</tool_response>"
    assert all(set(m) == {"role", "content"} for m in out)
