"""The gateway: kvserve's HTTP API (auth, idempotency, admission, tokenizing, metrics, usage) as a Ray
Serve ingress deployment, with each model's EngineClient a FleetClient over that model's replica pool.

It is the same FastAPI app as the single-process server (server/app.py); only the client factory differs.
Gateways keep no state of their own: tenants, idempotency keys and usage live in the shared store, the
current pools in the fleet record, so any number of them can run behind Serve's HTTP proxy.
"""
from __future__ import annotations

from ray import serve

from kvserve.config import ServerConfig
from kvserve.fleet.client import FleetClient
from kvserve.fleet.metrics import install as install_fleet_metrics
from kvserve.fleet.record import PoolDirectory


@serve.ingress()
class Gateway:
    def __init__(self, config: ServerConfig):
        self.config = config

    def __serve_build_asgi_app__(self):
        from kvserve.server.app import create_app

        directory = PoolDirectory(self.config.fleet.ray_namespace)
        fleet = self.config.fleet

        def client_factory(spec, engine_config, on_step, on_finish):
            return FleetClient(spec, engine_config, on_step, on_finish, directory, fleet)

        # ready_models: a new gateway (a rolling update of the gateways) takes traffic only once it knows
        # every model's pool, instead of answering 503 model_warming meanwhile
        app = create_app(self.config, client_factory=client_factory, shared_store=True, ready_models=True)
        install_fleet_metrics(app.state.kv)
        return app

