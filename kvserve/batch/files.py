"""Uploaded and produced files: the bytes under <home>/files/<id>, the record in the store's `files`
table, each visible to its tenant only. Batch input files are checked against the limits on upload."""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.engine.errors import InvalidRequest

if TYPE_CHECKING:
    from kvserve.store.database import Database

@dataclass(frozen=True)
class FileObject:
    id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    created_at: float

    def to_json(self) -> dict:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": int(self.created_at),
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


class FileStore:
    def __init__(self, db: "Database", root: Path, max_lines: int = 50_000, max_bytes: int = 200 * 1024 * 1024):
        self.db, self.root = db, Path(root)
        self.max_lines, self.max_bytes = max_lines, max_bytes
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def path(self, file_id: str) -> Path:
        return self.root / file_id

    def upload(self, tenant: str, filename: str, purpose: str, data: bytes) -> FileObject:
        """A client's file: a batch input, within the limits."""
        if purpose != "batch":
            raise InvalidRequest(f"purpose must be 'batch', got {purpose!r}", param="purpose")
        if len(data) > self.max_bytes:
            raise InvalidRequest(f"the file has more than {self.max_bytes} bytes (the limit)", param="file")
        lines = sum(1 for line in data.splitlines() if line.strip())
        if lines == 0:
            raise InvalidRequest("the file has no lines", param="file")
        if lines > self.max_lines:
            raise InvalidRequest(f"the file has {lines} lines; the limit is {self.max_lines}", param="file")
        return self._create(tenant, filename, purpose, data)

    def output(self, tenant: str, filename: str, data: bytes) -> FileObject:
        """A batch's output or error file."""
        return self._create(tenant, filename, "batch_output", data)

    def _create(self, tenant: str, filename: str, purpose: str, data: bytes) -> FileObject:
        file_id = "file-" + secrets.token_hex(12)
        tmp = self.path(file_id + ".part")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path(file_id))  # the record below never names a file that is not whole
        obj = FileObject(file_id, tenant, purpose, filename, len(data), self.db.clock())
        with self.db.write() as conn:
            conn.execute("INSERT INTO files (id, tenant, purpose, filename, bytes, created_at) VALUES (?, ?, ?, ?, ?, ?)",
                         (obj.id, tenant, purpose, filename, obj.bytes, obj.created_at))
        return obj

    def get(self, tenant: str, file_id: str) -> FileObject | None:
        with self.db.read() as conn:
            row = conn.execute("SELECT id, tenant, purpose, filename, bytes, created_at FROM files WHERE id = ?"
                               " AND tenant = ? AND deleted_at IS NULL", (file_id, tenant)).fetchone()
        return FileObject(*row) if row else None

    def list(self, tenant: str, purpose: str | None = None, limit: int = 10_000) -> list[FileObject]:
        sql = "SELECT id, tenant, purpose, filename, bytes, created_at FROM files WHERE tenant = ? AND deleted_at IS NULL"
        params: list = [tenant]
        if purpose:
            sql += " AND purpose = ?"
            params.append(purpose)
        with self.db.read() as conn:
            rows = conn.execute(sql + " ORDER BY created_at DESC LIMIT ?", (*params, limit)).fetchall()
        return [FileObject(*r) for r in rows]

    def read(self, tenant: str, file_id: str) -> bytes | None:
        return self.path(file_id).read_bytes() if self.get(tenant, file_id) else None

    def delete(self, tenant: str, file_id: str) -> bool:
        with self.db.write() as conn:
            gone = conn.execute("UPDATE files SET deleted_at = ? WHERE id = ? AND tenant = ? AND deleted_at IS NULL",
                                (self.db.clock(), file_id, tenant)).rowcount == 1
        if gone:
            self.path(file_id).unlink(missing_ok=True)
        return gone
