"""RELIABILITY.md from a `make reliability` run: the figures the tests recorded (figures.jsonl) and each test's
outcome and time (pytest's junit XML), with the command, the date, the commit and the machine.

    python -m tests.reliability.report reliability-results RELIABILITY.md
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

COMMAND = "make reliability"
SECTIONS = {  # section -> (title, what it shows)
    "fuzz": ("Schema fuzzing", "Schemathesis over the server's own OpenAPI document, as an authenticated tenant."),
    "bad inputs": ("Bad inputs", "A hand-written matrix of malformed requests; each gets its 4xx in OpenAI's "
                   "error schema and the server keeps serving."),
    "soak": ("Overload soak, shipped defaults", "Poisson arrivals at 3x the rate this machine sustains (two "
             "thirds interactive, one third batch tier), the packaged models file and no admission settings."),
    "abandoned": ("Abandoned streams", "Streams cut by the client at random points."),
    "restart": ("Kill and restart", "SIGKILL of the server under load, then a restart on the same store."),
    "isolation": ("Tenant isolation", "Two tenants on one server: what one can learn of the other's work."),
    "fleet chaos": ("Fleet chaos", "A real local Ray cluster and Serve, SmolLM2 replicas; a replica SIGKILLed "
                    "every 30 s under W1-shaped load, then the gateway; and 12 greedy streams through a replica SIGKILL, "
                    "against an undisturbed run."),
    "kv disk tier": ("KV disk tier", "The prefix cache's disk tier under damage: a thread corrupts, truncates and "
                     "deletes its files while SmolLM2 serves (batch-invariant numerics, so a wrong page would show "
                     "in the bits); a process writing it, and the HTTP server under two clients, are SIGKILLed, and an "
                     "engine (a server) restarted on the directory serves the same prompts."),
    "regions chaos": ("Three regions under chaos", "Three servers, each its own region (engine and SQLite store) "
                      "and the others' peer, every link between regions through a proxy that delays it (this "
                      "kernel has no netem) and can cut it; clients in every region stream greedy completions "
                      "through the documented retry (Idempotency-Key, then Last-Event-ID at the next region) while "
                      "a region is SIGKILLed and restarted, another frozen (SIGSTOP) and thawed, and the third cut "
                      "off from the others and healed; each text compared with an uninterrupted stream's. A second "
                      "tenant with a budget shared by the regions (its ledger in the region that is killed) spends "
                      "in all three at once until it runs out."),
    "regions chaos (fleets)": ("Three fleet regions under chaos", "The same over three fleets, each region "
                               "`kvserve serve --fleet` with its own local Ray cluster (a SmolLM2 "
                               "replica and the gateway): a replica SIGKILLed in one region, the gateway in another "
                               "(Serve starts each again), a whole region SIGKILLed (its gateway's process and Ray "
                               "cluster) and started again, a region cut off and healed."),
}


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor() or "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    isa = [name for flag, name in (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX-512 BF16"),
                                   ("amx_tile", "AMX")) if flag in flags]
    return f"{model}, {os.cpu_count()} cores, {' + '.join(isa) or 'no AVX2'}"


def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()
        return sha + (" (with uncommitted changes)" if dirty else "")
    except OSError:
        return "unknown"


def outcomes(results: Path) -> list[tuple[str, str, float]]:
    """(test id, passed|failed|skipped, seconds) for each test case, from every junit*.xml in `results`
    (`make reliability-rerun` adds one): a test's latest outcome counts."""
    out: dict[str, tuple[str, str, float]] = {}
    for junit in sorted(results.glob("junit*.xml"), key=lambda p: p.stat().st_mtime):
        for case in _cases(junit):
            out[case[0]] = case
    return list(out.values())


def latest_figures(rows: list[dict]) -> list[dict]:
    """Each test's figures from its latest run only."""
    last = {}
    for r in rows:
        last[r["test"]] = max(last.get(r["test"], 0.0), r.get("run", 0.0))
    return [r for r in rows if r.get("run", 0.0) == last[r["test"]]]


def _cases(junit: Path) -> list[tuple[str, str, float]]:
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        status = "passed"
        if case.find("failure") is not None or case.find("error") is not None:
            status = "failed"
        elif case.find("skipped") is not None:
            status = "skipped"
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        out.append((name, status, float(case.get("time", 0))))
    return out


def _cell(v) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def render(results: Path) -> str:
    rows = [json.loads(x) for x in (results / "figures.jsonl").read_text().splitlines() if x.strip()] \
        if (results / "figures.jsonl").exists() else []
    rows = latest_figures(rows)
    cases = outcomes(results)
    reruns = sorted({r["test"] for r in rows if r.get("run", 0.0) > min((x.get("run", 0.0) for x in rows),
                                                                         default=0.0)})
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    total = sum(s for _, _, s in cases)
    failed = [c for c in cases if c[1] == "failed"]
    lines = ["# Reliability", "",
             f"Generated by `{COMMAND}` (`python -m tests.reliability.report`) on {when}, commit {commit()}.",
             f"Machine: {machine()}. The suite took {total / 60:.1f} minutes; "
             f"{len(cases) - len(failed)} of {len(cases)} tests passed" + (
                 f", **{len(failed)} failed**." if failed else "."), "",
             "Each test also runs at a smaller scale inside `make test`. A figure marked *missed* is one whose "
             "test failed on it.", ""]
    if reruns:
        lines += ["Rerun later with `make reliability-rerun` (their figures and outcomes are from that run): "
                  + ", ".join(f"`{t}`" for t in reruns) + ".", ""]
    seen = [s for s in SECTIONS if any(r["section"] == s for r in rows)]
    seen += sorted({r["section"] for r in rows} - set(SECTIONS))
    for section in seen:
        title, what = SECTIONS.get(section, (section, ""))
        lines += [f"## {title}", "", what, "", "| figure | value | target | status | detail |", "|---|---|---|---|---|"]
        for r in (r for r in rows if r["section"] == section):
            status = {True: "met", False: "**missed**", None: ""}[r["ok"]]
            lines.append(f"| {_cell(r['name'])} | {_cell(r['value'])} | {_cell(r['target'])} | {status} | "
                         f"{_cell(r['detail'])} |")
        lines.append("")
    lines += ["## Tests", "", "| test | outcome | seconds |", "|---|---|---|"]
    lines += [f"| `{name}` | {status if status != 'failed' else '**failed**'} | {secs:.0f} |"
              for name, status, secs in cases]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    results, out = Path(argv[0]), Path(argv[1])
    out.write_text(render(results))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
