"""LLMEngine: the assembly of one model's engine (load the checkpoint, make the hardware plan, build the
ModelRunner and the EngineCore over it), and the offline LLM API (generate / chat) on top.

The step loop itself is EngineCore's (engine/core.py); this module is what needs torch to set it up.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace
from typing import Callable

import torch

from kvserve.config import EngineConfig, LoRAAdapterSpec, TierLimits, engine_config_from_kwargs
from kvserve.engine.core import EngineCore, Executor
from kvserve.engine.kv.manager import KVCacheManager
from kvserve.engine.kv.disk import DiskKVStore, kv_namespace, model_digest
from kvserve.engine.kv.host import HostKVStore
from kvserve.engine.kv.eviction import KVSharePolicy
from kvserve.engine.kv.groups import KVLayout
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.request import EngineRequest, Priority
from kvserve.engine.worker.cuda_graphs import GraphPlan, capture_cuda_graph
from kvserve.engine.worker.runner import ModelRunner
from kvserve.engine.worker.sleep import Sleeper, SleepBusy, SleepReport, SleepUnsupported
from kvserve.engine.sampling import SamplingParams
from kvserve.engine.step_time import StepTimeModel, StepTimePrior
from kvserve.kernels import kv_quant
from kvserve.models import backend
from kvserve.models.attention import kv_cache_dtype
from kvserve.models.catalog import resolve_model
from kvserve.models.loader import (build_model, checkpoint_header, checkpoint_info, describe_forms, load_checkpoint,
                                   weights_label)
from kvserve.models.model_info import ModelInfo
from kvserve.models.tokenizer import Tokenizer
from kvserve.engine.structured.grammar import GrammarCompiler

log = logging.getLogger(__name__)


class LLMEngine:
    """One model's engine, assembled: the loaded model, its hardware plan, the runner, the KV tiers and the
    EngineCore over them (`core`: the step loop callers drive, engine/core.py).

    By default it loads `config.model`, plans its hardware once (models/backend.plan) and runs it with a
    ModelRunner. A caller may instead give the `executor` (anything with `execute(SchedulerOutput,
    interjection) -> RunnerOutput` and the block moves) with the model's `info` (config and tokenizer)
    and `config.cache.num_gpu_blocks_override`. Every timestamp comes from `clock`."""

    def __init__(self, config: EngineConfig, model_id: str | None = None, *, executor: Executor | None = None,
                 info: ModelInfo | None = None, clock: Callable[[], float] = time.monotonic,
                 step_time_prior: StepTimePrior | None = None):
        t0 = time.perf_counter()
        self._sleeper: Sleeper | None = None  # sleep mode (sleep, wake_up)
        checkpoint, path = self._load_and_plan(config, model_id, executor, info)
        num_blocks, num_host_blocks = self._size_kv()
        if executor is not None:
            self.runner = self.executor = executor
        elif config.tensor_parallel_size > 1:
            self.executor = self._start_tensor_parallel(checkpoint, path, num_blocks, num_host_blocks)
            self.runner = self.executor.runner  # rank 0's: it samples
        else:
            self.runner = self.executor = self._build_runner(checkpoint, num_blocks, num_host_blocks)
        del checkpoint
        self.adapters = self._enable_lora() if config.lora_enabled and executor is None else None
        tier = self._open_tiers(path)
        prior = step_time_prior.model() if step_time_prior is not None and step_time_prior.fits(self.dtype) else None
        self.core = self._build_core(num_blocks, num_host_blocks, tier, clock, prior)
        self.num_blocks = num_blocks
        self._request_ids = itertools.count()
        self.load_seconds = time.perf_counter() - t0
        built = getattr(getattr(self.runner, "model", None), "backend", None)
        # The numerics in force: the plan's, unless the built model fell back from the fused decoder.
        self.numerics = self.plan.numerics if built is None or built.invariant else "fast"
        cache_cfg = self.config.cache
        log.info("loaded %s (%s, %s, path %s, numerics %s) in %.1fs: %d KV blocks of %d tokens and %d layers in %d "
                 "KV groups (%s, %d bytes a token a device), %d host blocks%s", self.model_id, self.dtype, self.device,
                 built.name if built else "injected executor", self.numerics, self.load_seconds, num_blocks,
                 cache_cfg.block_size, self.kv_layout.group_size, self.kv_layout.num_groups,
                 self.kv_label, self.kv_bytes_per_token,
                 num_host_blocks, "; step-time prior from this machine's calibration" if prior else "")

    def _load_and_plan(self, config: EngineConfig, model_id: str | None, executor: Executor | None,
                       info: ModelInfo | None):
        """The hardware plan and the model's info: from the checkpoint's header and weights (returned, with its
        path, for the runner to consume), or for an injected executor from `info` (None, None)."""
        cache_cfg = config.cache
        checkpoint = path = None
        if executor is None:
            resolved_id, path = resolve_model(config.model)
            header_config, tensor_names = checkpoint_header(path)
            self.plan = backend.plan(header_config, tensor_names, device=config.device, dtype=config.dtype,
                                     kv_cache_dtype=cache_cfg.kv_cache_dtype, kv_cache_memory=cache_cfg.kv_cache_memory,
                                     native_decoder=config.native_decoder and config.tensor_parallel_size == 1,
                                     onednn_weights=config.onednn_weights,
                                     numerics=config.numerics, activations=config.activations,
                                     cuda_graphs=config.cuda_graphs, weights=config.weights)
            if config.tensor_parallel_size > 1:  # rank 0's slices only, dense (models/parallel.py)
                from kvserve.engine.worker.tensor_parallel import rank_weights
                from kvserve.models.parallel import TensorParallel

                checkpoint = load_checkpoint(path, rank_weights(config.weights), self.plan.dtype,
                                             shard=TensorParallel(config.tensor_parallel_size, 0))
            else:
                checkpoint = load_checkpoint(path, config.weights, self.plan.dtype,
                                             int8_acts=self.plan.activations == "int8")
            self.weights = weights_label(checkpoint, self.plan.quantized_weights, self.plan.dtype)
            info = checkpoint_info(checkpoint, name=model_id or resolved_id)
        else:
            if info is None or not cache_cfg.num_gpu_blocks_override:
                raise ValueError("an injected executor needs the model's info and config.cache.num_gpu_blocks_override")
            resolved_id = config.model
            cpu = torch.device("cpu")
            self.plan = backend.Plan(device=cpu, dtype=backend.resolve_dtype(config.dtype, cpu), path="injected",
                                     quantized_weights=False, onednn_weights=False,
                                     kv_int8=cache_cfg.kv_cache_dtype == "int8", kv_memory=0,
                                     numerics=config.numerics, kv_fp8=cache_cfg.kv_cache_dtype == "fp8")
            self.weights = "injected executor"
        self.device, self.dtype, self.kv_int8 = self.plan.device, self.plan.dtype, self.plan.kv_int8
        self.kv_fp8 = self.plan.kv_fp8
        self.kv_dtype = kv_cache_dtype(self.dtype, self.kv_int8, self.kv_fp8)  # the cache tensors' element type
        self.kv_label = "int8" if self.kv_int8 else str(self.kv_dtype).removeprefix("torch.")
        self.activations = self.plan.activations  # what its quantized matrices multiply (bf16 or int8)
        self.model_id = model_id or resolved_id
        self.info = info
        self.model_config, self.tokenizer = info.config.with_attention_window(config.sinks_window), info.tokenizer
        sched_cfg = replace(config.scheduler, max_model_len=min(config.scheduler.max_model_len,
                                                                self.model_config.max_position_embeddings))
        self.config = replace(config, scheduler=sched_cfg)
        self.max_model_len = sched_cfg.max_model_len
        return checkpoint, path

    def _size_kv(self) -> tuple[int, int]:
        """The KV layout and page size, and how many device and host blocks the plan's memory holds: per device,
        so under tensor parallelism of a rank's KV heads (every rank holds as many blocks, each its heads' share;
        the host pool of `swap_space` bytes is per rank too, as vLLM's)."""
        cache_cfg = self.config.cache
        elem = kv_quant.bytes_per_element(self.model_config.head_dim, self.kv_dtype, self.kv_int8)
        device_heads = self.model_config.num_kv_heads
        if self.config.tensor_parallel_size > 1:
            from kvserve.models.parallel import TensorParallel

            device_heads = TensorParallel(self.config.tensor_parallel_size, 0).kv_heads(self.model_config)[0]
        self.kv_bytes_per_token = round(self.model_config.kv_bytes_per_token_per_element * elem * device_heads
                                        / self.model_config.num_kv_heads)
        self.kv_layout = KVLayout.for_model(self.model_config, split=cache_cfg.kv_groups)
        # A block ("page") holds one group's layers: all of them with one group.
        self.kv_page_bytes = block_bytes = cache_cfg.block_size * self.kv_bytes_per_token * \
            self.kv_layout.group_size // self.model_config.num_layers
        num_blocks = cache_cfg.num_gpu_blocks_override or max(1 + self.kv_layout.reserved_pages,
                                                              self.plan.kv_memory // block_bytes)
        if self.device.type == "cuda" and not cache_cfg.num_gpu_blocks_override:
            # Each cache tensor stays under 2^31 elements: past that torch's CUDA index kernels (the K/V writes and
            # gathers of the op-by-op path) take 64-bit paths that cost about the whole tensor per call.
            row = kv_quant.row_width(self.model_config.head_dim, self.kv_int8)
            cap = (2 ** 31 - 1) // (cache_cfg.block_size * device_heads * row)
            if num_blocks > cap:
                log.info("%s: KV pool capped at %d blocks (of %d that fit): a cache tensor over 2^31 elements is slow "
                         "to index on CUDA", self.model_id, cap, num_blocks)
                num_blocks = cap
        return num_blocks, cache_cfg.swap_space // block_bytes

    def _build_runner(self, checkpoint, num_blocks: int, num_host_blocks: int) -> ModelRunner:
        """The model built to the plan from the checkpoint (which it consumes), in a ModelRunner with its KV pool."""
        config = self.config
        torch.manual_seed(config.seed)
        forms = checkpoint.forms
        model = build_model(checkpoint, self.plan, max_positions=self.max_model_len, consume=True,
                            attention_window=config.sinks_window)
        log.info("%s weights: %s, %.2f GB held, %.2f GB read per token (%s); quantized matrices multiply %s "
                 "activations", self.model_id, self.weights, model.weight_bytes() / 1e9,
                 model.token_weight_bytes() / 1e9, describe_forms(forms), self.plan.activations)
        return ModelRunner(model, self.model_config, num_blocks, num_host_blocks, config.cache.block_size,
                           self.dtype, self.device, kv_int8=self.kv_int8, kv_fp8=self.kv_fp8,
                           eos_token_ids=self.tokenizer.eos_token_ids, layout=self.kv_layout,
                           graphs=GraphPlan(capture_cuda_graph(torch.cuda.graph_pool_handle()),
                                            config.scheduler.max_num_seqs, self.max_model_len)
                           if self.plan.cuda_graphs else None, pages_contiguous=self.plan.kv_pages_contiguous)

    @property
    def resident_bytes(self) -> int:
        """What the loaded model holds on its device: its weights (this process's rank) and its KV pool. Asleep, the
        same: it wakes for the next request, so the model memory keeps its room."""
        model = getattr(self.runner, "model", None)
        weights = model.weight_bytes() if model is not None else 0
        return weights + self.num_blocks * self.kv_page_bytes

    def _enable_lora(self):
        """The model's adapters (engine/worker/adapters.py) and the runner's slots for them; the configured ones
        read now."""
        from kvserve.engine.worker.adapters import Adapters

        config = self.config
        adapters = Adapters(config.lora_adapters, self.model_config, config.max_lora_rank, config.max_cpu_loras)
        self.runner.enable_lora(adapters, config.scheduler.max_loras, config.max_lora_rank)
        for spec in config.lora_adapters:
            adapters.load(spec)
        return adapters

    def _start_tensor_parallel(self, checkpoint, path, num_blocks: int, num_host_blocks: int):
        """Ranks 1..N-1 in processes of their own and rank 0 here, each with its slice of the model and of every KV
        block (engine/worker/tensor_parallel.py); the pool's block count is what one device's KV memory holds of a
        rank's heads (_size_kv)."""
        from kvserve.engine.worker import tensor_parallel

        spec = tensor_parallel.RankSpec(config=self.config, plan=self.plan, path=str(path), num_blocks=num_blocks,
                                        num_host_blocks=num_host_blocks, max_model_len=self.max_model_len,
                                        port=tensor_parallel.free_port(), size=self.config.tensor_parallel_size)
        return tensor_parallel.start(spec, checkpoint, self.tokenizer.eos_token_ids)

    def _open_tiers(self, model_path) -> HostKVStore | DiskKVStore | None:
        """The KV pool's lower tiers (host memory over disk), where prefix caching and the settings ask for them;
        returns the top one, which the runner reads and writes."""
        cache_cfg = self.config.cache
        self.kv_disk = self.kv_host = None
        if cache_cfg.kv_disk_dir is not None and cache_cfg.enable_prefix_caching and model_path is not None:
            self.kv_disk = self._open_kv_disk(cache_cfg, model_path)
        if cache_cfg.kv_host_bytes and cache_cfg.enable_prefix_caching:
            if self.device.type == "cpu":
                log.warning("%s: kv_host_bytes on a CPU keeps copies of evicted blocks in the memory the pool "
                            "could hold them in; a larger kv_cache_memory does the same without the copies",
                            self.model_id)
            self.kv_host = HostKVStore(self.runner.page_bytes, cache_cfg.kv_host_bytes, below=self.kv_disk,
                                       write_through=cache_cfg.kv_disk_write_through)
        tier = self.kv_host or self.kv_disk
        if tier is not None:
            self.runner.tier = tier
        return tier

    def _build_core(self, num_blocks: int, num_host_blocks: int, tier, clock: Callable[[], float],
                    prior: StepTimeModel | None) -> EngineCore:
        """The EngineCore over the runner: its KV pool, the tokenizer's stops and the grammar compiler."""
        cache_cfg = self.config.cache
        kv = KVCacheManager(num_blocks, num_host_blocks, cache_cfg.block_size, cache_cfg.enable_prefix_caching,
                            self.kv_layout, tier=tier,
                            shares=KVSharePolicy(cache_cfg.kv_tenant_weights, cache_cfg.kv_pinned_blocks),
                            write_through=cache_cfg.kv_disk_write_through and self.kv_disk is not None)
        return EngineCore(self.config.scheduler, kv, self.executor, max_model_len=self.max_model_len,
                          model_id=self.model_id, tokenizer=self.tokenizer,
                          eos_token_ids=frozenset(self.tokenizer.eos_token_ids), clock=clock, step_time=prior,
                          grammars=GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                   self.config.structured_limits))

    def _open_kv_disk(self, cache_cfg, model_path) -> DiskKVStore:
        """The disk tier for this model file, dtype, block size and KV layout (another of any never hits)."""
        t0 = time.perf_counter()
        layout = ";".join(f"{g.window}:{','.join(map(str, g.layers))}" for g in self.kv_layout.groups)
        namespace = kv_namespace(model_digest(model_path, cache_cfg.kv_disk_dir), self.kv_label, cache_cfg.block_size,
                                 layout)
        store = DiskKVStore(cache_cfg.kv_disk_dir, namespace, self.runner.page_bytes, cache_cfg.kv_disk_bytes)
        stats = store.stats()
        log.info("%s KV disk tier at %s: %d pages (%.1f MB) found, budget %.1f GB (opened in %.1fs)", self.model_id,
                 store.root, stats.entries, stats.bytes / 1e6, cache_cfg.kv_disk_bytes / 1e9, time.perf_counter() - t0)
        return store

    def close(self, save: bool = True) -> None:
        """Between steps, on the thread that steps the engine: save the prefix pages the disk tier lacks, most
        recently used first for at most kv_disk_flush_seconds, so a restart finds them (`save`: unless a failed
        step left the pool in doubt), then finish the disk tier's queued writes; a tensor-parallel group's other
        ranks are stopped."""
        if hasattr(self.executor, "close"):
            self.executor.close()
        if self.kv_disk is None:
            return
        if save:
            self._save_prefix_cache()
        self.kv_disk.close()

    def _save_prefix_cache(self) -> None:
        """The prefix pages the disk tier lacks, to it (at most kv_disk_flush_seconds); nothing without one."""
        if self.kv_disk is None or self.config.cache.kv_disk_flush_seconds <= 0:
            return
        t0 = time.monotonic()
        try:
            saved = self.core.kv.save_to(self.kv_disk, self.runner.read_pages,
                                         t0 + self.config.cache.kv_disk_flush_seconds, host=self.kv_host)
            log.info("%s: saved %d prefix pages to the KV disk tier in %.1fs", self.model_id, saved,
                     time.monotonic() - t0)
        except Exception:  # a failed save loses cache entries only
            log.exception("%s: saving the prefix cache to the KV disk tier failed", self.model_id)

    # ---- sleep mode (engine/worker/sleep.py) -------------------------------------------------
    @property
    def asleep(self) -> bool:
        return self._sleeper is not None and self._sleeper.asleep

    def sleep(self, directory: str | None = None) -> SleepReport:
        """Free the weights' memory (written to a file in `directory`, read back on waking) and the KV pools'
        (discarded: the prefix cache is saved to the disk tier if there is one, then forgotten); the rest of the
        engine stays as it is. Between steps, with no request in the engine."""
        if self.asleep:
            raise SleepUnsupported(f"model {self.model_id} is asleep already")
        if not isinstance(self.runner, ModelRunner) or self.executor is not self.runner or self.device.type != "cpu":
            raise SleepUnsupported(f"model {self.model_id} cannot sleep: sleep mode frees a CPU engine's own memory "
                                   "(one process, no tensor parallelism)")
        if self.core.has_unfinished_requests():
            raise SleepBusy(f"model {self.model_id} has requests in flight: it sleeps once they finish")
        self._save_prefix_cache()
        self.core.kv.reset_prefix_cache()
        runner = self.runner
        self._sleeper = Sleeper(runner.model, [runner.kv_slots, runner.host_slots], directory)
        report = self._sleeper.sleep()
        log.info("%s: asleep in %.2fs: %.1f MB of weights paged out, %.1f MB of KV freed", self.model_id,
                 report.seconds, report.paged_out_bytes / 1e6, report.discarded_bytes / 1e6)
        return report

    def wake_up(self) -> float:
        """Read the weights back (sleep); the seconds it took. Nothing if awake."""
        if not self.asleep:
            return 0.0
        seconds = self._sleeper.wake()
        log.info("%s: awake in %.2fs", self.model_id, seconds)
        return seconds

    # ---- requests ------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None) -> list[int]:
        return self.info.encode(prompt, messages)

    def request(self, prompt: str | list[int] | None = None, params: SamplingParams | None = None, *,
                messages: list[dict] | None = None, request_id: str | None = None,
                priority: Priority | str | None = None, **fields) -> EngineRequest:
        """An EngineRequest for this model from a prompt (text or token ids) or chat messages, tokenized here
        (offline use and tools; the server's service tokenizes and builds its own)."""
        ids = self.encode_prompt(prompt, messages)
        return EngineRequest(request_id or f"req-{next(self._request_ids)}", ids, params or SamplingParams(),
                             Priority.parse(priority), prompt=prompt if isinstance(prompt, str) else None, **fields)

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

    def close(self) -> None:
        """Save the prefix cache to the disk tier (kv_disk_dir) for the next LLM on it (LLMEngine.close)."""
        self.engine.close()

    def sleep(self, directory: str | None = None) -> SleepReport:
        """vLLM's LLM.sleep(level=1): the weights paged out to a file in `directory` (default: the temporary
        directory) and the KV memory freed (LLMEngine.sleep); the next generate, or wake_up, reads them back."""
        return self.engine.sleep(directory)

    def wake_up(self) -> float:
        return self.engine.wake_up()

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: str | None = None,
                 lora_request: "LoRARequest | str | list | None" = None) -> list[RequestOutput]:
        """`lora_request`: the adapter every prompt runs with, or one per prompt (None: the base model); a
        LoRARequest (read from its path the first time) or the name of a configured adapter."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([dict(prompt=p) for p in prompts], sampling_params, use_tqdm, priority, lora_request)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run([dict(prompt=None, messages=m) for m in conversations], sampling_params, use_tqdm, None)

    def _adapter_keys(self, lora_request, count: int) -> list[str | None]:
        """Each input's adapter key (held in use: release them), from LLM.generate's `lora_request`."""
        from kvserve.engine.lora import LoRARequest

        loras = lora_request if isinstance(lora_request, list) else [lora_request] * count
        if len(loras) != count:
            raise ValueError("one lora_request per prompt, or a single one for all")
        adapters, keys = self.engine.adapters, []
        for lora in loras:
            if lora is None:
                keys.append(None)
                continue
            if adapters is None:
                raise ValueError("this LLM serves no LoRA adapters: build it with enable_lora=True")
            if isinstance(lora, LoRARequest):
                if lora.lora_name not in adapters.names():
                    adapters.load(LoRAAdapterSpec(lora.lora_name, lora.lora_path))
                lora = lora.lora_name
            keys.append(adapters.acquire(lora))
        return keys

    def _run(self, inputs: list[dict], sampling_params, use_tqdm: bool, priority,
             lora_request=None) -> list[RequestOutput]:
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(inputs)
        if len(sampling_params) != len(inputs):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        keys = self._adapter_keys(lora_request, len(inputs))
        self.engine.wake_up()  # (asleep: the weights read back first)
        try:
            return self._generate(inputs, sampling_params, use_tqdm, priority, keys)
        finally:
            for key in keys:
                if key is not None:
                    self.engine.adapters.release(key)

    def _generate(self, inputs: list[dict], sampling_params: list[SamplingParams], use_tqdm: bool, priority,
                  keys: list[str | None]) -> list[RequestOutput]:
        engine, core = self.engine, self.engine.core
        ids = [core.add_request(engine.request(params=sp, priority=priority, lora=key, **inp))
               for inp, sp, key in zip(inputs, sampling_params, keys)]
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) >= 8:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while core.has_unfinished_requests():
            for ro in core.step():
                if ro.finished:
                    results[ro.request_id] = ro
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        outputs = [results[i] for i in ids]
        LLMEngine.reset_deltas(outputs)
        return outputs
