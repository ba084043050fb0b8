"""Benchmarking tools.

  loadgen      `kvserve bench serve`: async load generator for any OpenAI-compatible server
  metrics      per-request records -> TTFT/TPOT/ITL/E2E, throughput, goodput, errors (vLLM's definitions)
  datasets     random / shared-prefix / chat prompts made with the model's tokenizer
  suite        `make bench`: W1-W5 (shared/WORKLOADS.md) against kvserve and, with BENCH_PEERS=1, the peers
  targets      how each engine's server is started (kvserve, vLLM CPU, llama.cpp, HF static batching)
  ceilings     peak matmul FLOP/s and copy bandwidth with torch
  report       BENCHMARKS.md + docs/bench/*.png from bench_results/
  fake_server  an OpenAI SSE server with fixed timing, to check clients' arithmetic
"""
