"""Structured outputs and tool calls (engine/structured/grammar.py, service/tools.py), measured on a real model, in process
through AsyncLLM (the server's engine: constraints compile off the engine thread).

  python -m benchmarks.structured [--model smollm2-135m] [--runs 3] [--out docs/bench]

- Validity: 200 chat requests over 20 JSON schemas (10 each), temperature 0.7: the share whose output parses and
  validates against its schema (jsonschema), and the share that ran to max_tokens (cut short: not valid JSON).
  Tool calls: 40 requests with two tools, tool_choice "required" and "auto": valid calls (each call's arguments
  validate against its tool's schema), and how often "auto" chose to call.
- Throughput cost: W1's shape (32 at once, 128 greedy output tokens) unconstrained and with every request
  constrained by a schema whose outputs run to max_tokens (a JSON list of at least 100 short strings: the quotes,
  commas and strings of typical JSON), output tokens/s, medians of runs.
- Compile cost beside interactive traffic: 32 short interactive requests arriving 30 ms apart, 25% carrying a
  schema never seen before (a compile each), against none: TTFT p50 of the unconstrained ones. (Sent all at
  once, whether a wave's prompts share one prefill step or two decides its TTFT, whatever the schemas.)
- Pathological schemas beside interactive traffic: waves of 32 unconstrained requests (arriving 30 ms apart)
  with 4 more carrying small new schemas, spread over the wave; with 8 carrying what a careless or hostile client sends instead (4 schemas over the size limit,
  4 nested past the depth limit: refused before any compile); and with 4 new enums of 4,000 strings (the
  costliest compile found within the limits, served). The slowest refusal, and the 32 requests' TTFT p99 for
  each kind of wave (all runs pooled).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import replace

import kvserve  # noqa: F401  (first: it caps torch's CPU dispatch at KVSERVE_CPU_ISA's level)

from benchmarks.pages import stamp, write_page

TOPICS = ["a person", "a book", "a city", "a recipe", "a car", "a movie", "a planet", "a company", "a song", "a team"]


def _string(n: int = 30) -> dict:
    return {"type": "string", "maxLength": n}


def _obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def schemas() -> list[dict]:
    """20 schemas of the shapes applications send: flat and nested objects, arrays, enums, anyOf, bounds,
    patterns, booleans (bounded, as a schema for a small model should be)."""
    s = [
        _obj({"name": _string(), "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
        _obj({"title": _string(), "year": {"type": "integer", "minimum": 1900, "maximum": 2030}}),
        _obj({"city": _string(), "country": _string(), "population": {"type": "integer", "minimum": 0}}),
        _obj({"name": _string(), "steps": {"type": "array", "items": _string(40), "minItems": 1, "maxItems": 3}}),
        _obj({"make": _string(20), "model": _string(20), "electric": {"type": "boolean"}}),
        _obj({"title": _string(), "rating": {"type": "number", "minimum": 0, "maximum": 10}}),
        _obj({"name": _string(), "moons": {"type": "integer", "minimum": 0, "maximum": 200},
              "rocky": {"type": "boolean"}}),
        _obj({"name": _string(), "sector": {"enum": ["tech", "finance", "health", "retail", "energy"]}}),
        _obj({"title": _string(), "artist": _string(), "genre": {"enum": ["pop", "rock", "jazz", "classical"]}}),
        _obj({"team": _string(), "players": {"type": "array", "items": _string(20), "minItems": 2, "maxItems": 4}}),
        _obj({"name": _string(), "address": _obj({"street": _string(), "zip": {"type": "string",
                                                                               "pattern": "^[0-9]{5}$"}})}),
        _obj({"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "active": {"type": "boolean"}}),
        _obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"type": "null"}]}}),
        _obj({"tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "black"]}, "maxItems": 4}}),
        _obj({"summary": _string(80), "sentiment": {"enum": ["positive", "neutral", "negative"]}}),
        _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}, "event": _string()}),
        _obj({"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}),
        _obj({"owner": _obj({"name": _string(), "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}"
                                                                                        "\\.com$"}}),
              "pets": {"type": "integer", "minimum": 0, "maximum": 9}}),
        _obj({"items": {"type": "array", "items": _obj({"sku": _string(10), "qty": {"type": "integer", "minimum": 1,
                                                                                    "maximum": 9}}),
                        "minItems": 1, "maxItems": 3}}),
        _obj({"kind": {"anyOf": [_obj({"circle": {"type": "number", "minimum": 0, "maximum": 100}}),
                                 _obj({"square": {"type": "number", "minimum": 0, "maximum": 100}})]}}),
    ]
    assert len(s) == 20
    return s


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters":
                                      _obj({"city": _string(), "unit": {"enum": ["c", "f"]}})}},
    {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters":
                                      _obj({"query": _string(60), "limit": {"type": "integer", "minimum": 1,
                                                                            "maximum": 10}})}},
]
QUESTIONS = ["What's the weather in Paris?", "Find recent news about solar panels.", "Is it raining in Oslo?",
             "Search for the best pizza recipe.", "How warm is it in Cairo today?"]
LIST_SCHEMA = _obj({"words": {"type": "array", "items": _string(12), "minItems": 100, "maxItems": 200}})
MAX_TOKENS = 200


def _log(msg: str) -> None:
    print(f"[structured] {msg}", file=sys.stderr, flush=True)


async def _generate(llm, tok, messages, params, tools=None):
    """(text, finish reason, seconds to first token, output tokens) of one request through the service's prompt
    path (service/protocol.py + service/tools.py)."""
    from kvserve.service.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **(tools or {})})
    msgs, tool_defs = req.prompt(tok.renders_tools)
    ids = tok.encode_chat(msgs, tools=tool_defs)
    params = replace(params, structured_outputs=req.structured())
    t0 = time.perf_counter()
    first, final = None, None
    async for out in llm.generate(ids, params):
        if first is None and out.outputs and out.outputs[0].token_ids:
            first = time.perf_counter() - t0
        final = out
    o = final.outputs[0]
    return o.text, o.finish_reason, first, len(o.token_ids), req


async def validity(llm, tok) -> dict:
    import jsonschema

    from kvserve import SamplingParams
    from kvserve.service.tools import parse_calls

    jobs = []
    for i, schema in enumerate(schemas()):
        for k in range(10):
            msg = [{"role": "user", "content": f"Reply in JSON with an example of {TOPICS[k % len(TOPICS)]}."}]
            fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}}
            jobs.append((schema, _generate(llm, tok, msg, SamplingParams(temperature=0.7, seed=100 * i + k,
                                                                         max_tokens=MAX_TOKENS), fmt)))
    results = await asyncio.gather(*(j for _, j in jobs))
    valid = cut = 0
    for (schema, _), (text, finish, *_rest) in zip(jobs, results):
        cut += finish == "length"
        try:
            jsonschema.validate(json.loads(text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    tools = {}
    for choice in ("required", "auto"):
        runs = [_generate(llm, tok, [{"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}],
                          SamplingParams(temperature=0.7, seed=k, max_tokens=MAX_TOKENS),
                          {"tools": TOOLS, "tool_choice": choice}) for k in range(20)]
        called = ok = 0
        for text, finish, *_ in await asyncio.gather(*runs):
            calls = parse_calls(text)
            if calls:
                called += 1
                try:
                    for c in calls:
                        jsonschema.validate(json.loads(c.arguments), by_name[c.name])
                    ok += 1
                except (ValueError, KeyError, jsonschema.ValidationError):
                    pass
        tools[choice] = {"requests": len(runs), "called": called, "valid_calls": ok}
    return {"requests": len(jobs), "schemas": 20, "valid": valid, "cut_at_max_tokens": cut, "tools": tools}


async def throughput(llm, tok, runs: int) -> dict:
    from kvserve import SamplingParams

    async def batch(constrained: bool) -> float:
        fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": LIST_SCHEMA}}} \
            if constrained else None
        params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=not constrained)  # W1: greedy
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(_generate(llm, tok, [{"role": "user", "content": f"List words about {t}."}],
                                                params, fmt)
                                      for i, t in enumerate((TOPICS * 4)[:32])))
        return sum(n for *_, n, _ in outs) / (time.perf_counter() - t0)

    got = {"off": [], "on": []}
    await batch(True)  # warm: the schema's compile, kernels
    for r in range(runs):
        for constrained in ((False, True) if r % 2 == 0 else (True, False)):
            got["on" if constrained else "off"].append(await batch(constrained))
            _log(f"throughput run {r} {'constrained' if constrained else 'free'}: {got['on' if constrained else 'off'][-1]:.1f} tok/s")
    med = {k: statistics.median(v) for k, v in got.items()}
    return {"tok_s_free": med["off"], "tok_s_constrained": med["on"], "ratio": med["on"] / med["off"], "runs": got}


ARRIVAL_GAP_S = 0.03  # interactive requests arrive one by one, not all in one step


async def _after(delay: float, coro):
    await asyncio.sleep(delay)
    return await coro


async def compile_beside_traffic(llm, tok, runs: int) -> dict:
    from kvserve import SamplingParams

    async def wave(new_schemas: bool, salt: int) -> float:
        jobs = []
        for i in range(32):
            fmt = None
            if new_schemas and i % 4 == 0:  # a schema nobody sent before: its compile
                schema = _obj({f"field_{salt}_{i}_{j}": _string() for j in range(6)})
                fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
            jobs.append((fmt is None, _after(i * ARRIVAL_GAP_S, _generate(
                llm, tok, [{"role": "user", "content": f"Say hi to {i}."}], SamplingParams(temperature=0, max_tokens=8),
                fmt))))
        outs = await asyncio.gather(*(j for _, j in jobs))
        return statistics.median(o[2] for (free, _), o in zip(jobs, outs) if free)

    got = {"none": [], "new": []}
    for r in range(runs):
        for new in ((False, True) if r % 2 == 0 else (True, False)):
            got["new" if new else "none"].append(await wave(new, salt=r))
    med = {k: statistics.median(v) for k, v in got.items()}
    return {"ttft_p50_ms_none": 1000 * med["none"], "ttft_p50_ms_new": 1000 * med["new"],
            "ratio": med["new"] / med["none"], "runs": got}


def _oversized_schema(salt: str) -> dict:
    s: dict = _string()
    for i in range(6):  # a union 3 wide nested 6 deep: over the default 64 KiB
        s = {"anyOf": [_obj({f"k{salt}_{i}_{j}": s}) for j in range(3)]}
    return s


def _deep_schema(salt: str) -> dict:
    s: dict = _string()
    for i in range(40):  # past the default depth of 32, in 2 KiB
        s = _obj({f"d{salt}{i}": s})
    return s


def _large_enum_schema(salt: str) -> dict:
    return {"enum": [f"{salt}{i:05d}{TOPICS[i % len(TOPICS)][:3]}" for i in range(4000)]}


async def pathological_beside_traffic(llm, tok, runs: int) -> dict:
    from kvserve import SamplingParams
    from kvserve.engine.structured.params import InvalidStructuredOutput

    async def constrained(schema: dict) -> float | None:
        """Seconds until refused, or None when served."""
        fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}
        t0 = time.perf_counter()
        try:
            await _generate(llm, tok, [{"role": "user", "content": "Fill it."}],
                            SamplingParams(temperature=0, max_tokens=8), fmt)
        except InvalidStructuredOutput:
            return time.perf_counter() - t0
        return None

    def beside(kind: str, salt: str) -> list[dict]:
        if kind == "refused":
            return [_oversized_schema(f"{salt}{i}") for i in range(4)] + [_deep_schema(f"{salt}{i}") for i in range(4)]
        if kind == "large":
            return [_large_enum_schema(f"{salt}{i}") for i in range(4)]
        return [_obj({f"small_{salt}_{i}": _string()}) for i in range(4)]

    kinds = ("small", "refused", "large")
    ttfts: dict[str, list[float]] = {k: [] for k in kinds}
    refusals: list[float] = []
    for r in range(runs):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            free = [_after(i * ARRIVAL_GAP_S, _generate(llm, tok, [{"role": "user", "content": f"Say hi to {i}."}],
                                                         SamplingParams(temperature=0, max_tokens=8)))
                    for i in range(32)]
            extra = beside(kind, f"{r}{kind[0]}")  # spread over the wave's arrivals
            spread = 32 * ARRIVAL_GAP_S / len(extra)
            outs = await asyncio.gather(*free, *(_after((k + 0.5) * spread, constrained(x))
                                                 for k, x in enumerate(extra)))
            ttfts[kind] += [o[2] for o in outs[:32]]
            refusals += [t for t in outs[32:] if t is not None]
            if (kind == "refused") != (len(outs) - 32 == sum(t is not None for t in outs[32:])):
                raise RuntimeError(f"a {kind} schema was not treated as such")

    p99 = {k: statistics.quantiles(v, n=100)[98] for k, v in ttfts.items()}
    return {"ttft_p99_ms": {k: 1000 * v for k, v in p99.items()}, "ratio_refused": p99["refused"] / p99["small"],
            "ratio_large": p99["large"] / p99["small"], "refused": len(refusals),
            "refusal_max_ms": 1000 * max(refusals)}


async def _main(args, argv) -> dict:
    from kvserve.config import TierLimits, engine_config_from_kwargs
    from kvserve.engine.async_engine import AsyncLLM

    llm = AsyncLLM(engine_config_from_kwargs(args.model, dtype="bfloat16", max_num_seqs=64,
                                             interactive=TierLimits.unbounded(), batch=TierLimits.unbounded())).start()
    await asyncio.to_thread(llm.wait_ready)
    tok = llm.engine.tokenizer
    try:
        v = await validity(llm, tok)
        _log(f"validity: {v}")
        t = await throughput(llm, tok, args.runs)
        c = await compile_beside_traffic(llm, tok, args.runs)
        _log(f"compile beside traffic: {c}")
        bad = await pathological_beside_traffic(llm, tok, args.runs)
        _log(f"pathological beside traffic: {bad}")
        grammar = llm.grammar_stats
    finally:
        llm.stop()
    return {**stamp("benchmarks.structured", argv), "model": args.model, "runs": args.runs, "validity": v,
            "throughput": t, "compile": c, "pathological": bad, "grammar_stats": grammar.__dict__}


def markdown(r: dict) -> str:
    m, v, t, c, b = r["machine"], r["validity"], r["throughput"], r["compile"], r["pathological"]
    out = ["## Structured outputs and tool calls", "",
           f"`{r['command']}` on {m.get('cpu_model', '?')} ({m.get('nproc', '?')} CPUs), {r['when']}: {r['model']} "
           "in bfloat16, in process through AsyncLLM (constraints compile off the engine thread, as in the server).",
           "", "| measure | figure |", "|---|---|",
           f"| JSON schema outputs valid ({v['requests']} requests over {v['schemas']} schemas, temperature 0.7) | "
           f"{v['valid'] / v['requests']:.1%} ({v['valid']}/{v['requests']}; cut at max_tokens: "
           f"{v['cut_at_max_tokens']}) |"]
    for choice, x in v["tools"].items():
        out.append(f"| tool_choice {choice}: requests that called / calls valid | {x['called']}/{x['requests']} "
                   f"called, {x['valid_calls']}/{x['called']} valid |")
    out += [f"| W1 shape (32 at once, 128 tokens): output tok/s free / every request constrained | "
            f"{t['tok_s_free']:.1f} / {t['tok_s_constrained']:.1f} ({t['ratio']:.2f}x) |",
            f"| TTFT p50 of unconstrained requests (arriving 30 ms apart), 25% of the wave with a new schema / none | "
            f"{c['ttft_p50_ms_new']:.0f} / {c['ttft_p50_ms_none']:.0f} ms ({c['ratio']:.2f}x) |",
            f"| 4 schemas over the size limit and 4 past the depth limit beside 32 unconstrained requests: "
            f"slowest refusal | {b['refusal_max_ms']:.1f} ms ({b['refused']} refused) |",
            f"| their TTFT p99 (arriving 30 ms apart): beside those 8 / beside 4 small new schemas | {b['ttft_p99_ms']['refused']:.0f} / "
            f"{b['ttft_p99_ms']['small']:.0f} ms ({b['ratio_refused']:.2f}x) |",
            f"| their TTFT p99: beside 4 new 4,000-string enums (served) / beside 4 small new schemas | "
            f"{b['ttft_p99_ms']['large']:.0f} / {b['ttft_p99_ms']['small']:.0f} ms ({b['ratio_large']:.2f}x) |",
            "", f"Medians of {r['runs']} runs, interleaved. The compiler over the run: "
            f"{r['grammar_stats']['misses']} compiles, {r['grammar_stats']['hits']} cache hits, "
            f"{r['grammar_stats']['joined']} requests that waited for a compile in flight, "
            f"{r['grammar_stats']['compile_seconds']:.2f} s compiling.", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="docs/bench")
    args = ap.parse_args(argv)
    result = asyncio.run(_main(args, argv))
    write_page(args.out, "structured", result, markdown(result))


if __name__ == "__main__":
    main()
