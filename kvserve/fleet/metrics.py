"""The gateway's fleet metrics on its /metrics: per replica, requests this gateway routed there (by the
policy's reason), requests in flight, prefix-cache hits and lookups (the replica's own cumulative counts),
and migrations by outcome. Read at scrape time from the FleetClients."""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class FleetCollector:
    def __init__(self, clients: Callable[[], Iterable]):
        self.clients = clients

    def describe(self):
        return []

    def collect(self):
        routed = CounterMetricFamily("kvserve:fleet_routed_requests", "Requests this gateway routed to a replica",
                                     labels=["model_name", "replica", "version"])
        reasons = CounterMetricFamily("kvserve:fleet_routing_decisions",
                                      "Routing decisions by reason (affinity, spilled, load, no_key, fallback)",
                                      labels=["model_name", "reason"])
        inflight = GaugeMetricFamily("kvserve:fleet_replica_inflight", "Requests in flight per replica (this gateway)",
                                     labels=["model_name", "replica"])
        hits = CounterMetricFamily("kvserve:fleet_prefix_cache_hits", "Prompt tokens a replica served from its cache",
                                   labels=["model_name", "replica"])
        queries = CounterMetricFamily("kvserve:fleet_prefix_cache_queries", "Prompt tokens a replica looked up",
                                      labels=["model_name", "replica"])
        migrations = CounterMetricFamily("kvserve:fleet_migrations", "Streams moved off a lost replica, by outcome "
                                         "(migrated, limit, no_replica, not_resumable)", labels=["model_name", "outcome"])
        for client in self.clients():
            if not hasattr(client, "pool_status"):
                continue
            st = client.pool_status()
            for r in st["replicas"]:
                routed.add_metric([client.model_id, r["id"], str(r["version"])], r["routed"])
                inflight.add_metric([client.model_id, r["id"]], r["inflight"])
                hits.add_metric([client.model_id, r["id"]], r.get("prefix_hit_tokens") or 0)
                queries.add_metric([client.model_id, r["id"]], r.get("prefix_query_tokens") or 0)
            for reason, n in st["by_reason"].items():
                reasons.add_metric([client.model_id, reason], n)
            for outcome, n in st["migrations"].items():
                migrations.add_metric([client.model_id, outcome], n)
        yield from (routed, reasons, inflight, hits, queries, migrations)


def install(state) -> None:
    """Add the fleet metrics to a gateway's /metrics (the app's ServerState), read from its models' clients."""
    state.metrics.registry.register(FleetCollector(lambda: [h.client for h in state.models.values()]))
