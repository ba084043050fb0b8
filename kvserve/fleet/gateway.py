"""The gateway: kvserve's HTTP API (auth, idempotency, admission, tokenizing, metrics, usage) as a Ray
Serve ingress deployment, with each model's EngineClient a FleetClient over that model's replica pool.

It is the same FastAPI app as the single-process server (server/app.py); only the client factory differs.
Gateways keep no state of their own: tenants, idempotency keys and usage live in the shared store, the
current pools in the fleet record, so any number of them can run behind Serve's HTTP proxy.

While a fleet starts, a *warming* gateway answers first: Serve's proxy listens from the start and, with no
application yet, would answer 404 (not in OpenAI's error schema) to every client and probe for as long as the
pools take to load; the warming gateway answers 503 `warming` with Retry-After instead, and the real gateway
replaces it (the same deployment, updated) once the pools are up.
"""
from __future__ import annotations

from ray import serve

from kvserve.config import ServerConfig
from kvserve.fleet.client import FleetClient
from kvserve.fleet.metrics import install as install_fleet_metrics
from kvserve.fleet.record import PoolDirectory


WARMING_RETRY_AFTER_S = 5


@serve.ingress()
class Gateway:
    def __init__(self, config: ServerConfig, warming: bool = False):
        self.config, self.warming = config, warming

    def __serve_build_asgi_app__(self):
        from kvserve.server.app import create_app

        if self.warming:
            return warming_app()

        directory = PoolDirectory(self.config.fleet.ray_namespace)
        fleet = self.config.fleet

        def client_factory(spec, engine_config, on_step, on_finish):
            return FleetClient(spec, engine_config, on_step, on_finish, directory, fleet)

        # ready_models: a new gateway (a rolling update of the gateways) takes traffic only once it knows
        # every model's pool, instead of answering 503 model_warming meanwhile
        app = create_app(self.config, client_factory=client_factory, shared_store=True, ready_models=True)
        install_fleet_metrics(app.state.kv)
        return app



def warming_app():
    """Every path: 503 `warming`, in OpenAI's error schema, with Retry-After (a client's retry, a peer region's
    probe and a load balancer's health check all read it as "not yet")."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def warming(path: str):
        return JSONResponse({"error": {"message": "this fleet is starting: its models' pools are not up yet",
                                       "type": "service_unavailable", "param": None, "code": "warming"}},
                            status_code=503, headers={"retry-after": str(WARMING_RETRY_AFTER_S)})

    return app
