"""LLMEngine (add_request / abort_request / step) and the offline LLM API (generate / chat).

One step: schedule -> execute (runner) -> sample -> update scheduler -> detokenize and check stops.
Forks for n > 1 are made when the parent's prompt is done: its last prompt position's logits
are sampled n times, and the children share the prompt's blocks (copy-on-write on the last one).
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from kvserve.config import ConfigError, EngineConfig, TierLimits, engine_config_from_kwargs
from kvserve.engine.errors import InvalidRequest
from kvserve.engine.interjection import Interjection
from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.output_processor import OutputProcessor, RequestState, SeqState
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.request import Priority, Sequence
from kvserve.engine.sampler import Sampler, SamplingMetadata, make_generator
from kvserve.engine.sampling import SamplingParams
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.scheduler_output import SchedulerOutput
from kvserve.kernels import kv_quant
from kvserve.models.catalog import resolve_model
from kvserve.models.backend import quantized_weights_run
from kvserve.models.loader import (build_model, checkpoint_header, checkpoint_info, describe_forms, load_checkpoint,
                                   resolve_device, resolve_dtype, weights_label)
from kvserve.models.native_decoder import NativeDecoder
from kvserve.models.model_info import ModelInfo
from kvserve.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_MEMORY = 2 << 30
DEFAULT_GPU_KV_FRACTION = 0.5


@dataclass
class StepStats:
    """What one engine step did; the server's metrics read these."""

    started: float
    duration: float
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int


class LLMEngine:
    """Requests in, RequestOutputs out, one step at a time.

    By default it loads `config.model` and runs it with a ModelRunner. A caller may instead give the
    `runner` (anything with `execute(SchedulerOutput, interjection) -> logits or None` and the block
    moves; a simulator's runner only advances its clock) with the model's `info` (config and
    tokenizer) and `config.cache.num_gpu_blocks_override`. Every timestamp comes from `clock`.
    """

    def __init__(self, config: EngineConfig, model_id: str | None = None, *, runner=None,
                 info: ModelInfo | None = None, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        t0 = time.perf_counter()
        cache_cfg = config.cache
        if runner is None:
            resolved_id, path = resolve_model(config.model)
            self.device = resolve_device(config.device)
            model_config, tensor_names = checkpoint_header(path)
            fused = config.native_decoder and self.device.type == "cpu" \
                and NativeDecoder.would_serve(model_config, tensor_names)
            self.dtype = resolve_dtype(config.dtype, self.device, fused=fused)
            checkpoint = load_checkpoint(path, config.weights, self.dtype)
            self.weights = weights_label(checkpoint, quantized_weights_run(self.device, self.dtype), self.dtype)
            info = checkpoint_info(checkpoint, name=model_id or resolved_id)
        else:
            if info is None or not cache_cfg.num_gpu_blocks_override:
                raise ValueError("an injected runner needs the model's info and config.cache.num_gpu_blocks_override")
            resolved_id, self.device = config.model, torch.device("cpu")
            self.dtype = resolve_dtype(config.dtype, self.device)
            self.weights = "injected runner"
        kv_dtype = config.cache.kv_cache_dtype
        if kv_dtype not in kv_quant.MODES and resolve_dtype(kv_dtype, self.device) != self.dtype:
            raise ConfigError(f"kv_cache_dtype = {kv_dtype!r} is not supported: a float KV cache is held in the "
                              f"model's dtype ({str(self.dtype).removeprefix('torch.')}); use auto or int8")
        self.kv_int8 = kv_dtype == "int8"
        self.model_id = model_id or resolved_id
        self.info = info
        self.model_config, self.tokenizer = info.config, info.tokenizer
        sched_cfg = replace(config.scheduler, max_model_len=min(config.scheduler.max_model_len,
                                                                self.model_config.max_position_embeddings))
        self.config = config = replace(config, scheduler=sched_cfg)
        self.max_model_len = sched_cfg.max_model_len

        elem = kv_quant.bytes_per_element(self.model_config.head_dim, self.dtype, self.kv_int8)
        self.kv_bytes_per_token = round(self.model_config.kv_bytes_per_token_per_element * elem)
        block_bytes = cache_cfg.block_size * self.kv_bytes_per_token
        if cache_cfg.num_gpu_blocks_override:
            num_blocks = cache_cfg.num_gpu_blocks_override
        else:
            num_blocks = max(1, self._kv_memory_budget() // block_bytes)
        num_host_blocks = cache_cfg.swap_space // block_bytes
        self.kv = KVCacheManager(num_blocks, num_host_blocks, cache_cfg.block_size, cache_cfg.enable_prefix_caching)
        self.scheduler = Scheduler(sched_cfg, self.kv, clock=clock)
        if runner is None:
            torch.manual_seed(config.seed)
            forms = checkpoint.forms
            model = build_model(checkpoint, self.dtype, self.device, max_positions=self.max_model_len,
                                onednn_weights=config.onednn_weights, native_decoder=config.native_decoder,
                                consume=True)
            del checkpoint
            log.info("%s weights: %s, %.2f GB held (%s)", model_id or resolved_id, self.weights,
                     model.weight_bytes() / 1e9, describe_forms(forms))
            from kvserve.engine.runner import ModelRunner

            runner = ModelRunner(model, self.model_config, num_blocks, num_host_blocks, cache_cfg.block_size,
                                 self.dtype, self.device, kv_int8=self.kv_int8)
        self.runner = runner
        self.sampler = Sampler()
        self.eos_token_ids = set(self.tokenizer.eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len, self.scheduler, clock,
                                       self.model_id)
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.interjection: Interjection | None = None  # set by AsyncLLM: see step()
        self._interjected_s = 0.0  # time spent in interjections, to keep it out of their suspended steps' charge
        self.last_step: StepStats | None = None
        self.load_seconds = time.perf_counter() - t0
        backend = getattr(getattr(runner, "model", None), "backend", None)
        log.info("loaded %s (%s, %s, path %s) in %.1fs: %d KV blocks of %d tokens (%s, %d bytes a token), "
                 "%d host blocks", self.model_id, self.dtype, self.device,
                 backend.name if backend else "injected runner", self.load_seconds, num_blocks, cache_cfg.block_size,
                 "int8" if self.kv_int8 else str(self.dtype).removeprefix("torch."), self.kv_bytes_per_token,
                 num_host_blocks)

    def _kv_memory_budget(self) -> int:
        if self.config.cache.kv_cache_memory:
            return self.config.cache.kv_cache_memory
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * DEFAULT_GPU_KV_FRACTION)
        return DEFAULT_CPU_KV_MEMORY

    # ---- requests ------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None) -> list[int]:
        return self.info.encode(prompt, messages)

    def add_request(self, prompt: str | list[int] | None, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: Priority | str | None = None,
                    tenant: str = "default", cache_salt: str | None = None,
                    messages: list[dict] | None = None, prompt_token_ids: list[int] | None = None,
                    arrival: float | None = None, resumed_token_ids: list[int] | None = None) -> str:
        """Queue a request. Raises ContextLengthExceeded / CapacityExhausted at once when refused.

        `arrival` (on the engine's clock) is when it reached the server, if earlier than now: its wait for
        the step in flight then counts in its queue time, TTFT and the admission bounds.
        `resumed_token_ids`: output tokens already generated for this request elsewhere (a stream moved
        from a failed replica; n = 1). They are computed like a recompute after preemption, count against
        max_tokens and min_tokens, are seen by penalties and the detokenizer, and are not output again; a
        seeded request's generator skips their draws, so it goes on as it would have there."""
        params = params or SamplingParams()
        ids = prompt_token_ids if prompt_token_ids is not None else self.encode_prompt(prompt, messages)
        resumed = list(resumed_token_ids or ())
        if resumed and params.n != 1:
            raise InvalidRequest("a request can be resumed only with n = 1", param="n")
        request_id = request_id or f"req-{next(self._request_ids)}"
        if request_id in self.outputs.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        priority = Priority.parse(priority)
        if params.max_tokens is None:  # what the context leaves (Scheduler.add_request refuses a prompt that fills it)
            params.max_tokens = max(1, self.max_model_len - len(ids))
        seq = Sequence(seq_id=next(self._seq_ids), request_id=request_id, prompt_token_ids=ids, sampling=params,
                       priority=priority, tenant=tenant, cache_salt=cache_salt, output_token_ids=list(resumed))
        now = self.clock()
        seq.timings.arrival = now if arrival is None else min(arrival, now)
        self.scheduler.add_request([seq])  # admission control may raise here
        state = RequestState(request_id, prompt if isinstance(prompt, str) else None, ids, params, priority,
                             tenant, cache_salt, arrival=seq.timings.arrival, resumed_token_ids=resumed)
        self.outputs.add(state)
        ss = self._track(state, seq)
        if resumed and ss.generator is not None:
            self.sampler.skip_draws(ss.generator, len(resumed), self.model_config.vocab_size)
        return request_id

    def _track(self, state: RequestState, seq: Sequence):
        p = state.params
        return self.outputs.track(state, seq, make_generator(p.seed, seq.fork_index, self.device)
                                  if p.seed is not None else None)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (finish_reason 'abort')."""
        return self.outputs.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.outputs.requests)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: every scheduled sequence advances; returns outputs of requests that changed.

        With `interjection` set (AsyncLLM does), a step that holds batch work may stop between decoder
        layers when its flag is raised, run `interjection.run` (which calls `interject`), and go on."""
        started = self.clock()
        self.outputs.begin_step()
        out = self.scheduler.schedule()
        interjection = self.interjection if self.interjection is not None and any(
            ss.seq.priority is Priority.BATCH for ss in out.scheduled) else None
        return self._run_step(out, started, interjection)

    def interject(self) -> list[RequestOutput] | None:
        """A step of waiting interactive prompts only, run while the step in flight is suspended between
        layers (Scheduler.schedule_interjection); None when there was nothing to run. Its outputs are the
        new requests' first tokens; the suspended step's come when it ends."""
        started = self.clock()
        out = self.scheduler.schedule_interjection()
        if not out.scheduled:
            return None
        outputs = self._run_step(out, started, None)
        self._interjected_s += self.last_step.duration  # not the suspended step's own time
        return outputs

    def _run_step(self, out: SchedulerOutput, started: float, interjection: Interjection | None) -> list[RequestOutput]:
        touched: dict[str, RequestState] = {}
        interjected_before = self._interjected_s
        for seq in out.finished:  # queue timeouts decided by the scheduler
            ss = self.outputs.seq_states.get(seq.seq_id)
            if ss is not None:
                self.outputs.finish(ss, seq.status, touched)
        logits = self.runner.execute(out, interjection)
        if logits is not None:
            self._sample_and_update(out, logits, touched)
        elif out.scheduled:
            self.scheduler.update_from_output(out, {})
        num_prefill = sum(s.num_new_tokens for s in out.scheduled if s.seq.is_prefill or s.num_new_tokens > 1)
        duration = self.clock() - started
        self.last_step = StepStats(started, duration, len(out.scheduled), num_prefill,
                                   out.num_batched_tokens - num_prefill, len(out.preempted))
        self.outputs.charge(out.scheduled, duration - (self._interjected_s - interjected_before))
        return self.outputs.end_step(touched)

    def _sample_and_update(self, out, logits: torch.Tensor, touched: dict) -> None:
        sampled = [s for s in out.scheduled if s.sample]
        rows: list[int] = []
        targets: list[tuple[SeqState, SeqState | None]] = []  # (state, parent if this is a new fork)
        for i, s in enumerate(sampled):
            ss = self.outputs.seq_states[s.seq.seq_id]
            rows.append(i)
            targets.append((ss, None))
            state = self.outputs.requests[ss.seq.request_id]
            if state.params.n > 1 and not state.forked:
                state.forked = True
                for k in range(1, state.params.n):
                    child = Sequence(seq_id=next(self._seq_ids), request_id=state.request_id,
                                     prompt_token_ids=state.prompt_token_ids, sampling=state.params,
                                     priority=state.priority, tenant=state.tenant, cache_salt=state.cache_salt,
                                     fork_index=k)
                    rows.append(i)
                    targets.append((self._track(state, child), ss))
        if rows != list(range(len(sampled))):
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        seqs = [t[0].seq for t in targets]
        md = SamplingMetadata.build([s.sampling for s in seqs], [s.output_token_ids for s in seqs],
                                    [s.prompt_token_ids for s in seqs], [t[0].generator for t in targets],
                                    self.eos_token_ids, device=logits.device)
        result = self.sampler(logits, md)
        tokens = result.tolist()
        logprobs = result.logprobs
        now = self.clock()
        self.scheduler.update_from_output(out, {t[0].seq.seq_id: tok for t, tok in zip(targets, tokens)
                                                if t[1] is None})
        # Forks first: processing the parent's token may finish it (max_tokens=1, eos, a stop) and free
        # the blocks its forks are to share.
        for (ss, parent), tok in zip(targets, tokens):
            if parent is not None:  # a new fork with its own first token (Scheduler.fork: the rest is the parent's)
                seq = ss.seq
                seq.append_token(tok)
                seq.timings.first_token = seq.timings.last_token = now
                seq.timings.token_times.append(now)
                self.scheduler.fork(parent.seq, seq)
        for j, ((ss, _), tok) in enumerate(zip(targets, tokens)):
            self.outputs.process_token(ss, tok, logprobs[j] if logprobs else None, touched)

    @staticmethod
    def reset_deltas(outputs: list[RequestOutput]) -> None:
        for ro in outputs:
            for o in ro.outputs:
                o.delta_text, o.delta_token_ids, o.delta_logprobs = "", [], None


class LLM:
    """Offline batch inference with vLLM's shape: LLM("smollm2-135m").generate(prompts, params)."""

    def __init__(self, model: str, **engine_args):
        config = engine_config_from_kwargs(model, **engine_args)
        if "interactive" not in engine_args and "batch" not in engine_args:
            # Offline work is all submitted at once: queue bounds are for servers, not for a batch job.
            config = replace(config, scheduler=replace(config.scheduler, interactive=TierLimits.unbounded(),
                                                       batch=TierLimits.unbounded()))
        self.engine = LLMEngine(config)

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: str | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([dict(prompt=p) for p in prompts], sampling_params, use_tqdm, priority)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run([dict(prompt=None, messages=m) for m in conversations], sampling_params, use_tqdm, None)

    def _run(self, inputs: list[dict], sampling_params, use_tqdm: bool, priority) -> list[RequestOutput]:
        from copy import deepcopy

        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(inputs)
        if len(sampling_params) != len(inputs):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        engine = self.engine
        ids = [engine.add_request(params=deepcopy(sp), priority=priority, **inp)
               for inp, sp in zip(inputs, sampling_params)]
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) >= 8:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while engine.has_unfinished_requests():
            for ro in engine.step():
                if ro.finished:
                    results[ro.request_id] = ro
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        outputs = [results[i] for i in ids]
        LLMEngine.reset_deltas(outputs)
        return outputs
