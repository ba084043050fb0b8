"""deploy/grafana/kvserve-dashboard.json queries only what kvserve exports: every panel's PromQL is parsed for
the metric names it reads, and each must be a series of a family that a server's /metrics (with a fleet
gateway's collector installed) exposes: F_bucket, F_sum and F_count of a histogram, F_total of a counter,
F of a gauge. So a renamed metric, or a panel for one that is not exported, fails here."""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.config import ServedModel, ServerConfig

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvserve-dashboard.json"
# PromQL words that are not metric names: binary and set operators, modifiers
KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right"}
SERIES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total", "_created"), "gauge": ("",),
          "summary": ("", "_sum", "_count"), "untyped": ("",)}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (not its functions, label names, values or keywords)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values and other strings
    e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # range selectors ($__rate_interval too)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", e):
        if m.group() in KEYWORDS or e[m.end():].lstrip().startswith("("):  # a function or an aggregation
            continue
        names.add(m.group())
    return names


def exported_series(text: str) -> set[str]:
    return {f.name + suffix for f in text_string_to_metric_families(text) for suffix in SERIES[f.type]}


def panels(dashboard: dict):
    for p in dashboard["panels"]:
        yield p
        yield from p.get("panels", [])  # a collapsed row keeps its panels inside it


@pytest.fixture(scope="module")
def exposition(tmp_path_factory) -> str:
    """A server's /metrics, over HTTP (in process), with the fleet gateway's collector installed as the gateway
    installs it."""
    from kvserve.fleet.metrics import install
    from kvserve.server.app import create_app

    home = tmp_path_factory.mktemp("grafana")
    app = create_app(ServerConfig(models=[ServedModel(id="m", source="/dev/null")], home=str(home)))
    install(app.state.kv)

    async def scrape() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.get("/metrics")
            assert r.status_code == 200
            return r.text

    return asyncio.run(scrape())


def test_the_metric_name_extractor():
    expr = ('histogram_quantile(0.99, sum by (le, model_name) (rate(kvserve:a_bucket{model_name=~"$model", '
            'tier!="x{y}"}[$__rate_interval]))) / on (model_name) group_left kvserve:b offset 5m * 3600 '
            '+ count without (replica) (up) and bool kvserve:c_total')
    assert metric_names(expr) == {"kvserve:a_bucket", "kvserve:b", "up", "kvserve:c_total"}


def test_series_names_follow_the_family_type(exposition):
    series = exported_series(exposition)
    assert {"kvserve:time_to_first_token_seconds_bucket", "kvserve:time_to_first_token_seconds_count",
            "kvserve:spend_usd_total", "kvserve:kv_cache_usage_perc", "kvserve:fleet_migrations_total"} <= series
    # a suffix only a histogram or a counter has is not a series of a gauge, nor a counter's bare name
    assert "kvserve:kv_cache_usage_perc_bucket" not in series and "kvserve:num_preemptions" not in series


def test_every_panel_queries_only_exported_metrics(exposition):
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 39  # Grafana 11 and later
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    series = exported_series(exposition)
    queried, titles = set(), []
    for p in panels(dashboard):
        if p["type"] == "row":
            continue
        titles.append(p["title"])
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            names = metric_names(t["expr"])
            assert names, (p["title"], t["expr"])
            missing = names - series
            assert not missing, f"panel {p['title']!r} queries {sorted(missing)}, which kvserve does not export"
            queried |= names
    assert len(titles) == len(set(titles))
    assert re.fullmatch(r"label_values\(([\w:]+), model_name\)", variables["model"]["definition"]).group(1) in series
    # the panels the dashboard is for: latency histograms, load, admission, money, the fleet
    assert {"kvserve:time_to_first_token_seconds_bucket", "kvserve:time_per_output_token_seconds_bucket",
            "kvserve:e2e_request_latency_seconds_bucket", "kvserve:num_requests_waiting",
            "kvserve:estimated_ttft_seconds", "kvserve:kv_cache_usage_perc", "kvserve:prefix_cache_hits_total",
            "kvserve:num_preemptions_total", "kvserve:admission_rejections_total", "kvserve:spend_usd_total",
            "kvserve:fleet_replica_inflight", "kvserve:fleet_migrations_total"} <= queried
