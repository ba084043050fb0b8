"""The served models: per model, its EngineClient and what the service keeps around it (per-request
accounting: metrics and the usage row; the load signal; routing among models).
"""
from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from kvserve.config import TIER_NAMES, EngineConfig, ModelPrice, ServedModel, ServerConfig
from kvserve.engine.client import EngineClient, EngineStatus
from kvserve.engine.errors import LoRANotFound, ModelNotFound
from kvserve.engine.in_process import in_process_client
from kvserve.engine.outputs import RequestOutput
from kvserve.metering.prices import request_cost, request_price
from kvserve.planning.calibrate import calibrated_prior
from kvserve.service.metrics import LiveModelStats, ServerMetrics
from kvserve.service.reasoning import ThinkingFormat, thinking_format
from kvserve.service.router import AUTO_MODEL, AutoPolicy, LoadLevel, ModelView, choose_auto_model, load_level
from kvserve.service.tool_formats import ToolFormat, tool_format
from kvserve.service.usage import UsageLedger
from kvserve.store import UsageRecord


@dataclass
class RequestInfo:
    """What the engine-thread hooks need to account for one engine request."""

    tenant: str
    tier: str
    model: str
    adapter: str | None = None  # the LoRA adapter it runs with; None: the base model


def _status_of(finish_reason: str | None) -> str:
    return {"stop": "ok", "length": "ok", "abort": "aborted", "queue_timeout": "timeout"}.get(finish_reason or "",
                                                                                            "error")


# Builds a model's EngineClient: (the model's spec, its engine config, on_step, on_finish) -> client.
ClientFactory = Callable[[ServedModel, EngineConfig, Callable, Callable[[RequestOutput], None]], EngineClient]


def calibrated_client(spec: ServedModel, config: EngineConfig, on_step: Callable,
                      on_finish: Callable[[RequestOutput], None]) -> EngineClient:
    """The engine in this process (engine/in_process.py), its admission estimates started from this
    machine's calibration when it has one."""
    return in_process_client(spec, config, on_step, on_finish, step_time_prior=calibrated_prior(spec.id))


class ModelHandle:
    """One served model: its engine client, and the live numbers the service and the metrics read."""

    def __init__(self, spec: ServedModel, config: ServerConfig, metrics: ServerMetrics, ledger: UsageLedger,
                 client_factory: ClientFactory = calibrated_client):
        self.spec = spec
        self.id = spec.id
        self.role = spec.role
        self.config = config
        self.metrics = metrics
        self.ledger = ledger
        self.engine_config: EngineConfig = spec.engine_config()
        self.created = int(time.time())
        self.requests: dict[str, RequestInfo] = {}  # engine request id -> info (event loop adds, engine thread pops)
        self._lock = threading.Lock()
        self._client_factory = client_factory
        self.client: EngineClient = client_factory(spec, self.engine_config, self._on_step, self._on_finish)
        self._from_tokenizer: dict[str, Any] = {}  # what is decided once the tokenizer is known (_decided)
        # Residency (service/residency.py): whether its engine was started (loading or loaded), the calls open on
        # it (routed and not yet answered: CompletionService.open to Completion.release), when one last came, an
        # admin's pin, and whether it is being unloaded now.
        self.on_demand = spec.load == "on_demand" and getattr(self.client, "loads_in_process", False)
        self.started = False
        self.users = 0
        self.last_used = 0.0
        self.pinned = False
        self.unloading = False

    # ---- residency (models loaded by demand) -------------------------------------------------
    def start(self) -> None:
        """Start loading its engine (in the engine's own thread)."""
        if not self.started:
            self.started = True
            self.client.start()

    def unload(self) -> None:
        """Stop its engine and free its memory (blocking: run off the event loop). Only when idle: no call open."""
        import gc

        from kvserve.models.loader import return_freed_memory

        old = self.client
        old.drain()
        old.stop(10.0)
        self.client = self._client_factory(self.spec, self.engine_config, self._on_step, self._on_finish)
        self.started = False
        old.engine = old.core = None  # its model and KV pool go with their last references
        del old
        gc.collect()
        return_freed_memory()

    def resident_bytes(self) -> int:
        """What it holds loaded: measured once loaded, else estimated (its checkpoint's files and its KV memory)."""
        engine = getattr(self.client, "engine", None)
        if engine is not None and hasattr(engine, "resident_bytes"):
            return engine.resident_bytes
        return self._estimated_bytes

    @functools.cached_property
    def _estimated_bytes(self) -> int:
        """Its checkpoint's files and its KV memory: resolved and summed once (a pkg: source may be assembled on the
        way), not on each look of a waiting load."""
        from kvserve.models.backend import DEFAULT_CPU_KV_MEMORY
        from kvserve.models.catalog import resolve_source

        try:
            path = resolve_source(self.spec.source, self.spec.engine_args.get("install", ""))
            files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]
            weights = sum(p.stat().st_size for p in files)
        except Exception:  # noqa: BLE001 - not installed yet: its load will say so
            weights = 0
        return weights + (self.engine_config.cache.kv_cache_memory or DEFAULT_CPU_KV_MEMORY)

    # ---- engine-thread hooks (thread-safe work only) -----------------------------------------
    def _on_step(self, client: EngineClient, step) -> None:
        self.metrics.observe_step(self.id, step)

    def _on_finish(self, out: RequestOutput) -> None:
        with self._lock:
            info = self.requests.pop(out.request_id, None)
        if info is None:
            return
        self.metrics.observe_finished(self.id, info.tier, out, info.adapter)
        record = self._usage_record(info, out)
        self.metrics.observe_usage(info.tenant, self.id, info.tier, record.price, record.cost)
        self.ledger.record_threadsafe(record)

    def _usage_record(self, info: RequestInfo, out: RequestOutput) -> UsageRecord:
        m = out.metrics

        def ms(v):
            return None if v is None else round(v * 1000, 3)

        reason = next((o.finish_reason for o in out.outputs if o.finish_reason == "abort"), None) or (
            out.outputs[0].finish_reason if out.outputs else None)
        cached = min(out.num_cached_tokens, out.num_prompt_tokens)
        price = self.price_for(info.adapter)
        return UsageRecord(request_id=out.request_id, tenant=info.tenant, model=self.id, tier=info.tier,
                           prompt_tokens=out.num_prompt_tokens, cached_prompt_tokens=cached,
                           disk_cached_prompt_tokens=min(out.num_tier_cached_tokens - out.num_host_cached_tokens,
                                                         cached),
                           host_cached_prompt_tokens=min(out.num_host_cached_tokens, cached),
                           completion_tokens=out.num_completion_tokens,
                           queue_ms=ms(m.queue_time if m else None), ttft_ms=ms(m.ttft if m else None),
                           e2e_ms=ms(m.e2e if m else None), status=_status_of(reason), finish_reason=reason,
                           engine_s=out.engine_seconds,
                           price=request_price(price, info.tier, out.num_prompt_tokens, cached,
                                               out.num_completion_tokens),
                           cost=request_cost(price, out.engine_seconds), adapter=info.adapter)

    def price_for(self, adapter: str | None) -> ModelPrice:
        """The prices a request pays: its configured adapter's own ([[models.adapters]] price), else the model's."""
        if adapter is not None:
            spec = next((a for a in self.engine_config.lora_adapters if a.name == adapter), None)
            if spec is not None and spec.price is not None:
                return spec.price
        return self.spec.price

    def register(self, request_id: str, info: RequestInfo) -> None:
        with self._lock:
            self.requests[request_id] = info

    def unregister(self, request_id: str) -> None:
        with self._lock:
            self.requests.pop(request_id, None)

    def inflight_ids(self) -> list[str]:
        with self._lock:
            return list(self.requests)

    def _decided(self, key: str, decide: Callable[[Any], Any]) -> Any:
        """`decide(tokenizer)`, once: the first time it is asked after the tokenizer is read (None before)."""
        if key not in self._from_tokenizer:
            tokenizer = self.client.tokenizer
            if tokenizer is None:
                return None
            self._from_tokenizer[key] = decide(tokenizer)
        return self._from_tokenizer[key]

    @property
    def thinking(self) -> ThinkingFormat | None:
        """Whether the model thinks, and its tags (service/reasoning.py): decided once, from its tokenizer and
        chat template and the model's reasoning_parser setting; None until the tokenizer is read."""
        return self._decided("thinking", lambda tokenizer: thinking_format(tokenizer, self.spec.reasoning_parser))

    @property
    def tool_format(self) -> ToolFormat | None:
        """The format its tool calls are written in (service/tool_formats.py): decided once, from its chat template
        and tokenizer and the model's tool_call_parser setting; None until the tokenizer is read."""
        return self._decided("tool_format", lambda tokenizer: tool_format(tokenizer, self.spec.tool_call_parser))

    # ---- live state --------------------------------------------------------------------------
    def adapter_names(self) -> list[str]:
        """The LoRA adapters a request may name: the engine's (configured and loaded since), or before it is up
        the configured ones."""
        names = getattr(self.client, "adapter_names", None)
        return names() if names is not None else [a.name for a in self.engine_config.lora_adapters]

    @property
    def status(self) -> EngineStatus:
        return self.client.status if self.started or not self.on_demand else EngineStatus.UNLOADED

    @property
    def max_model_len(self) -> int:
        known = self.client.max_model_len
        return known if known is not None else self.engine_config.scheduler.max_model_len

    @property
    def weights(self) -> str:
        """The weights' form as loaded (LLMEngine.weights), or the setting until they are."""
        return self.client.weights or self.engine_config.weights

    @property
    def numerics(self) -> str:
        """The numerics in force (LLMEngine.numerics), or the setting until the model is loaded."""
        return self.client.numerics or self.engine_config.numerics

    @property
    def activations(self) -> str:
        """What the quantized matrices multiply (LLMEngine.activations: bf16 or int8), or the setting until
        the model is loaded."""
        return self.client.activations or self.engine_config.activations

    def queue_bound(self, tier: str) -> int:
        return getattr(self.engine_config.scheduler, tier).max_waiting

    def waiting_by_tier(self) -> dict[str, int]:
        """Waiting requests per tier, from the engine's latest stats snapshot."""
        stats = self.client.stats
        counts = {t: 0 for t in TIER_NAMES}
        if stats is not None:
            counts.update({p.label: n for p, n in stats.waiting.items()})
        return counts

    def queue_depth(self, tier: str) -> int:
        return self.waiting_by_tier().get(tier, 0)

    def live_stats(self) -> LiveModelStats:
        stats = self.client.stats
        waiting = self.waiting_by_tier()
        if stats is None:
            return LiveModelStats(self.id, 0, waiting, 0.0, 0, 0)
        return LiveModelStats(self.id, stats.running, waiting, stats.kv.device_usage, stats.prefix_query_tokens,
                              stats.prefix_hit_tokens, {p.label: t for p, t in stats.ttft_s.items()},
                              prefix_disk_hits=stats.kv.tier_hit_tokens - stats.kv.host_hit_tokens,
                              prefix_host_hits=stats.kv.host_hit_tokens,
                              kv_disk_bytes=stats.kv.tier_bytes.get("disk", 0),
                              kv_host_bytes=stats.kv.tier_bytes.get("host", 0),
                              drafts=stats.drafts, draft_length=stats.draft_length,
                              grammar=getattr(self.client, "grammar_stats", None))

    def load(self, tier: str) -> LoadLevel:
        cfg = self.config
        return load_level(self.queue_depth(tier), self.queue_bound(tier), self.metrics.window.ttft_p50_ms(self.id, tier),
                          cfg.ttft_target_ms.get(tier), cfg.load_high_fraction, cfg.load_shedding_fraction)

    def load_headers(self, tier: str, queue_wait_ms: float | None = None,
                     load: LoadLevel | None = None) -> dict[str, str]:
        """The load signal of a completion response (on errors: the recent median queue wait)."""
        if queue_wait_ms is None:
            queue_wait_ms = self.metrics.window.queue_p50_ms(self.id, tier) or 0.0
        return {"x-kvserve-queue-depth": str(self.queue_depth(tier)),
                "x-kvserve-queue-wait-ms": str(int(round(queue_wait_ms))),
                "x-kvserve-load": (load or self.load(tier)).value,
                "x-kvserve-model": self.id}


def served_names(models: dict[str, ModelHandle]) -> set[str]:
    """Every `model` a request may name (resolve_served): each model's id, its adapters' names and
    "<model>:<adapter>" ("auto" aside): what the batch API checks an input file's lines against."""
    names = set(models)
    for handle in models.values():
        for adapter in handle.adapter_names():
            names.update((adapter, f"{handle.id}:{adapter}"))
    return names


def resolve_served(models: dict[str, ModelHandle], config: ServerConfig, model: str, tier: str,
                   prompt_chars: int) -> tuple[ModelHandle, str | None]:
    """(the handle, the LoRA adapter's name or None) for a request's `model`: a model's id (or "auto"), an
    adapter's name, or "<model>:<adapter>". ModelNotFound for anything else."""
    if model in models or model == AUTO_MODEL:
        return resolve_model(models, config, model, tier, prompt_chars), None
    base, sep, name = model.partition(":")
    if sep and base in models:
        handle = models[base]
        if name in handle.adapter_names():
            return handle, name
        raise LoRANotFound(f"model {base!r} has no LoRA adapter {name!r}; it has: "
                           f"{', '.join(handle.adapter_names()) or 'none'}")
    for handle in models.values():
        if model in handle.adapter_names():
            return handle, model
    return resolve_model(models, config, model, tier, prompt_chars), None


def resolve_model(models: dict[str, ModelHandle], config: ServerConfig, model: str, tier: str,
                  prompt_chars: int) -> ModelHandle:
    """The handle serving `model` (or the auto policy's choice); ModelNotFound for unknown ids. A request
    that names a model is never served by another."""
    if model == AUTO_MODEL:
        views = [ModelView(h.id, h.role, h.status == EngineStatus.READY, h.queue_depth(tier))
                 for h in models.values()]
        a = config.auto
        chosen = choose_auto_model(views, tier, prompt_chars, AutoPolicy(a.short_prompt_chars, a.capable_max_queue_depth))
        if chosen is None:
            raise ModelNotFound("no models are configured")
        return models[chosen]
    handle = models.get(model)
    if handle is None:
        known = ", ".join(sorted(models)) or "(none)"
        raise ModelNotFound(f"The model {model!r} does not exist. Available: {known}, or 'auto'.")
    return handle
