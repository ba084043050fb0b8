"""Which region serves a request that reached one region's gateway: its own first, a peer when it cannot, and a
peer that failed only once it has been healthy for a while. Pure Python (no I/O, no clock of its own: every
call is given `now`), unit-tested in milliseconds; a gateway feeds it probe results and load signals.

Health, per peer region, from this gateway's probes (and from requests forwarded there, which count as probes):
- UP -> DOWN after `fail_after` failures in a row, or when no probe has succeeded for `stale_after_s` (a probe
  that hangs is a failure too). With probes every `probe_period_s`, a dead region is detected within
  fail_after x probe_period_s + probe_timeout_s.
- DOWN -> RECOVERING at its first success; RECOVERING -> UP once it has answered every probe for
  `recover_after_s`; a failure while recovering sends it back to DOWN and restarts that clock. So a region
  that flaps never takes traffic, and one that came back takes it again without anybody's help (the complaint
  about failovers that keep calling a dead primary, or never return to it, is about exactly these two edges).
- A peer never probed is DOWN until it answers; one whose probes all answered so far is UP at once.

The choice for a request:
1. Local first: this region serves it while its pools are healthy, not draining and within their admission
   bounds (the gateway knows all three).
2. Otherwise a peer that is UP and not overloaded, the one with the least round-trip time plus load
   (`load_weight_ms` per unit of load: 1.0 is a region at its admission bound).
3. A request that was already forwarded is never forwarded again (no ping-pong between two regions that both
   think the other is better): it is served here or refused.
4. No region can take it: served here if the local pools are alive (queued, or refused by admission with its
   own 429/503), else refused (503 with Retry-After).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from kvserve.config import RegionPolicy  # noqa: F401  (the policy's fields are the [regions.policy] table)


class Health(enum.Enum):
    UP = "up"
    RECOVERING = "recovering"
    DOWN = "down"


@dataclass
class PeerState:
    """What this gateway knows of one peer region."""

    health: Health = Health.DOWN
    changed_at: float | None = None  # when `health` last changed (the caller's clock); None: never
    failures: int = 0  # in a row
    ever_failed: bool = False
    last_ok: float | None = None
    healthy_since: float | None = None  # the start of the current run of successes
    rtt_ms: float = 0.0  # smoothed
    load: float = 0.0  # its gateways' own figure: 0 idle, 1.0 at its admission bounds
    draining: bool = False


def _become(s: PeerState, health: Health, now: float) -> None:
    s.health, s.changed_at = health, now


@dataclass(frozen=True)
class Local:
    """This region's own state for one request's model."""

    healthy: bool = True  # at least one ready replica in the model's pool
    draining: bool = False
    over_bounds: bool = False  # its admission would refuse this request's tier now


@dataclass(frozen=True)
class RegionDecision:
    region: str | None  # None: refuse
    reason: str  # "local" | "failover" | "local_fallback" | "forwarded_here" | "no_region"


class RegionRouter:
    """One gateway's view of the peer regions, and the choice per request."""

    RTT_SMOOTHING = 0.3

    def __init__(self, local: str, peers: list[str], policy: RegionPolicy = RegionPolicy()):
        if local in peers or len(set(peers)) != len(peers):
            raise ValueError("peers must be distinct and not the local region")
        self.local, self.policy = local, policy
        self.peers = {p: PeerState() for p in peers}

    # ---- health ------------------------------------------------------------------------------
    def probe_ok(self, peer: str, now: float, rtt_ms: float, load: float = 0.0, draining: bool = False) -> None:
        s = self.peers[peer]
        s.failures = 0
        s.last_ok = now
        s.rtt_ms = rtt_ms if s.healthy_since is None else \
            (1 - self.RTT_SMOOTHING) * s.rtt_ms + self.RTT_SMOOTHING * rtt_ms
        s.load, s.draining = load, draining
        if s.healthy_since is None:
            s.healthy_since = now
        if s.health is Health.DOWN:
            # a peer whose every probe answered is trusted at once; one that failed must stay healthy a while
            _become(s, Health.RECOVERING if s.ever_failed else Health.UP, now)
        if s.health is Health.RECOVERING and now - s.healthy_since >= self.policy.recover_after_s:
            _become(s, Health.UP, now)

    def probe_failed(self, peer: str, now: float) -> None:
        s = self.peers[peer]
        s.failures += 1
        s.ever_failed = True
        s.healthy_since = None
        if s.health is Health.RECOVERING or (s.health is Health.UP and s.failures >= self.policy.fail_after):
            _become(s, Health.DOWN, now)

    def tick(self, now: float) -> None:
        """Time passes: a peer with no successful probe for stale_after_s is DOWN (probes that hang)."""
        for s in self.peers.values():
            if s.health is not Health.DOWN and (s.last_ok is None or now - s.last_ok >= self.policy.stale_after_s):
                s.healthy_since, s.ever_failed = None, True
                _become(s, Health.DOWN, now)

    # ---- the choice --------------------------------------------------------------------------
    def choose(self, local: Local, forwarded: bool = False) -> RegionDecision:
        if local.healthy and not local.draining and not local.over_bounds:
            return RegionDecision(self.local, "local")
        if forwarded:
            return RegionDecision(self.local if local.healthy else None,
                                  "forwarded_here" if local.healthy else "no_region")
        peer = self.best_peer()
        if peer is not None:
            return RegionDecision(peer, "failover")
        return RegionDecision(self.local, "local_fallback") if local.healthy else RegionDecision(None, "no_region")

    def best_peer(self) -> str | None:
        p = self.policy
        ok = [(s.rtt_ms + p.load_weight_ms * s.load, name) for name, s in self.peers.items()
              if s.health is Health.UP and not s.draining and s.load < p.overload]
        return min(ok)[1] if ok else None
