"""What speculative decoding (engine/speculation/) does to decode speed, in process, on a real model: the same
requests with it off and on, side by side, runs interleaved, medians of the runs.

  python -m benchmarks.speculation [--model smollm2-135m] [--runs 3] [--out docs/bench]

Workloads (greedy, `ignore_eos`, 96 output tokens; W7's kind of grounded work beside open text):
- grounded: copy or lightly edit a given passage (the fixed license text of benchmarks/data/long_text.txt, cut
  in passages), answer from a given context, continue a code file that repeats its own pattern; at
  concurrency 1 and 8;
- open: open-ended prompts (stories, explanations) with nothing to copy; at concurrency 1 and 32.
A concurrency of c submits c requests at once and runs them to the end; the suffix drafter's cache of outputs starts
empty in each case (the runs repeat the same prompts, whose earlier outputs would draft them word for word). Per request, TPOT = (finish - first
token) / (tokens - 1); the figures are the median TPOT and the output tokens per second of the whole batch, and
the ratio off / on (above 1: speculation faster). Writes speculation.json and speculation.md under --out.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import kvserve  # noqa: F401  (first: it caps torch's CPU dispatch at KVSERVE_CPU_ISA's level)

from benchmarks.pages import stamp, write_page

TEXT = Path(__file__).parent / "data" / "long_text.txt"
OUTPUT_TOKENS = 96
CASES = (("grounded", 1), ("grounded", 8), ("open", 1), ("open", 32))
OPEN = ["Write a short story about a lighthouse keeper who finds a strange bottle.",
        "Explain why the sky is blue to a ten-year-old.", "What are three good habits for a healthy life?",
        "Describe a walk through a forest in autumn.", "Give advice to someone starting their first job.",
        "Why do people enjoy music?", "Tell me about the history of bicycles.", "What makes a good friend?"]


def _log(msg: str) -> None:
    print(f"[speculation] {msg}", file=sys.stderr, flush=True)


def grounded_prompts(n: int) -> list[str]:
    """Copy, edit, answer-from-context and code-continuation tasks over fixed text."""
    words = TEXT.read_text().split()
    out = []
    for i in range(n):
        passage = " ".join(words[300 * i:300 * i + 120])
        kind = i % 4
        if kind == 0:
            out.append(f"Copy the following text exactly.\n\nText: {passage}\n\nCopy: ")
        elif kind == 1:
            out.append(f"Rewrite the text with every 'License' replaced by 'Licence'.\n\nText: {passage}\n\n"
                       "Rewritten: ")
        elif kind == 2:
            out.append(f"Context: {passage}\n\nQuote the sentence of the context that mentions the word 'work'.\n"
                       "Quote: ")
        else:
            funcs = "".join(f"def get_{w}(record):\n    return record['{w}']\n\n\n" for w in words[300 * i:300 * i + 8]
                            if w.isalpha())
            out.append(funcs + "def get_")
    return out


def _prompts(kind: str, c: int) -> list[str]:
    return grounded_prompts(c) if kind == "grounded" else [OPEN[i % len(OPEN)] for i in range(c)]


def run_case(engine, tok, prompts: list[str]) -> dict:
    from kvserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    return run_case_ids(engine, [tok.encode(p) for p in prompts], params)


def tradeoff(model: str, runs: int) -> list[dict]:
    """The quantization trade-off table's speed columns (benchmarks.quality's `_speed`: TPOT at c=1 on a random
    prompt, W1 out tok/s, cost per million output tokens) per weights x speculation, bf16 KV. The quality columns
    need no new run: greedy outputs under speculation are the bits of decoding (tests/integration/test_speculation.py),
    so they are the row without it."""
    from benchmarks.offline import Shape
    from benchmarks.quality import _llm, _speed
    from kvserve.config import ModelPrice, ServerConfig

    price = next((m.price for m in ServerConfig.from_toml().models if m.id == model), ModelPrice())
    rows = []
    for weights in ("bf16", "auto"):
        for spec in (False, True):
            llm = _llm(model, "bfloat16", Shape(), weights=weights, speculative_decoding=spec)
            res = _speed(llm, Shape(), runs, runs, price)
            rows.append({"weights": weights, "kv": "bf16", "speculation": spec, **res})
            _log(f"tradeoff {weights} speculation {'on' if spec else 'off'}: {res}")
            del llm
    return rows


class OracleDrafter:
    """Drafts a request's own greedy output (recorded with speculation off: the same bits whatever the batch), each
    drafted token kept with probability `acceptance` and otherwise swapped for another token the target rejects:
    the speed of verification at a chosen acceptance, on any model, random weights included."""

    name = "ngram"  # stands in for the n-gram drafter

    def __init__(self, outputs: dict[tuple[int, ...], list[int]]):
        self.outputs = outputs  # prompt -> its greedy output
        self._seq: dict[int, tuple[int, list[int]]] = {}  # seq id -> (prompt length, its drafts)
        self.acceptance = 1.0

    @property
    def acceptance(self) -> float:
        return self._acceptance

    @acceptance.setter
    def acceptance(self, a: float) -> None:
        """Each output's drafts at this acceptance, drawn once (a proposal then costs a slice, as a real
        drafter's lookup does)."""
        import random

        self._acceptance = a
        self._drafts = {}
        for p, out in self.outputs.items():
            rng = random.Random(len(p))
            self._drafts[p] = [t if rng.random() < a else (t - 1 if t else 1) for t in out]  # rejected: not t
        self._seq.clear()

    def propose(self, seq_id: int, tokens: list[int], k: int) -> list[int]:
        got = self._seq.get(seq_id)
        if got is None:
            got = next((len(p), d) for p, d in self._drafts.items() if tuple(tokens[:len(p)]) == p)
            self._seq[seq_id] = got
        plen, drafts = got
        pos = len(tokens) - plen
        return drafts[pos:pos + k]

    def forget(self, seq_id: int) -> None:
        self._seq.pop(seq_id, None)


CEILING_ACCEPTANCE = (1.0, 0.6, 0.3)
CEILING_STATIC_K = 4


def ceiling(models: list[str], runs: int) -> list[dict]:
    """Per model and concurrency (grounded prompts, c = 1 and 8): TPOT p50 with speculation off, then with the
    oracle drafter at each acceptance, drafting CEILING_STATIC_K tokens always (a static length) and sized by
    the controller (up to 8), each after a run at that acceptance (the controller's steady state, not its
    adaptation); medians of the runs, interleaved."""
    from kvserve.config import TierLimits, engine_config_from_kwargs
    from kvserve.engine.worker.llm_engine import LLMEngine
    from kvserve import SamplingParams

    rows = []
    for model in models:
        def engine(**kw):
            return LLMEngine(engine_config_from_kwargs(
                model, dtype="bfloat16", max_num_seqs=16, kv_cache_memory="1GiB",
                interactive=TierLimits.unbounded(), batch=TierLimits.unbounded(), **kw))

        off = engine()
        tok = off.tokenizer
        prompts = {c: [tok.encode(p) for p in grounded_prompts(c)] for c in (1, 8)}
        outputs = {}
        params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
        for ids in prompts[8]:
            off.core.add_request(off.request(ids, params))
        while off.core.has_unfinished_requests():
            outputs.update({tuple(ro.prompt_token_ids): list(ro.outputs[0].token_ids)
                            for ro in off.core.step() if ro.finished})
        on = {"static": engine(speculative_decoding=True, num_speculative_tokens=CEILING_STATIC_K,
                               speculative_controller=False),
              "controller": engine(speculative_decoding=True)}
        for eng in on.values():
            eng.core.scheduler.speculator.ngram = OracleDrafter(outputs)
        run_case_ids(off, prompts[8][:4], params)  # warm up: kernels
        for c in (1, 8):
            base = []
            for a in CEILING_ACCEPTANCE:
                got: dict[str, list[float]] = {}
                for eng in on.values():  # each at this acceptance first: the controller's steady state is measured
                    eng.core.scheduler.speculator.ngram.acceptance = a
                    run_case_ids(eng, prompts[c], params)
                configs = [("off", off)] + list(on.items())
                for r in range(runs):
                    for name, eng in (configs if r % 2 == 0 else configs[::-1]):
                        res = run_case_ids(eng, prompts[c], params)
                        got.setdefault(name, []).append(res["tpot_p50_ms"])
                        _log(f"ceiling {model} c={c} acceptance {a} {name}: {res}")
                base += got["off"]
                for name in on:
                    rows.append({"model": model, "c": c, "drafts": name, "acceptance": a,
                                 "tpot_on_ms": statistics.median(got[name]), "tpot_off_runs": got["off"]})
            for row in rows:  # speculation off is the same at every acceptance: all its runs at this c
                if row["model"] == model and row["c"] == c:
                    row["tpot_off_ms"] = statistics.median(base)
                    row["speedup"] = row["tpot_off_ms"] / row["tpot_on_ms"]
        del off, on
    return rows


CONSTRAINED_SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 2000}},
                      "required": ["text"], "additionalProperties": False}


def constrained_prompts(n: int) -> list[str]:
    """Copy a passage of the fixed text into a JSON object."""
    words = TEXT.read_text().split()
    return [f'Text: {" ".join(words[300 * i:300 * i + 120])}\n\nThe text above, word for word, as JSON '
            '{"text": "..."}:\n' for i in range(n)]


def constrained(model: str, runs: int) -> list[dict]:
    """Copying passages into a JSON object (CONSTRAINED_SCHEMA constrains every output), greedy, at c = 1 and 8: TPOT p50 and tokens/s with speculation off and on (the controller), medians of the runs interleaved.
    Drafts stop where the grammar forbids a token; every row is masked or checked in its grammar's state."""
    from kvserve import SamplingParams, StructuredOutputsParams
    from kvserve.config import TierLimits, engine_config_from_kwargs
    from kvserve.engine.worker.llm_engine import LLMEngine
    from kvserve.engine.speculation.drafters import SuffixDrafter

    engines = {spec: LLMEngine(engine_config_from_kwargs(
        model, dtype="bfloat16", max_num_seqs=16, speculative_decoding=spec,
        interactive=TierLimits.unbounded(), batch=TierLimits.unbounded())) for spec in (False, True)}
    tok = engines[False].tokenizer
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS,
                            structured_outputs=StructuredOutputsParams(json=CONSTRAINED_SCHEMA))
    prompts = {c: [tok.encode(p) for p in constrained_prompts(c)] for c in (1, 8)}
    for eng in engines.values():  # warm up: kernels, the schema's compile, the step-time model
        run_case_ids(eng, prompts[8][:4], params)
    rows = []
    for c in (1, 8):
        got: dict[bool, list[dict]] = {False: [], True: []}
        for r in range(runs):
            for spec in ((False, True) if r % 2 == 0 else (True, False)):
                if spec:
                    engines[spec].core.scheduler.speculator.suffix = SuffixDrafter()
                got[spec].append(run_case_ids(engines[spec], prompts[c], params))
                _log(f"constrained c={c} {'on' if spec else 'off'}: {got[spec][-1]}")
        med = {spec: {m: statistics.median(x[m] for x in v) for m in ("tpot_p50_ms", "tokens_per_s")}
               for spec, v in got.items()}
        rows.append({"c": c, "off": med[False], "on": med[True],
                     "tpot_speedup": med[False]["tpot_p50_ms"] / med[True]["tpot_p50_ms"],
                     "throughput_ratio": med[True]["tokens_per_s"] / med[False]["tokens_per_s"]})
    stats = engines[True].core.scheduler.speculator.stats
    del engines
    return [{"rows": rows, "drafts": {n: {"proposed": s.proposed, "accepted": s.accepted}
                                      for n, s in stats.items()}}]


def run_case_ids(engine, prompts: list[list[int]], params) -> dict:
    t0 = time.perf_counter()
    for ids in prompts:
        engine.core.add_request(engine.request(ids, params))
    finals = []
    while engine.core.has_unfinished_requests():
        finals += [ro for ro in engine.core.step() if ro.finished]
    wall = time.perf_counter() - t0
    tpots = [(ro.metrics.finished_time - ro.metrics.first_token_time) / (len(ro.outputs[0].token_ids) - 1)
             for ro in finals]
    tokens = sum(len(ro.outputs[0].token_ids) for ro in finals)
    return {"tpot_p50_ms": 1000 * statistics.median(tpots), "tokens_per_s": tokens / wall}


HTTP_JOBS = ("W1", "W2", "W7-c1", "W7-c8")


def http_pages(off: Path, on: Path) -> dict:
    """The suite's HTTP runs (`benchmarks.suite --workloads W1,W2,W7`, sessions without and with
    `--engine-arg speculative_decoding=true`): per job, the medians over runs of TPOT p50, TTFT p50 and output
    tokens/s, off and on."""
    import json

    def medians(session: Path, job: str) -> dict | None:
        runs = [json.loads(f.read_text()) for f in sorted((session / "kvserve" / job).glob("run*.json"))]
        if not runs:
            return None
        return {"runs": len(runs), **{k: statistics.median(r[k] for r in runs)
                                      for k in ("p50_tpot_ms", "p50_ttft_ms", "output_throughput")}}

    return {"sessions": [str(off), str(on)],
            "jobs": {job: {"off": medians(off, job), "on": medians(on, job)} for job in HTTP_JOBS
                     if medians(off, job) and medians(on, job)}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="docs/bench")
    ap.add_argument("--no-tradeoff", action="store_true", help="skip the trade-off table's speculation rows")
    ap.add_argument("--http-sessions", nargs=2, metavar=("OFF", "ON"), type=Path,
                    help="only re-render the page with the suite's HTTP sessions (W1, W2, W7) off and on added")
    ap.add_argument("--ceiling", metavar="MODELS",
                    help="only measure the oracle-drafter table (comma-separated models or GGUF paths) into the page")
    ap.add_argument("--constrained", action="store_true",
                    help="only measure grounded prompts under a JSON schema, off and on, into the page")
    args = ap.parse_args(argv)
    if args.constrained:
        import json

        page = Path(args.out) / "speculation.json"
        result = json.loads(page.read_text())
        result["constrained"] = {**stamp("benchmarks.speculation", argv), "runs": args.runs, "model": args.model,
                                 **constrained(args.model, args.runs)[0]}
        write_page(args.out, "speculation", result, markdown(result))
        return
    if args.ceiling:
        import json

        page = Path(args.out) / "speculation.json"
        result = json.loads(page.read_text())
        result["ceiling"] = {**stamp("benchmarks.speculation", argv), "runs": args.runs,
                             "rows": ceiling(args.ceiling.split(","), args.runs)}
        write_page(args.out, "speculation", result, markdown(result))
        return
    if args.http_sessions:
        page = Path(args.out) / "speculation.json"
        import json

        result = json.loads(page.read_text())
        result["http"] = http_pages(*args.http_sessions)
        write_page(args.out, "speculation", result, markdown(result))
        return
    from kvserve.config import TierLimits, engine_config_from_kwargs
    from kvserve.engine.worker.llm_engine import LLMEngine
    from kvserve.engine.speculation.drafters import SuffixDrafter

    engines = {}
    for spec in (False, True):  # admission unbounded: each case submits its whole batch at once
        engines[spec] = LLMEngine(engine_config_from_kwargs(
            args.model, dtype="bfloat16", max_num_seqs=64, speculative_decoding=spec,
            interactive=TierLimits.unbounded(), batch=TierLimits.unbounded()))
    tok = engines[False].tokenizer
    for eng in engines.values():  # warm up: kernels, the step-time model
        run_case(eng, tok, _prompts("open", 4))
    raw: dict[str, dict[str, list[dict]]] = {}
    for r in range(args.runs):
        for kind, c in CASES:
            for spec in ((False, True) if r % 2 == 0 else (True, False)):  # alternate which goes first
                if spec:  # the same prompts' earlier outputs would draft themselves: each case starts cold
                    engines[spec].core.scheduler.speculator.suffix = SuffixDrafter()
                res = run_case(engines[spec], tok, _prompts(kind, c))
                raw.setdefault(f"{kind} c={c}", {}).setdefault("on" if spec else "off", []).append(res)
                _log(f"run {r} {kind} c={c} {'on' if spec else 'off'}: {res}")
    stats = engines[True].core.scheduler.speculator.stats
    rows = {}
    for case, by in raw.items():
        med = {k: {m: statistics.median(x[m] for x in v) for m in ("tpot_p50_ms", "tokens_per_s")}
               for k, v in by.items()}
        rows[case] = {**med, "tpot_speedup": med["off"]["tpot_p50_ms"] / med["on"]["tpot_p50_ms"],
                      "throughput_ratio": med["on"]["tokens_per_s"] / med["off"]["tokens_per_s"], "runs": by}
    del engines
    result = {**stamp("benchmarks.speculation", argv), "model": args.model, "output_tokens": OUTPUT_TOKENS,
              "runs": args.runs, "cases": rows, "tradeoff": [] if args.no_tradeoff else tradeoff(args.model, args.runs),
              "drafters": {n: {"proposed": s.proposed, "accepted": s.accepted, "drafts": s.drafts}
                           for n, s in stats.items()}}
    old = Path(args.out) / "speculation.json"
    if old.exists():  # the other modes' sections stay until they are measured again
        import json

        result.update({k: v for k, v in json.loads(old.read_text()).items()
                       if k in ("http", "ceiling", "constrained")})
    write_page(args.out, "speculation", result, markdown(result))


def markdown(r: dict) -> str:
    m = r["machine"]
    out = ["## Speculative decoding", "",
           f"`{r['command']}` on {m.get('cpu_model', '?')} ({m.get('nproc', '?')} CPUs), {r['when']}: "
           f"{r['model']} in bfloat16, in process, greedy, {r['output_tokens']} output tokens a request; the same "
           f"requests with speculation off and on, {r['runs']} runs interleaved, medians. Grounded: copy, edit, "
           "quote from a given passage, continue a repetitive code file (W7's kind); open: open-ended prompts "
           "(W1/W2's kind). Speed-up = TPOT p50 off / on; throughput = output tokens/s on / off.", "",
           "| workload | TPOT p50 off (ms) | TPOT p50 on (ms) | speed-up | tok/s off | tok/s on | throughput |",
           "|---|---|---|---|---|---|---|"]
    for case, x in r["cases"].items():
        out.append(f"| {case} | {x['off']['tpot_p50_ms']:.1f} | {x['on']['tpot_p50_ms']:.1f} | "
                   f"{x['tpot_speedup']:.2f}x | {x['off']['tokens_per_s']:.1f} | {x['on']['tokens_per_s']:.1f} | "
                   f"{x['throughput_ratio']:.2f}x |")
    if r.get("tradeoff"):
        out += ["", "The quantization trade-off table (\"Quantization against accuracy\") with speculation as a column: "
                "its speed figures measured the same way (TPOT at c=1: one greedy sequence on a random 256-token "
                "prompt; W1: 64 random prompts, 128 greedy tokens, 32 running; cost from W1's engine seconds), "
                "medians of the runs. Quality: the row without speculation's (greedy outputs are the same bits).", "",
                "| weights | KV | speculation | quality | TPOT c=1 (ms) | W1 out tok/s | cost / M output tokens |",
                "|---|---|---|---|---|---|---|"]
        for t in r["tradeoff"]:
            out.append(f"| {t['weights']} | {t['kv']} | {'on' if t['speculation'] else 'off'} | "
                       f"{'= off (same bits)' if t['speculation'] else 'trade-off table'} | {t['tpot_ms']:.1f} | "
                       f"{t['w1_out_tok_s']:.1f} | ${t['cost_per_million_output']:.4f} |")
    if r.get("http"):
        runs = {x["off"]["runs"] for x in r["http"]["jobs"].values()}
        out += ["", "Through the server (`python -m benchmarks.suite --workloads W1,W2,W7 --targets kvserve --runs "
                f"{max(runs)}`, a session without and one with `--engine-arg speculative_decoding=true`; "
                "`kvserve bench serve`, greedy; W1 and W2 as WORKLOADS.md, random-token prompts; W7 the grounded "
                "workload), medians of the runs:", "",
                "| workload | TPOT p50 off (ms) | on (ms) | speed-up | TTFT p50 off / on (ms) | out tok/s off | on | "
                "throughput |", "|---|---|---|---|---|---|---|---|"]
        for job, x in r["http"]["jobs"].items():
            a, b = x["off"], x["on"]
            out.append(f"| {job} | {a['p50_tpot_ms']:.1f} | {b['p50_tpot_ms']:.1f} | "
                       f"{a['p50_tpot_ms'] / b['p50_tpot_ms']:.2f}x | {a['p50_ttft_ms']:.0f} / {b['p50_ttft_ms']:.0f} | "
                       f"{a['output_throughput']:.1f} | {b['output_throughput']:.1f} | "
                       f"{b['output_throughput'] / a['output_throughput']:.2f}x |")
    if r.get("ceiling"):
        c = r["ceiling"]
        cm = c["machine"]
        out += ["", "### What verification costs: drafts of a chosen acceptance", "",
                f"`{c['command']}` on {cm.get('cpu_model', '?')} ({cm.get('nproc', '?')} CPUs), {c['when']}: the "
                "grounded prompts, greedy, 96 output tokens; drafts from an oracle (the request's own output recorded "
                "with speculation off, each drafted token kept with the given probability and otherwise replaced by a "
                "token the target rejects), so the speed of verifying at an acceptance is measured apart from any "
                "drafter's skill, on random-weight shapes too. static: "
                f"{CEILING_STATIC_K} drafted tokens per decode always (as other engines do); controller: lengths "
                "chosen per step (up to 8), measured after a run at the same acceptance (its steady state; how "
                "fast it adapts shows in the workloads above). TPOT p50, medians of "
                f"{c['runs']} runs interleaved; speed-up = off / on (off: its runs at every acceptance).",
                "", "| model | c | acceptance | TPOT off (ms) | static: on (ms) | speed-up | controller: on (ms) | "
                "speed-up |", "|---|---|---|---|---|---|---|---|"]
        by = {}
        for x in c["rows"]:
            by.setdefault((x["model"], x["c"], x["acceptance"]), {})[x["drafts"]] = x
        for (model, cc, a), x in by.items():
            st, co = x["static"], x["controller"]
            out.append(f"| {Path(model).stem} | {cc} | {a:.0%} | {st['tpot_off_ms']:.1f} | {st['tpot_on_ms']:.1f} | "
                       f"{st['speedup']:.2f}x | {co['tpot_on_ms']:.1f} | {co['speedup']:.2f}x |")
    if r.get("constrained"):
        k = r["constrained"]
        km = k["machine"]
        drafts = "; ".join(f"{n}: {x['proposed']} proposed, {x['accepted']} accepted" for n, x in k["drafts"].items())
        out += ["", "### Under a grammar", "",
                f"`{k['command']}` on {km.get('cpu_model', '?')} ({km.get('nproc', '?')} CPUs), {k['when']}: "
                f"{k['model']}, passages of the fixed text copied into a JSON object (`{{\"text\": string}}`, "
                "every output constrained by its schema), greedy, at most 96 tokens; speculation off and on (the controller); a draft "
                f"stops where the grammar forbids a token. Medians of {k['runs']} runs interleaved ({drafts}).", "",
                "| c | TPOT p50 off (ms) | on (ms) | speed-up | tok/s off | on | throughput |",
                "|---|---|---|---|---|---|---|"]
        for x in k["rows"]:
            out.append(f"| {x['c']} | {x['off']['tpot_p50_ms']:.1f} | {x['on']['tpot_p50_ms']:.1f} | "
                       f"{x['tpot_speedup']:.2f}x | {x['off']['tokens_per_s']:.1f} | {x['on']['tokens_per_s']:.1f} | "
                       f"{x['throughput_ratio']:.2f}x |")
    d = r["drafters"]
    out += ["", "Drafts over the whole run (speculation on): " + "; ".join(
        f"{n}: {s['proposed']} tokens proposed, {s['accepted']} accepted "
        f"({s['accepted'] / s['proposed']:.0%})" if s["proposed"] else f"{n}: none" for n, s in d.items()) + ".", ""]
    return "\n".join(out)


if __name__ == "__main__":
    main()
