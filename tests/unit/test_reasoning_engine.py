"""Reasoning on a tiny random model whose chat template opens a thinking block (tests/conftest.py tiny_think_gguf):
the engine closes the block when the budget is spent (with forks, with speculative drafts, and before a
structured-output constraint that then holds for the answer alone), and the completion service returns the
thinking as reasoning_content, in whole responses and streamed chunks alike, counts it in usage, passes
chat_template_kwargs to the template and leaves /v1/completions unparsed."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from kvserve.config import ServedModel, ServerConfig
from kvserve.engine.reasoning import Phase, count_reasoning_tokens
from kvserve.engine.sampling import SamplingParams
from kvserve.engine.structured.params import StructuredOutputsParams
from kvserve.service import protocol as p
from kvserve.service.completion import CompletionService
from kvserve.service.reasoning import thinking_format
from tests.engine_checks import assert_no_leaks, make_engine, torch_threads

MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["blue", "red"]}, "sure": {"type": "boolean"}},
          "required": ["colour", "sure"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(tiny_think_gguf):
    with torch_threads(1):
        yield make_engine(tiny_think_gguf, dtype="float32", num_gpu_blocks_override=128, speculative_decoding=True,
                          num_speculative_tokens=4)


def run(engine, params: SamplingParams, budget: int | None, constrained: bool = False):
    """One chat request through the engine: its control as the service plans it; (final output, control)."""
    fmt = thinking_format(engine.tokenizer, "auto")
    ids, control = fmt.plan(engine.tokenizer, engine.encode_prompt(messages=MESSAGES), budget, constrained)
    assert control.start is Phase.THINKING  # the template opened the block
    engine.core.add_request(engine.request(ids, params, thinking=control))
    final = None
    while engine.core.has_unfinished_requests():
        for out in engine.core.step():
            final = out if out.finished else final
    assert_no_leaks(engine)
    return final, control


@pytest.mark.parametrize("budget", [0, 1, 7, 24])
def test_the_engine_closes_the_block_when_the_budget_is_spent(engine, budget):
    """Exactly `budget` sampled thinking tokens, then the close tag and the separator as the tokenizer encodes
    them, then the answer; every fork alike (the forks' first token is forced too at budget 0); with speculative
    drafts on, no draft crosses the budget."""
    tail = 6
    params = SamplingParams(n=2, temperature=1.0, seed=budget, ignore_eos=True, max_tokens=budget + 4 + tail)
    final, control = run(engine, params, budget)
    forced = list(control.close_ids + control.separator_ids)
    for o in final.outputs:
        assert o.token_ids[budget:budget + len(forced)] == forced, o.token_ids
        assert len(o.token_ids) == budget + len(forced) + tail
        assert count_reasoning_tokens(control, o.token_ids) == budget + len(control.close_ids)
        assert "</think>\n\n" in o.text


def test_without_a_budget_the_block_runs_to_max_tokens(engine):
    final, control = run(engine, SamplingParams(temperature=0, ignore_eos=True, max_tokens=30), None)
    o = final.outputs[0]
    assert o.finish_reason == "length" and "</think>" not in o.text
    assert count_reasoning_tokens(control, o.token_ids) == 30


def test_a_constraint_holds_the_answer_after_the_block_and_not_the_thinking(engine):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=80,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    final, control = run(engine, params, 12, constrained=True)
    o = final.outputs[0]
    thinking, answer = o.text.split("</think>\n\n", 1)
    jsonschema.validate(json.loads(answer), SCHEMA)
    assert o.finish_reason == "stop" and len(o.token_ids) > 12 + 4
    assert thinking == engine.tokenizer.decode(o.token_ids[:12], skip_special_tokens=True)
    assert not thinking.startswith("{")  # free tokens: the JSON grammar would have begun with "{"


# ---- the completion service -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def service(tiny_think_gguf, tmp_path_factory):
    model = ServedModel(id="think", source=str(tiny_think_gguf),
                        engine_args=dict(dtype="float32", num_gpu_blocks_override=64, max_model_len=512))
    svc = CompletionService(ServerConfig(models=[model], home=str(tmp_path_factory.mktemp("think"))))
    handle = svc.models["think"]
    with torch_threads(1):
        handle.client.start()
        assert handle.client.wait_ready(60)
        yield svc
        handle.client.stop()


def call(service, kind: str, **body):
    """(the whole response, its streamed chunks) of the same greedy request."""
    req_type = p.ChatCompletionRequest if kind == "chat" else p.CompletionRequest
    body = {"model": "think", "temperature": 0, **body}

    async def both():
        whole = service.open(kind, req_type(**body), tenant="t")
        await service.start(whole)
        response = whole.response(await whole.finals())
        streamed = service.open(kind, req_type(**body, stream=True, stream_options={"include_usage": True}),
                                tenant="t")
        await service.start(streamed)
        chunks = streamed.chunks()
        events = list(chunks.opening())
        async for i, out in streamed.outputs():
            events += chunks.of(i, out)
        return response, events + chunks.closing()

    return asyncio.run(both())


def streamed_field(events: list[dict], name: str) -> str:
    return "".join(e["choices"][0]["delta"].get(name) or "" for e in events if e["choices"])


def test_chat_returns_the_thinking_as_reasoning_whole_and_streamed(service):
    budget = 9
    response, events = call(service, "chat", messages=MESSAGES, max_tokens=40, ignore_eos=True,
                            thinking_token_budget=budget)
    message = response.choices[0].message
    assert message.reasoning_content == message.reasoning and message.reasoning_content
    assert "</think>" not in message.content and "<think>" not in message.reasoning_content
    assert response.usage.completion_tokens_details.reasoning_tokens == budget + 3  # "</", "think", ">"
    assert streamed_field(events, "reasoning_content") == streamed_field(events, "reasoning") == \
        message.reasoning_content
    assert streamed_field(events, "content") == message.content
    assert events[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == budget + 3
    assert events[-1]["usage"]["completion_tokens"] == response.usage.completion_tokens == 40


def test_reasoning_effort_sets_the_budget_and_an_explicit_budget_wins(service):
    low, _ = call(service, "chat", messages=MESSAGES, max_tokens=280, ignore_eos=True, reasoning_effort="low")
    assert low.usage.completion_tokens_details.reasoning_tokens == 256 + 3
    both, _ = call(service, "chat", messages=MESSAGES, max_tokens=20, ignore_eos=True, reasoning_effort="low",
                   thinking_token_budget=2)
    assert both.usage.completion_tokens_details.reasoning_tokens == 2 + 3


def test_chat_template_kwargs_reach_the_template(service):
    off, events = call(service, "chat", messages=MESSAGES, max_tokens=12, ignore_eos=True,
                       chat_template_kwargs={"enable_thinking": False}, thinking_token_budget=2)
    on, _ = call(service, "chat", messages=MESSAGES, max_tokens=12, ignore_eos=True, thinking_token_budget=2)
    # the template wrote an empty closed block: the output is all answer, and the prompt is longer by it
    assert off.choices[0].message.reasoning_content is None and off.choices[0].message.content
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + len(service.models["think"].client.tokenizer.encode(
        "\n</think>\n\n", add_special_tokens=False))
    assert streamed_field(events, "reasoning_content") == ""


def test_structured_output_and_tool_calls_come_after_the_block(service):
    fmt = {"type": "json_schema", "json_schema": {"name": "sky", "schema": SCHEMA}}
    response, events = call(service, "chat", messages=MESSAGES, max_tokens=80, response_format=fmt,
                            thinking_token_budget=5)
    jsonschema.validate(json.loads(response.choices[0].message.content), SCHEMA)
    assert response.usage.completion_tokens_details.reasoning_tokens == 5 + 3
    assert streamed_field(events, "content") == response.choices[0].message.content
    tools = [{"type": "function", "function": {"name": "look", "parameters": SCHEMA}}]
    called, events = call(service, "chat", messages=MESSAGES, max_tokens=80, tools=tools, tool_choice="required",
                          thinking_token_budget=4)
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    jsonschema.validate(json.loads(choice.message.tool_calls[0]["function"]["arguments"]), SCHEMA)
    assert called.usage.completion_tokens_details.reasoning_tokens == 4 + 3
    streamed_calls = [d["tool_calls"] for e in events if e["choices"] for d in [e["choices"][0]["delta"]]
                      if "tool_calls" in d]
    assert streamed_calls and streamed_calls[0][0]["function"]["name"] == "look"


def test_completions_stay_raw_text(service):
    """The same prompt as text: /v1/completions gives the thinking as it was generated, in `text`."""
    chat, _ = call(service, "chat", messages=MESSAGES, max_tokens=10, ignore_eos=True)
    prompt = service.models["think"].client.tokenizer.apply_chat_template(MESSAGES)
    raw, _ = call(service, "completion", prompt=prompt, max_tokens=10, ignore_eos=True)
    assert chat.choices[0].message.content is None and chat.usage.completion_tokens_details.reasoning_tokens == 10
    assert raw.choices[0].text.strip("\n") == chat.choices[0].message.reasoning_content
    assert raw.usage.completion_tokens_details.reasoning_tokens == 0
