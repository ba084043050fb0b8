"""FleetClient: the gateway's EngineClient for one model's pool of engine replicas (Ray Serve).

The completion service uses it exactly as it uses the in-process AsyncLLM: the gateway tokenizes (it holds
the model's tokenizer, not its weights), `submit` sends the tokens through the pool's DeploymentHandle,
whose KVRequestRouter picks the replica, and the returned FleetStream yields full RequestOutputs rebuilt
from the replica's slim ones (fleet/wire.py).

Migration (a replica dies mid-stream, or its engine fails): the stream sees the handle raise (actor death,
unavailable) or a "failed" message, and submits the request again to another replica with the prompt plus
the tokens already sent (`resumed_token_ids`: the engine recomputes them, counts them against max_tokens,
and a seeded generator skips their draws), excluding the replicas it failed on. The consumer sees one
stream without a gap or a repeated token; the model's finish hook sees the request once, with its real
totals. After `migration_limit` moves, or when no replica accepts it within `route_timeout_s`, the request
ends with finish reason "error" (its usage row says so) and the stream raises ModelFailed: an SSE error
event to a streaming client, a 503 otherwise. A request with n > 1 is not migrated (its forks cannot be
resumed); it fails the same way.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Callable

from kvserve.config import EngineConfig, FleetConfig, ServedModel
from kvserve.engine.client import EngineHealth, EngineStatus, check_available
from kvserve.engine.errors import CapacityExhausted, KVServeError, ModelFailed, from_wire
from kvserve.engine.kv.manager import BlockHash
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.engine.request import EngineRequest
from kvserve.engine.stats import SchedulerStats
from kvserve.fleet import wire
from kvserve.fleet.routing import RoutingPolicy, affinity_key

log = logging.getLogger(__name__)


class FleetStream:
    """One request on the pool: the replica stream it is reading now, and everything it has received."""

    def __init__(self, client: "FleetClient", request: EngineRequest, affinity: BlockHash | None,
                 acc: wire.OutputAccumulator):
        self.client = client
        self.request_id = request.request_id
        self.request = request
        self.affinity = affinity
        self.acc = acc
        self.replica: str | None = None
        self.model_version: str | None = None
        self.migrations = 0
        self.exclude: list[str] = []
        self._gen = None
        self._pending: list[RequestOutput] = []
        self._done = False

    # ---- opening (first submit and each migration) -----------------------------------------
    async def open(self) -> None:
        """Route to a replica and wait for it to accept; typed errors when none does."""
        fleet = self.client.fleet
        deadline = time.monotonic() + fleet.route_timeout_s
        while True:
            request = replace(self.request, resumed_token_ids=tuple(self.acc.sent_token_ids))
            route = dict(exclude=list(self.exclude), affinity_key=self.affinity)
            gen = self.client.handle.options(stream=True).generate.remote(request, route)
            remaining = deadline - time.monotonic()
            try:
                msg = await asyncio.wait_for(gen.__anext__(), timeout=max(0.01, remaining))
            except asyncio.TimeoutError:
                gen.cancel()
                raise ModelFailed(f"no replica of {self.client.model_id} accepted the request within "
                                  f"{fleet.route_timeout_s:.0f} s") from None
            except (StopAsyncIteration, asyncio.CancelledError):
                gen.cancel()
                raise
            except Exception as e:  # the replica died before it answered: try again while time is left
                log.warning("routing %s to %s failed (%s); retrying", self.request_id, self.client.model_id, e)
                if time.monotonic() >= deadline:
                    raise ModelFailed(f"no replica of {self.client.model_id} could take the request: {e}") from None
                await asyncio.sleep(0.2)
                continue
            if msg[0] == wire.REFUSED:
                replica, err = msg[1], from_wire(msg[2])
                # A full replica is not a full pool: try the others; while the autoscaler can still add
                # replicas, wait for them. 429 only when the pool is at its maximum and every replica is full.
                if isinstance(err, CapacityExhausted):
                    if len(self.exclude) + 1 < self.client.pool_size():
                        self.exclude.append(replica)
                        continue
                    if self.client.can_grow() and time.monotonic() + 0.5 < deadline:
                        self.exclude.clear()
                        await asyncio.sleep(0.5)
                        continue
                raise err
            _, self.replica, self.model_version = msg
            self._gen = gen
            return

    # ---- reading ------------------------------------------------------------------------------
    def __aiter__(self) -> "FleetStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._pending:
            return self._pending.pop(0)
        if self._done:
            raise StopAsyncIteration
        while True:
            try:
                msg = await self._gen.__anext__()
            except StopAsyncIteration:
                failure = "the replica ended the stream before the request finished"
            except asyncio.CancelledError:
                raise
            except Exception as e:  # actor died, unavailable, connection lost
                failure = f"{type(e).__name__}: {e}"
            else:
                if msg[0] == wire.OUTPUTS:
                    now = time.monotonic()
                    outs = [self.acc.add(o, now) for o in msg[1]]
                    if outs[-1].finished:
                        self._finish(outs[-1])
                    self._pending = outs[1:]
                    return outs[0]
                failure = str(from_wire(msg[1]))
            await self._migrate(failure)

    def get_nowait(self) -> RequestOutput | None:
        return self._pending.pop(0) if self._pending else None

    async def _migrate(self, failure: str) -> None:
        client = self.client
        self.acc.replica_lost()
        if self.replica is not None:
            self.exclude.append(self.replica)
        log.warning("request %s lost replica %s (%s)", self.request_id, self.replica, failure)
        if self.request.params.n != 1:
            self._fail(f"{failure}; a request with n > 1 cannot be resumed elsewhere", "not_resumable")
        if self.migrations >= client.fleet.migration_limit:
            self._fail(f"{failure}; migration limit ({client.fleet.migration_limit}) reached", "limit")
        self.migrations += 1
        try:
            await self.open()
        except KVServeError as e:
            self._fail(f"{failure}; no replica could continue it: {e}", "no_replica")
        client.count_migration("migrated")
        log.info("request %s continues on replica %s after %d tokens", self.request_id, self.replica,
                 len(self.acc.sent_token_ids))

    def _fail(self, why: str, outcome: str) -> None:
        self.client.count_migration(outcome)
        self._finish(self.acc.final("error", time.monotonic()))
        raise ModelFailed(f"model {self.client.model_id}: the request could not be completed: {why}")

    def _finish(self, final: RequestOutput) -> None:
        """The request's end, reported once (the model's finish hook: metrics and one usage row)."""
        if self._done:
            return
        self._done = True
        self.client.streams.pop(self.request_id, None)
        if self.client.on_finish is not None:
            self.client.on_finish(final)

    # ---- ending early -------------------------------------------------------------------------
    def abort(self) -> None:
        if self._done:
            return
        if self._gen is not None:
            self._gen.cancel()  # Serve cancels the replica's generator, which aborts the engine request
        self._finish(self.acc.final("abort", time.monotonic()))

    async def aclose(self) -> None:
        self.abort()


class FleetClient:
    """The EngineClient of one model's replica pool, in a gateway (engine/client.py)."""

    def __init__(self, spec: ServedModel, config: EngineConfig, on_step: Callable | None,
                 on_finish: Callable[[RequestOutput], None] | None, directory, fleet: FleetConfig):
        self.spec = spec
        self.model_id = spec.id
        self.config = config
        self.directory = directory  # fleet/record.py PoolDirectory: which pool serves this model now
        self.fleet = fleet
        self.on_finish = on_finish
        self.status = EngineStatus.WARMING
        self.error: str | None = None
        self.info = None
        self.source: str | None = None  # the model source the tokenizer was read from
        self.pool: str | None = None  # the Serve application of the replica pool requests go to
        self.handle = None
        self.version: str | None = None
        self.max_replicas = 1  # the pool's autoscaling maximum
        self._max_model_len: int | None = None
        self._weights: str | None = None
        self._numerics: str | None = None
        self._activations: str | None = None
        self.policy = RoutingPolicy(affinity_blocks=fleet.affinity_blocks, block_size=config.cache.block_size,
                                    load_bound=fleet.load_bound)
        self.streams: dict[str, FleetStream] = {}
        self.migrations: dict[str, int] = {}
        self.started_at = time.monotonic()
        self._watch_task: asyncio.Task | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> "FleetClient":
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())
        return self

    async def _watch(self) -> None:
        """Follow the fleet record: the pool serving this model, switched to once it answers (a rolling
        update: new requests go to the new pool; streams on the old one finish there)."""
        while True:
            try:
                entry = (await self.directory.pools()).get(self.model_id)
                if entry is not None and entry["app"] != self.pool:
                    await self._switch(entry)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("fleet record for %s unreadable: %s", self.model_id, e)
            await asyncio.sleep(1.0)

    async def _switch(self, entry: dict) -> None:
        from kvserve.models.catalog import resolve_source
        from kvserve.models.model_info import read_model_info

        if entry["source"] != self.source:  # the tokenizer first: requests for the new pool need it
            try:
                path = await asyncio.to_thread(resolve_source, entry["source"], self.spec.engine_args.get("install", ""))
                self.info = await asyncio.to_thread(read_model_info, path, self.spec.id)
                self.source = entry["source"]
            except Exception as e:
                log.exception("gateway could not read the tokenizer of %s", self.model_id)
                self.error, self.status = f"{type(e).__name__}: {e}", EngineStatus.FAILED
                return
        handle = self.directory.handle(entry["app"])
        desc = await handle.describe.remote()  # the context length the replicas settled on
        self.handle, self.pool, self.version = handle, entry["app"], entry["version"]
        self.max_replicas = entry.get("max_replicas", 1)
        self._max_model_len = desc["max_model_len"]
        self._weights = desc.get("weights")
        self._numerics = desc.get("numerics")
        self._activations = desc.get("activations")
        if self.status in (EngineStatus.WARMING, EngineStatus.FAILED):
            self.status, self.error = EngineStatus.READY, None
        log.info("model %s now served by pool %s (version %s)", self.model_id, self.pool, self.version)

    def drain(self) -> None:
        if self.status == EngineStatus.READY:
            self.status = EngineStatus.DRAINING

    def stop(self, timeout: float = 10.0) -> None:
        for stream in list(self.streams.values()):
            stream.abort()
        if self._watch_task is not None:
            self._watch_task.cancel()
        self.status = EngineStatus.STOPPED

    def health(self) -> EngineHealth:
        return EngineHealth(self.status, None, 0.0, self.started_at, self.error)

    def is_stalled(self, timeout: float) -> bool:
        """Replicas' progress is Serve's health check (EngineReplica.check_health); a gateway never stalls."""
        return self.status == EngineStatus.FAILED

    # ---- what the service reads -----------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.info.tokenizer if self.info is not None else None

    @property
    def max_model_len(self) -> int | None:
        return self._max_model_len

    @property
    def weights(self) -> str | None:
        return self._weights

    @property
    def numerics(self) -> str | None:
        return self._numerics

    @property
    def activations(self) -> str | None:
        return self._activations

    @property
    def num_inflight(self) -> int:
        return len(self.streams)

    def router(self):
        from kvserve.fleet.serve_router import ROUTERS

        return ROUTERS.get(self.pool) if self.pool is not None else None

    def replica_stats(self) -> list[tuple[str, dict, dict]]:
        router = self.router()
        return router.replicas() if router is not None else []

    def pool_size(self) -> int:
        return max(1, len(self.replica_stats()))

    def can_grow(self) -> bool:
        return len(self.replica_stats()) < self.max_replicas

    @property
    def stats(self) -> SchedulerStats | None:
        """The pool's load as one scheduler snapshot: sums over the replicas' latest stats (the shortest
        estimated wait and TTFT, since a new request goes to the least loaded)."""
        stats = [s["scheduler"] for _, s, _ in self.replica_stats() if "scheduler" in s]
        return SchedulerStats.pooled(stats) if stats else None

    def pool_status(self) -> dict:
        """The pool as this gateway sees it: replicas with their latest stats, and where it routed what."""
        router = self.router()
        routing = router.routing if router is not None else None
        replicas = []
        for rid, stats, meta in self.replica_stats():
            q, h = stats.get("prefix_query_tokens", 0), stats.get("prefix_hit_tokens", 0)
            replicas.append(dict(id=rid, version=meta.get("version", stats.get("version")),
                                 routed=routing.routed.get(rid, 0) if routing else 0,
                                 inflight=router.inflight.get(rid, 0) if router else 0,
                                 prefix_hit_rate=h / q if q else None,
                                 **{k: stats.get(k) for k in ("accepted", "running", "queued_prompt_tokens",
                                                              "kv_usage", "est_ttft_s", "busy_seconds",
                                                              "prefix_query_tokens", "prefix_hit_tokens")}))
        return dict(status=self.status.value, pool=self.pool, version=self.version, replicas=replicas,
                    by_reason=dict(routing.by_reason) if routing else {}, migrations=dict(self.migrations),
                    inflight=self.num_inflight)

    def count_migration(self, outcome: str) -> None:
        self.migrations[outcome] = self.migrations.get(outcome, 0) + 1

    # ---- requests --------------------------------------------------------------------------------
    async def submit(self, request: EngineRequest) -> FleetStream:
        check_available(self)
        ids = list(request.prompt_token_ids)
        acc = wire.OutputAccumulator(request.request_id, None, ids, time.monotonic(), self.model_id)
        if request.resumed_token_ids:
            acc.add(RequestOutput(request.request_id, None, [], [CompletionOutput(0, delta_token_ids=list(
                request.resumed_token_ids))], False), time.monotonic())
        stream = FleetStream(self, request, affinity_key(ids, request.cache_salt, self.policy, request.cache_key,
                                                      request.lora), acc)
        self.streams[request.request_id] = stream
        try:
            await stream.open()
        except BaseException:
            self.streams.pop(request.request_id, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.abort()
