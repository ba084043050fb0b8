"""create_app(config): the FastAPI app. The lifespan opens the store and starts one engine thread per
model (models load in the background: the server answers at once, 503 model_warming until ready).
"""
from __future__ import annotations

import asyncio
import logging
import signal
from contextlib import asynccontextmanager

from fastapi import FastAPI

from kvserve.config import ServerConfig
from kvserve.server import openapi
from kvserve.server.errors import install_exception_handlers
from kvserve.server.routes import admin, batches, dashboard, ops, v1
from kvserve.server.state import ServerState
from kvserve.service.completion import CompletionService
from kvserve.service.models import ClientFactory

log = logging.getLogger(__name__)


def create_app(config: ServerConfig | None = None, client_factory: ClientFactory | None = None,
               shared_store: bool = False, ready_models: bool = False) -> FastAPI:
    """`client_factory`: how each model's EngineClient is made (default: an engine in this process; the
    fleet's gateway passes one that reaches a replica pool). `shared_store`: other servers use the same
    store (fleet gateways), so nothing left in progress is this process's alone to release. `ready_models`:
    start-up waits (at most the fleet's route timeout) until every model's client is ready."""
    config = config or ServerConfig.from_toml()
    service = CompletionService(config, client_factory) if client_factory is not None else None
    state = ServerState(config, service, shared_store=shared_store, ready_models=ready_models)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.startup()
        try:
            yield
        finally:
            await state.shutdown()

    app = FastAPI(title="kvserve", version="0.1.0", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.kv = state
    install_exception_handlers(app)
    app.include_router(v1.router)
    app.include_router(ops.router)
    app.include_router(admin.router)
    app.include_router(batches.router)
    dashboard.mount(app)
    openapi.install(app)
    return app


def make_server(app: FastAPI, host: str, port: int, log_level: str = "info"):
    """A uvicorn Server whose first SIGTERM/SIGINT drains instead of closing the listening socket.

    Draining: new requests get 503 server_draining while running ones finish (at most
    shutdown_timeout_s), then uvicorn shuts down (lifespan stops the engines, closes the store).
    A second signal exits at once.
    """
    import uvicorn

    state: ServerState = app.state.kv

    class DrainingServer(uvicorn.Server):
        _drain_task: asyncio.Task | None = None

        def handle_exit(self, sig, frame) -> None:
            loop = state.loop
            if self._drain_task is None and sig in (signal.SIGTERM, signal.SIGINT) and loop is not None \
                    and not self.should_exit:
                log.info("received %s: draining (grace %.0fs); send it again to exit now",
                         signal.Signals(sig).name, state.config.shutdown_timeout_s)

                async def drain_then_exit():
                    await state.drain(state.config.shutdown_timeout_s)
                    self.should_exit = True

                self._drain_task = True  # type: ignore[assignment]
                loop.call_soon_threadsafe(lambda: setattr(self, "_drain_task", loop.create_task(drain_then_exit())))
                return
            super().handle_exit(sig, frame)

    # Keep-alive past clients' idle expiry (httpx, under the openai client: 5 s, uvicorn's own default): the
    # client closes an idle connection first, so it never sends a request on one the server is closing.
    cfg = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                         timeout_keep_alive=75, access_log=log_level == "debug")
    return DrainingServer(cfg)
