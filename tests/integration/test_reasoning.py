"""Reasoning through `kvserve serve` with the real `openai` client, on the tiny random model whose chat template
opens a thinking block (tests/conftest.py tiny_think_gguf): the thinking comes back as `reasoning_content` (and
`reasoning`), whole and streamed, cut by the engine at `thinking_token_budget` or `reasoning_effort`'s budget,
counted in usage's `completion_tokens_details.reasoning_tokens`; `chat_template_kwargs` reach the template;
structured outputs hold for the answer after the block; bad values are 400s in OpenAI's error schema."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.live_server import LiveServer, tiny_model_toml

pytestmark = pytest.mark.timeout(600)

MODEL = "think"
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["blue", "red"]}, "sure": {"type": "boolean"}},
          "required": ["colour", "sure"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_think_gguf):
    srv = LiveServer(tmp_path_factory.mktemp("reasoning"),
                     tiny_model_toml(tiny_think_gguf, MODEL, max_model_len=512, blocks=128)).start()
    yield srv
    srv.stop()


def test_reasoning_whole_and_streamed_with_its_usage(server):
    client = server.openai()
    args = dict(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0,
                extra_body={"thinking_token_budget": 6, "ignore_eos": True})
    whole = client.chat.completions.create(**args)
    message = whole.choices[0].message
    assert message.reasoning_content and message.reasoning == message.reasoning_content
    assert "</think>" not in (message.content or "") + message.reasoning_content
    assert whole.usage.completion_tokens_details.reasoning_tokens == 6 + 3  # the close tag is 3 tokens here
    reasoning = content = ""
    usage = None
    for chunk in client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
        usage = chunk.usage or usage
    assert (reasoning, content) == (message.reasoning_content, message.content or "")
    assert usage.completion_tokens_details.reasoning_tokens == 6 + 3


def test_reasoning_effort_and_chat_template_kwargs(server):
    client = server.openai()
    low = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=270, temperature=0,
                                         reasoning_effort="low", extra_body={"ignore_eos": True})
    assert low.usage.completion_tokens_details.reasoning_tokens == 256 + 3
    off = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                     "ignore_eos": True})
    assert getattr(off.choices[0].message, "reasoning_content", None) is None and off.choices[0].message.content
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


def test_structured_output_holds_after_the_block(server):
    r = server.openai().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "sky", "schema": SCHEMA}},
        extra_body={"thinking_token_budget": 5})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    assert r.usage.completion_tokens_details.reasoning_tokens == 5 + 3


@pytest.mark.parametrize("extra,param", [
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ({"thinking_token_budget": "many"}, "thinking_token_budget"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"self": 1}}, "chat_template_kwargs"),  # a name the template call cannot take
])
def test_bad_reasoning_fields_are_400s(server, extra, param):
    with pytest.raises(openai.BadRequestError) as bad:
        server.openai().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra)
    assert bad.value.status_code == 400
    assert bad.value.body["type"] == "invalid_request_error" and bad.value.body["param"] == param
