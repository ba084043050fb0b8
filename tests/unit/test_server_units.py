"""Pure server logic: the auto-routing policy, the load signal, percentiles, the sliding window, the
request schemas, the error mapping and the server config; plus /health and /ready in-process over a
fake engine (no model)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from types import SimpleNamespace

import httpx
import pytest

from kvserve.config import ConfigError, SchedulerConfig, ServedModel, ServerConfig, engine_config_from_kwargs
from kvserve.engine.kv.manager import KVCacheManager
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.errors import (CapacityExhausted, ContextLengthExceeded, InvalidRequest, ModelFailed, ModelNotFound,
                                   ModelWarming)
from kvserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.engine.request import EngineRequest
from kvserve.engine.sampling import InvalidSamplingParams, SamplingParams
from kvserve.service import protocol as p
from kvserve.server.errors import APIError, retry_after_header, to_api_error
from kvserve.service.metrics import ServerMetrics, ServingWindow, StepSample
from kvserve.service.router import AutoPolicy, LoadLevel, ModelView, choose_auto_model, load_level, percentile
from kvserve.server.streaming import DONE, sse

# ---- auto routing --------------------------------------------------------------------------------

FAST = ModelView("fast-m", "fast", ready=True, queue_depth=0)
CAPABLE = ModelView("capable-m", "capable", ready=True, queue_depth=0)
POLICY = AutoPolicy(short_prompt_chars=100, capable_max_queue_depth=4)
LONG = 500


def test_auto_batch_goes_fast():
    assert choose_auto_model([FAST, CAPABLE], "batch", LONG, POLICY) == "fast-m"


def test_auto_short_prompt_goes_fast():
    assert choose_auto_model([FAST, CAPABLE], "interactive", 10, POLICY) == "fast-m"


def test_auto_interactive_long_goes_capable_when_queue_short():
    assert choose_auto_model([FAST, CAPABLE], "interactive", LONG, POLICY) == "capable-m"
    busy = ModelView("capable-m", "capable", ready=True, queue_depth=3)
    assert choose_auto_model([FAST, busy], "interactive", LONG, POLICY) == "capable-m"


def test_auto_capable_queue_at_threshold_goes_fast():
    busy = ModelView("capable-m", "capable", ready=True, queue_depth=4)
    assert choose_auto_model([FAST, busy], "interactive", LONG, POLICY) == "fast-m"


def test_auto_capable_warming_goes_fast():
    warming = ModelView("capable-m", "capable", ready=False, queue_depth=0)
    assert choose_auto_model([FAST, warming], "interactive", LONG, POLICY) == "fast-m"


def test_auto_fast_not_ready_falls_back_to_capable():
    fast_warming = ModelView("fast-m", "fast", ready=False, queue_depth=0)
    assert choose_auto_model([fast_warming, CAPABLE], "batch", LONG, POLICY) == "capable-m"
    assert choose_auto_model([fast_warming, CAPABLE], "interactive", 5, POLICY) == "capable-m"
    both_warming = ModelView("capable-m", "capable", ready=False, queue_depth=0)
    assert choose_auto_model([fast_warming, both_warming], "interactive", LONG, POLICY) == "fast-m"


def test_auto_single_or_roleless_models():
    assert choose_auto_model([], "interactive", 5, POLICY) is None
    assert choose_auto_model([CAPABLE], "batch", 5, POLICY) == "capable-m"
    assert choose_auto_model([FAST], "interactive", LONG, POLICY) == "fast-m"
    plain = [ModelView("a", "", True, 0), ModelView("b", "", True, 0)]
    assert choose_auto_model(plain, "interactive", LONG, POLICY) == "a"


# ---- load signal -----------------------------------------------------------------------------------


@pytest.mark.parametrize("depth,bound,ttft,target,want", [
    (0, 16, None, 500, LoadLevel.OK),
    (7, 16, 100, 500, LoadLevel.OK),
    (8, 16, 100, 500, LoadLevel.HIGH),  # half the bound
    (0, 16, 900, 500, LoadLevel.HIGH),  # slow first tokens
    (15, 16, 100, 500, LoadLevel.SHEDDING),  # 90% of 16 = 14.4 -> at 15
    (14, 16, 100, 500, LoadLevel.HIGH),
    (16, 16, None, None, LoadLevel.SHEDDING),
    (1, 2, None, None, LoadLevel.SHEDDING),  # tiny bound: one slot from full
    (0, 2, None, None, LoadLevel.OK),
    (0, 1, None, None, LoadLevel.OK),
    (1, 1, None, None, LoadLevel.SHEDDING),
    (5, None, 100, 500, LoadLevel.OK),  # no bound known
    (921, 1024, None, None, LoadLevel.HIGH),
    (922, 1024, None, None, LoadLevel.SHEDDING),
])
def test_load_level(depth, bound, ttft, target, want):
    assert load_level(depth, bound, ttft, target) is want


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    vals = [float(i) for i in range(1, 101)]
    assert percentile(vals, 50) == 50.0
    assert percentile(vals, 99) == 99.0
    assert percentile(vals, 100) == 100.0
    assert percentile(vals, 0) == 1.0


# ---- sliding window and metrics -----------------------------------------------------------------------


def _output(rid="r", prompt=10, completion=5, cached=4, finish="stop", t0=100.0):
    m = RequestMetrics(arrival_time=t0, first_scheduled_time=t0 + 0.01, first_token_time=t0 + 0.1,
                       last_token_time=t0 + 0.5, finished_time=t0 + 0.5, queue_time=0.01)
    o = CompletionOutput(index=0, text="x" * completion, token_ids=list(range(completion)), finish_reason=finish)
    return RequestOutput(rid, None, list(range(prompt)), [o], True, num_cached_tokens=cached, metrics=m, model="m")


def test_window_summary_and_expiry():
    now = [1000.0]
    w = ServingWindow(60.0, clock=lambda: now[0])
    metrics = ServerMetrics(60.0)
    metrics.window = w
    metrics.observe_finished("m", "interactive", _output())
    w.add_step(StepSample(now[0], "m", 0.5, 10, 5, 1))
    now[0] += 10
    s = w.summary("m", None)
    assert s["requests"] == 1 and s["window_s"] == 60.0
    assert s["ttft_p50_ms"] == pytest.approx(100.0)
    assert s["tpot_p50_ms"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4
    assert s["prefix_cache_hit_rate"] == pytest.approx(0.4)
    assert s["preemptions"] == 1
    assert s["engine_util"] == pytest.approx(0.05)  # 0.5 s busy over the 10 s since start
    assert s["tokens_per_s"] == pytest.approx(0.5)
    assert w.ttft_p50_ms("m") == pytest.approx(100.0)
    assert w.summary("other", None)["requests"] == 0
    now[0] += 61
    s = w.summary("m", None)
    assert s["requests"] == 0 and s["ttft_p50_ms"] is None and s["preemptions"] == 0


def test_prometheus_exposition_names():
    from prometheus_client.parser import text_string_to_metric_families

    metrics = ServerMetrics(60.0)
    metrics.observe_finished("m", "batch", _output())
    metrics.observe_step("m", SimpleNamespace(duration=0.1, num_prefill_tokens=3, num_decode_tokens=2,
                                              num_preempted=2))
    metrics.reject("m", "batch", "queue_full")
    text = metrics.exposition().decode()
    names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert {"kvserve:time_to_first_token_seconds_bucket", "kvserve:num_preemptions_total",
            "kvserve:admission_rejections_total", "kvserve:prompt_tokens_total",
            "kvserve:generation_tokens_total"} <= names
    assert 'kvserve:num_preemptions_total{model_name="m"} 2.0' in text
    # each app has its own registry
    fresh = ServerMetrics(60.0).exposition().decode()
    assert 'kvserve:prompt_tokens_total{' not in fresh


def test_an_adapters_request_is_its_base_models_usage_row_and_counted_per_adapter(tmp_path):
    """The finish hook: a request registered with a LoRA adapter writes a usage row of the base model with the
    adapter's name, and counts in kvserve:lora_requests_total{model_name, adapter}; a base-model request in
    neither. served_names: what a batch line may name."""
    from kvserve.service.models import ModelHandle, RequestInfo, served_names

    rows = []
    spec = ServedModel(id="tiny", source="/dev/null", role="fast",
                       engine_args=dict(adapters=[{"name": "sql", "path": str(tmp_path)}]))
    metrics = ServerMetrics(60.0)
    handle = ModelHandle(spec, ServerConfig(models=[spec], home=str(tmp_path)), metrics,
                         SimpleNamespace(record_threadsafe=rows.append),
                         client_factory=lambda spec, config, on_step, on_finish: SimpleNamespace())
    handle.register("r1", RequestInfo("acme", "interactive", "tiny", "sql"))
    handle.register("r2", RequestInfo("acme", "batch", "tiny"))
    handle._on_finish(_output("r1"))
    handle._on_finish(_output("r2"))
    assert [(r.request_id, r.model, r.adapter, r.tier) for r in rows] == [("r1", "tiny", "sql", "interactive"),
                                                                          ("r2", "tiny", None, "batch")]
    text = metrics.exposition().decode()
    assert 'kvserve:lora_requests_total{adapter="sql",model_name="tiny"} 1.0' in text
    assert text.count("kvserve:lora_requests_total{") == 1
    assert served_names({"tiny": handle}) == {"tiny", "sql", "tiny:sql"}


# ---- request schemas ------------------------------------------------------------------------------------


def test_chat_request_defaults_and_extras():
    req = p.ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                                   {"role": "user", "content": "hi"}],
        "unknown_field": {"x": 1}, "top_k": 5, "repetition_penalty": 1.1, "stop": "END",
        "max_completion_tokens": 7, "max_tokens": 99, "logprobs": True, "top_logprobs": 3, "priority": "batch",
        "metadata": {"tenant_id": "t", "request_id": "r-1", "free": 3}})
    sp = req.sampling_params()
    assert sp.max_tokens == 7 and sp.top_k == 5 and sp.repetition_penalty == 1.1 and sp.stop == ("END",)
    assert sp.logprobs == 3 and req.priority == "batch" and req.tenant_id == "t" and req.client_request_id == "r-1"
    assert req.template_messages()[0] == {"role": "system", "content": "be brief"}
    plain = p.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert plain.sampling_params().max_tokens is None  # the server fills min(default, remaining context)
    assert plain.sampling_params().temperature == 1.0 and plain.num_logprobs() is None


def test_completion_request_prompts():
    req = p.CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"], "n": 3, "logprobs": 2})
    assert req.prompts() == ["a", "b"] and req.sampling_params().logprobs == 2
    assert req.sampling_params().max_tokens == 16  # OpenAI's default for /v1/completions
    assert p.CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]}).prompts() == [[1, 2]]
    assert p.CompletionRequest.model_validate({"model": "m", "prompt": [[1], [2, 3]]}).prompts() == [[1], [2, 3]]


@pytest.mark.parametrize("body", [
    {"model": "m", "messages": []},
    {"model": "m", "messages": [{"role": "robot", "content": "x"}]},
    {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 129},
    {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
    {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
    {"model": "m", "messages": [{"role": "user", "content": "x"}], "priority": "now"},
    {"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a", ""]},
])
def test_chat_request_rejects(body):
    with pytest.raises(Exception) as e:
        p.ChatCompletionRequest.model_validate(body)
    assert to_api_error(e.value).status == 400


def test_invalid_sampling_combination_is_400():
    req = p.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                  "min_tokens": 9, "max_tokens": 3})
    with pytest.raises(InvalidSamplingParams) as e:
        req.sampling_params()
    err = to_api_error(e.value)
    assert err.status == 400 and err.param == "min_tokens"


@pytest.mark.parametrize("kind,body", [
    ("chat", {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hé"}]}],
              "temperature": 1, "stop": "\n", "metadata": {"request_id": "r"}, "unknown_extra": 3,
              "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}},
              "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
              "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("completion", {"model": "m", "prompt": [[1, 2], [3]], "structured_outputs": {"json": {"type": "integer"}},
                    "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}),
])
def test_a_forwarded_body_is_the_same_request(kind, body):
    """What a peer region is sent (and an Idempotency-Key is bound to) validates to the same request, with the
    schema's wire names, and is the same whichever spelling of it the client sent."""
    from kvserve.server.serving import Call

    schema = p.ChatCompletionRequest if kind == "chat" else p.CompletionRequest
    req = schema.model_validate(body)
    sent = Call(None, kind, None, req=req).body()
    again = schema.model_validate(p.parse_json(json.dumps(sent).encode()))
    assert again == req and again.model_fields_set == req.model_fields_set
    assert Call(None, kind, None, req=again).body() == sent
    text = json.dumps(sent)
    assert "unknown_extra" not in sent and '"schema_"' not in text and '"json_"' not in text


def test_a_place_in_flight_is_given_back_once_however_its_call_ends():
    from kvserve.server.in_flight import InFlight

    counted = InFlight()
    with pytest.raises(RuntimeError):
        with counted.hold():
            assert counted.count == 1
            raise RuntimeError("the call failed")
    assert counted.count == 0
    with counted.hold() as place:
        place.pass_on()  # a stream's response owns it now
    assert counted.count == 1
    place.release()
    place.release()
    assert counted.count == 0


# ---- error mapping ---------------------------------------------------------------------------------------


def test_error_mapping():
    e = to_api_error(CapacityExhausted("full", retry_after=2.2))
    assert (e.status, e.type, e.code, e.headers["Retry-After"]) == (429, "capacity_exhausted", "capacity_exhausted",
                                                                    "3")
    assert to_api_error(CapacityExhausted("full", retry_after=0.01)).headers["Retry-After"] == "1"
    assert to_api_error(ModelWarming("loading")).status == 503
    assert to_api_error(ModelNotFound("nope")).param == "model"
    assert to_api_error(ContextLengthExceeded("long")).code == "context_length_exceeded"
    bad = to_api_error(InvalidRequest("bad chat template", param="messages", code="invalid_prompt"))
    assert (bad.status, bad.type, bad.code, bad.param) == (400, "invalid_request_error", "invalid_prompt", "messages")
    assert to_api_error(ValueError("an internal check")).status == 500  # only typed errors are the client's fault
    failed = to_api_error(ModelFailed("model x failed"))
    assert (failed.status, failed.code, failed.headers["Retry-After"]) == (503, "model_failed", "30")
    assert to_api_error(json.JSONDecodeError("x", "doc", 0)).code == "invalid_json"
    boom = to_api_error(RuntimeError("secret detail"))
    assert boom.status == 500 and "secret" not in boom.message
    assert to_api_error(APIError(413, "big", code="request_too_large")).status == 413
    assert retry_after_header(float("inf")) == "1" and retry_after_header(None) == "1"


def test_validation_param_names_skip_union_tags():
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as e:
        p.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": 5}],
                                                "stop": 5})
    err = to_api_error(e.value)
    assert err.param in ("messages[0].content", "stop")


def test_sse_encoding():
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'
    assert DONE == "data: [DONE]\n\n"


# ---- server config -----------------------------------------------------------------------------------------


def test_server_config_from_toml(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text("""
[server]
port = 9000
max_body_bytes = "2MiB"
[server.auto]
capable_max_queue_depth = 2
[[models]]
id = "a"
source = "/nowhere.gguf"
role = "fast"
max_num_seqs = 3
kv_cache_memory = "16MiB"
[models.batch]
max_waiting = 5
""")
    cfg = ServerConfig.from_toml(str(path), port=9100, host=None)
    assert cfg.port == 9100 and cfg.host == "127.0.0.1" and cfg.max_body_bytes == 2 << 20
    assert cfg.auto.capable_max_queue_depth == 2
    (m,) = cfg.models
    ec = m.engine_config()
    assert ec.scheduler.max_num_seqs == 3 and ec.cache.kv_cache_memory == 16 << 20
    assert ec.scheduler.batch.max_waiting == 5 and ec.scheduler.batch.max_queue_wait_s == 3600.0
    assert ec.scheduler.interactive.max_waiting == 1024
    # The offline API's flat keywords take the same tables: fields over the tier's defaults.
    flat = engine_config_from_kwargs("m", interactive={"max_ttft_s": 0.7}, batch={"max_waiting": 7})
    assert flat.scheduler.interactive.max_ttft_s == 0.7 and flat.scheduler.interactive.max_waiting == 1024
    assert flat.scheduler.batch.max_waiting == 7 and flat.scheduler.batch.max_queue_wait_s == 3600.0
    bad = tmp_path / "bad.toml"
    # A bad key or value fails when the config is read (at start), naming the key, the value and what is allowed.
    cases = {
        '[server]\nsize = 3\n': r"unknown \[server\] keys .*\['size'\]; allowed: .*port",
        '[server]\nload_high_fraction = 1.5\n': r"load_high_fraction = 1.5 is not allowed: a number in \(0, 1\]",
        '[server.auto]\nshort_prompt = 3\n': r"unknown \[server.auto\] keys: \['short_prompt'\]",
        'max_num_sequences = 3\n': r"models\[a\]: unknown engine argument 'max_num_sequences'; allowed: .*max_num_seqs",
        'max_num_seqs = 0\n': r"models\[a\]: SchedulerConfig.max_num_seqs = 0 is not allowed: an integer > 0",
        'preemption_mode = "sometimes"\n': r"preemption_mode = 'sometimes' is not allowed: one of swap, recompute, auto",
        'kv_cache_memory = "lots"\n': r"kv_cache_memory = 'lots' is not allowed: a byte size",
        'dtype = "int3"\n': r"EngineConfig.dtype = 'int3' is not allowed: one of auto, float32",
        '[models.batch]\nmax_waiting = -1\n': r"models\[a\]: TierLimits.max_waiting = -1 is not allowed",
        '[models.interactive]\nmax_wait = 2\n': r"interactive: unknown keys \['max_wait'\]",
    }
    for text, message in cases.items():
        if text.startswith("[server"):
            bad.write_text(text + '[[models]]\nid = "a"\nsource = "x"\n')
        else:
            bad.write_text('[[models]]\nid = "a"\nsource = "x"\n' + text)
        with pytest.raises(ConfigError, match=message):
            ServerConfig.from_toml(str(bad))
    bad.write_text('[[models]]\nsource = "x"\n')
    with pytest.raises(ConfigError, match="has no id"):
        ServerConfig.from_toml(str(bad))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1  # configs are values: what was validated stays so
    default = ServerConfig.from_toml()
    assert [m.role for m in default.models] == ["fast", "capable"]


# ---- /health and /ready over a fake engine ----------------------------------------------------------------


class _FakeEngine:
    """Just enough of LLMEngine for AsyncLLM: its core's step hangs once a request is added."""

    max_model_len = 128
    tokenizer = None

    def __init__(self, config):
        self.core = _FakeCore()


class _FakeCore:
    last_step = None

    def __init__(self):
        self.requests = {}
        self.release = threading.Event()
        self.kv = KVCacheManager(8)
        self.scheduler = Scheduler(SchedulerConfig(), self.kv)  # pure Python: the real stats shape

    def add_request(self, request):
        self.requests[request.request_id] = request.prompt_token_ids
        return request.request_id

    def abort_request(self, request_id):
        self.requests.pop(request_id, None)
        return None

    def has_unfinished_requests(self):
        return bool(self.requests)

    @property
    def num_unfinished_requests(self):
        return len(self.requests)

    def step(self):
        self.release.wait(10)  # a hung forward pass
        return []


def test_health_and_ready_in_process(tmp_path):
    from kvserve.engine.async_engine import AsyncLLM
    from kvserve.server.app import create_app

    cfg = ServerConfig(models=[ServedModel(id="fake", source="/dev/null", role="fast")], home=str(tmp_path),
                       stall_timeout_s=0.3)
    app = create_app(cfg)
    state = app.state.kv
    handle = state.models["fake"]
    handle.client = AsyncLLM(handle.engine_config, model_id="fake", engine_factory=_FakeEngine)

    async def scenario():
        await state.startup()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                handle.client.wait_ready(5)
                assert (await c.get("/ready")).status_code == 200
                assert (await c.get("/health")).status_code == 200
                await handle.client.submit(EngineRequest("r1", [1, 2], SamplingParams(), tenant="t"))
                await asyncio.sleep(0.6)  # work pending, no step finishes
                h = await c.get("/health")
                assert h.status_code == 503 and h.json()["unhealthy_models"] == ["fake"]
                assert (await c.get("/metrics")).status_code == 200
                r = await c.get("/v1/models")
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
                handle.client.core.requests.clear()
                handle.client.core.release.set()
                state.draining = True
                assert (await c.get("/ready")).status_code == 503
        finally:
            state.draining = True
            handle.client.core.release.set()
            await state.shutdown()

    asyncio.run(scenario())
