"""Structured outputs in the engine, on the tiny random model (its text is noise, so only the grammar makes it
valid): every constrained output matches, under preemption by recompute and by swap, chunked prefill, n > 1 with
seeds (reproducible), a resumed stream (the matcher replays the delivered tokens), static drafts; and an
unconstrained request beside constrained ones gets the bits it gets alone."""
from __future__ import annotations

import json
import re
from dataclasses import replace

import jsonschema
import pytest

from kvserve import SamplingParams
from kvserve.engine.structured.params import StructuredOutputsParams as SO
from tests.engine_checks import Req, assert_no_leaks, drive, make_engine, torch_threads

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["id", "tags", "ok"], "additionalProperties": False}
REGEX = r"[a-z]{2,6}-[0-9]{2}"
CONSTRAINTS = [SO(json=SCHEMA), SO(regex=REGEX), SO(choice=("alpha", "beta", "gamma")), SO(json_object=True)]


@pytest.fixture(scope="module", autouse=True)
def _threads():
    with torch_threads(1):
        yield


def valid(so: SO, text: str) -> bool:
    if so.kind == "json":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            return True
        except (ValueError, jsonschema.ValidationError):
            return False
    if so.kind == "json_object":
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if so.kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return text in so.choice


def requests(tok, n: int = 1, max_tokens: int = 120) -> list[Req]:
    out = []
    for i, so in enumerate(CONSTRAINTS):
        for temp in (0.0, 1.0):
            out.append(Req(tok.encode(f"request {i} at {temp}:"), SamplingParams(
                temperature=temp, seed=100 + i, max_tokens=max_tokens, n=n, structured_outputs=so)))
    return out


def check(run, reqs: list[Req]) -> None:
    for ro, r in zip(run.outputs, reqs):
        for o in ro.outputs:
            so = r.params.structured_outputs
            if so.kind == "json_object" and o.finish_reason == "length":
                continue  # an open object may run to max_tokens on noise; a bounded schema may not
            assert o.finish_reason == "stop" and valid(so, o.text), (so.kind, o.text, o.finish_reason)


def test_constrained_outputs_match_on_a_model_that_writes_noise(tiny_llama_gguf):
    eng = make_engine(tiny_llama_gguf, dtype="float32")
    reqs = requests(eng.tokenizer)
    check(drive(eng, reqs), reqs)
    assert_no_leaks(eng)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_chunked_prefill_keep_the_matcher(tiny_llama_gguf, mode):
    reqs = requests(make_engine(tiny_llama_gguf, dtype="float32").tokenizer, max_tokens=60) * 2
    reference = drive(make_engine(tiny_llama_gguf, dtype="float32"), reqs)
    # Blocks of 4 tokens, a pool of 20: a sequence's whole length fits, the batch's does not
    eng = make_engine(tiny_llama_gguf, dtype="float32", block_size=4, num_gpu_blocks_override=20,
                      preemption_mode=mode, swap_space="4MiB", max_num_batched_tokens=16)
    run = drive(eng, reqs)
    assert run.preemptions > 0 and run.chunked_prefills > 0
    assert run.tokens == reference.tokens  # the same tokens: the matcher went on where it was
    check(run, reqs)
    assert_no_leaks(eng)


def test_n2_with_seeds_is_valid_and_reproducible(tiny_llama_gguf):
    eng = make_engine(tiny_llama_gguf, dtype="float32")
    reqs = [r for r in requests(eng.tokenizer, n=2) if r.params.temperature > 0]
    first = drive(eng, reqs)
    check(first, reqs)
    assert drive(eng, reqs).tokens == first.tokens


def test_a_resumed_stream_goes_on_under_its_constraint(tiny_llama_gguf):
    eng = make_engine(tiny_llama_gguf, dtype="float32")
    reqs = [r for r in requests(eng.tokenizer) if r.params.structured_outputs.kind == "json"]
    whole = drive(eng, reqs)
    resumed = [replace(r, resumed=o.outputs[0].token_ids[:5]) for r, o in zip(reqs, whole.outputs)]
    run = drive(eng, resumed)
    for a, b in zip(whole.outputs, run.outputs):
        assert a.outputs[0].token_ids[5:] == b.outputs[0].token_ids  # seeded or greedy: the same continuation
    with pytest.raises(Exception, match="do not match"):
        eng.core.add_request(eng.request(reqs[0].prompt, reqs[0].params, resumed_token_ids=eng.tokenizer.encode(
            "not json", add_special_tokens=False)))


def test_a_neighbours_output_is_untouched_by_constrained_rows(tiny_llama_gguf):
    eng = make_engine(tiny_llama_gguf, dtype="bfloat16")
    assert eng.numerics == "batch_invariant"
    free = Req(eng.tokenizer.encode("free text:"), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                                 logprobs=3))
    alone = drive(eng, [free])
    mixed = drive(eng, [free] + requests(eng.tokenizer))
    assert mixed.outputs[0].outputs[0].token_ids == alone.outputs[0].outputs[0].token_ids
    assert [lp.logprob for lp in mixed.outputs[0].outputs[0].logprobs] == \
        [lp.logprob for lp in alone.outputs[0].outputs[0].logprobs]


def test_constrained_requests_with_drafts_stay_valid(tiny_llama_gguf):
    """Static drafts (every proposal verified) for constrained requests on noise: every output still matches."""
    eng = make_engine(tiny_llama_gguf, dtype="float32", speculative_decoding=True, speculative_controller=False)
    reqs = requests(eng.tokenizer)
    check(drive(eng, reqs), reqs)
    assert_no_leaks(eng)


def test_checking_after_sampling_gives_the_masked_rows_tokens(tiny_llama_gguf, monkeypatch):
    """Greedy rows sample unmasked and check the token (engine/worker/grammar_mask.py): the tokens are those of masking
    every row first; unseeded sampled rows stay valid."""
    from kvserve.engine.worker import runner as runner_mod

    eng = make_engine(tiny_llama_gguf, dtype="float32")
    greedy = [r for r in requests(eng.tokenizer) if r.params.temperature == 0]
    unseeded = [replace(r, params=replace(r.params, seed=None, temperature=0.8)) for r in greedy]
    checked = drive(eng, greedy + unseeded)
    check(checked, greedy + unseeded)
    real = runner_mod.checked_after_sampling
    monkeypatch.setattr(runner_mod, "checked_after_sampling", lambda seqs, gens: ([], sum(real(seqs, gens), [])))
    masked = drive(eng, greedy)
    assert masked.tokens == checked.tokens[:len(greedy)]


def test_the_offline_llm_takes_structured_outputs(tiny_llama_gguf):
    from kvserve import LLM, StructuredOutputsParams

    llm = LLM(str(tiny_llama_gguf), dtype="float32")
    outs = llm.generate(["pick:", "choose:"], SamplingParams(temperature=0.9, max_tokens=8, structured_outputs=
                                                            StructuredOutputsParams(choice=["left", "right"])))
    assert [o.outputs[0].text in ("left", "right") for o in outs] == [True, True]


def test_numbers_end_at_a_doubles_precision_instead_of_running_to_max_tokens(tiny_llama_gguf, monkeypatch):
    """A bounded `number` allows decimals forever; on noise they run on. With a double's 17 significant digits
    the number is offered its end (engine/structured/number_precision.py), and every output is a valid object; taking
    that away, some run to max_tokens (so this test can fail)."""
    from kvserve.engine.structured.number_precision import NumberScanner

    schema = {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1},
                                               "y": {"type": "number"}},
              "required": ["x", "y"], "additionalProperties": False}
    eng = make_engine(tiny_llama_gguf, dtype="float32")
    reqs = [Req(eng.tokenizer.encode(f"numbers {i}:"), SamplingParams(
        temperature=t, seed=i if i % 2 else None, max_tokens=80, structured_outputs=SO(json=schema)))
        for i in range(8) for t in (0.0, 1.0)]

    def outcomes():
        run = drive(eng, reqs)
        return [(o.finish_reason, o.text) for ro in run.outputs for o in ro.outputs]

    for reason, text in outcomes():
        assert reason == "stop", text
        value = json.loads(text)
        jsonschema.validate(value, schema)
        for v in value.values():
            digits = re.sub(r"[eE].*", "", json.dumps(v)).replace("-", "").replace(".", "").lstrip("0")
            assert len(digits) <= 17, text
    assert_no_leaks(eng)
    monkeypatch.setattr(NumberScanner, "digits_closed", property(lambda self: False))
    assert any(reason == "length" for reason, _ in outcomes())
