"""The fleet record: which replica pool serves each model now, and the config last applied.

One detached Ray actor per fleet (named RECORD_NAME in the fleet's namespace) holds it; `kvserve fleet
apply` writes it once a new pool is up, gateways read it (PoolDirectory, every second) and move new
requests to the new pool. Keeping it in the cluster, not in a file, lets every gateway on every node see
the same record, and a refused apply leave the running fleet exactly as it was.
"""
from __future__ import annotations

import ray

RECORD_NAME = "kvserve-fleet"
ENGINE_DEPLOYMENT = "engine"  # the deployment's name inside each pool's Serve application


@ray.remote(num_cpus=0)
class FleetRecord:
    def __init__(self):
        self.config_text: str | None = None
        self.pools: dict[str, dict] = {}  # model id -> {"app", "source", "version"}

    def get(self) -> tuple[str | None, dict[str, dict]]:
        return self.config_text, self.pools

    def set(self, config_text: str, pools: dict[str, dict]) -> None:
        self.config_text, self.pools = config_text, pools


def record(namespace: str, create: bool = False):
    """The fleet's record actor (created, detached, when `create` and none exists yet)."""
    if create:
        return FleetRecord.options(name=RECORD_NAME, namespace=namespace, lifetime="detached",
                                   get_if_exists=True).remote()
    return ray.get_actor(RECORD_NAME, namespace=namespace)


class PoolDirectory:
    """A gateway's view of the record, and handles to the pools it names."""

    def __init__(self, namespace: str):
        self.namespace = namespace
        self._handles: dict[str, object] = {}

    async def pools(self) -> dict[str, dict]:
        _, pools = await record(self.namespace).get.remote()
        return pools

    def handle(self, app: str):
        from ray import serve

        if app not in self._handles:
            self._handles[app] = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=app)
        return self._handles[app]
