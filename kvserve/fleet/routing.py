"""Which engine replica of a model serves a request: prefix affinity, load, and a guard against hot prefixes.
Pure Python (no Ray, no I/O), unit-tested in microseconds; the fleet gateway calls `choose`.

The policy, in order:
1. Affinity key: the chain hash (`kv_cache.hash_block`, salted by tenant as the KV manager salts it) of
   the prompt's first `affinity_blocks` full KV blocks, or of all its full blocks when it has fewer. A
   prompt shorter than one block has no key and goes by load alone (step 4).
2. Consistent hashing: the ready replicas are ranked for the key by rendezvous (highest random weight)
   hashing. A key keeps its replica while the pool changes, except when that replica leaves; then only
   its keys move, each to its next-ranked replica.
3. Bounded load (the balance guard, consistent hashing with bounded loads): walking the key's ranking,
   take the first replica that would hold at most max(1, `load_bound` x the fair share) of the requests
   in flight, this one counted. So one hot prefix, say a system prompt every request shares, cannot pin
   concurrent traffic to one replica: with two replicas and the default 1.25, none holds more than
   62.5% of the requests in flight; the spilled ones warm the next replica's cache, where the following
   ones hit. (Requests that never overlap all stay on the first replica: there is no load to share.)
4. Load: if the chosen replica is much busier than the least-loaded one (its load exceeds the least
   by `imbalance_abs` and is more than `imbalance_rel` times it), the least-loaded takes the request:
   a cache hit does not make up for a long queue. A request without a key goes to the least loaded.

Load of a replica, from its live stats: queued prompt tokens / `tokens_per_load`, + running sequences
(or, when higher, the requests this gateway has in flight there: stats are a stats period old) / its
max_num_seqs, + KV-cache use (0..1), + estimated TTFT / `ttft_target_s`. Replicas that are not
ready are never chosen.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from kvserve.engine.kv.manager import BlockHash, hash_block


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica at this instant (from its stats, refreshed by the gateway)."""

    id: str
    ready: bool = True
    inflight: int = 0  # requests this gateway has routed there and not seen finish
    queued_prompt_tokens: int = 0
    running: int = 0
    max_num_seqs: int = 64
    kv_usage: float = 0.0  # fraction of device KV blocks in use
    est_ttft_s: float = 0.0  # the replica's own estimate for a short interactive request


@dataclass(frozen=True)
class RoutingPolicy:
    affinity_blocks: int = 8  # full KV blocks of the prompt that make its affinity key
    block_size: int = 16  # the engines' KV block size (the key must be the KV manager's hash)
    load_bound: float = 1.25  # a replica takes at most this times its fair share of the in-flight requests
    imbalance_abs: float = 1.0  # load units the preferred replica may exceed the least-loaded one by...
    imbalance_rel: float = 2.0  # ...and this ratio, before the least-loaded replica takes the request
    tokens_per_load: int = 4096  # queued prompt tokens that count as one unit of load
    ttft_target_s: float = 0.5  # estimated TTFT that counts as one unit of load

    def __post_init__(self):
        if self.affinity_blocks < 1 or self.block_size < 1 or self.tokens_per_load < 1:
            raise ValueError("affinity_blocks, block_size and tokens_per_load must be >= 1")
        if self.load_bound < 1.0 or self.imbalance_rel < 1.0 or self.imbalance_abs < 0 or self.ttft_target_s <= 0:
            raise ValueError("load_bound and imbalance_rel must be >= 1, imbalance_abs >= 0, ttft_target_s > 0")


@dataclass(frozen=True)
class Decision:
    replica: str
    key: BlockHash | None  # the affinity key, None without one
    preferred: str | None  # the key's first-ranked ready replica
    reason: str  # "affinity" | "spilled" (bounded load) | "load" (imbalance) | "no_key"


@dataclass
class RoutingStats:
    """Counts per replica, for the gateway's metrics: requests routed, and by which reason."""

    routed: dict[str, int] = field(default_factory=dict)
    by_reason: dict[str, int] = field(default_factory=dict)

    def count(self, d: Decision) -> None:
        self.routed[d.replica] = self.routed.get(d.replica, 0) + 1
        self.by_reason[d.reason] = self.by_reason.get(d.reason, 0) + 1


def affinity_key(prompt_token_ids: list[int], salt: str | None, policy: RoutingPolicy,
                 cache_key: str | None = None, adapter: str | None = None) -> BlockHash | None:
    """The chain hash of the prompt's first full blocks (at most policy.affinity_blocks); None if it has none.
    With the request's prompt_cache_key, the hash of that key instead (in the tenant's salt): requests that name
    one key go to one replica whatever their first blocks, as OpenAI routes on it. With a LoRA adapter, the hash of
    its name: an adapter's requests go where it is resident already (its prefixes are cached there too), as long
    as that replica is not overloaded (the load bound)."""
    if adapter is not None:
        return hashlib.sha256(b"lora\0" + adapter.encode()).digest()
    if cache_key is not None:
        return hashlib.sha256(b"prompt_cache_key\0" + (salt or "").encode() + b"\0" + cache_key.encode()).digest()
    bs = policy.block_size
    full = min(len(prompt_token_ids) // bs, policy.affinity_blocks)
    parent: BlockHash | None = None
    for i in range(full):
        parent = hash_block(parent, prompt_token_ids[i * bs:(i + 1) * bs], salt)
    return parent


def rank(key: BlockHash, replicas: list[str]) -> list[str]:
    """Rendezvous order of `replicas` for `key`: each replica's weight is a hash of (key, replica id)."""
    return sorted(replicas, key=lambda r: hashlib.blake2b(key + r.encode(), digest_size=8).digest(), reverse=True)


def load(r: ReplicaView, policy: RoutingPolicy) -> float:
    # Running sequences: the replica's last report, or this gateway's own count of what it sent there when
    # that is higher (reports come every stats period; a burst is routed between two of them).
    running = max(r.running, r.inflight)
    return (r.queued_prompt_tokens / policy.tokens_per_load + running / max(1, r.max_num_seqs) + r.kv_usage
            + r.est_ttft_s / policy.ttft_target_s)


def choose(replicas: list[ReplicaView], key: BlockHash | None, policy: RoutingPolicy) -> Decision:
    """The replica for a request with affinity `key` (see the module docstring). ValueError if none is ready."""
    ready = [r for r in replicas if r.ready]
    if not ready:
        raise ValueError("no ready replica")
    by_id = {r.id: r for r in ready}
    loads = {r.id: load(r, policy) for r in ready}
    least = min(ready, key=lambda r: (loads[r.id], r.inflight, r.id))
    if key is None:
        return Decision(least.id, None, None, "no_key")
    order = rank(key, list(by_id))
    total = sum(r.inflight for r in ready) + 1
    cap = max(1.0, policy.load_bound * total / len(ready))
    chosen = next((rid for rid in order if by_id[rid].inflight + 1 <= cap), order[0])
    reason = "affinity" if chosen == order[0] else "spilled"
    busy, lightest = loads[chosen], loads[least.id]
    if chosen != least.id and busy - lightest > policy.imbalance_abs and busy > policy.imbalance_rel * lightest:
        return Decision(least.id, key, order[0], "load")
    return Decision(chosen, key, order[0], reason)
