"""Tool calling's pure half (service/tools.py), in each format (Hermes, Mistral, Llama 3.1's JSON): the grammar per
tool_choice, parsing calls out of the generated text and streaming them as OpenAI's deltas whatever the text's
chunking, a marker the tokenizer has as a special token, and the prompt: the fallback for templates that do not
render tools, and the messages for those that do."""
from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from kvserve.service.tool_formats import FORMATS, HERMES, LLAMA3_JSON, MISTRAL, ToolFormat
from kvserve.service.tools import (Tool, ToolCallStream, fallback_messages, messages_for_template, parse_calls,
                                   render_call, tool_grammar, tool_json)
from tests import tool_templates

WEATHER = Tool("get_weather", "Weather in a city", {"type": "object", "properties": {"city": {"type": "string"}},
                                                      "required": ["city"]})
TIME = Tool("get_time", None, {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]})
CITY = '{"city": "Pa\\"ris {x}]"}'  # quotes, braces and brackets inside a string
ALL = pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))


def calls_text(fmt: ToolFormat, *calls: tuple[str, str]) -> str:
    return fmt.calls_text([render_call(name, args, fmt) for name, args in calls])


def two_calls(fmt: ToolFormat) -> str:
    return calls_text(fmt, ("get_weather", CITY), ("get_time", '{"tz": "UTC"}'))


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    from kvserve.engine.structured.grammar import GrammarCompiler

    c = GrammarCompiler(smollm2_tokenizer, smollm2_tokenizer.vocab_size)
    yield c
    c.shutdown()


@pytest.fixture
def accepts(compiler, smollm2_tokenizer):
    def check(so, text: str | list[int]) -> bool:
        ids = text if isinstance(text, list) else smollm2_tokenizer.encode(text, add_special_tokens=False)
        m = compiler.compile(so).matcher()
        return m.consume_tokens(ids) and m.is_accepting()
    return check


# ---- the grammar ------------------------------------------------------------------------------------------------

@ALL
def test_the_grammar_takes_well_formed_calls_and_nothing_else(fmt, accepts):
    tools = [WEATHER, TIME]
    assert tool_grammar(tools, "none", True, fmt=fmt) is None
    required = tool_grammar(tools, "required", True, fmt=fmt)
    one = calls_text(fmt, ("get_weather", '{"city": "Paris"}'))
    assert accepts(required, two_calls(fmt)) and accepts(required, one)
    assert not accepts(required, "Sunny.")
    assert not accepts(required, calls_text(fmt, ("get_weather", '{"town": "Paris"}')))  # not the tool's schema
    assert not accepts(required, calls_text(fmt, ("get_rain", '{"city": "Paris"}')))  # no such tool
    other = next(f for f in FORMATS.values() if f.arguments_key != fmt.arguments_key)
    assert not accepts(required, one.replace(f'"{fmt.arguments_key}"', f'"{other.arguments_key}"'))
    for f in FORMATS.values():  # another family's calls
        assert f is fmt or not accepts(required, calls_text(f, ("get_weather", '{"city": "Paris"}')))
    bad_separator = one + " | " + one
    assert not accepts(required, bad_separator)
    assert not accepts(required, one[:-1])  # cut short
    single = tool_grammar(tools, "required", parallel=False, fmt=fmt)
    assert not accepts(single, two_calls(fmt)) and accepts(single, one)
    named = tool_grammar(tools, "get_time", True, fmt=fmt)
    assert not accepts(named, one) and accepts(named, calls_text(fmt, ("get_time", '{"tz": "UTC"}')))
    auto = tool_grammar(tools, "auto", True, fmt=fmt)
    assert accepts(auto, "Sunny, 20 degrees.") and accepts(auto, two_calls(fmt))
    assert not accepts(auto, one[0] + "b" + one[0])  # the calls' first character commits to a call
    auto_json = tool_grammar([WEATHER], "auto", True, fmt=fmt, answer_schema={
        "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
        "additionalProperties": False})
    assert accepts(auto_json, '{"answer": "sunny"}') and not accepts(auto_json, "sunny")
    assert accepts(auto_json, one)


def test_a_marker_the_tokenizer_has_as_a_special_token_is_generated_as_that_token(accepts, smollm2_tokenizer):
    """As Mistral's [TOOL_CALLS] and Llama's <|python_tag|> are in their tokenizers (here SmolLM2's <|im_start|>,
    id 1, stands for them): the grammar names the token, not its text spelled in pieces."""
    enc = lambda text: smollm2_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    required = replace(MISTRAL, marker="<|im_start|>", marker_token=1)
    body = calls_text(required, ("get_weather", '{"city": "Paris"}'))[len("<|im_start|>"):]
    grammar = tool_grammar([WEATHER], "required", True, fmt=required)
    assert accepts(grammar, [1, *enc(body)])
    assert not accepts(grammar, [*enc("<|im_"), *enc("start|>"), *enc(body)])  # spelled as text
    assert not accepts(grammar, body)
    # an answer may start with anything (a call starts with the token), and calls keep the token in their text
    assert accepts(tool_grammar([WEATHER], "auto", True, fmt=required), "[1] is the answer")
    assert required.keeps_special_tokens
    text = smollm2_tokenizer.decode([1, *enc(body)], skip_special_tokens=False)
    assert [c.name for c in parse_calls(text, required)] == ["get_weather"]
    assert parse_calls(body, required) is None  # without its marker this is no call
    # optional (Llama's): with or without the token; the answer still may not start as the calls' text does
    optional = replace(LLAMA3_JSON, marker="<|im_start|>", marker_token=1)
    call = calls_text(optional, ("get_weather", '{"city": "Paris"}'))
    auto = tool_grammar([WEATHER], "auto", True, fmt=optional)
    assert accepts(auto, [1, *enc(call)]) and accepts(auto, call) and not accepts(auto, "{x}")
    assert not optional.keeps_special_tokens
    assert [c.name for c in parse_calls("<|im_start|>" + call, optional)] == ["get_weather"]


# ---- parsing and streaming ---------------------------------------------------------------------------------------

@ALL
def test_calls_are_parsed_and_a_cut_call_is_left_out(fmt):
    text = two_calls(fmt)
    calls = parse_calls(text, fmt)
    assert [(x.name, json.loads(x.arguments)) for x in calls] == [("get_weather", {"city": 'Pa"ris {x}]'}),
                                                                   ("get_time", {"tz": "UTC"})]
    assert calls[0].id != calls[1].id
    assert all(re.fullmatch(r"call_[0-9a-f]{24}" if not fmt.call_id_chars else r"[A-Za-z0-9]{9}", c.id)
               for c in calls)
    assert parse_calls("Sunny.", fmt) is None
    assert parse_calls(text[:25], fmt) is None  # cut by max_tokens in its first call: returned as text
    cut = parse_calls(text[:-5], fmt)  # cut in the second call: the first stands
    assert [x.name for x in cut] == ["get_weather"]


def test_llamas_calls_may_follow_its_python_tag():
    text = "<|python_tag|>" + two_calls(LLAMA3_JSON)
    assert [c.name for c in parse_calls(text, LLAMA3_JSON)] == ["get_weather", "get_time"]
    assert parse_calls("<b>Sunny</b>", LLAMA3_JSON) is None


def _stream(fmt: ToolFormat, pieces: list[str]) -> tuple[ToolCallStream, list[dict]]:
    s = ToolCallStream(fmt)
    return s, [d for piece in pieces for d in s.feed(piece)] + s.finish()


def _splits(text: str) -> list[list[str]]:
    """The text in two pieces at every character position, and in steps of 1, 2, 3 and 7 characters."""
    return ([[text[:i], text[i:]] for i in range(len(text) + 1)]
            + [[text[i:i + step] for i in range(0, len(text), step)] for step in (1, 2, 3, 7)])


@ALL
def test_streamed_calls_are_openai_deltas_whatever_the_chunking(fmt):
    text = two_calls(fmt)
    whole = parse_calls(text, fmt)
    for pieces in _splits(text):
        s, deltas = _stream(fmt, pieces)
        assert all(set(d) == {"tool_calls"} for d in deltas), pieces
        heads = [d["tool_calls"][0] for d in deltas if "id" in d["tool_calls"][0]]
        assert [(h["index"], h["type"], h["function"]["name"], h["function"]["arguments"]) for h in heads] == [
            (0, "function", "get_weather", ""), (1, "function", "get_time", "")], pieces
        args = {0: "", 1: ""}
        for d in deltas:
            tc = d["tool_calls"][0]
            args[tc["index"]] += tc["function"].get("arguments", "")
        assert [args[0], args[1]] == [c.arguments for c in s.calls] == [c.arguments for c in whole], pieces
        assert s.complete == 2 and [h["id"] for h in heads] == [c.id for c in s.calls]


@ALL
@pytest.mark.parametrize("answer", ["Sunny, 20 degrees.", '{"answer": "sunny"}', "<b>Sunny</b>", "[1] sunny", " "])
def test_an_answer_streams_as_content_whatever_the_chunking(fmt, answer):
    """Whatever could still start a call is held until it cannot, or the text ends (then it is content)."""
    assert parse_calls(answer, fmt) is None
    for pieces in _splits(answer):
        s, deltas = _stream(fmt, pieces)
        assert all(set(d) == {"content"} for d in deltas) and not s.calls
        assert "".join(d["content"] for d in deltas) == answer


def test_an_answer_is_not_held_when_its_first_character_tells():
    s = ToolCallStream(HERMES)
    assert s.feed("Sun") == [{"content": "Sun"}] and s.feed("ny.") == [{"content": "ny."}] and not s.calls


def test_a_call_cut_in_its_opening_is_text_when_streamed_too():
    text = two_calls(MISTRAL)[:8]  # "[TOOL_CA"
    s, deltas = _stream(MISTRAL, [text])
    assert deltas == [{"content": text}] and parse_calls(text, MISTRAL) is None


# ---- the prompt --------------------------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_8f2a01bc39de44e0a1b2c3d4", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]},
    {"role": "tool", "tool_call_id": "call_8f2a01bc39de44e0a1b2c3d4", "content": "20C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}]


@ALL
def test_the_fallback_prompt_describes_tools_and_writes_calls_and_results_back(fmt):
    out = fallback_messages(CONVERSATION, [WEATHER, TIME], fmt)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]  # results in one user turn
    system = out[0]["content"]
    assert system.startswith("Be brief.") and '"name": "get_weather"' in system
    assert system.endswith(fmt.instruction + "\n" + fmt.example())
    assert out[2]["content"] == calls_text(fmt, ("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}'))
    assert parse_calls(out[2]["content"], fmt) is not None  # written back as the model writes them
    assert out[3]["content"] == "\n".join(fmt.result_open + r + fmt.result_close for r in ("20C", "12:00"))
    assert all(set(m) == {"role", "content"} for m in out)


def test_the_hermes_fallback_is_hermes_function_calling_prompt():
    out = fallback_messages(CONVERSATION, [WEATHER], HERMES)
    assert out[0]["content"].endswith(
        "within <tool_call></tool_call> XML tags as follows:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-dict>}\n</tool_call>')
    assert out[3]["content"] == "<tool_response>\n20C\n</tool_response>\n<tool_response>\n12:00\n</tool_response>"


@ALL
def test_a_template_that_renders_tools_gets_arguments_as_objects_and_ids_it_accepts(fmt, smollm2_tokenizer):
    messages = messages_for_template(CONVERSATION[1:4], fmt)
    calls = messages[1]["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == [{"city": "Paris"}, {"tz": "CET"}]
    assert messages[2]["tool_call_id"] == calls[0]["id"] and CONVERSATION[2]["tool_calls"][0]["function"][
        "arguments"] == '{"city": "Paris"}'  # the request's own messages are left as they were
    if fmt.call_id_chars:
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in calls)
    else:
        assert [c["id"] for c in calls] == ["call_8f2a01bc39de44e0a1b2c3d4", "call_2"]
    messages[1]["tool_calls"] = calls[:1]  # Llama 3.1's template takes one call a turn
    prompt = smollm2_tokenizer.apply_chat_template(messages + [{"role": "user", "content": "And?"}],
                                                   chat_template=tool_templates.TEMPLATES[fmt.name],
                                                   tools=[tool_json(WEATHER)])
    without_ids = prompt.replace(f', "id": "{calls[0]["id"]}"', "")  # Mistral's template adds them to its calls
    assert render_call("get_weather", '{"city": "Paris"}', fmt).strip() in without_ids
    assert '"description": "Weather in a city"' in prompt and "20C" in prompt
