"""Bearer-token authentication against the store, and the development tenant made on first start."""
from __future__ import annotations

import os
from pathlib import Path

from starlette.requests import Request

from kvserve.server.errors import APIError
from kvserve.store import AsyncStore, Store, Tenant

DEV_TENANT = "dev"
DEV_TOKEN_FILE = "dev-token"


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, "invalid_request_error", "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


async def authenticate(request: Request, store: AsyncStore) -> Tenant:
    """The tenant of the request's `Authorization: Bearer <token>`; 401 when missing, unknown or revoked."""
    header = request.headers.get("authorization")
    if not header:
        raise _unauthorized("Missing API key: send 'Authorization: Bearer <token>' "
                            "(create one with `kvserve tenants create NAME`).")
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise _unauthorized("Malformed Authorization header: expected 'Bearer <token>'.")
    tenant = await store.aauthenticate(token)
    if tenant is None:
        raise _unauthorized("Incorrect or revoked API key provided.")
    return tenant


def check_tenant_claim(tenant: Tenant, claimed: str | None) -> None:
    """`metadata.tenant_id`, when sent, must name the token's own tenant (403 otherwise)."""
    if claimed is not None and claimed != tenant.name:
        raise APIError(403, f"metadata.tenant_id {claimed!r} does not match the tenant of this API key",
                       "permission_error", "tenant_mismatch", param="metadata.tenant_id")


def ensure_dev_tenant(store: Store, home: Path) -> tuple[str | None, bool]:
    """(token, created): the development token to print at start-up.

    On a store with no tenants, create tenant "dev" and keep its token in <home>/dev-token (0600)
    so later starts can print it again. Returns (None, False) when tenants exist but no dev token
    file does (the operator manages tokens) or the dev tenant was revoked.
    """
    path = Path(home) / DEV_TOKEN_FILE
    if path.is_file():
        token = path.read_text().strip()
        if token and store.tenants.authenticate(token) is not None:
            return token, False
        return None, False
    if store.list_tenants():
        return None, False
    _, token = store.create_tenant(DEV_TENANT)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
    return token, True
