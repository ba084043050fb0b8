"""Tenants and their API tokens.

A token is ``kvs-`` + ``secrets.token_urlsafe(32)`` (43 characters). It is shown once, at creation;
the database keeps only

* a salted scrypt hash (``scrypt$n$r$p$<salt>$<hash>``, per-token random salt; parameters are
  stored with the hash so they can change later), and
* a non-secret lookup prefix: the first 8 characters after ``kvs-``, unique and indexed,

so authentication is one indexed lookup plus one hash, compared with ``hmac.compare_digest``.

Successful authentications are cached in memory (LRU, default 30 s) keyed by the sha256 of the
token, so the hot path does not pay scrypt on every request. Revoking a token or a tenant
invalidates the cache at once in this process (another process sharing the database sees the
revocation after at most the cache TTL).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.store.database import Database

TOKEN_PREFIX = "kvs-"
LOOKUP_LEN = 8  # characters after "kvs-" stored in clear as the lookup key
TOKEN_SECRET_BYTES = 32
MAX_TOKEN_LEN = 256  # longer input is rejected before hashing
DEFAULT_SCRYPT_N = 2**14
SCRYPT_R = 8
SCRYPT_P = 1
SCRYPT_DKLEN = 32
DEFAULT_AUTH_CACHE_TTL_S = 30.0
DEFAULT_AUTH_CACHE_SIZE = 4096

TENANT_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_TOKEN_RE = re.compile(r"kvs-[A-Za-z0-9_-]{%d,%d}" % (LOOKUP_LEN + 8, MAX_TOKEN_LEN))


class TenantError(ValueError):
    pass


class InvalidTenantName(TenantError):
    pass


class TenantExistsError(TenantError):
    pass


class TenantNotFoundError(TenantError, LookupError):
    pass


class TenantRevokedError(TenantError):
    pass


@dataclass(frozen=True)
class Tenant:
    id: int
    name: str
    created_at: float
    revoked: bool = False
    admin: bool = False  # may read every tenant's usage and set budgets and limits (`tenants create --admin`)


@dataclass(frozen=True)
class TenantInfo:
    name: str
    created_at: float
    active_tokens: int
    revoked: bool


@dataclass(frozen=True)
class TokenInfo:
    prefix: str  # "kvs-XXXXXXXX": enough to identify (and revoke) a token, useless to authenticate
    created_at: float
    revoked: bool


@dataclass(frozen=True)
class MintedToken:
    """A fresh token and what the database stores for it (computing the hash is the slow part)."""

    token: str
    prefix: str
    hash: str


def validate_tenant_name(name: str) -> str:
    if not isinstance(name, str) or not TENANT_NAME_RE.fullmatch(name):
        raise InvalidTenantName(f"tenant name must match [A-Za-z0-9_.-]{{1,64}}, got {name!r}")
    return name


def _b64(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).decode().rstrip("=")


def _unb64(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


def _scrypt(secret: str, salt: bytes, n: int, r: int, p: int, dklen: int) -> bytes:
    return hashlib.scrypt(secret.encode(), salt=salt, n=n, r=r, p=p, dklen=dklen,
                          maxmem=max(64 << 20, 130 * r * n + (1 << 20)))


def hash_token(token: str, *, n: int = DEFAULT_SCRYPT_N) -> str:
    """``scrypt$n$r$p$salt$hash`` with a fresh 16-byte salt."""
    salt = secrets.token_bytes(16)
    dk = _scrypt(token, salt, n, SCRYPT_R, SCRYPT_P, SCRYPT_DKLEN)
    return f"scrypt${n}${SCRYPT_R}${SCRYPT_P}${_b64(salt)}${_b64(dk)}"


def verify_token_hash(token: str, encoded: str) -> bool:
    try:
        scheme, n, r, p, salt, want = encoded.split("$")
        if scheme != "scrypt":
            return False
        want_b = _unb64(want)
        got = _scrypt(token, _unb64(salt), int(n), int(r), int(p), len(want_b))
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got, want_b)


def token_lookup_prefix(token: str) -> str:
    return token[len(TOKEN_PREFIX):len(TOKEN_PREFIX) + LOOKUP_LEN]


def looks_like_token(token: object) -> bool:
    return isinstance(token, str) and _TOKEN_RE.fullmatch(token) is not None


def mint_token(*, n: int = DEFAULT_SCRYPT_N) -> MintedToken:
    token = TOKEN_PREFIX + secrets.token_urlsafe(TOKEN_SECRET_BYTES)
    return MintedToken(token=token, prefix=token_lookup_prefix(token), hash=hash_token(token, n=n))


class _AuthCache:
    """LRU of successful authentications with a TTL and a revocation generation.

    ``put`` is dropped if a revocation happened since the caller read the database
    (``generation`` captured before the lookup), so a lookup racing with a revoke cannot
    re-insert a revoked token.
    """

    def __init__(self, ttl_s: float, maxsize: int) -> None:
        self.ttl_s = ttl_s
        self.maxsize = maxsize
        self._entries: OrderedDict[bytes, tuple[float, Tenant, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.generation = 0

    def get(self, key: bytes, now: float) -> Tenant | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            expires, tenant, _ = entry
            if now >= expires:
                del self._entries[key]
                return None
            self._entries.move_to_end(key)
            return tenant

    def put(self, key: bytes, tenant: Tenant, token_id: int, generation: int, now: float) -> None:
        if self.ttl_s <= 0 or self.maxsize <= 0:
            return
        with self._lock:
            if generation != self.generation:
                return
            self._entries[key] = (now + self.ttl_s, tenant, token_id)
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)

    def invalidate(self, *, token_id: int | None = None, tenant_id: int | None = None) -> None:
        with self._lock:
            self.generation += 1
            for key in [k for k, (_, t, tid) in self._entries.items()
                        if (token_id is not None and tid == token_id) or (tenant_id is not None and t.id == tenant_id)]:
                del self._entries[key]

    def clear(self) -> None:
        with self._lock:
            self.generation += 1
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def _cache_key(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TenantRegistry:
    def __init__(self, db: "Database", *, scrypt_n: int = DEFAULT_SCRYPT_N,
                 cache_ttl_s: float = DEFAULT_AUTH_CACHE_TTL_S, cache_size: int = DEFAULT_AUTH_CACHE_SIZE) -> None:
        self.db = db
        self.scrypt_n = scrypt_n
        self.cache = _AuthCache(cache_ttl_s, cache_size)

    def mint(self) -> MintedToken:
        """A new token and its hash (slow: scrypt). Pass it to ``create_tenant``/``create_token``."""
        return mint_token(n=self.scrypt_n)

    # -- creation ---------------------------------------------------------------------------

    def _insert_token(self, conn, tenant_id: int, minted: MintedToken | None) -> str:
        for _ in range(5):
            m = minted or self.mint()
            try:
                conn.execute("SAVEPOINT insert_token")
                conn.execute("INSERT INTO api_tokens (tenant_id, prefix, hash, created_at) VALUES (?, ?, ?, ?)",
                             (tenant_id, m.prefix, m.hash, self.db.clock()))
                conn.execute("RELEASE SAVEPOINT insert_token")
                return m.token
            except self.db.integrity_errors:  # lookup-prefix collision (~2^-48): draw another token
                conn.execute("ROLLBACK TO SAVEPOINT insert_token")
                conn.execute("RELEASE SAVEPOINT insert_token")
                minted = None
        raise RuntimeError("could not allocate a unique token prefix")

    def create_tenant(self, name: str, minted: MintedToken | None = None, admin: bool = False) -> tuple[Tenant, str]:
        """Create a tenant and its first token; the raw token is returned here and never again."""
        validate_tenant_name(name)
        minted = minted or self.mint()  # hash outside the write transaction
        now = self.db.clock()
        with self.db.write() as conn:
            if conn.execute("SELECT 1 FROM tenants WHERE name = ?", (name,)).fetchone() is not None:
                raise TenantExistsError(f"tenant {name!r} already exists")
            (tenant_id,) = conn.execute("INSERT INTO tenants (name, created_at, is_admin) VALUES (?, ?, ?) RETURNING id",
                                        (name, now, int(admin))).fetchone()
            tenant = Tenant(id=tenant_id, name=name, created_at=now, admin=admin)
            token = self._insert_token(conn, tenant.id, minted)
        return tenant, token

    def create_token(self, tenant: str | Tenant, minted: MintedToken | None = None) -> str:
        """An additional token for an existing, active tenant."""
        name = tenant.name if isinstance(tenant, Tenant) else tenant
        minted = minted or self.mint()
        with self.db.write() as conn:
            row = conn.execute("SELECT id, revoked_at FROM tenants WHERE name = ?", (name,)).fetchone()
            if row is None:
                raise TenantNotFoundError(f"no tenant {name!r}")
            if row[1] is not None:
                raise TenantRevokedError(f"tenant {name!r} is revoked")
            return self._insert_token(conn, row[0], minted)

    # -- authentication ---------------------------------------------------------------------

    def cached(self, token: str) -> Tenant | None:
        """Cache-only lookup (a sha256 and a dict probe): safe to call on the event loop."""
        if not looks_like_token(token):
            return None
        return self.cache.get(_cache_key(token), self.db.clock())

    def authenticate(self, token: str) -> Tenant | None:
        """The token's tenant, or None (unknown, malformed, revoked token or revoked tenant)."""
        if not looks_like_token(token):
            return None
        key = _cache_key(token)
        hit = self.cache.get(key, self.db.clock())
        if hit is not None:
            return hit
        generation = self.cache.generation  # before the read: see _AuthCache
        row = self.db.conn().execute(
            "SELECT t.id, t.name, t.created_at, k.id, k.hash, t.is_admin FROM api_tokens k JOIN tenants t"
            " ON t.id = k.tenant_id WHERE k.prefix = ? AND k.revoked_at IS NULL AND t.revoked_at IS NULL",
            (token_lookup_prefix(token),)).fetchone()
        if row is None or not verify_token_hash(token, row[4]):
            return None
        tenant = Tenant(id=row[0], name=row[1], created_at=row[2], admin=bool(row[5]))
        self.cache.put(key, tenant, row[3], generation, self.db.clock())
        return tenant

    # -- revocation -------------------------------------------------------------------------

    def revoke_token(self, token_or_prefix: str) -> bool:
        """Revoke by full token (verified against its hash) or by prefix (``kvs-XXXXXXXX`` or ``XXXXXXXX``).

        Returns False if no active token matched. Takes effect immediately in this process.
        """
        s = token_or_prefix
        full = looks_like_token(s)
        if full:
            prefix = token_lookup_prefix(s)
        else:
            prefix = s[len(TOKEN_PREFIX):] if s.startswith(TOKEN_PREFIX) else s
            if len(prefix) != LOOKUP_LEN:
                return False
        row = self.db.conn().execute("SELECT id, hash FROM api_tokens WHERE prefix = ? AND revoked_at IS NULL",
                                     (prefix,)).fetchone()
        if row is None or (full and not verify_token_hash(s, row[1])):  # hash outside the write lock
            return False
        with self.db.write() as conn:
            changed = conn.execute("UPDATE api_tokens SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                                   (self.db.clock(), row[0])).rowcount
        self.cache.invalidate(token_id=row[0])
        return changed == 1

    def revoke_tenant(self, name: str) -> bool:
        """Revoke a tenant and all its tokens. False if unknown or already revoked."""
        now = self.db.clock()
        with self.db.write() as conn:
            row = conn.execute("SELECT id FROM tenants WHERE name = ? AND revoked_at IS NULL", (name,)).fetchone()
            if row is None:
                return False
            conn.execute("UPDATE tenants SET revoked_at = ? WHERE id = ?", (now, row[0]))
            conn.execute("UPDATE api_tokens SET revoked_at = ? WHERE tenant_id = ? AND revoked_at IS NULL",
                         (now, row[0]))
        self.cache.invalidate(tenant_id=row[0])
        return True

    # -- listing ----------------------------------------------------------------------------

    def get_tenant(self, name: str) -> Tenant | None:
        row = self.db.conn().execute("SELECT id, name, created_at, revoked_at, is_admin FROM tenants WHERE name = ?",
                                     (name,)).fetchone()
        return None if row is None else Tenant(id=row[0], name=row[1], created_at=row[2], revoked=row[3] is not None,
                                               admin=bool(row[4]))

    def list_tenants(self) -> list[TenantInfo]:
        rows = self.db.conn().execute(
            "SELECT t.name, t.created_at, t.revoked_at,"
            " (SELECT COUNT(*) FROM api_tokens k WHERE k.tenant_id = t.id AND k.revoked_at IS NULL)"
            " FROM tenants t ORDER BY t.name").fetchall()
        return [TenantInfo(name=r[0], created_at=r[1], active_tokens=r[3], revoked=r[2] is not None) for r in rows]

    def list_tokens(self, tenant: str | Tenant) -> list[TokenInfo]:
        name = tenant.name if isinstance(tenant, Tenant) else tenant
        with self.db.read() as conn:
            row = conn.execute("SELECT id FROM tenants WHERE name = ?", (name,)).fetchone()
            if row is None:
                raise TenantNotFoundError(f"no tenant {name!r}")
            rows = conn.execute("SELECT prefix, created_at, revoked_at FROM api_tokens WHERE tenant_id = ?"
                                " ORDER BY created_at, id", (row[0],)).fetchall()
        return [TokenInfo(prefix=TOKEN_PREFIX + r[0], created_at=r[1], revoked=r[2] is not None) for r in rows]
