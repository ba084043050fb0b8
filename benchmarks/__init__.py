"""This repository's benchmark harness (not part of the installed kvserve package). Run from the
repository root: `make bench`, or `python -m benchmarks.<module>`.

  suite     `make bench`: W1-W5 (shared/WORKLOADS.md) against kvserve and, with BENCH_PEERS=1, the peers
  targets   how each engine's server is started (kvserve, vLLM CPU, llama.cpp, HF static batching)
  report    BENCHMARKS.md + docs/bench/*.png from bench_results/ (with docs/bench/analysis.md)
  ceilings  peak matmul FLOP/s and copy bandwidth with torch
  offline   offline throughput (continuous vs static batching, HF static) and TTFT with a prefix hit
  profile   where an engine step's time goes (W1's shape offline, timers around each part)
  single    load time, resident memory and single-sequence decode speed per model and dtype

The load generator they drive is the product's `kvserve bench serve` (kvserve.bench).
"""
