"""The `kvserve bench` subcommand, for kvserve/cli.py: `add_arguments(parser)` and `run(args)`.

  kvserve bench serve ...   load generator against a running OpenAI-compatible server
                            (kvserve.bench.loadgen; same as `python -m kvserve.bench.loadgen ...`)

This repository's benchmark suite and report are not part of the product: `make bench`, or
`python -m benchmarks.suite` / `python -m benchmarks.report` from the repository root.
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


def run(args: argparse.Namespace) -> int:
    if args.bench_cmd == "serve":
        from kvserve.bench.loadgen import run_cli

        return run_cli(args, sys.argv[sys.argv.index("serve") + 1:] if "serve" in sys.argv else None)
    return 2
