"""A platform benchmark's page: its result as JSON and as the markdown BENCHMARKS.md shows (BENCHMARK_PAGES in
benchmarks/report.py), written side by side under one directory."""
from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def stamp(module: str, argv: list[str] | None) -> dict:
    """Where and how a result was made: the machine, the command line, the time."""
    from benchmarks.offline import machine_info

    return {"machine": machine_info(), "command": f"python -m {module} " + " ".join(argv or sys.argv[1:]),
            "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def write_page(directory: str | Path, name: str, result: dict, markdown: str) -> None:
    """<directory>/<name>.json and <name>.md; the markdown is printed too."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown)
    print(markdown)


def print_and_save(result: dict, markdown: str, json_path: str | None) -> None:
    """Print the markdown; with `json_path`, the result there and the markdown beside it (<stem>.md): a device
    check's figures, which come back from the lent machine as files."""
    print(markdown)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))
        Path(json_path).with_suffix(".md").write_text(markdown)
