"""A tiny OpenAI-style streaming server with controlled timing, to check a benchmark client's arithmetic.

Every streamed request gets its first token `ttft_ms` after it arrived and each next one `itl_ms`
later (scheduled on absolute times, so delays do not add up), `max_tokens` tokens in all. It can
imitate the details that clients trip over: usage in its own chunk (vLLM, kvserve) or in the last
chunk with choices (llama.cpp) or not at all, a chat role preamble sent at once, a trailing empty
chunk, error statuses on every k-th request, an error event inside the stream, 429s above a number of
requests in flight, and closing the connection after each response.

  python -m kvserve.bench.fake_server --port 8011 --ttft-ms 50 --itl-ms 10

then point `kvserve bench serve` and `vllm bench serve` at it: both must report TTFT ~50 ms,
TPOT ~10 ms and ITL ~10 ms.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field


@dataclass
class FakeConfig:
    ttft_ms: float = 50.0
    itl_ms: float = 10.0
    model: str = "fake-model"
    usage: str = "separate"  # "separate" | "last_choice" | "none"
    chat_preamble: str = "with_first"  # "immediate" | "with_first" | "none"
    final_empty_chunk: bool = False  # a last choice chunk with empty text and finish_reason
    fail_status: int | None = None  # answer this status to every `fail_every`-th request (1-based)
    fail_every: int = 0
    stream_error_every: int = 0  # every k-th request: an error event instead of the 2nd token
    reject_above: int | None = None  # 429 when this many streams are already in flight
    close_after_response: bool = False


@dataclass
class SeenRequest:
    arrival: float
    path: str
    headers: dict
    body: dict
    status: int = 200


@dataclass
class FakeState:
    requests: list[SeenRequest] = field(default_factory=list)
    inflight: int = 0
    max_inflight: int = 0
    connections: int = 0


class FakeOpenAIServer:
    def __init__(self, config: FakeConfig | None = None, host: str = "127.0.0.1", port: int = 0, tokenizer=None):
        """With a tokenizer, usage.prompt_tokens counts the prompt's tokens; without, usage has no prompt_tokens."""
        self.config = config or FakeConfig()
        self.tokenizer = tokenizer
        self.host, self.port = host, port
        self.state = FakeState()
        self._server: asyncio.base_events.Server | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> "FakeOpenAIServer":
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc):
        await self.stop()

    # -- HTTP ------------------------------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.state.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                length = int(headers.get("content-length", "0") or 0)
                raw = await reader.readexactly(length) if length else b""
                close = headers.get("connection", "").lower() == "close" or self.config.close_after_response
                await self._route(method, path, headers, raw, writer, close)
                if close:
                    return
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            try:
                writer.close()
            except Exception:
                pass

    @staticmethod
    async def _send_json(writer, status: int, obj: dict, close: bool) -> None:
        body = json.dumps(obj).encode()
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests",
                  503: "Service Unavailable"}.get(status, "Error")
        writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: {'close' if close else 'keep-alive'}\r\n\r\n"
                     .encode() + body)
        await writer.drain()

    async def _route(self, method, path, headers, raw, writer, close) -> None:
        if method == "GET" and path.startswith("/v1/models"):
            await self._send_json(writer, 200, {"object": "list", "data": [{"id": self.config.model,
                                                                             "object": "model"}]}, close)
            return
        if method == "GET" and path in ("/health", "/ready"):
            await self._send_json(writer, 200, {"status": "ok"}, close)
            return
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            await self._send_json(writer, 404, {"error": {"message": "not found"}}, close)
            return
        arrival = time.perf_counter()
        body = json.loads(raw or b"{}")
        seen = SeenRequest(arrival, path, headers, body)
        self.state.requests.append(seen)
        n = len(self.state.requests)
        cfg = self.config
        if cfg.fail_status and cfg.fail_every and n % cfg.fail_every == 0:
            seen.status = cfg.fail_status
            await self._send_json(writer, cfg.fail_status, {"error": {"message": "injected", "code": cfg.fail_status}},
                                  close)
            return
        if cfg.reject_above is not None and self.state.inflight >= cfg.reject_above:
            seen.status = 429
            await self._send_json(writer, 429, {"error": {"message": "overloaded"}}, close)
            return
        self.state.inflight += 1
        self.state.max_inflight = max(self.state.max_inflight, self.state.inflight)
        try:
            await self._stream(writer, path.endswith("chat/completions"), body, arrival, n, close)
        finally:
            self.state.inflight -= 1

    async def _stream(self, writer, chat: bool, body: dict, arrival: float, n: int, close: bool) -> None:
        cfg = self.config
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                     b"Transfer-Encoding: chunked\r\nConnection: " + (b"close" if close else b"keep-alive") +
                     b"\r\n\r\n")

        async def event(obj) -> None:
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()

        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        prompt = body.get("prompt")
        usage = {"completion_tokens": max_tokens}
        if isinstance(prompt, list):
            usage["prompt_tokens"] = len(prompt)
        elif self.tokenizer is not None:
            usage["prompt_tokens"] = len(self.tokenizer.encode(prompt) if prompt is not None else
                                         self.tokenizer.encode_chat(body.get("messages") or []))
        base = {"id": f"req-{n}", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": cfg.model}

        def choice(text, finish=None):
            if chat:
                return {"index": 0, "delta": {"content": text} if text is not None else {}, "finish_reason": finish}
            return {"index": 0, "text": text or "", "finish_reason": finish}

        if chat and cfg.chat_preamble == "immediate":
            await event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "finish_reason": None}]})
        first = arrival + cfg.ttft_ms / 1000.0
        for k in range(max_tokens):
            delay = first + k * cfg.itl_ms / 1000.0 - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if k == 0 and chat and cfg.chat_preamble == "with_first":
                await event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "finish_reason": None}]})
            if cfg.stream_error_every and n % cfg.stream_error_every == 0 and k == 1:
                await event({"error": {"message": "injected stream error", "type": "server_error"}})
                break
            last = k == max_tokens - 1
            finish = "length" if last and not cfg.final_empty_chunk else None
            chunk = {**base, "choices": [choice(f"t{k} ", finish)]}
            if last and not cfg.final_empty_chunk and cfg.usage == "last_choice" and include_usage:
                chunk["usage"] = usage
            await event(chunk)
        else:
            if cfg.final_empty_chunk:
                chunk = {**base, "choices": [choice("" if not chat else None, "length")]}
                if cfg.usage == "last_choice" and include_usage:
                    chunk["usage"] = usage
                await event(chunk)
            if cfg.usage == "separate" and include_usage:
                await event({**base, "choices": [], "usage": usage})
        await event(b"[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--ttft-ms", type=float, default=50.0)
    ap.add_argument("--itl-ms", type=float, default=10.0)
    ap.add_argument("--model", default="fake-model")
    ap.add_argument("--usage", choices=["separate", "last_choice", "none"], default="separate")
    ap.add_argument("--final-empty-chunk", action="store_true")
    ap.add_argument("--close-after-response", action="store_true")
    ap.add_argument("--reject-above", type=int, default=None)
    ap.add_argument("--tokenizer", default=None, help="count prompt tokens in usage with this tokenizer "
                    "(catalog id, .gguf or HF dir); default: usage has no prompt_tokens")
    a = ap.parse_args(argv)
    tokenizer = None
    if a.tokenizer:
        from kvserve.bench.datasets import load_tokenizer

        tokenizer = load_tokenizer(a.tokenizer)
    cfg = FakeConfig(ttft_ms=a.ttft_ms, itl_ms=a.itl_ms, model=a.model, usage=a.usage,
                     final_empty_chunk=a.final_empty_chunk, close_after_response=a.close_after_response,
                     reject_above=a.reject_above)

    async def serve():
        srv = await FakeOpenAIServer(cfg, a.host, a.port, tokenizer=tokenizer).start()
        print(f"fake OpenAI server on {srv.base_url} (ttft {a.ttft_ms} ms, itl {a.itl_ms} ms)", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
