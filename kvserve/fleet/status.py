"""`kvserve fleet status`: the fleet's pools and replicas in a table, from Serve (application and replica
states), the fleet record (which pool serves each model) and a gateway's /fleet/status (live load,
prefix hit rates, routing counts)."""
from __future__ import annotations

import tomllib


def collect(address: str | None, url: str | None) -> dict:
    import httpx
    from ray import serve

    from kvserve.config import ServerConfig
    from kvserve.fleet import deploy
    from kvserve.fleet.record import record

    deploy.connect(address, ServerConfig())
    config_text, pools = deploy.ray_get(record(ServerConfig().fleet.ray_namespace).get.remote())
    server = tomllib.loads(config_text or "").get("server", {})
    url = url or f"http://{server.get('host', '127.0.0.1')}:{server.get('port', 8000)}"
    apps = serve.status().applications
    out = {"gateway_url": url, "apps": {}, "models": {}, "pools": pools}
    for name, st in apps.items():
        deps = {d: {"status": str(ds.status).split(".")[-1],
                    "replicas": {str(k).split(".")[-1]: v for k, v in (ds.replica_states or {}).items()}}
                for d, ds in (st.deployments or {}).items()}
        out["apps"][name] = {"status": str(st.status).split(".")[-1], "deployments": deps}
    try:
        out["models"] = httpx.get(f"{url}/fleet/status", timeout=10).json().get("models", {})
    except Exception as e:
        out["gateway_error"] = f"{type(e).__name__}: {e}"
    return out


def render(data: dict) -> str:
    lines = []
    rows = [("APP", "STATUS", "DEPLOYMENT", "REPLICAS")]
    for app, st in sorted(data["apps"].items()):
        for dep, ds in st["deployments"].items():
            rows.append((app, st["status"], f"{dep} ({ds['status']})",
                         ", ".join(f"{n} {k.lower()}" for k, n in ds["replicas"].items()) or "-"))
    lines += _table(rows)
    for model, m in sorted(data.get("models", {}).items()):
        lines.append("")
        mig = ", ".join(f"{k} {v}" for k, v in sorted(m.get("migrations", {}).items())) or "none"
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(m.get("by_reason", {}).items())) or "none"
        lines.append(f"{model}: pool {m.get('pool')} version {m.get('version')} ({m.get('status')}); "
                     f"routed by {reasons}; migrations: {mig}")
        rows = [("REPLICA", "VERSION", "ROUTED", "ACCEPTED", "INFLIGHT", "RUNNING", "QUEUED TOK", "KV USE",
                 "EST TTFT", "PREFIX HIT", "BUSY S")]
        for r in m.get("replicas", []):
            hit = r.get("prefix_hit_rate")
            rows.append((r["id"], str(r.get("version")), str(r.get("routed", 0)), str(r.get("accepted") or 0),
                         str(r.get("inflight", 0)), str(r.get("running") or 0), str(r.get("queued_prompt_tokens") or 0),
                         f"{(r.get('kv_usage') or 0) * 100:.0f}%", f"{(r.get('est_ttft_s') or 0) * 1000:.0f} ms",
                         "-" if hit is None else f"{hit * 100:.0f}%", f"{r.get('busy_seconds') or 0:.1f}"))
        lines += _table(rows)
    if data.get("gateway_error"):
        lines.append(f"\ngateway {data['gateway_url']} unreachable: {data['gateway_error']}")
    return "\n".join(lines)


def _table(rows: list[tuple]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
