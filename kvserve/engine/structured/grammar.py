"""Grammars for structured outputs, compiled by llguidance, cached, and bounded in time.

llguidance turns a JSON schema, a regex, a choice or a Lark grammar into a matcher over the model's
tokenizer: from the matcher's state, the mask of tokens allowed next (the sampler applies it, engine/worker/runner.py),
advanced by each token the sequence takes. Compiling is cheap for ordinary schemas but not for every one: a
nested `oneOf` can stall another engine's step loop for as long as it compiles. Here:

- Compiling runs in a worker thread, never on the engine thread (llguidance drops the GIL while it builds),
  and the request waits at most `compile_timeout_s` for it: past that it is refused with a 400 naming the
  budget (the worker finishes on its own, bounded by llguidance's fuel limits, and its result is cached).
- A compiled grammar is cached per (tokenizer, constraint): a matcher for a new sequence is a deep copy of
  the cached one's start state (no compile). Hits, misses, refusals and compile seconds are counted for
  /metrics.
- An error in the constraint (a `$ref` to nowhere, a regex that does not parse, an unsupported keyword) is
  InvalidStructuredOutput with llguidance's message.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace

from kvserve.config import StructuredLimits
from kvserve.engine.structured.number_precision import NumberScanner, TokenBytes
from kvserve.engine.structured.params import InvalidStructuredOutput, StructuredOutputsParams, interoperable_integers

CACHE_ENTRIES = 512
COMPILE_WORKERS = 2
# JSON as `json.dumps` writes it by default ({"a": 1, "b": [2, 3]}): the spacing models were trained on, and no
# free whitespace (a model looping on spaces or newlines would run to max_tokens inside a valid prefix).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class GrammarStats:
    """Since start: the compiled-grammar cache's hits and misses, refusals, compile seconds."""

    hits: int = 0
    misses: int = 0  # compiles started
    joined: int = 0  # requests that waited for a compile another request started
    refused: int = 0  # constraints over a limit, failed compiles, compiles past the budget
    timeouts: int = 0
    compile_seconds: float = 0.0


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for a constraint."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

    kind = params.kind
    try:
        if kind == "json":
            return LLMatcher.grammar_from_json_schema(interoperable_integers(json.loads(params.json)),
                                                      defaults=JSON_OPTIONS)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
        # Lark (llguidance's own), or GBNF (llama.cpp's, and what vLLM's guided_grammar takes), converted
        return LLMatcher.grammar_from_lark(any_to_lark(params.grammar))
    except (ValueError, TypeError, GbnfToLarkError) as e:
        raise params.invalid(f"the {kind} constraint is not valid: {e}") from None


class CompiledGrammar:
    """A constraint compiled for one tokenizer: `matcher()` gives a new sequence its own matcher, and
    `numbers()` its number-precision scanner where the output is JSON (engine/structured/number_precision.py)."""

    def __init__(self, params: StructuredOutputsParams, start, tokens: TokenBytes | None = None):
        self.params = params
        self._start = start  # an llguidance LLMatcher in its start state, never advanced
        self._tokens = tokens if params.kind in ("json", "json_object") else None

    def matcher(self):
        return self._start.deep_copy()

    def numbers(self) -> NumberScanner | None:
        return NumberScanner(self._tokens) if self._tokens is not None else None

    def __reduce__(self):
        """Over a process hop (Ray) a compiled grammar travels as nothing: the engine on the other side compiles
        the request's constraint for its own tokenizer."""
        return _nothing, ()


def _nothing() -> None:
    return None


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer, off the caller's thread, with a cache and a time budget."""

    def __init__(self, tokenizer, vocab_size: int, limits: StructuredLimits | None = None):
        """`tokenizer`: kvserve's Tokenizer (its `tokenizers` backend and eos ids); `vocab_size`: the model's
        logits width (the mask covers it)."""
        self.limits = limits or StructuredLimits()
        self.vocab_size = vocab_size
        self.stats = GrammarStats()
        self._tokenizer = tokenizer
        self._ll_tokenizer = None
        self._token_bytes: TokenBytes | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutputsParams, CompiledGrammar] = OrderedDict()
        self._pending: dict[StructuredOutputsParams, Future] = {}
        self._pool = ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="kvserve-grammar")

    def _ll(self):
        with self._lock:
            if self._ll_tokenizer is None:
                from llguidance import LLTokenizer

                tok = self._tokenizer
                self._ll_tokenizer = LLTokenizer(tok.backend.to_str(), n_vocab=self.vocab_size,
                                                 eos_token=sorted(tok.eos_token_ids))
            return self._ll_tokenizer

    def _tokens(self) -> TokenBytes:
        ll = self._ll()
        with self._lock:
            if self._token_bytes is None:
                self._token_bytes = TokenBytes.of([ll.decode_bytes([i]) for i in range(self.vocab_size)])
            return self._token_bytes

    def _build(self, params: StructuredOutputsParams) -> CompiledGrammar:
        from llguidance import LLMatcher

        started = time.perf_counter()
        try:
            try:
                matcher = LLMatcher(self._ll(), grammar_text(params), log_level=0)
                if matcher.is_error():
                    raise params.invalid(f"the {params.kind} constraint cannot be compiled: {matcher.get_error()}")
            except InvalidStructuredOutput:
                self._count_refusal()
                raise
            compiled = CompiledGrammar(params, matcher, self._tokens())
            with self._lock:
                self._cache[params] = compiled
                while len(self._cache) > CACHE_ENTRIES:
                    self._cache.popitem(last=False)
            return compiled
        finally:
            with self._lock:
                self.stats.compile_seconds += time.perf_counter() - started
                self._pending.pop(params, None)

    def _lookup(self, params: StructuredOutputsParams) -> CompiledGrammar | Future:
        try:
            params.check(self.limits)
        except InvalidStructuredOutput:
            self._count_refusal()
            raise
        with self._lock:
            hit = self._cache.get(params)
            if hit is not None:
                self._cache.move_to_end(params)
                self.stats.hits += 1
                return hit
            pending = self._pending.get(params)
            if pending is not None:  # the same constraint compiling for another request: wait for that one
                self.stats.joined += 1
                return pending
            self.stats.misses += 1
            pending = self._pending[params] = self._pool.submit(self._build, params)
            return pending

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Blocking (the offline LLM, the engine's fallback); the same budget."""
        got = self._lookup(params)
        if isinstance(got, CompiledGrammar):
            return got
        try:
            return got.result(timeout=self.limits.compile_timeout_s)
        except FutureTimeout:
            raise self._timeout(params) from None

    async def compile_async(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The server's: the event loop waits, the engine steps on."""
        got = self._lookup(params)
        if isinstance(got, CompiledGrammar):
            return got
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(got)), self.limits.compile_timeout_s)
        except asyncio.TimeoutError:
            raise self._timeout(params) from None

    def _count_refusal(self) -> None:
        with self._lock:
            self.stats.refused += 1

    def _timeout(self, params: StructuredOutputsParams) -> InvalidStructuredOutput:
        with self._lock:
            self.stats.timeouts += 1
            self.stats.refused += 1
        return params.invalid(f"the {params.kind} constraint did not compile within its budget of "
                              f"{self.limits.compile_timeout_s:g} s (simplify it: deeply nested anyOf/oneOf and "
                              "large alternations cost the most)")

    def snapshot(self) -> GrammarStats:
        with self._lock:
            return replace(self.stats)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
