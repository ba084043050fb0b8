"""The load generator: `kvserve bench serve`.

  loadgen      `kvserve bench serve`: async load generator for any OpenAI-compatible server
  metrics      per-request records -> TTFT/TPOT/ITL/E2E, throughput, goodput, errors (vLLM's definitions)
  datasets     random / shared-prefix / chat prompts made with the model's tokenizer; long documents
               (standard-library source)
  cli          the `kvserve bench` subcommand for kvserve/cli.py
  fake_server  an OpenAI SSE server with fixed timing, to check clients' arithmetic

This repository's own benchmark harness (W1-W6, peers, BENCHMARKS.md) is the top-level `benchmarks`
package, outside the installed package.
"""
