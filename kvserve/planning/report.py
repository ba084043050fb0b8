"""`kvserve plan --report DIR`: the plan as a page, with TTFT against load and KV use over time.

TTFT against load: the chosen replica simulated (real scheduler) at fractions of the load per replica
from 0.25 to 1.5, p50 and p99 against the SLO; it shows how much headroom the plan has and where the
replica falls over. KV use over time: the plan's own simulation.
"""
from __future__ import annotations

import html
from pathlib import Path

from kvserve.config import Priority
from kvserve.planning.search import SLO, Load, PlanResult, _configs, simulate_replica
from kvserve.planning.simulator import percentile

LOAD_FRACTIONS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)


def ttft_against_load(r: PlanResult, load: Load, seconds: float = 20.0) -> list[tuple[float, float, float]]:
    """(requests/s per replica, TTFT p50, TTFT p99) at fractions of the plan's per-replica load."""
    p = r.best
    c = p.candidate
    per_replica = load.rate(Priority.INTERACTIVE) / max(1, p.simulated_replicas or p.interactive_replicas)
    chunk = _configs(c.deployment, 8192)[0]
    points = []
    for f in LOAD_FRACTIONS:
        rate = per_replica * f
        if rate <= 0:
            continue
        sim = simulate_replica(c.deployment, c.max_num_seqs, c.memory, rate, load, seconds, chunk)
        t = sim.tiers[Priority.INTERACTIVE].ttft
        if t:
            points.append((rate, percentile(t, 50), percentile(t, 99)))
    return points


def write_report(directory: str | Path, r: PlanResult, model: str, load: Load, slos: list[SLO], text: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    images = []
    points = ttft_against_load(r, load)
    if points:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([x[0] for x in points], [x[1] * 1000 for x in points], "o-", label="TTFT p50")
        ax.plot([x[0] for x in points], [x[2] * 1000 for x in points], "s--", label="TTFT p99")
        for s in slos:
            if s.metric == "ttft":
                ax.axhline(s.seconds * 1000, color="red", lw=0.8, label=f"SLO {s}")
        planned = load.rate(Priority.INTERACTIVE) / max(1, r.best.simulated_replicas or r.best.interactive_replicas)
        ax.axvline(planned, color="gray", lw=0.8, ls=":", label="planned load")
        ax.set_xlabel("interactive requests/s per replica")
        ax.set_ylabel("TTFT (ms)")
        ax.set_yscale("log")
        ax.set_title(f"{model} on {r.best.candidate.deployment.label} (simulated)", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "ttft_vs_load.png", dpi=110)
        plt.close(fig)
        images.append(("TTFT against load", "ttft_vs_load.png"))
    sim = r.best.simulation
    if sim is not None and sim.kv_timeline:
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.plot([t for t, _ in sim.kv_timeline], [u * 100 for _, u in sim.kv_timeline], lw=0.8)
        ax.set_xlabel("simulated seconds")
        ax.set_ylabel("KV blocks held (%)")
        ax.set_ylim(0, 100)
        ax.set_title("KV use over time, one replica at the planned load (simulated)", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "kv_over_time.png", dpi=110)
        plt.close(fig)
        images.append(("KV use over time", "kv_over_time.png"))
    rows = "".join(f"<tr><td>{x[0]:.2f}</td><td>{x[1] * 1000:.0f}</td><td>{x[2] * 1000:.0f}</td></tr>"
                   for x in points)
    body = [f"<h1>kvserve plan: {html.escape(model)}</h1>", f"<pre>{html.escape(text)}</pre>"]
    body += [f"<h2>{title}</h2><img src='{src}' alt='{title}'>" for title, src in images]
    if rows:
        body.append("<h2>TTFT against load (simulated)</h2><table><tr><th>req/s per replica</th>"
                    f"<th>TTFT p50 (ms)</th><th>TTFT p99 (ms)</th></tr>{rows}</table>")
    body.append("<p>How the plan is computed, and its limits: docs/PLANNING.md.</p>")
    page = out / "index.html"
    page.write_text("<!doctype html><meta charset='utf-8'><title>kvserve plan</title>"
                    "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}"
                    "td,th{padding:0 1em;text-align:right}</style>" + "\n".join(body))
    return page
