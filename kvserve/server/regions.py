"""This region's front toward its peers: probes them, answers theirs, and forwards a completion a peer must
serve (service/region_routing.py decides which; this module does the I/O).

- Probes: every `probe_period_s` each peer's GET /v1/region/status (its readiness, draining flag and load), within
  `probe_timeout_s`; a transport error, a timeout or a non-200 is a failed probe, and so is a forwarded request
  the peer could not take.
- A completion whose model this region cannot serve now (its pool not ready, the server draining, or the
  request's tier shedding) goes to the best peer, streamed back as the peer sends it, with the client's
  Authorization and Idempotency-Key (tenants and their tokens exist in every region) and
  `x-kvserve-forwarded-from`: a forwarded request is served where it lands or refused, never forwarded again.
  A request the local engine refuses at admission for capacity is forwarded the same way.
- Every completion response carries `x-kvserve-region`: the region that served it.

The front is given what it reads (the models' handles, the draining flag, the store once open) and the count of
responses in flight (server/in_flight.py) that its relayed streams hold; it writes nothing of the server's.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Callable, Mapping
from urllib.parse import quote

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvserve.config import RegionsConfig
from kvserve.server.background import stop_task
from kvserve.server.budget_share import BudgetShare
from kvserve.engine.client import EngineStatus
from kvserve.service.region_routing import Local, RegionDecision, RegionRouter
from kvserve.service.router import LoadLevel

if TYPE_CHECKING:
    from kvserve.server.in_flight import InFlight
    from kvserve.service.models import ModelHandle
    from kvserve.store import AsyncStore

log = logging.getLogger(__name__)

FORWARDED_HEADER = "x-kvserve-forwarded-from"
REGION_HEADER = "x-kvserve-region"
STATUS_PATH = "/v1/region/status"
_PASSED_ON = ("authorization", "content-type", "idempotency-key", "last-event-id", "openai-organization",
              "openai-project", "user-agent", "accept", "x-stainless-retry-count")
_NOT_PASSED_BACK = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}
_LOAD = {LoadLevel.OK: 0.0, LoadLevel.HIGH: 0.5, LoadLevel.SHEDDING: 1.0}


class RegionFront:
    def __init__(self, config: RegionsConfig, models: Mapping[str, "ModelHandle"], draining: Callable[[], bool],
                 in_flight: "InFlight"):
        self.config = config
        self.models, self.draining = models, draining  # read only
        self.in_flight = in_flight  # its relays hold a place there
        self._store: AsyncStore | None = None  # for key lookups, once the server opened it (start)
        self.router = RegionRouter(config.local, [p.name for p in config.peers], config.policy)
        self.urls = {p.name: p.url.rstrip("/") for p in config.peers}
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task | None = None
        self.budgets: BudgetShare | None = None  # with a [regions] ledger: budgets shared by the regions

    @property
    def local(self) -> str:
        return self.config.local

    async def start(self, store: "AsyncStore") -> None:
        """Probe the peers; with a [regions] ledger, share the budgets (`budgets`, for the metering gate)."""
        self._store = store
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per probe
        p = self.config.policy
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.config.forward_timeout_s, connect=p.probe_timeout_s))
        self._task = asyncio.create_task(self._probe_loop(), name="kvserve-region-probes")
        if self.config.ledger:
            self.budgets = BudgetShare(self.config, store, self._client, self.urls)
            await self.budgets.start()

    async def stop(self) -> None:
        if self.budgets is not None:
            await self.budgets.stop()
        await stop_task(self._task)
        if self._client is not None:
            await self._client.aclose()

    # ---- probes ------------------------------------------------------------------------------
    async def _probe_loop(self) -> None:
        period = self.config.policy.probe_period_s
        while True:
            started = time.monotonic()
            await asyncio.gather(*(self._probe(name) for name in self.urls))
            self.router.tick(time.monotonic())
            await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))

    async def _probe(self, peer: str) -> None:
        t0 = time.monotonic()
        try:
            r = await self._client.get(self.urls[peer] + STATUS_PATH, timeout=self.config.policy.probe_timeout_s)
            body = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            body = None
        now = time.monotonic()
        if body is None or not body.get("ready"):
            self.router.probe_failed(peer, now)
        else:
            self.router.probe_ok(peer, now, rtt_ms=1000 * (now - t0), load=float(body.get("load", 0.0)),
                                 draining=bool(body.get("draining")))

    def status(self) -> dict:
        """This region as its peers' probes see it: ready when every model is, its load the highest of its
        models' interactive tiers (0 ok, 0.5 high, 1.0 shedding); and its own view of each peer."""
        handles = list(self.models.values())
        ready = bool(handles) and all(h.status == EngineStatus.READY for h in handles)
        load = max((_LOAD[h.load("interactive")] for h in handles), default=0.0)
        now = time.monotonic()
        peers = self.router.peers.items()
        return {"region": self.local, "ready": ready, "draining": self.draining(), "load": load,
                "peers": {name: s.health.value for name, s in peers},
                # how long each peer has held that health: an observer dates a change without a shared clock
                "peers_for_s": {name: round(now - s.changed_at, 3) for name, s in peers if s.changed_at is not None}}

    # ---- the choice ------------------------------------------------------------------------------
    def decide(self, request: Request, model: str | None, tier: str) -> RegionDecision:
        handle = self.models.get(model) if model else None
        healthy = handle is None or handle.status == EngineStatus.READY  # an unknown model: refused here
        shedding = handle is not None and healthy and handle.load(tier) is LoadLevel.SHEDDING
        return self.router.choose(Local(healthy=healthy, draining=self.draining(), over_bounds=shedding),
                                  forwarded=self.is_forwarded(request))

    @staticmethod
    def is_forwarded(request: Request) -> bool:
        return FORWARDED_HEADER in request.headers

    def failover_peer(self, request: Request) -> str | None:
        """After the local engine refused a request for capacity: a peer to try, if any."""
        return None if self.is_forwarded(request) else self.router.best_peer()

    # ---- keys held elsewhere ----------------------------------------------------------------
    @staticmethod
    def is_retry(request: Request) -> bool:
        """A client's retry: it resumes a stream (Last-Event-ID) or says it retries (the OpenAI SDKs send
        x-stainless-retry-count). Only retries ask the peers for their Idempotency-Key: first attempts pay nothing."""
        count = request.headers.get("x-stainless-retry-count", "0")
        return "last-event-id" in request.headers or (count.isdigit() and int(count) > 0)

    async def retry_holder(self, request: Request, tenant: str, key: str) -> str | None:
        """The peer that holds this Idempotency-Key, for a client's retry (not a forwarded call) whose key this
        region's store does not hold."""
        if self.is_forwarded(request) or not self.is_retry(request) \
                or await self._store.aidempotency_state(tenant, key) is not None:
            return None
        return await self.key_holder(request, key)

    async def key_holder(self, request: Request, key: str) -> str | None:
        """The peer (up) that holds this Idempotency-Key for the caller's tenant, if any answers so in time."""
        peers = [name for name, s in self.router.peers.items() if s.health.value == "up"]
        if not peers:
            return None
        auth = {"authorization": request.headers.get("authorization", "")}

        async def ask(peer: str) -> str | None:
            try:
                r = await self._client.get(f"{self.urls[peer]}/v1/region/keys/{quote(key, safe='')}", headers=auth,
                                           timeout=self.config.policy.probe_timeout_s)
            except httpx.HTTPError:
                return None
            return peer if r.status_code == 200 else None

        found = [p for p in await asyncio.gather(*(ask(p) for p in peers)) if p is not None]
        return found[0] if found else None

    # ---- usage of every region ----------------------------------------------------------------
    async def peer_usage(self, request: Request, params: dict[str, str]) -> dict[str, dict | None]:
        """Each peer's usage page for the same buckets (`/v1/usage`, as the caller), None where it did not answer."""
        auth = {"authorization": request.headers.get("authorization", "")}

        async def one(peer: str) -> dict | None:
            try:
                r = await self._client.get(f"{self.urls[peer]}/v1/usage", params=params, headers=auth,
                                           timeout=self.config.forward_timeout_s)
                return r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None

        names = list(self.urls)
        return dict(zip(names, await asyncio.gather(*(one(n) for n in names))))

    # ---- forwarding --------------------------------------------------------------------------
    async def forward(self, request: Request, body: bytes, peer: str) -> Response | None:
        """The peer's response, streamed as it comes; None when the peer could not be reached (a failed probe)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in _PASSED_ON}
        headers[FORWARDED_HEADER] = self.local
        url = self.urls[peer] + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        with self.in_flight.hold() as place:  # a drain waits for forwarded streams as for its own
            try:
                upstream = await self._client.send(
                    self._client.build_request("POST", url, headers=headers, content=body), stream=True)
            except httpx.HTTPError as e:
                log.warning("forwarding to region %s failed: %s", peer, e)
                self.router.probe_failed(peer, time.monotonic())
                return None
            passed = {k: v for k, v in upstream.headers.items() if k.lower() not in _NOT_PASSED_BACK}
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                async def relay():
                    try:
                        async for chunk in upstream.aiter_raw():
                            yield chunk
                    finally:
                        place.release()
                        await upstream.aclose()

                response = StreamingResponse(relay(), status_code=upstream.status_code, headers=passed)
                place.pass_on()  # the relay's end gives it back
                return response
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
            return Response(content, status_code=upstream.status_code, headers=passed)
