"""Server state: the completion service (the models, their metrics and usage ledger), the store,
idempotency, and the draining flag. Everything the routes need hangs off `ServerState`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from kvserve.batch.files import FileStore
from kvserve.batch.jobs import BatchStore
from kvserve.batch.runner import BatchRunner
from kvserve.config import ServerConfig, kvserve_home
from kvserve.server.background import renew_leases, stop_task
from kvserve.server.idempotency import IdempotencyManager
from kvserve.server.in_flight import InFlight
from kvserve.server.regions import RegionFront
from kvserve.service.completion import CompletionService
from kvserve.service.metrics import ServerMetrics
from kvserve.service.models import ModelHandle
from kvserve.store import AsyncStore, store_location

log = logging.getLogger(__name__)


class ServerState:
    def __init__(self, config: ServerConfig, service: CompletionService | None = None, shared_store: bool = False,
                 ready_models: bool = False):
        self.config = config
        self.shared_store = shared_store
        self.ready_models = ready_models
        self.service = service or CompletionService(config)
        self.store: AsyncStore | None = None
        self.idempotency: IdempotencyManager | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.in_flight = InFlight()  # completion responses not fully sent (a drain waits for them)
        self._tasks: set[asyncio.Task] = set()
        self.started_at = time.time()
        self.drain_done: asyncio.Event | None = None
        self.batch_files: FileStore | None = None
        self.batch_jobs: BatchStore | None = None
        self.batch_runner: BatchRunner | None = None
        self._sampler: asyncio.Task | None = None
        self._hold_renewer: asyncio.Task | None = None
        self.regions: RegionFront | None = None
        if config.regions.enabled:
            self.regions = RegionFront(config.regions, self.service.models, lambda: self.draining, self.in_flight)

    @property
    def models(self) -> dict[str, ModelHandle]:
        return self.service.models

    @property
    def metrics(self) -> ServerMetrics:
        return self.service.metrics

    @property
    def draining(self) -> bool:
        return self.service.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.service.draining = value

    # ---- lifecycle ---------------------------------------------------------------------------
    @property
    def db_path(self) -> Path | str:
        """The SQLite file, or a postgresql:// URL (a store shared by gateways on several machines)."""
        return store_location(self.config.db_path, self.config.home)

    @property
    def home(self) -> Path:
        return kvserve_home(self.config.home)

    async def startup(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.drain_done = asyncio.Event()
        if isinstance(self.db_path, Path):
            self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self.store = await AsyncStore.aopen(self.db_path, auth_cache_ttl_s=self.config.auth_cache_ttl_s)
        # The only server on its data dir releases what a previous run left in progress; fleet gateways share it.
        released = 0 if self.shared_store else await self.store.areset_in_progress()
        if released:
            log.info("released %d idempotency keys left in progress by a previous run", released)
        # ... and the budget holds of its requests in flight (no usage row will ever settle them)
        holds = 0 if self.shared_store else await self.store.arelease_all_holds()
        if holds:
            log.info("released %d budget holds left by a previous run's requests in flight", holds)
        self.idempotency = IdempotencyManager(self.store, self.spawn)
        self.idempotency.start()
        self.service.ledger.open(self.store, self.loop)
        gate = self.service.metering
        gate.open(self.store)
        self._hold_renewer = self.loop.create_task(renew_leases(
            self.store.store.holds.hold_lease_s, gate.held, gate.renew, "budget holds in flight"))
        b = self.config.batch
        self.batch_files = FileStore(self.store.store.db, self.home / "files", b.max_file_lines, b.max_file_bytes)
        self.batch_jobs = BatchStore(self.store.store.db)
        self.batch_runner = BatchRunner(self.service, self.store, self.batch_files, self.batch_jobs, b)
        self.batch_runner.start()
        self._sampler = self.loop.create_task(self._sample_load())
        if self.regions is not None:
            await self.regions.start(self.store)
            if self.regions.budgets is not None:  # budgets shared by the regions: the gate asks for leases
                self.service.metering.share = self.regions.budgets
        for handle in self.models.values():
            if handle.on_demand:  # loaded by its first request (service/residency.py)
                continue
            handle.start()  # loads in its own thread; the server listens meanwhile
            log.info("loading model %s (%s) in the background", handle.id, handle.spec.source)
        if self.ready_models:
            from kvserve.engine.client import EngineStatus

            deadline = time.monotonic() + self.config.fleet.route_timeout_s
            while time.monotonic() < deadline and any(h.status == EngineStatus.WARMING
                                                      for h in self.models.values()):
                await asyncio.sleep(0.1)

    async def shutdown(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
        if self.batch_runner is not None:  # its lines in flight go back to pending, for the next start
            await self.batch_runner.stop()
        if not self.draining:
            await self.drain(self.config.shutdown_timeout_s)
        if self.regions is not None:  # after the drain: requests that came meanwhile went to peers
            await self.regions.stop()
        await asyncio.gather(*(asyncio.to_thread(h.client.stop, 10.0) for h in self.models.values()))
        await self.flush()
        await self.service.ledger.flush()
        await stop_task(self._hold_renewer)  # after the ledger's last rows settled their holds
        if self.idempotency is not None:
            await self.idempotency.stop()
        if self.store is not None:
            await self.store.aclose()

    async def drain(self, timeout: float) -> None:
        """Stop admitting (503 server_draining), let running requests finish for `timeout` s, abort the rest."""
        self.draining = True
        for h in self.models.values():
            h.client.drain()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.in_flight.count == 0 and all(h.client.num_inflight == 0 for h in self.models.values()):
                break
            await asyncio.sleep(0.05)
        else:
            for h in self.models.values():
                rids = h.inflight_ids()
                for rid in rids:
                    h.client.abort(rid)
                if rids:
                    log.warning("shutdown grace period over: aborted %d requests on %s", len(rids), h.id)
            # let the aborted streams send their last events
            end = time.monotonic() + 2.0
            while self.in_flight.count and time.monotonic() < end:
                await asyncio.sleep(0.05)
        if self.drain_done is not None:
            self.drain_done.set()

    # ---- background work ---------------------------------------------------------------------
    async def _sample_load(self) -> None:
        """KV use and queues every load_sample_interval_s, into the metrics' load history (the dashboard's)."""
        while True:
            try:
                self.metrics.sample_load(time.time())
            except Exception:  # a model's stats mid-swap: skip this sample, keep sampling
                log.exception("load sample failed")
            await asyncio.sleep(self.config.load_sample_interval_s)

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    async def flush(self) -> None:
        await asyncio.sleep(0)
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
