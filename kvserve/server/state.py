"""Server state: one `ModelHandle` (an AsyncLLM in its own thread) per configured model, the store,
metrics, idempotency, and the draining flag. Everything the routes need hangs off `ServerState`.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from kvserve.config import TIER_NAMES, EngineConfig, ServedModel, ServerConfig
from kvserve.engine.async_engine import AsyncLLM, EngineStatus
from kvserve.engine.errors import ModelNotFound, ModelWarming, ServerDraining
from kvserve.engine.outputs import RequestOutput
from kvserve.server.errors import APIError
from kvserve.server.idempotency import IdempotencyManager
from kvserve.server.metrics import LiveModelStats, ServerMetrics
from kvserve.server.router import AUTO_MODEL, AutoPolicy, LoadLevel, ModelView, choose_auto_model, load_level
from kvserve.store import AsyncStore, UsageRecord, default_db_path, kvserve_home

log = logging.getLogger(__name__)


@dataclass
class RequestInfo:
    """What the engine-thread hooks need to account for one engine request."""

    tenant: str
    tier: str
    model: str


def _status_of(finish_reason: str | None) -> str:
    return {"stop": "ok", "length": "ok", "abort": "aborted", "queue_timeout": "timeout"}.get(finish_reason or "",
                                                                                            "error")


class ModelHandle:
    """One served model: its AsyncLLM and the live numbers the routes and metrics read."""

    def __init__(self, spec: ServedModel, state: "ServerState"):
        self.spec = spec
        self.id = spec.id
        self.role = spec.role
        self.state = state
        self.engine_config: EngineConfig = spec.engine_config()
        self.created = int(time.time())
        self.requests: dict[str, RequestInfo] = {}  # engine request id -> info (event loop adds, engine thread pops)
        self._lock = threading.Lock()
        source, install = spec.source, spec.engine_args.get("install", "")

        def factory(cfg: EngineConfig):
            from kvserve.engine.llm_engine import LLMEngine
            from kvserve.models.catalog import resolve_source

            path = resolve_source(source, install)  # may assemble a packaged model: do it in the engine thread
            return LLMEngine(replace(cfg, model=str(path)), model_id=spec.id)

        self.llm = AsyncLLM(self.engine_config, model_id=spec.id, on_step=self._on_step, on_finish=self._on_finish,
                            engine_factory=factory)

    # ---- engine-thread hooks (thread-safe work only) -----------------------------------------
    def _on_step(self, llm: AsyncLLM, step) -> None:
        self.state.metrics.observe_step(self.id, step)

    def _on_finish(self, out: RequestOutput) -> None:
        with self._lock:
            info = self.requests.pop(out.request_id, None)
        if info is None:
            return
        self.state.metrics.observe_finished(self.id, info.tier, out)
        self.state.record_usage_threadsafe(self._usage_record(info, out))

    def _usage_record(self, info: RequestInfo, out: RequestOutput) -> UsageRecord:
        m = out.metrics

        def ms(v):
            return None if v is None else round(v * 1000, 3)

        reason = next((o.finish_reason for o in out.outputs if o.finish_reason == "abort"), None) or (
            out.outputs[0].finish_reason if out.outputs else None)
        return UsageRecord(request_id=out.request_id, tenant=info.tenant, model=self.id, tier=info.tier,
                           prompt_tokens=out.num_prompt_tokens,
                           cached_prompt_tokens=min(out.num_cached_tokens, out.num_prompt_tokens),
                           completion_tokens=out.num_completion_tokens,
                           queue_ms=ms(m.queue_time if m else None), ttft_ms=ms(m.ttft if m else None),
                           e2e_ms=ms(m.e2e if m else None), status=_status_of(reason), finish_reason=reason)

    def register(self, request_id: str, info: RequestInfo) -> None:
        with self._lock:
            self.requests[request_id] = info

    def unregister(self, request_id: str) -> None:
        with self._lock:
            self.requests.pop(request_id, None)

    # ---- live state --------------------------------------------------------------------------
    @property
    def status(self) -> EngineStatus:
        return self.llm.status

    @property
    def engine(self):
        return self.llm.engine

    @property
    def max_model_len(self) -> int:
        engine = self.engine
        return engine.max_model_len if engine is not None else self.engine_config.scheduler.max_model_len

    def queue_bound(self, tier: str) -> int:
        return getattr(self.engine_config.scheduler, tier).max_waiting

    def waiting_by_tier(self) -> dict[str, int]:
        """Waiting requests per tier, from the engine thread's latest stats snapshot."""
        stats = self.llm.stats
        counts = {t: 0 for t in TIER_NAMES}
        if stats is not None:
            counts.update({p.name.lower(): n for p, n in stats.waiting.items()})
        return counts

    def queue_depth(self, tier: str) -> int:
        return self.waiting_by_tier().get(tier, 0)

    def live_stats(self) -> LiveModelStats:
        stats = self.llm.stats
        waiting = self.waiting_by_tier()
        if stats is None:
            return LiveModelStats(self.id, 0, waiting, 0.0, 0, 0)
        return LiveModelStats(self.id, stats.running, waiting, stats.kv.device_usage, stats.prefix_query_tokens,
                              stats.prefix_hit_tokens, {p.name.lower(): t for p, t in stats.ttft_s.items()})

    def load(self, tier: str) -> LoadLevel:
        cfg = self.state.config
        return load_level(self.queue_depth(tier), self.queue_bound(tier),
                          self.state.metrics.window.ttft_p50_ms(self.id, tier), cfg.ttft_target_ms.get(tier),
                          cfg.load_high_fraction, cfg.load_shedding_fraction)

    def load_headers(self, tier: str, queue_wait_ms: float | None = None,
                     load: LoadLevel | None = None) -> dict[str, str]:
        """The load headers of a completion response (on errors: the recent median queue wait)."""
        if queue_wait_ms is None:
            queue_wait_ms = self.state.metrics.window.queue_p50_ms(self.id, tier) or 0.0
        return {"x-kvserve-queue-depth": str(self.queue_depth(tier)),
                "x-kvserve-queue-wait-ms": str(int(round(queue_wait_ms))),
                "x-kvserve-load": (load or self.load(tier)).value,
                "x-kvserve-model": self.id}

    def check_available(self) -> None:
        """Raise the typed error for a model that cannot take a request now."""
        status = self.status
        if status == EngineStatus.READY:
            return
        if status == EngineStatus.WARMING:
            raise ModelWarming(f"model {self.id} is still loading; retry shortly")
        if status in (EngineStatus.DRAINING, EngineStatus.STOPPED):
            raise ServerDraining(f"model {self.id} is draining for shutdown")
        raise APIError(503, f"model {self.id} failed: {self.llm.error}", "model_unavailable", "model_failed",
                       headers={"Retry-After": "30"})


class ServerState:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.metrics = ServerMetrics(config.metrics_window_s, live=self._live_stats)
        self.models: dict[str, ModelHandle] = {m.id: ModelHandle(m, self) for m in config.models}
        self.store: AsyncStore | None = None
        self.idempotency: IdempotencyManager | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        self.active_requests = 0  # completion requests whose response is not fully sent
        self._tasks: set[asyncio.Task] = set()
        self._ledger_tasks: set[asyncio.Task] = set()
        self.started_at = time.time()
        self.drain_done: asyncio.Event | None = None

    def _live_stats(self):
        return [h.live_stats() for h in self.models.values()]

    # ---- lifecycle ---------------------------------------------------------------------------
    @property
    def db_path(self) -> Path:
        if self.config.db_path:
            return Path(self.config.db_path)
        if self.config.home:
            return Path(self.config.home) / "kvserve.db"
        return default_db_path()

    @property
    def home(self) -> Path:
        return Path(self.config.home) if self.config.home else kvserve_home()

    async def startup(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.drain_done = asyncio.Event()
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self.store = await AsyncStore.aopen(self.db_path, auth_cache_ttl_s=self.config.auth_cache_ttl_s)
        released = await self.store.areset_in_progress()  # this process is the only server on its data dir
        if released:
            log.info("released %d idempotency keys left in progress by a previous run", released)
        self.idempotency = IdempotencyManager(self.store, self.spawn)
        for handle in self.models.values():
            handle.llm.start()  # loads in its own thread; the server listens meanwhile
            log.info("loading model %s (%s) in the background", handle.id, handle.spec.source)

    async def shutdown(self) -> None:
        if not self.draining:
            await self.drain(self.config.shutdown_timeout_s)
        await asyncio.gather(*(asyncio.to_thread(h.llm.stop, 10.0) for h in self.models.values()))
        await self.flush()
        if self.store is not None:
            await self.store.aclose()

    async def drain(self, timeout: float) -> None:
        """Stop admitting (503 server_draining), let running requests finish for `timeout` s, abort the rest."""
        self.draining = True
        for h in self.models.values():
            h.llm.drain()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.active_requests == 0 and all(h.llm.num_inflight == 0 for h in self.models.values()):
                break
            await asyncio.sleep(0.05)
        else:
            for h in self.models.values():
                with h._lock:
                    rids = list(h.requests)
                for rid in rids:
                    h.llm.abort(rid)
                if rids:
                    log.warning("shutdown grace period over: aborted %d requests on %s", len(rids), h.id)
            # let the aborted streams send their last events
            end = time.monotonic() + 2.0
            while self.active_requests and time.monotonic() < end:
                await asyncio.sleep(0.05)
        if self.drain_done is not None:
            self.drain_done.set()

    # ---- background work ---------------------------------------------------------------------
    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._ledger_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    def record_usage_threadsafe(self, record: UsageRecord) -> None:
        """From an engine thread: queue the ledger write on the event loop (AsyncStore's writer thread)."""
        loop = self.loop
        if loop is None or loop.is_closed() or self.store is None:
            return

        def schedule():
            self._ledger_tasks.add(self.spawn(self.store.arecord_usage(record)))

        try:
            loop.call_soon_threadsafe(schedule)
        except RuntimeError:  # loop closed during shutdown
            log.warning("usage record for %s dropped: event loop closed", record.request_id)

    async def flush_ledger(self) -> None:
        """Wait for the ledger writes queued so far (read-your-writes for /v1/usage)."""
        await asyncio.sleep(0)  # let call_soon_threadsafe callbacks already queued run
        if self._ledger_tasks:
            await asyncio.gather(*list(self._ledger_tasks), return_exceptions=True)

    async def flush(self) -> None:
        await asyncio.sleep(0)
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # ---- routing -----------------------------------------------------------------------------
    def resolve(self, model: str, tier: str, prompt_chars: int) -> ModelHandle:
        """The handle serving `model` (or the auto policy's choice); ModelNotFound for unknown ids."""
        if model == AUTO_MODEL:
            views = [ModelView(h.id, h.role, h.status == EngineStatus.READY, h.queue_depth(tier))
                     for h in self.models.values()]
            a = self.config.auto
            chosen = choose_auto_model(views, tier, prompt_chars, AutoPolicy(a.short_prompt_chars,
                                                                             a.capable_max_queue_depth))
            if chosen is None:
                raise ModelNotFound("no models are configured")
            return self.models[chosen]
        handle = self.models.get(model)
        if handle is None:
            known = ", ".join(sorted(self.models)) or "(none)"
            raise ModelNotFound(f"The model {model!r} does not exist. Available: {known}, or 'auto'.")
        return handle
