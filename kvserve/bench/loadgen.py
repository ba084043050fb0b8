r"""`kvserve bench serve`: an async load generator for any OpenAI-compatible server (ours or a peer's).

It streams every request (SSE, `stream_options.include_usage`), times it on the client, and reports
TTFT, TPOT, ITL and end-to-end latency (mean, median, percentiles), request and token throughput,
goodput under a TTFT bound, and the count of each error status, as a table and as JSON. The
figures use the definitions of `vllm bench serve` (see kvserve.bench.metrics), so the two clients
give the same numbers on the same server and workload.

Load shapes:
  * a fixed number of prompts (`--num-prompts`) sent at once and capped by `--max-concurrency`, or
    arriving as a Poisson process (`--request-rate`, `--burstiness`, `--seed`), or both;
  * time-bounded (`--duration S`): arrivals stop after S seconds, requests in flight finish;
  * a mix of tiers (`--mix`), each with its own load, dataset and `priority`, running together;
    a tier with `drain=0` is background load, cut off (requests cancelled, counted as such)
    once the other tiers are done.

Examples:
  kvserve bench serve --base-url http://127.0.0.1:8000 --model smollm2-135m --api-key $TOKEN \
      --dataset-name random --random-input-len 256 --random-output-len 128 --ignore-eos \
      --num-prompts 64 --max-concurrency 32 --result-file w1.json
  kvserve bench serve ... --request-rate 6 --duration 60 --goodput-ttft-ms 1000
  kvserve bench serve ... --duration 60 --mix "batch:concurrency=16,input=256,output=256,drain=0;\
interactive:rate=1,arrival=constant,dataset=chat,input=64,output=64"
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import math
import os
import platform
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from kvserve.bench.datasets import CHAT_DATASETS, DATASETS, Prompt, PromptSource, load_tokenizer
from kvserve.bench.metrics import DEFAULT_PERCENTILES, RequestRecord, compute_metrics, format_table

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
TIER_PRIORITY_INT = {"interactive": 0, "batch": 1}


@dataclass
class TierSpec:
    """One stream of requests: its dataset, sizes and load shape."""

    name: str = "default"
    dataset: str = "random"
    input_len: int = 1024
    input_lens: tuple[int, ...] = ()  # prompt i takes input_lens[i % n] tokens instead of input_len, if given
    output_len: int = 128
    prefix_len: int = 0
    range_ratio: float = 0.0
    num_prompts: int | None = 1000
    max_concurrency: int | None = None
    request_rate: float = math.inf
    arrival: str = "poisson"  # "poisson" (gamma with --burstiness, as vLLM) | "constant"
    burstiness: float = 1.0
    priority: str | int | None = None
    drain: bool = True  # False: background load, cancelled when the draining tiers are done
    endpoint: str | None = None  # None: chat datasets -> /v1/chat/completions, else /v1/completions
    seed: int = 0
    token_prompts: bool = False

    @property
    def chat(self) -> bool:
        return self.resolved_endpoint.rstrip("/").endswith("chat/completions")

    @property
    def resolved_endpoint(self) -> str:
        return self.endpoint or (CHAT_COMPLETIONS if self.dataset in CHAT_DATASETS else COMPLETIONS)

    def validate(self, duration: float | None) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"tier {self.name}: unknown dataset {self.dataset!r} ({', '.join(DATASETS)})")
        if self.arrival not in ("poisson", "constant"):
            raise ValueError(f"tier {self.name}: arrival must be poisson or constant")
        if self.request_rate <= 0:
            raise ValueError(f"tier {self.name}: request rate must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"tier {self.name}: max concurrency must be >= 1")
        if self.num_prompts is None and duration is None:
            raise ValueError(f"tier {self.name}: give a number of prompts or a --duration")
        if self.num_prompts is None and math.isinf(self.request_rate) and self.max_concurrency is None:
            raise ValueError(f"tier {self.name}: a time-bounded tier needs a request rate or a max concurrency")
        if self.token_prompts and self.chat:
            raise ValueError(f"tier {self.name}: token prompts need /v1/completions")


_MIX_KEYS = {
    "concurrency": ("max_concurrency", int), "max_concurrency": ("max_concurrency", int),
    "rate": ("request_rate", float), "request_rate": ("request_rate", float),
    "arrival": ("arrival", str), "burstiness": ("burstiness", float),
    "input": ("input_len", int), "input_len": ("input_len", int),
    "inputs": ("input_lens", lambda v: tuple(int(x) for x in v.split("/"))),  # e.g. inputs=32000/8000/16000
    "output": ("output_len", int), "output_len": ("output_len", int),
    "prefix": ("prefix_len", int), "prefix_len": ("prefix_len", int),
    "range_ratio": ("range_ratio", float),
    "num": ("num_prompts", int), "num_prompts": ("num_prompts", int),
    "dataset": ("dataset", str), "priority": ("priority", str), "endpoint": ("endpoint", str),
    "drain": ("drain", lambda v: v.lower() not in ("0", "false", "no", "off")),
    "token_prompts": ("token_prompts", lambda v: v.lower() in ("1", "true", "yes", "on")),
}


def tier_seed(base: int, name: str) -> int:
    """A tier's seed depends on its name, so a tier sends the same prompts alone or in any mix."""
    return (int(base) * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFFFFFF


def parse_mix(spec: str, defaults: TierSpec, duration: float | None) -> list[TierSpec]:
    """'batch:concurrency=16,input=256,output=256;interactive:rate=1,input=64,output=64' -> tiers.

    Unset keys come from `defaults` (the single-run flags); `num_prompts` defaults to unbounded when
    --duration is given; `priority` defaults to the tier name when it is interactive or batch.
    """
    tiers = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, rest = part.partition(":")
        name = name.strip()
        if not name:
            raise ValueError(f"mix tier without a name: {part!r}")
        t = replace(defaults, name=name, seed=tier_seed(defaults.seed, name),
                    num_prompts=None if duration is not None else defaults.num_prompts,
                    priority=name if name in TIER_PRIORITY_INT else defaults.priority,
                    max_concurrency=None, request_rate=math.inf)
        for kv in filter(None, (x.strip() for x in rest.split(","))):
            key, eq, value = kv.partition("=")
            key = key.strip().lower().replace("-", "_")
            if not eq or key not in _MIX_KEYS:
                raise ValueError(f"mix tier {name}: bad option {kv!r}; keys: {', '.join(sorted(_MIX_KEYS))}")
            attr, conv = _MIX_KEYS[key]
            value = value.strip()
            if attr == "priority" and value.lower() in ("none", ""):
                setattr_value: Any = None
            elif attr == "request_rate" and value.lower() == "inf":
                setattr_value = math.inf
            else:
                setattr_value = conv(value)
            t = replace(t, **{attr: setattr_value})
        if t.dataset in CHAT_DATASETS and t.token_prompts:
            raise ValueError(f"mix tier {name}: token prompts need a completions dataset")
        tiers.append(t)
    if not tiers:
        raise ValueError("empty --mix")
    if len({t.name for t in tiers}) != len(tiers):
        raise ValueError("mix tier names must be unique")
    return tiers


@dataclass
class ClientConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    api_key: str | None = None
    headers: dict = field(default_factory=dict)
    connection_close: bool = False
    temperature: float | None = 0.0
    ignore_eos: bool = False
    priority_style: str = "string"  # "string" (kvserve) | "int" (vLLM --scheduling-policy priority) | "none"
    duration: float | None = None
    goodput_ttft_ms: float | None = None
    percentiles: tuple = DEFAULT_PERCENTILES
    request_timeout: float = 6 * 3600.0
    num_warmups: int = 0
    save_detailed: bool = False
    disable_progress: bool = True


class _Stop(Exception):
    pass


class LoadGenerator:
    """Runs one benchmark (one or more tiers at once) and returns its result dict."""

    def __init__(self, cfg: ClientConfig, tiers: Sequence[TierSpec], tokenizer: Any):
        self.cfg = cfg
        self.tiers = list(tiers)
        for t in self.tiers:
            t.validate(cfg.duration)
        if cfg.duration is None and not any(t.drain for t in self.tiers):
            raise ValueError("background tiers (drain=0) alone need a --duration")
        self.tok = tokenizer
        self.sources = {t.name: PromptSource(tokenizer, t.dataset, input_len=t.input_len, output_len=t.output_len,
                                             prefix_len=t.prefix_len, range_ratio=t.range_ratio, seed=t.seed,
                                             token_prompts=t.token_prompts, input_lens=t.input_lens)
                        for t in self.tiers}
        self.prompts: dict[str, list[Prompt]] = {t.name: [] for t in self.tiers}
        self.records: list[RequestRecord] = []
        self.t0 = 0.0

    # -- prompts ----------------------------------------------------------------------------------------------

    def _expected_count(self, t: TierSpec) -> int:
        if t.num_prompts is not None:
            return t.num_prompts
        d = self.cfg.duration or 0.0
        if math.isfinite(t.request_rate):
            lam = t.request_rate * d
            return int(lam + 4 * math.sqrt(lam) + 8)
        return 2 * (t.max_concurrency or 1) + 8

    def pregenerate(self) -> None:
        for t in self.tiers:
            src, out = self.sources[t.name], self.prompts[t.name]
            out.extend(src.prompt(i) for i in range(len(out), self._expected_count(t)))

    def prompt(self, t: TierSpec, i: int) -> Prompt:
        out = self.prompts[t.name]
        while len(out) <= i:  # beyond the estimate (a time-bounded run that went faster): make more
            out.append(self.sources[t.name].prompt(len(out)))
        return out[i]

    # -- one request --------------------------------------------------------------------------------------------

    def _headers(self) -> dict:
        h = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.cfg.api_key:
            h["Authorization"] = f"Bearer {self.cfg.api_key}"
        if self.cfg.connection_close:
            h["Connection"] = "close"
        h.update(self.cfg.headers)
        return h

    def payload(self, t: TierSpec, p: Prompt) -> dict:
        body: dict[str, Any] = {"model": self.cfg.model, "stream": True, "stream_options": {"include_usage": True}}
        if t.chat:
            body["messages"] = p.messages if p.messages is not None else [{"role": "user", "content": p.prompt}]
            body["max_completion_tokens"] = p.max_tokens
            body["max_tokens"] = p.max_tokens
        else:
            body["prompt"] = p.prompt
            body["max_tokens"] = p.max_tokens
        if self.cfg.temperature is not None:
            body["temperature"] = self.cfg.temperature
        if self.cfg.ignore_eos:
            body["ignore_eos"] = True
        prio = t.priority
        if prio is not None and self.cfg.priority_style != "none":
            if self.cfg.priority_style == "int":
                body["priority"] = TIER_PRIORITY_INT.get(str(prio), None)
                if body["priority"] is None:
                    body["priority"] = int(prio)
            else:
                body["priority"] = prio
        return body

    async def send(self, client, url: str, t: TierSpec, body: bytes, rec: RequestRecord) -> None:
        """POST one streaming request and fill `rec` with what came back and when."""
        import httpx

        chat = t.chat
        st = time.perf_counter()
        rec.start = st - self.t0
        first = False
        last = st
        try:
            async with client.stream("POST", url, content=body, headers=self._headers()) as resp:
                rec.status = resp.status_code
                if resp.status_code != 200:
                    raw = await resp.aread()
                    rec.error = raw.decode("utf-8", "replace")[:500]
                    rec.error_kind = str(resp.status_code)
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    now = time.perf_counter()
                    data = line[5:].strip()
                    if not data or data == "[DONE]":
                        continue
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        rec.error, rec.error_kind = f"bad SSE data: {data[:200]}", "bad_chunk"
                        continue
                    if obj.get("error"):
                        err = obj["error"]
                        rec.error = json.dumps(err)[:500] if not isinstance(err, str) else err[:500]
                        rec.error_kind = "stream_error"
                        continue
                    choices = obj.get("choices")
                    if choices:
                        c = choices[0] or {}
                        if chat:
                            delta = c.get("delta") or {}
                            text = delta.get("content") or delta.get("reasoning_content") or ""
                        else:
                            text = c.get("text") or ""
                        counted = True
                        if not first:
                            if chat and not text and c.get("finish_reason") is None:
                                counted = False  # the role preamble ({"role": "assistant"}) is no token
                            else:
                                first = True
                                rec.ttft = now - st
                        else:
                            rec.itl.append(now - last)
                        if counted:
                            last = now
                            rec.chunks += 1
                            if text:
                                rec.text_chunks += 1
                                rec.generated_chars += len(text)
                    usage = obj.get("usage")
                    if usage:
                        # vLLM reads usage only from a chunk without choices; llama.cpp sends it in the
                        # last chunk with choices, so take it from any chunk.
                        rec.usage_completion_tokens = usage.get("completion_tokens")
                        rec.usage_prompt_tokens = usage.get("prompt_tokens")
                        details = usage.get("prompt_tokens_details") or {}
                        rec.usage_cached_tokens = details.get("cached_tokens")
        except asyncio.CancelledError:
            raise
        except (httpx.HTTPError, OSError) as e:
            rec.error, rec.error_kind = f"{type(e).__name__}: {e}"[:500], f"exception:{type(e).__name__}"
            return
        rec.latency = last - st
        if rec.error_kind:
            return
        if not first:
            rec.error, rec.error_kind = "the stream carried no token", "no_tokens"
            return
        rec.success = True

    async def _one(self, client, t: TierSpec, i: int, acquire, release) -> None:
        p = self.prompt(t, i)
        rec = RequestRecord(tier=t.name, index=i, prompt_len=p.prompt_len, max_tokens=p.max_tokens)
        self.records.append(rec)
        body = json.dumps(self.payload(t, p), separators=(",", ":")).encode()
        url = self.cfg.base_url.rstrip("/") + t.resolved_endpoint
        try:
            if acquire is not None:
                async with acquire:
                    await self.send(client, url, t, body, rec)
            else:
                await self.send(client, url, t, body, rec)
        except asyncio.CancelledError:
            rec.cancelled = True
            rec.success = False
            rec.error_kind = rec.error_kind or "cancelled"
        except Exception as e:  # the HTTP stack failed in a way send() does not expect: a failure, said
            rec.error, rec.error_kind = f"{type(e).__name__}: {e}"[:500], f"exception:{type(e).__name__}"
            rec.success = False
        finally:
            if release is not None:
                release.release()

    # -- one tier ----------------------------------------------------------------------------------------------

    async def _issue(self, client, t: TierSpec, tasks: list) -> None:
        """Start the tier's requests at their arrival times until its prompts or the duration run out."""
        duration = self.cfg.duration
        sem = asyncio.Semaphore(t.max_concurrency) if t.max_concurrency else None
        arrivals = np.random.default_rng(t.seed ^ 0x5EED)
        next_at = 0.0
        i = 0
        while t.num_prompts is None or i < t.num_prompts:
            now = time.perf_counter() - self.t0
            if duration is not None and now >= duration:
                break
            if math.isfinite(t.request_rate):
                if duration is not None and next_at >= duration:
                    break
                if next_at > now:
                    await asyncio.sleep(next_at - now)
                if t.arrival == "constant":
                    next_at = (i + 1) / t.request_rate  # from the index: no drift from adding up
                else:
                    theta = 1.0 / (t.request_rate * t.burstiness)
                    next_at += float(arrivals.gamma(shape=t.burstiness, scale=theta))
                tasks.append(asyncio.create_task(self._one(client, t, i, sem, None)))
            elif sem is not None:
                # Unlimited rate, capped concurrency: take a slot before starting the request, so a
                # time-bounded tier never holds more than max_concurrency pending tasks.
                try:
                    if duration is None:
                        await sem.acquire()
                    else:
                        await asyncio.wait_for(sem.acquire(), max(duration - now, 0.0))
                except asyncio.TimeoutError:
                    break
                tasks.append(asyncio.create_task(self._one(client, t, i, None, sem)))
            else:
                tasks.append(asyncio.create_task(self._one(client, t, i, None, None)))
            i += 1
            if i % 64 == 0:
                await asyncio.sleep(0)

    # -- the run ------------------------------------------------------------------------------------------------

    async def _warmup(self, client) -> None:
        n = self.cfg.num_warmups
        if n <= 0:
            return
        t = replace(self.tiers[0], name="warmup", seed=self.tiers[0].seed ^ 0x7A11, num_prompts=n,
                    request_rate=math.inf, drain=True)
        self.sources["warmup"] = PromptSource(self.tok, t.dataset, input_len=t.input_len, output_len=t.output_len,
                                              prefix_len=t.prefix_len, seed=t.seed, token_prompts=t.token_prompts,
                                              input_lens=t.input_lens)
        self.prompts["warmup"] = [self.sources["warmup"].prompt(i) for i in range(n)]
        saved = self.records
        self.records = []
        self.t0 = time.perf_counter()
        sem = asyncio.Semaphore(t.max_concurrency or n)
        await asyncio.gather(*(self._one(client, t, i, sem, None) for i in range(n)))
        bad = [r for r in self.records if not r.success]
        self.records = saved
        if bad:
            raise RuntimeError(f"warmup failed: {bad[0].error_kind} {bad[0].error}")

    async def run(self) -> dict:
        import httpx

        self.pregenerate()
        gc.collect()  # as vLLM's client: no collector pauses over the objects made so far
        gc.freeze()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(self.cfg.request_timeout, connect=60.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
            if self.cfg.model is None:
                self.cfg.model = await fetch_model_id(client, self.cfg.base_url, self._headers())
            await self._warmup(client)
            tasks: dict[str, list[asyncio.Task]] = {t.name: [] for t in self.tiers}
            self.t0 = time.perf_counter()
            issuers = [asyncio.create_task(self._issue(client, t, tasks[t.name])) for t in self.tiers]
            draining = [t for t in self.tiers if t.drain]
            background = [t for t in self.tiers if not t.drain]
            try:
                if draining:
                    await asyncio.gather(*(issuers[self.tiers.index(t)] for t in draining))
                    await asyncio.gather(*(x for t in draining for x in tasks[t.name]))
                else:
                    await asyncio.sleep(max((self.cfg.duration or 0) - (time.perf_counter() - self.t0), 0))
                end = time.perf_counter()
                # Stop the background issuers first, and make sure they stopped: Python 3.11's wait_for
                # can swallow a cancel that lands as its semaphore is granted, and the issuer then
                # starts one more request. Only then cut off every request they started.
                stopping = [issuers[self.tiers.index(t)] for t in background]
                while not all(x.done() for x in stopping):
                    for x in stopping:
                        x.cancel()
                    await asyncio.wait(stopping, timeout=0.05)
                for t in background:
                    for x in tasks[t.name]:
                        x.cancel()
                await asyncio.gather(*issuers, *(x for t in background for x in tasks[t.name]),
                                     return_exceptions=True)
            except BaseException:
                for x in issuers + [x for v in tasks.values() for x in v]:
                    x.cancel()
                raise
            finally:
                gc.unfreeze()
        return self.result(end - self.t0)

    def result(self, duration: float) -> dict:
        cfg = self.cfg
        records = sorted(self.records, key=lambda r: r.start)
        res: dict[str, Any] = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "client": "kvserve bench serve",
            "base_url": cfg.base_url,
            "model_id": cfg.model,
            "endpoint": sorted({t.resolved_endpoint for t in self.tiers}),
            "config": {"client": {**{k: v for k, v in asdict(cfg).items() if k != "api_key"},
                                  "headers": {k: v for k, v in cfg.headers.items() if k.lower() != "authorization"}},
                       "tiers": [{**asdict(t), "request_rate": _num(t.request_rate)} for t in self.tiers]},
        }
        res.update(compute_metrics(records, duration, goodput_ttft_ms=cfg.goodput_ttft_ms,
                                   percentiles=cfg.percentiles))
        res["tiers"] = {t.name: compute_metrics([r for r in records if r.tier == t.name], duration,
                                                goodput_ttft_ms=cfg.goodput_ttft_ms, percentiles=cfg.percentiles)
                        for t in self.tiers}
        res["prompt_mismatches"] = sum(s.mismatches for s in self.sources.values())
        # Per-request arrays, as in vLLM's result file (successful requests have a ttft; others 0).
        res["tier_of"] = [r.tier for r in records]
        res["start_times"] = [r.start for r in records]
        # The run's start on the system's monotonic clock (perf_counter is CLOCK_MONOTONIC on Linux):
        # start_times are offsets from it, so a server-side trace on the same host lines up with them.
        res["start_monotonic_s"] = self.t0
        res["input_lens"] = [r.prompt_len for r in records]
        res["output_lens"] = [r.output_tokens if r.success else 0 for r in records]
        res["ttfts"] = [r.ttft if r.success else 0.0 for r in records]
        res["e2els"] = [r.latency if r.success else 0.0 for r in records]
        res["statuses"] = [r.status for r in records]
        res["errors"] = [r.error_kind for r in records]
        res["server_prompt_tokens"] = [r.usage_prompt_tokens for r in records]
        if cfg.save_detailed:
            res["itls"] = [r.itl for r in records]
            res["requests"] = [r.to_json(with_itl=False) for r in records]
        return res


def _num(x: float) -> float | str:
    return "inf" if isinstance(x, float) and math.isinf(x) else x


async def fetch_model_id(client, base_url: str, headers: dict) -> str:
    resp = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return data[0]["id"]


# ---- command line -----------------------------------------------------------------------------------------------


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `kvserve bench serve` (names follow `vllm bench serve` where one exists)."""
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 (default: from "
                   "--host/--port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default=None,
                   help="default /v1/completions, or /v1/chat/completions for the chat dataset")
    g.add_argument("--model", default=None, help="model id sent in requests (default: the first of /v1/models)")
    g.add_argument("--api-key", default=None,
                   help="bearer token (default: $KVSERVE_API_KEY, else $OPENAI_API_KEY)")
    g.add_argument("--header", action="append", default=[], metavar="KEY=VALUE",
                   help="extra request header (repeatable), e.g. --header Connection=close")
    g.add_argument("--connection-close", action="store_true",
                   help="send 'Connection: close' (a fresh connection per request; needed for llama.cpp's server)")
    g.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds (default 6 h, as vLLM)")

    d = parser.add_argument_group("dataset")
    d.add_argument("--dataset-name", default="random", choices=DATASETS)
    d.add_argument("--tokenizer", default=None,
                   help="catalog id (smollm2-135m), .gguf file or HF directory (default: --model)")
    d.add_argument("--random-input-len", type=int, default=1024,
                   help="prompt tokens (random, chat, document), or the unique suffix for shared-prefix")
    d.add_argument("--random-output-len", type=int, default=128, help="max_tokens of every request")
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly in [len*(1-r), len*(1+r)]")
    d.add_argument("--random-prefix-len", type=int, default=0,
                   help="random dataset: a shared prefix of this many tokens before each prompt (as vLLM)")
    d.add_argument("--shared-prefix-len", type=int, default=512, help="shared-prefix dataset: common prefix tokens")
    d.add_argument("--token-prompts", action="store_true",
                   help="send token ids as the prompt (/v1/completions) instead of decoded text")
    d.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (always max_tokens tokens)")
    d.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy), as vLLM's client")
    d.add_argument("--seed", type=int, default=0)

    ld = parser.add_argument_group("load")
    ld.add_argument("--num-prompts", type=int, default=None,
                    help="requests to send (default 1000; unbounded when --duration is given)")
    ld.add_argument("--max-concurrency", type=int, default=None)
    ld.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    ld.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals; 1 = Poisson")
    ld.add_argument("--arrival", choices=["poisson", "constant"], default="poisson")
    ld.add_argument("--duration", type=float, default=None,
                    help="seconds: stop sending new requests after this (requests in flight finish)")
    ld.add_argument("--mix", default=None, metavar="SPEC",
                    help="tiers sent together: 'NAME:key=v,...;NAME:...'; keys concurrency, rate, arrival, "
                         "burstiness, input, inputs (lengths cycled over, e.g. 32000/8000/16000), output, prefix, "
                         "num, dataset, priority, endpoint, drain, token_prompts")
    ld.add_argument("--priority", default=None,
                    help="priority field of every request (interactive|batch, or an int for vLLM)")
    ld.add_argument("--priority-style", choices=["string", "int", "none"], default="string",
                    help="how tier priorities are sent: string (kvserve), int (vLLM priority scheduling: "
                         "interactive=0, batch=1), none (omit)")
    ld.add_argument("--num-warmups", type=int, default=0, help="untimed requests sent first")

    o = parser.add_argument_group("output")
    o.add_argument("--goodput-ttft-ms", type=float, default=None, help="goodput counts requests with TTFT <= this")
    o.add_argument("--percentiles", default="50,90,99", help="comma-separated (default 50,90,99)")
    o.add_argument("--result-file", default=None, help="write the result JSON here")
    o.add_argument("--save-detailed", action="store_true", help="also save per-request ITLs and records")
    o.add_argument("--label", default=None, help="a name stored in the result")
    o.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE", help="stored in the result")
    o.add_argument("--quiet", action="store_true", help="print no table")
    return parser


def _kv_list(items: Sequence[str], what: str) -> dict:
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"{what}: expected KEY=VALUE, got {item!r}")
        out[key.strip()] = value
    return out


def build(args: argparse.Namespace) -> tuple[ClientConfig, list[TierSpec]]:
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    api_key = args.api_key or os.environ.get("KVSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY")
    cfg = ClientConfig(base_url=base_url, model=args.model, api_key=api_key,
                       headers=_kv_list(args.header, "--header"), connection_close=args.connection_close,
                       temperature=args.temperature, ignore_eos=args.ignore_eos, priority_style=args.priority_style,
                       duration=args.duration, goodput_ttft_ms=args.goodput_ttft_ms,
                       percentiles=tuple(float(p) for p in args.percentiles.split(",") if p.strip()),
                       request_timeout=args.request_timeout, num_warmups=args.num_warmups,
                       save_detailed=args.save_detailed)
    num = args.num_prompts if args.num_prompts is not None else (None if args.duration is not None else 1000)
    prefix = args.shared_prefix_len if args.dataset_name == "shared-prefix" else args.random_prefix_len
    priority: Any = args.priority
    if priority is not None and priority.lstrip("-").isdigit():
        priority = int(priority)
    base = TierSpec(name="default", dataset=args.dataset_name, input_len=args.random_input_len,
                    output_len=args.random_output_len, prefix_len=prefix, range_ratio=args.random_range_ratio,
                    num_prompts=num, max_concurrency=args.max_concurrency, request_rate=args.request_rate,
                    arrival=args.arrival, burstiness=args.burstiness, priority=priority, endpoint=args.endpoint,
                    seed=args.seed, token_prompts=args.token_prompts)
    tiers = parse_mix(args.mix, base, args.duration) if args.mix else [base]
    return cfg, tiers


def run_args(args: argparse.Namespace, argv: Sequence[str] | None = None) -> dict:
    cfg, tiers = build(args)
    tok_spec = args.tokenizer or args.model
    if not tok_spec:
        raise SystemExit("kvserve bench serve: give --tokenizer (a catalog id, .gguf or HF dir) or --model")
    tokenizer = load_tokenizer(tok_spec)
    gen = LoadGenerator(cfg, tiers, tokenizer)
    result = asyncio.run(gen.run())
    result["tokenizer"] = tok_spec
    result["label"] = args.label
    result["metadata"] = _kv_list(args.metadata, "--metadata")
    result["command"] = ["kvserve", "bench", "serve", *(argv if argv is not None else sys.argv[1:])]
    result["client_env"] = {"python": platform.python_version(), "pid": os.getpid()}
    if not args.quiet:
        print(format_table(result, percentiles=cfg.percentiles), flush=True)
        if len(tiers) > 1:
            for name, m in result["tiers"].items():
                print(format_table(m, title=f"tier {name}", percentiles=cfg.percentiles), flush=True)
        if result["prompt_mismatches"]:
            print(f"note: {result['prompt_mismatches']} prompts did not re-encode to their exact target length")
    if args.result_file:
        path = os.path.abspath(args.result_file)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve bench serve", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_cli(parser.parse_args(argv), argv)


def run_cli(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Run parsed `kvserve bench serve` arguments; the exit status (2: bad arguments, 1: nothing completed)."""
    try:
        result = run_args(args, argv)
    except (ValueError, RuntimeError) as e:
        print(f"kvserve bench serve: error: {e}", file=sys.stderr)
        return 2
    return 0 if result["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
