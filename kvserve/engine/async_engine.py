"""AsyncLLM: the engine behind the server.

The engine runs in its own thread (model loading first, then a step loop while there is work), so
the event loop only moves bytes. Commands (add, abort) cross into the engine thread through a queue
and are applied between steps; outputs come back to each request's asyncio queue through
`call_soon_threadsafe`. Only the engine thread touches the scheduler, the KV manager and the model.
"""
from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable, Iterator

from kvserve.config import EngineConfig
from kvserve.engine.client import EngineHealth, EngineStatus, check_available
from kvserve.engine.errors import LoRANotFound, ModelFailed
from kvserve.engine.interjection import Interjection
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.request import EngineRequest, Priority
from kvserve.engine.sampling import SamplingParams
from kvserve.models.model_info import ModelInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Sink:
    """Where one request's outputs go: an asyncio queue, fed from the engine thread through its loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def __call__(self, out: RequestOutput) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, out)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


@dataclass
class _Add:
    request: EngineRequest
    sink: _Sink
    done: Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Work for the engine thread between steps (sleep mode); its result or exception goes to `done`."""

    fn: Callable[[], object]
    done: Future


class _QueueStream:
    """A request's RequestOutputs from its asyncio queue (the engine thread feeds it); closing the
    stream before the finished output aborts the request."""

    def __init__(self, request_id: str, queue: asyncio.Queue, abort: Callable[[str], None]):
        self.request_id = request_id
        self._queue = queue
        self._abort = abort
        self._done = False

    def __aiter__(self) -> "_QueueStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        out = await self._queue.get()
        self._done = out.finished
        return out

    def get_nowait(self) -> RequestOutput | None:
        """The next output if one is already queued, else None (to batch what a step delivered at once)."""
        if self._done or self._queue.empty():
            return None
        out = self._queue.get_nowait()
        self._done = out.finished
        return out

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._abort(self.request_id)


class AsyncLLM:
    """The in-process EngineClient (engine/client.py): an LLMEngine stepping in its own thread."""

    loads_in_process = True  # its model's memory is this process's: the server may load it by demand

    def __init__(self, config: EngineConfig, model_id: str | None = None,
                 on_step: Callable | None = None, on_finish: Callable[[RequestOutput], None] | None = None,
                 engine_factory: Callable | None = None):
        self.config = config
        self.model_id = model_id or config.model
        self.status = EngineStatus.WARMING
        self.engine = None  # the assembly (LLMEngine): the model, its tokenizer and tiers
        self.core = None  # its EngineCore: what the engine thread steps
        self.error: str | None = None
        self._commands: queue.Queue = queue.Queue()
        self._held: list = []  # commands taken during an interjection that wait for the step's end
        # Raised by submit() for an interactive request: a step with batch work stops at its next layer
        # and the request starts at once (EngineCore.interject), instead of after the rest of the step.
        self._interject_flag = ctypes.c_int32(0)
        self._wake = threading.Event()
        self._stop = False
        self._sinks: dict[str, _Sink] = {}
        self._adapter_of: dict[str, str] = {}  # request id -> its LoRA adapter's key, held in use until it ends
        self._on_step = on_step
        self._on_finish = on_finish
        self._engine_factory = engine_factory
        self.started_at = time.monotonic()
        self.last_step_at: float | None = None
        self.last_progress_at = time.monotonic()
        self.busy_seconds = 0.0
        self.num_inflight = 0  # requests added and not finished (engine thread writes, others read)
        self.num_waiting = 0
        self.stats = None  # SchedulerStats after the latest step (written by the engine thread only)
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.model_id}", daemon=True)
        self._ready = threading.Event()

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> "AsyncLLM":
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        if self.status == EngineStatus.FAILED:
            raise RuntimeError(f"engine for {self.model_id} failed to start: {self.error}")
        return self.status == EngineStatus.READY

    def drain(self) -> None:
        """Stop admitting; running requests continue."""
        if self.status in (EngineStatus.READY, EngineStatus.SLEEPING):
            self.status = EngineStatus.DRAINING

    def stop(self, timeout: float = 10.0) -> None:
        """Stop stepping (`timeout`: for the step in flight) and close the engine on its thread, which saves its
        prefix cache to the disk tier for a restart (kv_disk_flush_seconds more at most)."""
        self._stop = True
        self._wake.set()
        if self._thread.ident is not None:  # started (a model loaded by demand may never have been)
            self._thread.join(timeout + self.config.cache.kv_disk_flush_seconds)
        self.status = EngineStatus.STOPPED

    @property
    def info(self) -> ModelInfo | None:
        return self.engine.info if self.engine is not None else None

    @property
    def tokenizer(self):
        return self.engine.tokenizer if self.engine is not None else None

    @property
    def max_model_len(self) -> int | None:
        return self.engine.max_model_len if self.engine is not None else None

    @property
    def weights(self) -> str | None:
        return self.engine.weights if self.engine is not None else None

    @property
    def numerics(self) -> str | None:
        return self.engine.numerics if self.engine is not None else None

    @property
    def activations(self) -> str | None:
        return self.engine.activations if self.engine is not None else None

    def health(self) -> EngineHealth:
        return EngineHealth(self.status, self.last_step_at, self.busy_seconds, self.started_at, self.error,
                            getattr(self.engine, "load_seconds", None))

    def is_stalled(self, timeout: float) -> bool:
        """Work is pending but no step has completed for `timeout` seconds (the engine hangs)."""
        if self.status == EngineStatus.FAILED:
            return True
        busy = self.num_inflight > 0 or not self._commands.empty() or bool(self._held)
        return busy and time.monotonic() - self.last_progress_at > timeout

    # ---- requests ------------------------------------------------------------------------
    async def submit(self, request: EngineRequest) -> _QueueStream:
        """Queue a request (EngineClient.submit); admission and context errors raise here. A request without
        an arrival time is stamped now: the engine thread takes it only after the step in flight, and that
        wait counts."""
        check_available(self)
        if request.arrival is None:
            request = replace(request, arrival=time.monotonic())
        if request.lora is not None:
            # The adapter named: read if it is not resident (off the engine thread; the wait counts in this
            # request's queue time) and held in use until the request ends (_pop_sink).
            adapters = self.engine.adapters if self.engine is not None else None
            if adapters is None:
                raise LoRANotFound(f"model {self.model_id} serves no LoRA adapters (enable_lora)")
            request = replace(request, lora=await asyncio.to_thread(adapters.acquire, request.lora))
        constraint = request.params.structured_outputs
        if constraint is not None and request.grammar is None and self.engine is not None:
            # Compiled here, off the engine thread, within its budget (a 400 past it); the wait counts in the
            # request's queue time, not in anyone else's step.
            grammars = self._grammars
            if grammars is not None:
                request = replace(request, grammar=await grammars.compile_async(constraint))
        outputs: asyncio.Queue = asyncio.Queue()
        done: Future = Future()
        self._commands.put(_Add(request, _Sink(asyncio.get_running_loop(), outputs), done))
        if request.priority is Priority.INTERACTIVE:
            self._interject_flag.value = 1
        self._wake.set()
        request_id = await asyncio.wrap_future(done)
        return _QueueStream(request_id, outputs, self.abort)

    async def generate(self, prompt: str | list[int] | None = None, params: SamplingParams | None = None,
                       request_id: str | None = None, priority: Priority | str | None = None,
                       messages: list[dict] | None = None, **fields) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs (with deltas) for a prompt (text or ids) or chat messages until finished
        (waits for the model to load; tokenizes here). Admission errors raise before the first.

        Closing or cancelling the iterator aborts the request; its blocks are freed within a step.
        """
        if self.engine is None:
            await asyncio.to_thread(self.wait_ready)
        stream = await self.submit(self.engine.request(prompt, params, messages=messages, request_id=request_id,
                                                       priority=priority, **fields))
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    # ---- LoRA adapters (engine/worker/adapters.py) ----------------------------------------------------
    def adapter_names(self) -> list[str]:
        """The adapters a request may name: the engine's, or the configured ones until it is loaded."""
        engine = self.engine
        if engine is not None and engine.adapters is not None:
            return engine.adapters.names()
        return [a.name for a in self.config.lora_adapters]

    def adapter_spec(self, name: str):
        return self._adapters().spec(name)

    async def load_adapter(self, name: str, path: str, pinned: bool = False) -> None:
        """Register and read an adapter (an admin's load), off the engine thread."""
        from kvserve.config import ConfigError, LoRAAdapterSpec
        from kvserve.engine.errors import LoRAAdapterError

        try:
            spec = LoRAAdapterSpec(name, path, pinned)
        except ConfigError as e:
            raise LoRAAdapterError(str(e)) from None
        await asyncio.to_thread(self._adapters().load, spec)

    def unload_adapter(self, name: str) -> None:
        self._adapters().unload(name)

    def _adapters(self):
        check_available(self)
        adapters = self.engine.adapters if self.engine is not None else None
        if adapters is None:
            raise LoRANotFound(f"model {self.model_id} serves no LoRA adapters (enable_lora)")
        return adapters

    # ---- sleep mode (engine/worker/sleep.py) ------------------------------------------------------
    async def sleep(self, directory: str | None = None):
        """Free the model's weights and KV memory between steps (LLMEngine.sleep; SleepUnsupported with requests in
        flight); the SleepReport. A request that comes meanwhile wakes it."""
        def go():
            report = self.engine.sleep(directory)
            if self.status is EngineStatus.READY:
                self.status = EngineStatus.SLEEPING
            return report

        return await self._on_engine_thread(go)

    async def wake_up(self) -> float:
        """Read the weights back (LLMEngine.wake_up); the seconds it took (0: it was awake)."""
        return await self._on_engine_thread(self._wake_engine)

    def _wake_engine(self) -> float:
        seconds = self.engine.wake_up()
        if self.status is EngineStatus.SLEEPING:
            self.status = EngineStatus.READY
        return seconds

    async def _on_engine_thread(self, fn: Callable[[], object]):
        if self.engine is None or self.status not in (EngineStatus.READY, EngineStatus.SLEEPING):
            check_available(self)
            raise ModelFailed(f"model {self.model_id} is {self.status.value}")
        done: Future = Future()
        self._commands.put(_Call(fn, done))
        self._wake.set()
        return await asyncio.wrap_future(done)

    @property
    def grammar_stats(self):
        """The structured-output compiler's counters (a copy), or None before the model is loaded."""
        grammars = self._grammars
        return None if grammars is None else grammars.snapshot()

    @property
    def _grammars(self):
        """The loaded engine's structured-output compiler (None before the model is loaded, or without one)."""
        return getattr(self.core, "grammars", None)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))
        self._wake.set()

    # ---- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._engine_factory is not None:
                self.engine = self._engine_factory(self.config)
            else:
                from kvserve.engine.worker.llm_engine import LLMEngine

                self.engine = LLMEngine(self.config, model_id=self.model_id)
            # What exists now (weights' Python wrappers, the server's modules and app) lives as long as
            # the process: keep the cyclic collector from re-walking it on every full collection.
            gc.collect()
            gc.freeze()
            self.core = self.engine.core
            self.core.interjection = Interjection(self._interject_flag, self._interject)
            self.status = EngineStatus.READY
        except Exception as e:  # loading failed: report it, never crash the server
            log.exception("engine for %s failed to load", self.model_id)
            self.error = f"{type(e).__name__}: {e}"
            self.status = EngineStatus.FAILED
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except Exception as e:  # a broken engine fails its requests and reports; it never hangs them
            log.exception("engine loop failed for %s", self.model_id)
            self.error = f"{type(e).__name__}: {e}"
            self.status = EngineStatus.FAILED
            self._fail_all()
        self._close(save=self.status != EngineStatus.FAILED)

    def _close(self, save: bool) -> None:
        """The engine's close (LLMEngine.close), here on its thread after its last step, so no step changes the
        pool while it saves."""
        close = getattr(self.engine, "close", None)  # an injected engine may have nothing to close
        if close is None:
            return
        try:
            close(save)
        except Exception:
            log.exception("closing the engine for %s failed", self.model_id)

    def _loop(self) -> None:
        core = self.core
        while not self._stop:
            self._apply_commands()
            if not core.has_unfinished_requests():
                self.last_progress_at = time.monotonic()
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            t0 = time.monotonic()
            if getattr(self.engine, "asleep", False):  # a request came to a sleeping engine: it wakes for it
                self._wake_engine()
            outputs = core.step()
            t1 = time.monotonic()
            self.busy_seconds += t1 - t0
            self.last_step_at = self.last_progress_at = t1
            self._publish(outputs)

    def _interject(self) -> None:
        """Inside a suspended step (engine thread): add the interactive requests that came, run their
        first step, deliver its tokens. Everything else that came (aborts, batch requests) waits for the
        step's end: an abort now would free blocks the suspended step is still writing."""
        self._interject_flag.value = 0
        self._apply_commands(interactive_adds_only=True)
        outputs = self.core.interject()
        if outputs is not None:
            self._publish(outputs)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """After a step (a regular one or an interjection): deliver its outputs, refresh the counts,
        report the step."""
        self._deliver(outputs)
        self._update_counts()
        if self._on_step is not None:
            self._on_step(self, self.core.last_step)

    def _take_commands(self) -> Iterator:
        """The commands to apply, in their order: those held back by an interjection, then the queue's.
        (What the caller holds back again goes to a fresh `_held`.)"""
        held, self._held = self._held, []
        yield from held
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply_commands(self, interactive_adds_only: bool = False) -> None:
        core = self.core
        if not interactive_adds_only:
            self._interject_flag.value = 0  # what raised it is applied now (a later submit raises it again)
        for cmd in self._take_commands():
            if interactive_adds_only and not (isinstance(cmd, _Add) and cmd.request.priority is Priority.INTERACTIVE):
                self._held.append(cmd)
                continue
            if isinstance(cmd, _Add):
                try:
                    rid = core.add_request(cmd.request)
                except Exception as e:
                    self._release_adapter(cmd.request.lora)
                    cmd.done.set_exception(e)
                    continue
                self._sinks[rid] = cmd.sink
                if cmd.request.lora is not None:
                    self._adapter_of[rid] = cmd.request.lora
                cmd.done.set_result(rid)
            elif isinstance(cmd, _Call):
                try:
                    cmd.done.set_result(cmd.fn())
                except Exception as e:
                    cmd.done.set_exception(e)
            elif isinstance(cmd, _Abort):
                out = core.abort_request(cmd.request_id)
                sink = self._pop_sink(cmd.request_id)
                if out is not None:
                    if sink is not None:
                        sink(out)
                    if self._on_finish is not None:
                        self._on_finish(out)
        self._update_counts()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their queues: one wake-up per event loop and step, not one per request
        (each is a write to the loop's self-pipe, and wakes the loop's thread on the engine's cores)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if out.finished:
                self._pop_sink(out.request_id)
                if self._on_finish is not None:
                    self._on_finish(out)
            if sink is not None:
                batches.setdefault(sink.loop, []).append((sink.queue, out))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _pop_sink(self, request_id: str) -> _Sink | None:
        """A request ended (finished, aborted, failed): its sink, and its adapter released to the LRU."""
        self._release_adapter(self._adapter_of.pop(request_id, None))
        return self._sinks.pop(request_id, None)

    def _release_adapter(self, key: str | None) -> None:
        if key is not None and self.engine is not None and self.engine.adapters is not None:
            self.engine.adapters.release(key)

    def _update_counts(self) -> None:
        self.num_inflight = self.core.num_unfinished_requests
        self.stats = self.core.scheduler.stats()  # an immutable snapshot other threads may read
        self.num_waiting = self.stats.num_waiting

    def _fail_all(self) -> None:
        for cmd in self._take_commands():  # requests not yet added: refuse them
            if isinstance(cmd, _Add):
                self._release_adapter(cmd.request.lora)
                cmd.done.set_exception(ModelFailed(f"model {self.model_id} failed: {self.error}"))
        for rid in list(self._sinks):
            try:
                out = self.core.abort_request(rid)
            except Exception:
                out = None
            sink = self._pop_sink(rid)
            if out is not None:
                if self._on_finish is not None:  # aborted requests are accounted for too (usage ledger)
                    self._on_finish(out)
                sink(out)
        self.num_inflight = self.num_waiting = 0  # none left: a server's drain does not wait on a failed engine
