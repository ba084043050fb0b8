"""A streaming client that survives a region: the documented retry (docs/regions.md), and a chaos driver that
measures what clients see while regions are killed, frozen and brought back.

The retry: send the stream to the client's own region with an `Idempotency-Key`; when the connection fails, the
stream is cut before `[DONE]`, or the answer is a 5xx, a 429 or a 409 (the key busy where it was), send the same
request to the next region with the same key, `x-stainless-retry-count` (as the OpenAI SDKs send it) and
`Last-Event-ID` set to the id of the last event received
(service/resume.py): the stream goes on from there, no token twice, none lost. Without any id yet (nothing
received), the request starts again from scratch. Other 4xx answers are final. A region that failed the client
is tried last for the next 10 s; a 429 (alive but full) is waited out as its Retry-After asks (at most 1 s)
before the next region; between attempts the wait doubles from 0.2 s up to 2 s.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import httpx

RETRIED_STATUSES = {409, 429, 500, 502, 503, 504}


@dataclass
class StreamResult:
    ok: bool
    text: str = ""
    attempts: int = 0
    regions: list[str] = field(default_factory=list)  # the region that served each attempt that got an answer
    resumed: int = 0  # attempts sent with Last-Event-ID
    started: float = 0.0  # monotonic
    ttft_s: float | None = None  # to the first content token, retries included
    home: str = ""  # the client's own region (its name)
    e2e_s: float = 0.0
    error: str | None = None


class _Cut(Exception):
    pass


class RegionMemory:
    """A client's memory of regions that just failed it: skipped for `avoid_s` (while another is left), so a
    dead or frozen home region costs a client one timeout, not one per request."""

    def __init__(self, avoid_s: float = 10.0):
        self.avoid_s = avoid_s
        self._until: dict[str, float] = {}

    def failed(self, url: str) -> None:
        self._until[url] = time.monotonic() + self.avoid_s

    def order(self, urls: list[str], home: int) -> list[str]:
        """The regions to try, home first, those that failed lately last."""
        ring = [urls[(home + i) % len(urls)] for i in range(len(urls))]
        now = time.monotonic()
        return sorted(ring, key=lambda u: self._until.get(u, 0.0) > now)


async def stream_with_failover(client: httpx.AsyncClient, urls: list[str], home: int, body: dict, token: str,
                               path: str = "/v1/completions", max_attempts: int = 10, connect_timeout_s: float = 1.0,
                               read_timeout_s: float = 3.0, backoff_s: float = 0.2,
                               memory: RegionMemory | None = None) -> StreamResult:
    """One streamed completion through the documented retry, starting at region `home`."""
    key = f"failover-{uuid.uuid4().hex}"
    res = StreamResult(ok=False, started=time.monotonic())
    last_id: str | None = None
    timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
    memory = memory or RegionMemory()
    order = memory.order(urls, home)
    for attempt in range(max_attempts):
        res.attempts = attempt + 1
        url = order[attempt % len(order)]
        headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": key}
        if attempt:
            headers["x-stainless-retry-count"] = str(attempt)  # as the OpenAI SDKs say it: the region asks its peers
        if last_id is not None:
            headers["Last-Event-ID"] = last_id
            res.resumed += 1
        else:
            res.text = ""  # nothing resumable received: the request starts over
        try:
            async with client.stream("POST", url + path, json=body, headers=headers, timeout=timeout) as r:
                res.regions.append(r.headers.get("x-kvserve-region", url))
                if r.status_code != 200:
                    await r.aread()
                    if r.status_code == 429:  # alive but full: wait as it asks (at most a second), then go on
                        await asyncio.sleep(min(1.0, float(r.headers.get("retry-after", backoff_s) or backoff_s)))
                        res.error = f"429 from {url}"
                        continue
                    if r.status_code in RETRIED_STATUSES:
                        raise _Cut(f"{r.status_code} from {url}")
                    res.error = f"{r.status_code}: {r.text[:200]}"
                    break
                pending_id = None
                async for line in r.aiter_lines():
                    if line.startswith("id: "):
                        pending_id = line[4:]
                    elif line.startswith("data: "):
                        data = line[6:]
                        if data == "[DONE]":
                            res.ok = True
                            res.e2e_s = time.monotonic() - res.started
                            return res
                        event = json.loads(data)
                        if "error" in event:
                            raise _Cut(f"stream error from {url}: {event['error'].get('code')}")
                        for choice in event.get("choices", ()):
                            piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                            if piece and res.ttft_s is None:
                                res.ttft_s = time.monotonic() - res.started
                            res.text += piece
                        if pending_id is not None:
                            last_id, pending_id = pending_id, None
                raise _Cut(f"stream from {url} ended before [DONE]")
        except (httpx.TransportError, _Cut) as e:
            res.error = str(e) or type(e).__name__
            memory.failed(url)
        await asyncio.sleep(min(2.0, backoff_s * 2 ** attempt))
    res.e2e_s = time.monotonic() - res.started
    return res


@dataclass(frozen=True)
class Fault:
    at_s: float
    action: str  # of a region: "kill" | "restart" | "freeze" | "thaw" | "partition" | "heal"; inside one: any other
    region: int


async def watch_health(client: httpx.AsyncClient, urls: list[str], names: list[str], stop: asyncio.Event,
                       period_s: float = 0.1, timeout_s: float = 1.0) -> list[tuple[float, str, str, str]]:
    """(when, observer, peer, health) each time a region's view of a peer changes (GET /v1/region/status, every
    region at once: a frozen one holds up no other). `when` is the observer's own moment of change where it says
    how long the peer has held its health (peers_for_s): a busy observer that answers late does not make its
    detection look late."""
    seen: dict[tuple[str, str], str] = {}
    changes = []

    async def poll(url: str, name: str) -> None:
        try:
            r = await client.get(url + "/v1/region/status", timeout=timeout_s)
            body = r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return
        now = time.monotonic()
        held = body.get("peers_for_s", {})
        for peer, health in body.get("peers", {}).items():
            if seen.get((name, peer)) != health:
                seen[(name, peer)] = health
                changes.append((now - float(held.get(peer, 0.0)), name, peer, health))

    while not stop.is_set():
        await asyncio.gather(*(poll(url, name) for url, name in zip(urls, names)), asyncio.sleep(period_s))
    return sorted(changes)


@dataclass
class Spending:
    """What a tenant with a budget shared by the regions got while it spent in all of them at once."""

    served: int = 0
    refused_quota: int = 0  # 429 insufficient_quota: its budget (or this region's share of it) was spent
    other_errors: int = 0  # anything else (a region dead or frozen: the spender does not retry elsewhere)
    refusal_messages: list[str] = field(default_factory=list)


async def spend_everywhere(client: httpx.AsyncClient, urls: list[str], token: str, body: dict, until: float,
                           pause_s: float = 0.1) -> Spending:
    """One spender per region sends `body` (not streamed) to its region until `until` (monotonic), `pause_s`
    apart, and counts what was served and refused."""
    out = Spending()

    async def one(url: str) -> None:
        while time.monotonic() < until:
            try:
                r = await client.post(url + "/v1/completions", json=body, timeout=10,
                                      headers={"Authorization": f"Bearer {token}"})
                code = r.json().get("error", {}).get("code") if r.status_code != 200 else None
            except (httpx.HTTPError, ValueError):
                r, code = None, "transport"
            if r is not None and r.status_code == 200:
                out.served += 1
            elif r is not None and r.status_code == 429 and code == "insufficient_quota":
                out.refused_quota += 1
                if len(out.refusal_messages) < 200:
                    out.refusal_messages.append(r.json()["error"]["message"])
            else:
                out.other_errors += 1
            await asyncio.sleep(pause_s)

    await asyncio.gather(*(one(u) for u in urls))
    return out


async def run_chaos(urls: list[str], names: list[str], token: str, bodies: list[dict], expected: list[str],
                    faults: list[Fault], act: Callable[[Fault], Awaitable[None]], duration_s: float,
                    clients_per_region: int, ttft_slo_s: float, window_s: float = 10.0,
                    spender: tuple[str, dict] | None = None) -> dict:
    """Clients in every region loop over `bodies` through the documented retry for `duration_s` while `act`
    applies each fault at its time (and, with `spender` (its token, its body), a tenant with a budget spends in
    every region: spend_everywhere). Returns the figures: successes, TTFT SLO outside the failover windows
    (from each fault until its region is back, and `window_s` more), continued streams, text exactness against
    `expected`, detection times, and the spender's counts."""
    results: list[tuple[int, StreamResult]] = []
    start = time.monotonic()
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        faults_done = asyncio.Event()

        async def user(region: int, seed: int) -> None:
            k, memory = seed, RegionMemory()
            while time.monotonic() - start < duration_s or not faults_done.is_set():
                i = k % len(bodies)
                res = await stream_with_failover(client, urls, region, bodies[i], token, memory=memory)
                res.home = names[region]
                results.append((i, res))
                k += 1

        async def injector() -> list[tuple[float, Fault, float]]:
            """Each fault at its time, shifted by `late`: an action that ended past the next one's time (a
            restart that took long to be ready) moves the rest of the schedule on, so every fault still lasts
            as long as planned (a freeze thawed at once would give its peers nothing to detect)."""
            done, late = [], 0.0  # (applied, the fault, its action done: a restarted region is ready)
            for f in sorted(faults, key=lambda f: f.at_s):
                await asyncio.sleep(max(0.0, start + f.at_s + late - time.monotonic()))
                t = time.monotonic()
                late = t - (start + f.at_s)
                await act(f)
                done.append((t, f, time.monotonic()))
            faults_done.set()
            return done

        watcher = asyncio.create_task(watch_health(client, urls, names, stop))
        spending = (asyncio.create_task(spend_everywhere(client, urls, spender[0], spender[1], start + duration_s))
                    if spender else None)
        users = [user(r, r * 1000 + c) for r in range(len(urls)) for c in range(clients_per_region)]
        applied, *_ = await asyncio.gather(injector(), *users)
        duration_s = max(duration_s, time.monotonic() - start)  # longer where a late action moved the faults on
        stop.set()
        changes = await watcher
        spent = await spending if spending is not None else None
    out = _figures(results, expected, applied, changes, names, ttft_slo_s, window_s, duration_s, start)
    return {**out, "spending": spent}


def _figures(results, expected, applied, changes, names, ttft_slo_s, window_s, duration_s, start) -> dict:
    ok = [r for _, r in results if r.ok]
    exact = sum(1 for i, r in results if r.ok and r.text == expected[i])
    ends = {"kill": "restart", "freeze": "thaw", "partition": "heal"}  # a fault lasts until its region is back
    def back(t: float, f: Fault, action: str) -> float:
        """When the fault's region was back: its `action` (a restart: once ready) done."""
        return min((d for u, g, d in applied if u > t and g.region == f.region and g.action == action),
                   default=start + duration_s)

    windows = []
    for t, f, _ in applied:
        if f.action in ends:
            windows.append((t, back(t, f, ends[f.action]) + window_s))
        elif f.action not in ends.values():  # a fault inside a region (a replica, a gateway): its restart's time
            windows.append((t, t + window_s))
    calm = [r for _, r in results if not any(a <= r.started <= b for a, b in windows)]
    within_slo = [r for r in calm if r.ok and r.ttft_s is not None and r.ttft_s <= ttft_slo_s]
    # N+1: while a killed region is gone, the requests the others took at once (no failed attempt first)
    gone = [(t, back(t, f, "restart")) for t, f, _ in applied if f.action == "kill"]
    during_loss = [r for _, r in results if r.attempts == 1 and any(a <= r.started <= b for a, b in gone)]
    loss_within_slo = [r for r in during_loss if r.ok and r.ttft_s is not None and r.ttft_s <= ttft_slo_s]
    continued = [r for r in ok if r.resumed]
    failed_over = [r for r in ok if r.attempts > 1]
    detections = []
    for t, f, _ in applied:
        if f.action not in ends:
            continue
        victim, until = names[f.region], back(t, f, ends[f.action])
        seen = []  # a peer's "down" while the fault lasted (one after the region is back detected nothing)
        for observer in names:
            if observer == victim:
                continue
            mine = [(when, health) for when, o, peer, health in changes if o == observer and peer == victim]
            before = [h for when, h in mine if when < t]
            if before and before[-1] == "down":  # already down in its eyes (probes timing out under load)
                seen.append(t)
            seen += [when for when, h in mine if h == "down" and t <= when <= until]
        detections.append(min(seen) - t if seen else None)
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    first_fault = min((t for t, _, _ in applied), default=start + duration_s)
    before = [r for _, r in results if r.started < first_fault]
    local = [r for r in before if r.ok and r.attempts == 1 and r.regions[:1] == [r.home]]
    return {"requests": len(results), "succeeded": len(ok), "exact_text": exact,
            "success_share": len(ok) / max(1, len(results)),
            "calm_requests": len(calm), "calm_within_ttft_slo": len(within_slo),
            "ttft_slo_share": len(within_slo) / max(1, len(calm)), "ttft_slo_s": ttft_slo_s,
            "loss_requests": len(during_loss), "loss_within_ttft_slo": len(loss_within_slo),
            "failed_over": len(failed_over), "continued_streams": len(continued),
            "failover_e2e_s_p50": statistics.median(r.e2e_s for r in failed_over) if failed_over else None,
            "failover_e2e_s_max": max((r.e2e_s for r in failed_over), default=None),
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "before_faults": len(before), "local_before_faults": len(local),
            "detection_s": detections, "faults": [(round(t - start, 1), f.action, names[f.region]) for t, f, _ in applied],
            "duration_s": duration_s, "errors": [r.error for _, r in results if not r.ok][:10]}
