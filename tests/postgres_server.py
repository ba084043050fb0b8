"""A real PostgreSQL server for the store and metering tests: initdb in a temporary directory, `postgres`
listening on a Unix socket there only, a fresh database per test. Run as the `postgres` user when the tests
run as root (PostgreSQL refuses root). Debian's `postgresql` package provides the binaries (.ci/run)."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path


def binaries() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(versions[-1]).parent if versions else None


class PostgresServer:
    def __init__(self, bindir: Path):
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="kvserve-pg-"))
        self.data, self.sock = self.root / "data", self.root / "sock"
        self.sock.mkdir()
        self.user = "postgres" if os.geteuid() == 0 else None
        if self.user:
            shutil.chown(self.root, self.user)
            shutil.chown(self.sock, self.user)
        self.proc: subprocess.Popen | None = None

    def _cmd(self, *args: str) -> list[str]:
        return (["runuser", "-u", self.user, "--"] if self.user else []) + list(args)

    def start(self) -> "PostgresServer":
        subprocess.run(self._cmd(str(self.bindir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                                 "--no-sync"), check=True, capture_output=True)
        self.proc = subprocess.Popen(self._cmd(str(self.bindir / "postgres"), "-D", str(self.data), "-k", str(self.sock),
                                               "-c", "listen_addresses=", "-c", "fsync=off", "-c", "max_connections=200"),
                                     stdout=subprocess.DEVNULL, stderr=open(self.root / "server.log", "w"))
        import psycopg

        deadline = time.monotonic() + 30
        while True:
            try:
                psycopg.connect(self.url("postgres"), autocommit=True).close()
                return self
            except psycopg.OperationalError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("postgres did not start: " + (self.root / "server.log").read_text()[-2000:])
                time.sleep(0.2)

    def url(self, db: str) -> str:
        return f"postgresql://postgres@/{db}?host={self.sock}"

    def new_database(self) -> str:
        """A fresh, empty database's URL."""
        import psycopg

        name = "t" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(30)
        shutil.rmtree(self.root, ignore_errors=True)
