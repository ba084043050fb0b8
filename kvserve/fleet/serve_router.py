"""KVRequestRouter: Ray Serve's request-router hook, running fleet/routing.py's policy in each gateway.

Serve builds one per DeploymentHandle (one per engine pool in each gateway process) and asks it to rank
the pool's running replicas for each request. The request's payload carries its affinity key (the KV
chain hash of its first blocks, computed by the gateway, which has the tokens) and the replicas it must
not go to (those a migrating stream failed on, or that refused it). Live load comes from each replica's
`record_routing_stats` (refreshed every `stats_period_s`); the requests in flight per replica are this
router's own exact count, taken when it chooses, which the bounded-load guard needs.
"""
from __future__ import annotations

import importlib
import logging
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvserve.fleet.routing import Decision, ReplicaView, RoutingPolicy, RoutingStats, choose

log = logging.getLogger(__name__)

# The routers of this process, by pool (Serve application) name: the gateway's metrics and status read them.
ROUTERS: dict[str, "KVRequestRouter"] = {}

_VIEW_FIELDS = ("queued_prompt_tokens", "running", "max_num_seqs", "kv_usage", "est_ttft_s")


class KVRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **policy: Any) -> None:
        self.policy = RoutingPolicy(**policy)
        self.routing = RoutingStats()
        self.inflight: dict[str, int] = {}
        self._decisions: dict[str, Decision] = {}  # internal request id -> decision, until routed
        self._routed_to: dict[str, str] = {}  # internal request id -> replica, until completed
        # Serve ships this class to the gateway by value (cloudpickle), with its own copy of this module's
        # globals: register in the module the gateway imported.
        importlib.import_module(__name__).ROUTERS[self._deployment_id.app_name] = self

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        payload = _payload(pending_request)
        exclude = set(payload.get("exclude", ())) if payload else set()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas if r.replica_id.unique_id not in exclude}
        if not by_id:
            return []  # Serve backs off and asks again as replicas come (the gateway bounds the wait)
        views = [self.view(rid, r) for rid, r in by_id.items()]
        decision = choose(views, payload.get("affinity_key") if payload else None, self.policy)
        if pending_request is not None:
            internal = pending_request.metadata.internal_request_id
            self._undo(internal)  # asked again for the same request (Serve retries): its earlier choice is void
            self._decisions[internal] = decision
            # Counted now, not once Serve has sent it: the requests of a burst are chosen before any is sent,
            # and without this each would see the same (stale) loads and follow the others to one replica.
            self.inflight[decision.replica] = self.inflight.get(decision.replica, 0) + 1
        rest = sorted((v for v in views if v.id != decision.replica), key=lambda v: (v.inflight, v.id))
        return [[by_id[decision.replica]], [by_id[v.id] for v in rest]]

    def view(self, rid: str, replica: RunningReplica) -> ReplicaView:
        stats = replica.routing_stats or {}
        return ReplicaView(id=rid, inflight=self.inflight.get(rid, 0),
                           **{k: stats[k] for k in _VIEW_FIELDS if k in stats})

    def _undo(self, internal: str) -> Decision | None:
        """Take back the in-flight count of a choice not yet routed."""
        decision = self._decisions.pop(internal, None)
        if decision is not None and self.inflight.get(decision.replica, 0) > 0:
            self.inflight[decision.replica] -= 1
        return decision

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        internal = pending_request.metadata.internal_request_id
        rid = replica_id.unique_id
        decision = self._undo(internal)
        if decision is not None:
            if decision.replica != rid:  # Serve fell back to a lower rank (the first was full)
                decision = Decision(rid, decision.key, decision.preferred, "fallback")
            self.routing.count(decision)
        self.inflight[rid] = self.inflight.get(rid, 0) + 1
        self._routed_to[internal] = rid

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._undo(internal_request_id)
        rid = self._routed_to.pop(internal_request_id, None)
        if rid is not None and self.inflight.get(rid, 0) > 0:
            self.inflight[rid] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.inflight.pop(replica_id.unique_id, None)

    def replicas(self) -> list[tuple[str, dict, dict]]:
        """(replica id, its latest routing stats, its metadata) of each running replica."""
        return [(r.replica_id.unique_id, dict(r.routing_stats or {}), dict(r.replica_metadata or {}))
                for r in self._replicas.values()]


def _payload(pending_request: PendingRequest | None) -> dict | None:
    """The routing hints of a `generate(request, route)` call (FleetStream.open): exclude, affinity_key."""
    if pending_request is None or len(pending_request.args) < 2:
        return None
    route = pending_request.args[1]
    return route if isinstance(route, dict) else None
