"""A real kvserve server in a subprocess (`python -m kvserve.cli serve`), for integration and reliability
tests: its own home (SQLite store, files), a models TOML written from the test's text, a tenant made
before start, and stop by signal. Restartable on the same home and port (kill and restart tests).
`LiveFleet` is the same for `kvserve serve --fleet` and the local Ray cluster it starts."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model_toml(model: Path, model_id: str = "tiny", max_model_len: int = 256, blocks: int = 128,
                    extra: str = "") -> str:
    """One `[[models]]` table for a GGUF file at float32 (the tiny random model's tests)."""
    return (f'[[models]]\nid = "{model_id}"\nsource = "{model}"\ndtype = "float32"\n'
            f"max_model_len = {max_model_len}\nnum_gpu_blocks_override = {blocks}\n{extra}")


class LiveServer:
    start_timeout_s = 180.0
    new_session = False  # its own session: every process it starts can be killed with it

    def __init__(self, home: Path, models_toml: str, server_toml: str = "", tenant: str = "acme",
                 env: dict[str, str] | None = None, port: int | None = None, minted=None, admin_minted=None,
                 args: tuple[str, ...] = ()):
        """`port`: the port to listen on (default: a free one); `minted`: the tenant's token (a MintedToken,
        store/tenants.py), to give one tenant the same token on several servers; `admin_minted`: the same for
        an admin tenant "ops" (`admin_token`); `args`: more `kvserve serve` arguments (`--region NAME`)."""
        self.home, self.port, self.args = Path(home), port or free_port(), args
        self.base = f"http://127.0.0.1:{self.port}"
        self.config = self.home / "models.toml"
        self.config.write_text(f'[server]\nhome = "{self.home}"\nport = {self.port}\n{server_toml}\n'
                               f"{self.extra_toml}{models_toml}")
        self.env = {**os.environ, "KVSERVE_HOME": str(self.home), **(env or {})}
        from kvserve.store import Store

        with Store(self.home / "kvserve.db") as store:
            self.token = (store.tenants.create_tenant(tenant, minted) if minted else store.create_tenant(tenant))[1]
            self.admin_token = store.tenants.create_tenant("ops", admin_minted, admin=True)[1] if admin_minted else None
        self.proc: subprocess.Popen | None = None
        self.log_path = self.home / "server.log"

    extra_toml = ""
    serve_args: tuple[str, ...] = ()

    def start(self, timeout: float | None = None, ready_path: str = "/ready") -> "LiveServer":
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", *self.serve_args, "--port",
                                      str(self.port), "--config", str(self.config), *self.args], env=self.env,
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=self.new_session)
        deadline = time.monotonic() + (timeout or self.start_timeout_s)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(self.base + ready_path, timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.kill()
        raise AssertionError(f"server did not become ready:\n{self.log_text()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def headers(self, token: str | None = None, **extra: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token or self.token}", **extra}

    def openai(self, token: str | None = None, timeout: float = 60):
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key=token or self.token, max_retries=0, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """The Prometheus exposition's samples summed by name (all models), e.g. kvserve:kv_cache_usage_perc."""
        out: dict[str, float] = {}
        for line in httpx.get(self.base + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def store(self):
        from kvserve.store import Store

        return Store(self.home / "kvserve.db")

    def usage_rows(self, prefix: str = "") -> list[dict]:
        """Usage ledger rows whose request id starts with `prefix`."""
        with self.store() as store:
            cur = store.db.conn().execute("SELECT request_id, completion_tokens, tier, price FROM usage_records"
                                          " WHERE request_id LIKE ?", (prefix + "%",))
            return [dict(zip(("request_id", "completion_tokens", "tier", "price"), r)) for r in cur.fetchall()]


def start_all(servers: list["LiveServer"], **kwargs) -> None:
    """Start servers side by side (each loads its model meanwhile); a server that fails to start fails the caller."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(servers)) as pool:
        for f in [pool.submit(s.start, **kwargs) for s in servers]:
            f.result()


class LiveFleet(LiveServer):
    """`kvserve serve --fleet` in its own session: the gateway's process and the local Ray cluster it starts (every
    Ray process stays in that session). `kill` SIGKILLs the whole session (the region's Ray cluster with it),
    `kill_named` the processes whose command line has a fragment (a replica: "ServeReplica:pool-", the gateway:
    "ServeReplica:kvserve:gateway")."""

    start_timeout_s = 600.0
    new_session = True
    extra_toml = "[fleet]\ngateway_cpus = 0\nhealth_check_period_s = 1.0\n"
    serve_args = ("--fleet",)

    def session_pids(self) -> list[tuple[int, str]]:
        if self.proc is None:
            return []
        found = []
        for line in subprocess.run(["ps", "-eo", "pid=,sid=,args="], capture_output=True, text=True).stdout.splitlines():
            parts = line.split(None, 2)
            if len(parts) >= 2 and int(parts[1]) == self.proc.pid:
                found.append((int(parts[0]), parts[2] if len(parts) > 2 else ""))
        return found

    def kill_named(self, fragment: str) -> int:
        hit = [pid for pid, args in self.session_pids() if fragment in args]
        for pid in hit:
            _kill(pid)
        return len(hit)

    def kill(self) -> None:
        for pid, _ in self.session_pids():
            _kill(pid)
        if self.proc is not None:
            self.proc.wait(30)

    def stop(self, sig: int = signal.SIGKILL, timeout: float = 60) -> None:
        self.kill()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
