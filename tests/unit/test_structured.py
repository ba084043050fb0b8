"""Structured outputs' pure half and its compiler: what a request may ask (one constraint, within limits), the
compiled-grammar cache, the compile budget (a 400 naming it; the compile finishes and is cached), and llguidance's
errors surfaced as 400s naming the field."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

from kvserve.config import StructuredLimits
from kvserve.engine.structured import grammar as grammar_mod
from kvserve.engine.structured.grammar import GrammarCompiler
from kvserve.engine.structured.params import InvalidStructuredOutput, StructuredOutputsParams as SO


def test_exactly_one_constraint_and_schemas_keep_their_key_order():
    with pytest.raises(InvalidStructuredOutput, match="exactly one"):
        SO()
    with pytest.raises(InvalidStructuredOutput, match="exactly one"):
        SO(regex="a", choice=("a",))
    a = SO(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert a.json == '{"type":"object","properties":{"b":{},"a":{}}}' and a.kind == "json"
    assert a == SO(json='{"type": "object", "properties": {"b": {}, "a": {}}}', source="guided_json")  # same key
    with pytest.raises(InvalidStructuredOutput, match="not JSON"):
        SO(json="{nope")


def test_limits_are_checked_before_any_compile():
    limits = StructuredLimits(max_schema_bytes=200, max_schema_depth=4, max_pattern_bytes=10, max_choices=2)
    SO(json={"type": "object"}).check(limits)
    with pytest.raises(InvalidStructuredOutput, match="bytes") as e:
        SO(json={"enum": ["x" * 300]}, source="guided_json").check(limits)
    assert e.value.param == "guided_json" and e.value.http_status == 400
    deep = {"type": "object"}
    for _ in range(3):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(InvalidStructuredOutput, match="nests"):
        SO(json=deep).check(limits)
    with pytest.raises(InvalidStructuredOutput, match="bytes"):
        SO(regex="[a-z]{1,100}x").check(limits)
    with pytest.raises(InvalidStructuredOutput, match="choices"):
        SO(choice=("a", "b", "c")).check(limits)


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    c = GrammarCompiler(smollm2_tokenizer, smollm2_tokenizer.vocab_size)
    yield c
    c.shutdown()


def _text_through(matcher, tokenizer, text: str) -> bool:
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def test_compiled_grammars_match_what_they_should_and_are_cached(compiler, smollm2_tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    g = compiler.compile(SO(json=schema))
    assert _text_through(g.matcher(), smollm2_tokenizer, '{"n": 12}')
    assert not _text_through(g.matcher(), smollm2_tokenizer, '{"m": 12}')
    hits = compiler.stats.hits
    assert compiler.compile(SO(json=json.dumps(schema))) is g and compiler.stats.hits == hits + 1
    m = g.matcher()
    assert m.consume_tokens(smollm2_tokenizer.encode('{"n": 1', add_special_tokens=False))
    assert g.matcher().consume_tokens(smollm2_tokenizer.encode('{"n"', add_special_tokens=False))  # own state
    gbnf = compiler.compile(SO(grammar='root ::= "a" [0-9]+'))
    assert _text_through(gbnf.matcher(), smollm2_tokenizer, "a42")
    assert _text_through(compiler.compile(SO(choice=("yes", "no"))).matcher(), smollm2_tokenizer, "no")


@pytest.mark.parametrize("so, needle", [
    (SO(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}, source="response_format"), "nope"),
    (SO(regex="([a-z", source="guided_regex"), "regex"),
    (SO(grammar="start: undefined_rule", source="guided_grammar"), "grammar"),
])
def test_llguidance_errors_are_400s_naming_the_field(compiler, so, needle):
    refused = compiler.stats.refused
    with pytest.raises(InvalidStructuredOutput, match=needle) as e:
        compiler.compile(so)
    assert e.value.param == so.source and compiler.stats.refused == refused + 1


def test_a_compile_past_its_budget_is_refused_and_cached_when_done(smollm2_tokenizer, monkeypatch):
    release = threading.Event()
    real = grammar_mod.grammar_text

    def slow(params):
        release.wait(10)
        return real(params)

    monkeypatch.setattr(grammar_mod, "grammar_text", slow)
    c = GrammarCompiler(smollm2_tokenizer, smollm2_tokenizer.vocab_size, StructuredLimits(compile_timeout_s=0.05))
    so = SO(regex="[0-9]{4}", source="guided_regex")
    with pytest.raises(InvalidStructuredOutput, match="budget of 0.05 s") as e:
        asyncio.run(c.compile_async(so))
    assert e.value.param == "guided_regex" and c.stats.timeouts == 1
    with pytest.raises(InvalidStructuredOutput, match="budget"):  # joins the compile still in flight
        c.compile(so)
    release.set()
    for _ in range(200):
        if so in c._cache:
            break
        threading.Event().wait(0.01)
    assert asyncio.run(c.compile_async(so)) is c._cache[so]  # the finished compile serves the next request
    c.shutdown()


def test_unbounded_integers_get_i_json_bounds_and_stop_running_on(compiler, smollm2_tokenizer):
    from kvserve.engine.structured.params import MAX_SAFE_INTEGER, interoperable_integers

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "m": {"type": ["integer", "null"],
                                                                               "minimum": 3},
                                               "x": {"type": "number"}, "items": {"type": "array", "items": {
                                                   "type": "integer", "exclusiveMaximum": 10}}}}
    out = interoperable_integers(schema)
    assert out["properties"]["n"] == {"type": "integer", "maximum": MAX_SAFE_INTEGER, "minimum": -MAX_SAFE_INTEGER}
    assert out["properties"]["m"]["minimum"] == 3 and out["properties"]["m"]["maximum"] == MAX_SAFE_INTEGER
    assert out["properties"]["x"] == {"type": "number"}
    assert out["properties"]["items"]["items"] == {"type": "integer", "exclusiveMaximum": 10,
                                                   "minimum": -MAX_SAFE_INTEGER}
    assert schema["properties"]["n"] == {"type": "integer"}  # a copy
    m = compiler.compile(SO(json={"type": "integer"})).matcher()
    assert m.consume_tokens(smollm2_tokenizer.encode("1" * 16, add_special_tokens=False))
    assert m.is_stopped() or not m.consume_tokens(smollm2_tokenizer.encode("1" * 8, add_special_tokens=False))


def test_a_draft_ends_where_the_grammar_forbids_or_a_numbers_digits_close(compiler, smollm2_tokenizer):
    """Sequence.draftable: the scheduler drafts for a constrained sequence only tokens its grammar allows, up to
    where a number's digits close."""
    from kvserve import SamplingParams
    from kvserve.engine.request import EngineRequest, Sequence

    schema = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"],
              "additionalProperties": False}
    so = SO(json=schema)
    req = EngineRequest(request_id="r", prompt_token_ids=[1, 2],
                        params=SamplingParams(max_tokens=64, structured_outputs=so), grammar=compiler.compile(so))
    seq = Sequence.of(req, seq_id=0, max_tokens=64)
    enc = lambda text: tuple(smollm2_tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    head = enc('{"x": 0.')
    assert seq.draftable(head + enc(" nope")) == len(head)  # the grammar forbids the space
    digits = enc("1" * 30)
    assert len(digits) == 30  # one token a digit
    assert seq.draftable(head + digits) == len(head) + 16  # rows after 17 digits would need the digit ban
    for t in head + digits[:17]:
        seq.append_token(t)
    assert seq.numbers.digits_closed and seq.draftable(enc("}")) == 0  # no drafts from a closed number
