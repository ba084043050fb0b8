"""A TCP proxy that puts a network between two regions on one machine: a one-way delay on every byte in each
direction (what `tc netem delay` would add on a link; this machine's kernel has no netem), and a partition on
demand: while cut, bytes in flight and new ones are dropped and new connections hang unanswered, as when the
link's packets are lost; on heal, connections that were cut are closed (their peers reconnect).

Run one per directed link: `python -m kvserve.bench.netproxy --listen 9001 --to 127.0.0.1:8001 --delay-ms 35`;
SIGUSR1 cuts the link, SIGUSR2 heals it.
"""
from __future__ import annotations

import argparse
import asyncio
import signal
import time


class Link:
    def __init__(self, target_host: str, target_port: int, delay_s: float):
        self.target = (target_host, target_port)
        self.delay_s = delay_s
        self.cut = False
        self._writers: set[asyncio.StreamWriter] = set()

    def set_cut(self, cut: bool) -> None:
        self.cut = cut
        if not cut:  # what was cut stays cut: close it, the peers reconnect
            for w in list(self._writers):
                w.close()
            self._writers.clear()

    async def handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self._writers.add(client_w)
        if self.cut:  # no answer, no refusal: the connection hangs until the link heals
            return
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        self._writers.add(up_w)
        await asyncio.gather(self._pipe(client_r, up_w), self._pipe(up_r, client_w), return_exceptions=True)
        for w in (client_w, up_w):
            w.close()
            self._writers.discard(w)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Bytes in order, each delivered `delay_s` after it was read; dropped while the link is cut."""
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if data is None:
                    writer.close()
                    return
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                if not self.cut:
                    writer.write(data)
                    await writer.drain()

        sender = asyncio.create_task(deliver())
        try:
            while data := await reader.read(65536):
                if not self.cut:
                    queue.put_nowait((time.monotonic() + self.delay_s, data))
        except OSError:
            pass
        if not self.cut:
            queue.put_nowait((time.monotonic() + self.delay_s, None))
            await sender
        else:
            sender.cancel()


async def serve(listen_port: int, link: Link) -> None:
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, link.set_cut, True)
    loop.add_signal_handler(signal.SIGUSR2, link.set_cut, False)
    server = await asyncio.start_server(link.handle, "127.0.0.1", listen_port)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", type=int, required=True, help="port on 127.0.0.1")
    ap.add_argument("--to", required=True, help="host:port of the far end")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay in each direction")
    a = ap.parse_args(argv)
    host, _, port = a.to.rpartition(":")
    asyncio.run(serve(a.listen, Link(host, int(port), a.delay_ms / 1000)))


if __name__ == "__main__":
    main()


def start_link(listen_port: int, to_port: int, delay_ms: float) -> "subprocess.Popen":
    """A link in its own process (cut with SIGUSR1, healed with SIGUSR2); it listens once this returns."""
    import socket
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "kvserve.bench.netproxy", "--listen", str(listen_port),
                             "--to", f"127.0.0.1:{to_port}", "--delay-ms", str(delay_ms)])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", listen_port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"the link proxy on port {listen_port} did not start")
