"""What the sinks + window attention policy (StreamingLLM; EngineConfig.attention_policy = "sinks_window") costs
in quality against full attention, on a model without a native window.

  python -m benchmarks.long_context [--model smollm2-135m] [--contexts 2048,4096,8000] [--out docs/bench]

The text: benchmarks/data/long_text.txt (the GNU GPL 3, GNU FDL 1.3 and Apache 2.0 license texts, verbatim, from
Debian's /usr/share/common-licenses: a fixed English text of 15k SmolLM2 tokens), cut at each context. Float32,
op by op, so only the attention differs. For each policy (sinks + window) against full attention, over the
positions past the window (before it the two attend alike):
- perplexity of the text, teacher-forced, under each; top-1 agreement (the share of positions whose most
  likely next token is full attention's); mean KL(full || policy) in nats;
- a retrieval probe: "The secret code is 73914." opens the context, the text fills it, and "The secret code
  is" closes it (what a model copies from its context when it can see it); greedy answer (6 tokens)
  contains 73914 or not, and the log-probability of the code's tokens, teacher-forced.
Writes long-context.json and long-context.md (a BENCHMARKS.md page) under --out.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import kvserve  # noqa: F401  (first: it caps torch's CPU dispatch at KVSERVE_CPU_ISA's level)
import torch

from benchmarks.quality import _teacher_forced, kl_divergence, top1_agreement

TEXT = Path(__file__).parent / "data" / "long_text.txt"
POLICIES = ((4, 512), (4, 1024), (4, 2048), (0, 1024))  # (sinks, window)
CODE = "73914"


def _log(msg: str) -> None:
    print(f"[long_context] {msg}", file=sys.stderr, flush=True)


def _engine(model: str, policy: tuple[int, int] | None, pages: int):
    from kvserve import LLM

    args = {} if policy is None else dict(attention_policy="sinks_window", attention_sinks=policy[0],
                                          attention_window=policy[1])
    return LLM(model, dtype="float32", num_gpu_blocks_override=pages, swap_space=0, enable_prefix_caching=False,
               max_model_len=8192, **args)


def _probe_ids(tok, context: int, filler: list[int]) -> tuple[list[int], list[int]]:
    head = tok.encode(f"The secret code is {CODE}.\n\n")
    tail = tok.encode("\n\nThe secret code is")
    answer = tok.encode(f" {CODE}.")
    body = filler[: context - len(head) - len(tail) - len(answer)]
    return head + body + tail, answer


def _answer(llm, ids: list[int]) -> str:
    from kvserve import SamplingParams

    (out,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    return out.outputs[0].text


def _answer_logprob(llm, ids: list[int], answer: list[int]) -> float:
    logits = _teacher_forced(llm, ids + answer)[len(ids) - 1:-1].double().log_softmax(-1)
    return float(sum(logits[i, t] for i, t in enumerate(answer)))


def run(model: str, contexts: list[int]) -> dict:
    pages = max(contexts) // 16 + 8
    llm = _engine(model, None, pages)
    tok = llm.engine.tokenizer
    text = tok.encode(TEXT.read_text())
    reference, probes = {}, {}
    for ctx in contexts:
        ids = text[:ctx]
        reference[ctx] = (ids, _teacher_forced(llm, ids).float())
        p_ids, answer = _probe_ids(tok, ctx, text)
        probes[ctx] = (p_ids, answer, _answer(llm, p_ids), _answer_logprob(llm, p_ids, answer))
        _log(f"full attention at {ctx}: probe answer {probes[ctx][2]!r}")
    rows = [{"policy": "full attention", "context": ctx, "probe_found": CODE in probes[ctx][2],
             "probe_answer": probes[ctx][2], "probe_logprob": probes[ctx][3]} for ctx in contexts]
    del llm
    for sinks, window in POLICIES:
        llm = _engine(model, (sinks, window), pages)
        for ctx in [c for c in contexts if c - 1 > window]:  # (within the window the policy is full attention)
            ids, ref = reference[ctx]
            logits = _teacher_forced(llm, ids).float()
            past = slice(window, ctx - 1)  # positions whose keys reach past the window, with a next token
            targets = torch.tensor(ids[window + 1:ctx], dtype=torch.long)
            nll = torch.nn.functional.cross_entropy
            p_ids, answer, _, _ = probes[ctx]
            row = {"policy": f"sinks {sinks} + window {window}", "sinks": sinks, "window": window, "context": ctx,
                   "positions": ctx - 1 - window,
                   "ppl_full": float(nll(ref[past], targets).exp()), "ppl": float(nll(logits[past], targets).exp()),
                   "top1": top1_agreement(ref[past], logits[past]),
                   "kld": float(kl_divergence(ref[past], logits[past]).mean())}
            answer_text = _answer(llm, p_ids)
            row.update(probe_found=CODE in answer_text, probe_answer=answer_text,
                       probe_logprob=_answer_logprob(llm, p_ids, answer))
            rows.append(row)
            _log(f"{row['policy']} at {ctx}: ppl {row['ppl']:.2f} (full {row['ppl_full']:.2f}), top-1 "
                 f"{row['top1']:.3f}, probe {answer_text!r}")
        del llm
    return {"model": model, "contexts": contexts, "rows": rows}


def render(result: dict) -> str:
    m = result["machine"]
    lines = ["# Long context: what sinks + window costs", "",
             f"Machine: {m.get('cpu_model', '?')} ({m.get('nproc', '?')} CPUs); `{result['command']}`; {result['when']}. "
             f"Model: {result['model']}, float32 op by op. Text: benchmarks/data/long_text.txt (GPL 3, FDL 1.3, "
             "Apache 2.0 license texts), cut at each context.", "",
             "Over the positions past the window (before it both attend alike): perplexity under the policy and under "
             "full attention, top-1 agreement with full attention, mean KL(full || policy). The probe: a code stated "
             "in the context's first sentence, asked for at its end (greedy answer; log-probability of the code's "
             "tokens).", "",
             "| policy | context | perplexity (full) | top-1 agreement | KLD, nats | probe answer found | probe logprob |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "ppl" in r:
            lines.append(f"| {r['policy']} | {r['context']} | {r['ppl']:.2f} ({r['ppl_full']:.2f}) | "
                         f"{100 * r['top1']:.1f}% | {r['kld']:.4f} | {'yes' if r['probe_found'] else 'no'} | "
                         f"{r['probe_logprob']:.2f} |")
        else:
            lines.append(f"| {r['policy']} | {r['context']} | | | | {'yes' if r['probe_found'] else 'no'} | "
                         f"{r['probe_logprob']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", default="2048,4096,8000")
    ap.add_argument("--out", default="docs/bench")
    a = ap.parse_args(argv)
    from benchmarks.pages import stamp, write_page

    result = {**run(a.model, [int(c) for c in a.contexts.split(",")]), **stamp("benchmarks.long_context", argv)}
    write_page(a.out, "long-context", result, render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
