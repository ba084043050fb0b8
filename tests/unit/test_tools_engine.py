"""Tool calls in each family's format through the completion service, on tiny random models whose chat templates
are each family's (tests/tool_templates.py): the format is read from the template (or set per model, for a template
that does not render tools), tool_choice="required" makes the model write its calls in that format, and they come
back parsed as OpenAI's tool_calls, whole and streamed alike; the conversation with the calls and their results
goes back into the next prompt."""
from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from kvserve.config import ServedModel, ServerConfig
from kvserve.service import protocol as p
from kvserve.service.completion import CompletionService
from tests import tool_templates
from tests.engine_checks import torch_threads

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
             "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# model id -> (its chat template: None for the tokenizer's own ChatML, its tool_call_parser setting)
MODELS = {"mistral": (tool_templates.MISTRAL, "auto"), "llama": (tool_templates.LLAMA3_JSON, "auto"),
          "hermes": (tool_templates.HERMES, "auto"), "chatml-as-llama": (None, "llama3_json")}
# what the model's own text starts with, per model
OPENINGS = {"mistral": "[TOOL_CALLS] [{\"name\": \"", "llama": "{\"name\": \"", "hermes": "<tool_call>\n{\"name\": \"",
            "chatml-as-llama": "{\"name\": \""}


@pytest.fixture(scope="module")
def service(tiny_gguf_dir, smollm2_gguf_path, tmp_path_factory):
    from tests.gguf_factory import TinySpec, write_tiny_gguf

    models = []
    for model_id, (template, parser) in MODELS.items():
        path = tiny_gguf_dir / f"tiny-tools-{model_id}.gguf"
        if not path.exists():
            write_tiny_gguf(path, TinySpec(arch="llama", quant="Q8_0", chat_template=template), str(smollm2_gguf_path))
        models.append(ServedModel(id=model_id, source=str(path), tool_call_parser=parser, engine_args=dict(
            dtype="float32", num_gpu_blocks_override=96, max_model_len=1024,
            interactive={"max_ttft_s": 60.0})))  # a loaded 2-core machine: no refusals for its estimates
    svc = CompletionService(ServerConfig(models=models, home=str(tmp_path_factory.mktemp("tools"))))
    with torch_threads(1):
        for handle in svc.models.values():
            handle.client.start()
        for handle in svc.models.values():
            assert handle.client.wait_ready(60)
        yield svc
        for handle in svc.models.values():
            handle.client.stop()


def call(service, model: str, **body):
    """(the model's own text, the whole response, the streamed chunks) of the same greedy request."""
    body = {"model": model, "temperature": 0, "max_tokens": 120, **body}

    async def both():
        whole = service.open("chat", p.ChatCompletionRequest(**body), tenant="t")
        await service.start(whole)
        finals = await whole.finals()
        streamed = service.open("chat", p.ChatCompletionRequest(**body, stream=True), tenant="t")
        await service.start(streamed)
        chunks = streamed.chunks()
        events = list(chunks.opening())
        async for i, out in streamed.outputs():
            events += chunks.of(i, out)
        return finals[0].outputs[0].text, whole.response(finals), events

    return asyncio.run(both())


def streamed_calls(events: list[dict]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) of each call in a stream's tool_calls deltas."""
    calls: dict[int, list[str]] = {}
    for e in events:
        for tc in e["choices"][0]["delta"].get("tool_calls") or ():
            entry = calls.setdefault(tc["index"], [tc.get("id"), tc["function"].get("name"), ""])
            entry[2] += tc["function"].get("arguments", "")
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("model", list(MODELS))
def test_required_calls_are_written_in_the_models_format_and_parsed(service, model):
    text, response, events = call(service, model, messages=ASK, tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False)
    fmt = service.models[model].tool_format
    assert fmt.name == {"mistral": "mistral", "hermes": "hermes"}.get(model, "llama3_json")
    assert text.startswith(OPENINGS[model]), text
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (tc,) = choice.message.tool_calls
    assert re.fullmatch(r"[A-Za-z0-9]{9}" if model == "mistral" else r"call_[0-9a-f]{24}", tc["id"])
    name, arguments = tc["function"]["name"], json.loads(tc["function"]["arguments"])
    assert name in ("get_weather", "get_time")
    jsonschema.validate(arguments, SCHEMA if name == "get_weather" else TOOLS[1]["function"]["parameters"])
    ((_, s_name, s_args),) = streamed_calls(events)
    assert (s_name, s_args) == (name, tc["function"]["arguments"])
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(e["choices"][0]["delta"].get("content") for e in events)

    # the call and its result go back into the prompt (the template's own way, or the fallback's) whatever the
    # ids' form; a named function then holds the next turn to it
    for call_id in (tc["id"], "call_8f2a01bc39de44e0a1b2c3d4"):
        follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [{**tc, "id": call_id}]},
                        {"role": "tool", "tool_call_id": call_id, "content": '"sunny"'}]
        _, again, _ = call(service, model, messages=follow, tools=TOOLS,
                           tool_choice={"type": "function", "function": {"name": "get_time"}})
        assert [c["function"]["name"] for c in again.choices[0].message.tool_calls] == ["get_time"]
