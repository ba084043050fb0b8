"""Prompt generators for the load generator: random, shared-prefix, chat and document.

Like vLLM's random dataset, prompts are random token ids (special tokens excluded) decoded to text
with the model's tokenizer, then re-encoded and trimmed or topped up until the text encodes to the
wanted length, so that the server, re-tokenizing the text, sees about that many tokens. With
`token_prompts` the ids themselves are sent (to /v1/completions), and the length is exact.

The document dataset (long-context work, W6) is real text instead: a passage of the standard library's own
Python source (DOCUMENT_MODULES, fixed for a Python version, no download) from an offset drawn from
(seed, i), cut so that it and the question after it (DOCUMENT_QUESTION) encode to the wanted length. The
grounded dataset (W7) is the same with a task instead of the question (GROUNDED_TASKS in turn: copy, edit,
quote, continue), work whose answer mostly repeats its prompt.

Prompt i of a dataset depends only on (seed, i), so a time-bounded run can draw as many as it needs
and two runs with the same seed send the same prompts. Give every run its own seed when prompts must
not hit a prefix cache filled by an earlier run.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

DATASETS = ("random", "shared-prefix", "chat", "document", "grounded")
CHAT_DATASETS = ("chat",)
# The document dataset's text: about 200k tokens of source (Gemma 3 or SmolLM2), so a 32k-token document can
# start at any of some 170k offsets, and documents that start apart share no prefix-cache block.
DOCUMENT_MODULES = ("typing", "inspect", "argparse", "subprocess", "asyncio.base_events", "dataclasses", "threading",
                    "collections", "pathlib", "email.message", "json.decoder")
DOCUMENT_QUESTION = "\n\nQuestion: Summarize the code above in one sentence.\nAnswer:"
# The grounded dataset (W7: work whose answer is mostly in its prompt): a passage of the same text, then one of
# these tasks in turn (copy it, edit it, quote from it, continue it).
GROUNDED_TASKS = ("\n\nCopy the code above exactly, line for line.\nCopy:\n",
                  "\n\nRewrite the code above with every 'self' renamed to 'this'.\nRewritten:\n",
                  "\n\nQuote the longest function of the code above, exactly as written.\nQuote:\n",
                  "\n\nContinue the code above in the same style.\n")


def load_tokenizer(spec: str):
    """A kvserve Tokenizer from a catalog id (e.g. smollm2-135m), a .gguf file or a HF directory."""
    from kvserve.models.catalog import resolve_model
    from kvserve.models.tokenizer import Tokenizer

    _, path = resolve_model(spec)
    path = Path(path)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return Tokenizer.from_hf_dir(path)
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return Tokenizer.from_gguf(ggufs[0])
        raise FileNotFoundError(f"{path}: neither tokenizer.json nor a .gguf file")
    return Tokenizer.from_gguf(path)


def document_text() -> str:
    """DOCUMENT_MODULES' sources, each under a header line."""
    import importlib
    import inspect

    return "".join(f"# ---- {name} ----\n{inspect.getsource(importlib.import_module(name))}\n"
                   for name in DOCUMENT_MODULES)


@dataclass
class Prompt:
    """One request's input: text (or token ids) or chat messages, and its length in tokens."""

    prompt: str | list[int] | None
    messages: list[dict] | None
    prompt_len: int
    max_tokens: int


class PromptSource:
    """prompt(i) -> Prompt, deterministic in (seed, i). Token lengths are for the server-side prompt."""

    def __init__(self, tokenizer: Any, dataset: str = "random", *, input_len: int = 1024, output_len: int = 128,
                 prefix_len: int = 0, range_ratio: float = 0.0, seed: int = 0, token_prompts: bool = False,
                 max_retry: int = 10, input_lens: tuple[int, ...] = ()):
        if dataset not in DATASETS:
            raise ValueError(f"unknown dataset {dataset!r}; one of {', '.join(DATASETS)}")
        if not 0.0 <= range_ratio < 1.0:
            raise ValueError("range ratio must be in [0, 1)")
        if input_lens and (range_ratio or min(input_lens) < 1):
            raise ValueError("input lengths to cycle over must be >= 1, and take no range ratio")
        if dataset == "chat" and token_prompts:
            raise ValueError("token prompts go to /v1/completions; the chat dataset sends messages")
        self.tok = tokenizer
        self.dataset = dataset
        self.input_len = int(input_len)
        self.input_lens = tuple(int(n) for n in input_lens)  # prompt i: input_lens[i % n] tokens, if given
        self.output_len = int(output_len)
        self.prefix_len = int(prefix_len)
        self.range_ratio = float(range_ratio)
        self.seed = int(seed)
        self.token_prompts = token_prompts
        self.max_retry = max_retry
        self.mismatches = 0  # prompts whose re-encoded length missed the target after max_retry rounds
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.allowed = np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)
        self.num_special = 1 if getattr(tokenizer, "add_bos_token", False) else 0

    # -- helpers --------------------------------------------------------------------------------------------

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.seed & 0xFFFFFFFF, *key])

    def _random_ids(self, rng: np.random.Generator, n: int) -> list[int]:
        return self.allowed[rng.integers(0, len(self.allowed), size=max(n, 0))].tolist()

    def _fit(self, ids: list[int], target: int, rng: np.random.Generator) -> tuple[str, list[int]]:
        """vLLM's gen_prompt_decode_to_target_len: decode, re-encode, trim/extend until the length holds."""
        text = self.tok.decode(ids)
        for attempt in range(self.max_retry + 1):
            text = self.tok.decode(ids)
            ids = self.tok.encode(text, add_special_tokens=False)
            if len(ids) == target or attempt == self.max_retry:
                break
            if len(ids) < target:
                ids = ids + self._random_ids(rng, target - len(ids))
            else:
                ids = ids[:target]
        if len(ids) != target:
            self.mismatches += 1
        return text, ids

    def _lens(self, i: int) -> tuple[int, int]:
        if self.input_lens:
            return self.input_lens[i % len(self.input_lens)], self.output_len
        if self.range_ratio == 0:
            return self.input_len, self.output_len
        rng = self._rng(2, i)
        lo_i, hi_i = int(self.input_len * (1 - self.range_ratio)), int(self.input_len * (1 + self.range_ratio))
        lo_o, hi_o = int(self.output_len * (1 - self.range_ratio)), int(self.output_len * (1 + self.range_ratio))
        return int(rng.integers(max(lo_i, 1), hi_i + 1)), int(rng.integers(max(lo_o, 1), hi_o + 1))

    @cached_property
    def prefix_ids(self) -> list[int]:
        """The shared prefix (same for every prompt of this source), fitted once to prefix_len tokens."""
        if self.prefix_len <= 0:
            return []
        rng = self._rng(1)
        n = self.prefix_len if self.token_prompts else max(self.prefix_len - self.num_special, 1)
        ids = self._random_ids(rng, n)
        if self.token_prompts:
            return ids
        return self._fit(ids, n, rng)[1]

    @cached_property
    def chat_overhead(self) -> int:
        """Tokens the chat template adds around one user message (system prompt, role markers, ...)."""
        return len(self.tok.encode_chat([{"role": "user", "content": ""}]))

    @cached_property
    def document_ids(self) -> list[int]:
        """The document text's tokens, repeated until the longest document fits with room to spare."""
        ids = self.tok.encode(document_text(), add_special_tokens=False)
        need = max(self.input_lens or (self.input_len,)) + 256
        return ids * (1 + need // len(ids))

    def _document(self, i: int, input_len: int, output_len: int, question_text: str = DOCUMENT_QUESTION) -> Prompt:
        """A passage of the document text from an offset drawn from (seed, i), then the question: input_len
        tokens in all, as the server encodes the text (BOS included)."""
        question = self.tok.encode(question_text, add_special_tokens=False)
        corpus = self.document_ids
        body = max(input_len - len(question) - (0 if self.token_prompts else self.num_special), 1)
        start = int(self._rng(3, i).integers(0, len(corpus) - body))
        if self.token_prompts:
            ids = corpus[start:start + body] + question
            return Prompt(ids, None, len(ids), output_len)
        tried = set()
        for _ in range(self.max_retry + 1):  # a cut can merge or split tokens at its edges: move the end,
            tried.add(body)                  # or the start where moving the end goes back and forth
            text = self.tok.decode(corpus[start:start + body]) + question_text
            n = len(self.tok.encode(text, add_special_tokens=True))
            if n == input_len:
                break
            body += input_len - n
            if body in tried:
                start += 1
        else:
            self.mismatches += 1
        return Prompt(text, None, n, output_len)

    # -- the prompts ---------------------------------------------------------------------------------------------

    def prompt(self, i: int) -> Prompt:
        input_len, output_len = self._lens(i)
        if self.dataset == "document":
            return self._document(i, input_len, output_len)
        if self.dataset == "grounded":
            return self._document(i, input_len, output_len, GROUNDED_TASKS[i % len(GROUNDED_TASKS)])
        rng = self._rng(0, i)
        if self.dataset == "chat":
            body = max(input_len - self.chat_overhead, 1)
            text, _ = self._fit(self._random_ids(rng, body), body, rng)
            messages = [{"role": "user", "content": text}]
            n = len(self.tok.encode_chat(messages))
            return Prompt(None, messages, n, output_len)
        # random and shared-prefix: prefix_len shared tokens + input_len own tokens (vLLM's
        # --random-prefix-len adds to --random-input-len the same way).
        if self.token_prompts:  # ids go to the server as they are: no BOS is added to them
            ids = self.prefix_ids + self._random_ids(rng, max(input_len, 1))
            return Prompt(ids, None, len(ids), output_len)
        own = max(input_len - (0 if self.prefix_ids else self.num_special), 1)
        target = len(self.prefix_ids) + own
        text, ids = self._fit(self.prefix_ids + self._random_ids(rng, own), target, rng)
        return Prompt(text, None, len(self.tok.encode(text, add_special_tokens=True)), output_len)
