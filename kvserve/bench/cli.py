"""The `kvserve bench` subcommands, for kvserve/cli.py: `add_arguments(parser)` and `run(args)`.

  kvserve bench serve ...   load generator against a running OpenAI-compatible server
                            (kvserve.bench.loadgen; same as `python -m kvserve.bench.loadgen ...`)
  kvserve bench suite ...   W1-W5 against kvserve (and peers with BENCH_PEERS=1); `make bench`
  kvserve bench report ...  BENCHMARKS.md and plots from bench_results/
"""
from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.bench.loadgen import add_bench_arguments

    sub = parser.add_subparsers(dest="bench_cmd", required=True)
    serve = sub.add_parser("serve", help="load generator against an OpenAI-compatible server",
                           description="Async load generator for an OpenAI-compatible server (vLLM's metric "
                                       "definitions).")
    add_bench_arguments(serve)
    from kvserve.bench.report import add_report_arguments
    from kvserve.bench.suite import add_suite_arguments

    add_suite_arguments(sub.add_parser("suite", help="run W1-W5 against kvserve (and the peers with BENCH_PEERS=1); "
                                                     "same as python -m kvserve.bench.suite"))
    add_report_arguments(sub.add_parser("report", help="render BENCHMARKS.md and plots from bench_results/; same as "
                                                       "python -m kvserve.bench.report"))


def run(args: argparse.Namespace) -> int:
    if args.bench_cmd == "serve":
        from kvserve.bench.loadgen import run_cli

        return run_cli(args, sys.argv[sys.argv.index("serve") + 1:] if "serve" in sys.argv else None)
    if args.bench_cmd == "suite":
        from kvserve.bench.suite import finish_args, run_suite

        return run_suite(finish_args(args))
    if args.bench_cmd == "report":
        from kvserve.bench.report import render

        return render(args)
    return 2
