"""Tokenizers for the served models: built from GGUF metadata or loaded from a HF directory, plus chat templates.

A GGUF file carries no tokenizer.json, only llama.cpp's `tokenizer.ggml.*` keys. We rebuild a `tokenizers.Tokenizer`
from them that gives the same ids as transformers' GGUF tokenizer (see shared/notes/models-and-machine.md, section 2),
in a small fraction of the time transformers' own conversion takes for Gemma.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _BackendTokenizer

__all__ = [
    "ChatTemplateError",
    "Tokenizer",
    "read_gguf_metadata",
]

_TEMPLATE_DIR = Path(__file__).parent / "templates"

# llama.cpp token types (tokenizer.ggml.token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Tokens llama.cpp treats as end-of-generation when the vocabulary marks them special.
_END_OF_TURN_TOKENS = (
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|endoftext|>",
    "<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<｜end▁of▁sentence｜>",
)

# Split regexes for byte-level BPE vocabularies, keyed by `tokenizer.ggml.pre` (llama.cpp's names).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BYTE_LEVEL_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx", "pixtral"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}

# SentencePiece architectures whose merge order follows file position rather than score (as transformers does).
_POSITION_RANKED_ARCHS = ("gemma", "gemma2", "gemma3")


class ChatTemplateError(ValueError):
    """Bad chat messages, or a template that refused them (`raise_exception`) or failed to render."""


# --------------------------------------------------------------------------------------------------------------------
# GGUF metadata
# --------------------------------------------------------------------------------------------------------------------

from kvserve.models.gguf_file import read_gguf_metadata  # noqa: E402  (re-exported)


def _metadata_from_reader(reader: Any) -> dict[str, Any]:
    """Metadata from an already-open `gguf.GGUFReader` (its `fields`), in read_gguf_metadata's shapes."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, list) and value and not isinstance(value[0], str):
            value = np.asarray(value)
        meta[key] = value
    return meta


# --------------------------------------------------------------------------------------------------------------------
# Building a tokenizers.Tokenizer from GGUF metadata
# --------------------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _special_added_tokens(tokens: Sequence[str], types: Sequence[int], vocab: Mapping[str, int]) -> tuple[list, list]:
    """(special, plain) AddedTokens: control/unknown tokens are special; user-defined ones plain, matched on raw text.

    A token whose spelling is not a vocab key (respelled, or a duplicate) is skipped: adding it would append a new id.
    """
    special, plain = [], []
    for i, (tok, ttype) in enumerate(zip(tokens, types)):
        if ttype in (_CONTROL, _UNKNOWN) and vocab.get(tok) == i:
            special.append(AddedToken(tok, special=True, normalized=False))
        elif ttype == _USER_DEFINED and vocab.get(tok) == i:
            plain.append(AddedToken(tok, special=False, normalized=False))
    return special, plain


def _first_index_vocab(tokens: Sequence[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    return vocab


def _build_byte_level_bpe(meta: Mapping[str, Any]) -> _BackendTokenizer:
    """`tokenizer.ggml.model == "gpt2"`: byte-level BPE with merges stored in the file."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = _token_types(meta, len(tokens))
    alphabet = set(_bytes_to_unicode().values())
    spelling = _bytes_to_unicode()
    # Normal tokens are already in the GPT-2 byte alphabet; re-spell any that are not (as transformers does).
    tokens = [
        t if ttype != _NORMAL or set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
        for t, ttype in zip(tokens, types)
    ]
    vocab = _first_index_vocab(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", ())]
    backend = _BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre in _BYTE_LEVEL_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_BYTE_LEVEL_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre == "smollm":  # llama.cpp: every digit on its own, then the GPT-2 regex
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:  # "default", "gpt2" and anything unknown: the GPT-2 regex
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    # A "control" token outside the byte alphabet is a llama.cpp mislabel (transformers skips those too).
    special, plain = _special_added_tokens(tokens, types, vocab)
    special = [t for t in special if set(t.content) <= alphabet]
    backend.add_special_tokens(special)
    backend.add_tokens(plain)
    return backend


def _build_sentencepiece_bpe(meta: Mapping[str, Any]) -> _BackendTokenizer:
    """`tokenizer.ggml.model == "llama"`: SentencePiece BPE with byte fallback; merges recovered from the vocab."""
    raw_tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = _token_types(meta, len(raw_tokens))
    # Gemma stores runs of spaces as real spaces; in SentencePiece's normalized text they are runs of "▁".
    tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in raw_tokens]
    vocab = _first_index_vocab(tokens)
    arch = meta.get("general.architecture", "")
    scores = meta.get("tokenizer.ggml.scores")
    if arch in _POSITION_RANKED_ARCHS or scores is None:
        rank_score = -np.arange(len(tokens), dtype=np.float64)
    else:
        rank_score = np.asarray(scores, dtype=np.float64)
    merges = _merges_from_vocab(tokens, vocab, rank_score)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = _BackendTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True, unk_token=unk))
    steps: list[Any] = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", False):
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.decoder = decoders.Sequence(steps)
    special, plain = _special_added_tokens(raw_tokens, types, vocab)
    backend.add_special_tokens(special)
    backend.add_tokens(plain)
    return backend


def _token_types(meta: Mapping[str, Any], n: int) -> list[int]:
    types = meta.get("tokenizer.ggml.token_type")
    return [_NORMAL] * n if types is None else [int(t) for t in np.asarray(types).tolist()]


def _merges_from_vocab(tokens: Sequence[str], vocab: Mapping[str, int], rank_score: np.ndarray) -> list[tuple[str, str]]:
    """Every split of a token into two vocab tokens, best first: by rank_score (desc), then longer left piece.

    This is transformers' `generate_merges` order, so ids match its GGUF tokenizer. SentencePiece BPE merges the
    adjacent pair whose concatenation scores best, which is what BPE with these ranks does.
    """
    found = _split_candidates_numpy(tokens, vocab)
    if found is None:
        found = _split_candidates_python(tokens, vocab)
    token_idx, split_at = found
    lens = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    # lexsort: last key is primary. Ties: token index, then vocab ids of the pieces (transformers' local order).
    order = np.lexsort((token_idx, -(lens[token_idx] - split_at), -split_at, -rank_score[token_idx]))
    return [(tokens[i][:k], tokens[i][k:]) for i, k in zip(token_idx[order].tolist(), split_at[order].tolist())]


def _split_candidates_python(tokens: Sequence[str], vocab: Mapping[str, int]) -> tuple[np.ndarray, np.ndarray]:
    idx, ks = [], []
    for i, tok in enumerate(tokens):
        if vocab.get(tok) != i:
            continue
        for k in range(1, len(tok)):
            if tok[:k] in vocab and tok[k:] in vocab:
                idx.append(i)
                ks.append(k)
    return np.asarray(idx, dtype=np.int64), np.asarray(ks, dtype=np.int64)


def _split_candidates_numpy(tokens: Sequence[str], vocab: Mapping[str, int]) -> tuple[np.ndarray, np.ndarray] | None:
    """Vectorized `_split_candidates_python` (several times faster on a 262k-token vocabulary).

    Rolling 64-bit hashes find candidate splits; each candidate is then checked character by character, so the
    result is exact. Returns None (use the Python path) when hashes collide or a token holds a NUL character
    (numpy's fixed-width strings would drop it).
    """
    n = len(tokens)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    lens = np.fromiter(map(len, tokens), dtype=np.int64, count=n)
    width = int(lens.max())
    if width < 2 or width > 256:
        return None
    codes = np.array(tokens, dtype=f"<U{width}").view(np.uint32).reshape(n, width)
    if not np.array_equal(np.count_nonzero(codes, axis=1), lens):
        return None  # a NUL inside a token
    first = np.zeros(n, dtype=bool)  # the id each spelling maps to (a duplicate spelling is not a vocab key)
    first[np.fromiter(vocab.values(), dtype=np.int64, count=len(vocab))] = True
    base = np.uint64(0x100000001B3)
    prefix_hash = np.empty((width, n), dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = np.zeros(n, dtype=np.uint64)
        for j in range(width):
            h = h * base + codes[:, j].astype(np.uint64) + np.uint64(1)
            prefix_hash[j] = h
        powers = np.ones(width + 1, dtype=np.uint64)
        for j in range(1, width + 1):
            powers[j] = powers[j - 1] * base
        full = prefix_hash[np.maximum(lens - 1, 0), np.arange(n)]
        keys = full[first & (lens > 0)]
        owner = np.nonzero(first & (lens > 0))[0]
        sort = np.argsort(keys, kind="stable")
        table, table_owner = keys[sort], owner[sort]
        if table.size > 1 and np.any(table[1:] == table[:-1]):
            return None  # two spellings share a hash

        def lookup(q: np.ndarray) -> np.ndarray:
            pos = np.minimum(np.searchsorted(table, q), table.size - 1)
            return np.where(table[pos] == q, table_owner[pos], -1)

        out_i, out_k = [], []
        for k in range(1, width):
            rows = np.nonzero((lens > k) & first)[0]
            if rows.size == 0:
                break
            left_hash = prefix_hash[k - 1, rows]
            left = lookup(left_hash)
            hit = left >= 0
            rows, left, left_hash = rows[hit], left[hit], left_hash[hit]
            right = lookup(full[rows] - left_hash * powers[lens[rows] - k])
            hit = right >= 0
            rows, left, right = rows[hit], left[hit], right[hit]
            # Exact check: same length and same characters (both sides are zero-padded past their length).
            ok = (lens[left] == k) & (lens[right] == lens[rows] - k)
            ok &= np.all(codes[rows, :k] == codes[left, :k], axis=1)
            ok &= np.all(codes[rows, k:] == codes[right, : width - k], axis=1)
            out_i.append(rows[ok])
            out_k.append(np.full(int(ok.sum()), k, dtype=np.int64))
    if not out_i:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(out_i), np.concatenate(out_k)


def _bos_eos_post_processor(
    backend: _BackendTokenizer, bos_id: int | None, eos_id: int | None, add_bos: bool, add_eos: bool
) -> Any:
    bos = backend.id_to_token(bos_id) if bos_id is not None else None
    eos = backend.id_to_token(eos_id) if eos_id is not None else None
    single, pair, specials = "$A", "$A $B", []
    if add_bos and bos is not None:
        single, pair = f"{bos} {single}", f"{bos} $A {bos} $B"
        specials.append((bos, backend.token_to_id(bos)))
    if add_eos and eos is not None:
        single, pair = f"{single} {eos}", f"{pair} {eos}"
        specials.append((eos, backend.token_to_id(eos)))
    if not specials:
        return None
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


# --------------------------------------------------------------------------------------------------------------------
# Chat templates
# --------------------------------------------------------------------------------------------------------------------

_VALID_ROLES = frozenset({"system", "user", "assistant", "tool"})


def _normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate OpenAI-style messages; text parts are joined so every template sees `content` as a string."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Iterable):
        raise ChatTemplateError("messages must be a list of {'role', 'content'} objects")
    out: list[dict[str, Any]] = []
    for n, msg in enumerate(messages):
        if hasattr(msg, "model_dump"):
            msg = msg.model_dump(exclude_none=True)
        if not isinstance(msg, Mapping):
            raise ChatTemplateError(f"messages[{n}] must be an object with 'role' and 'content', got {type(msg).__name__}")
        role = msg.get("role")
        if role not in _VALID_ROLES:
            raise ChatTemplateError(f"messages[{n}].role must be one of {sorted(_VALID_ROLES)}, got {role!r}")
        content = msg.get("content")
        if content is None and role == "assistant" and msg.get("tool_calls"):
            content = ""
        if isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for p, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ChatTemplateError(
                        f"messages[{n}].content[{p}] must be {{'type': 'text', 'text': str}} (only text is supported)"
                    )
                parts.append(part["text"])
            text = "\n".join(parts)
        else:
            raise ChatTemplateError(
                f"messages[{n}].content must be a string or a list of text parts, got {type(content).__name__}"
            )
        out.append({**msg, "role": role, "content": text})
    if not out:
        raise ChatTemplateError("messages must not be empty")
    return out


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile_template(source: str) -> Any:
    """HF's template environment: sandboxed, immutable, trim_blocks + lstrip_blocks, loopcontrols."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def _shipped_template(name: str) -> str:
    return (_TEMPLATE_DIR / f"{name}.jinja").read_text(encoding="utf-8")


# --------------------------------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------------------------------


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the model's special ids, BOS policy and chat template."""

    def __init__(
        self,
        backend: _BackendTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        chat_template: str | None = None,
        name: str = "",
    ):
        self.backend = backend
        self.name = name
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        added = backend.get_added_tokens_decoder()
        special = {i for i, tok in added.items() if tok.special}
        self.all_special_ids: list[int] = sorted(
            special | {i for i in (bos_token_id, eos_token_id, pad_token_id, unk_token_id) if i is not None}
        )
        eot = {backend.token_to_id(t) for t in _END_OF_TURN_TOKENS} & special
        self.eos_token_ids: frozenset[int] = frozenset(
            {i for i in (eos_token_id, *eos_token_ids) if i is not None} | eot
        )
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        # `<0x00>`..`<0xFF>` when the model falls back to bytes; the detokenizer holds a run of them until it ends.
        byte_ids = set()
        if getattr(backend.model, "byte_fallback", False):
            byte_ids = {backend.token_to_id(f"<0x{b:02X}>") for b in range(256)} - {None}
        self.byte_fallback_ids: frozenset[int] = frozenset(byte_ids)
        # Whatever the backend's post-processor does is the truth (GGUF flags and tokenizer_config were applied to it).
        probe = backend.encode("", add_special_tokens=True).ids
        self.add_bos_token: bool = bos_token_id is not None and probe[:1] == [bos_token_id]
        self.chat_template = chat_template

    # -- construction ------------------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path_or_reader: Any) -> Tokenizer:
        """Build from a GGUF file's `tokenizer.ggml.*` metadata (a path, or an open `gguf.GGUFReader`)."""
        if isinstance(path_or_reader, (str, Path)):
            meta = read_gguf_metadata(path_or_reader)
            name = Path(path_or_reader).name
        elif isinstance(path_or_reader, Mapping):
            meta, name = dict(path_or_reader), ""
        else:
            meta, name = _metadata_from_reader(path_or_reader), Path(str(getattr(path_or_reader, "path", ""))).name
        return cls.from_gguf_metadata(meta, name=name)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], name: str = "") -> Tokenizer:
        """Build from metadata already read with `read_gguf_metadata` (so the loader reads the header once)."""
        kind = meta.get("tokenizer.ggml.model")
        if "tokenizer.ggml.tokens" not in meta:
            raise ValueError(f"{name or 'GGUF'}: no tokenizer.ggml.tokens in the metadata")
        if kind == "gpt2":
            backend = _build_byte_level_bpe(meta)
        elif kind == "llama":
            backend = _build_sentencepiece_bpe(meta)
        else:
            raise ValueError(f"{name or 'GGUF'}: tokenizer model {kind!r} is not supported (gpt2 and llama are)")
        tokens = meta["tokenizer.ggml.tokens"]

        def tok_id(key: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        bos, eos = tok_id("bos_token_id"), tok_id("eos_token_id")
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        backend.post_processor = _bos_eos_post_processor(backend, bos, eos, add_bos, add_eos)
        template = meta.get("tokenizer.chat_template")
        if not template:
            template = _shipped_template("gemma" if backend.token_to_id("<start_of_turn>") is not None else "chatml")
        extra_eos = [i for i in (tok_id("eot_token_id"), tok_id("eom_token_id")) if i is not None]
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            eos_token_ids=extra_eos,
            pad_token_id=tok_id("padding_token_id"),
            unk_token_id=tok_id("unknown_token_id"),
            chat_template=template,
            name=name or str(meta.get("general.name", "")),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, with special tokens, BOS policy and template from tokenizer_config.json.

        EOS ids also come from generation_config.json / config.json when present (they may list several).
        """
        root = Path(path)
        if not (root / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{root} has no tokenizer.json")
        backend = _BackendTokenizer.from_file(str(root / "tokenizer.json"))
        config = _read_json(root / "tokenizer_config.json")

        def special_id(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, Mapping):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        bos, eos, pad, unk = (special_id(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token"))
        extra_eos: list[int] = []
        for fname in ("generation_config.json", "config.json"):
            value = _read_json(root / fname).get("eos_token_id")
            ids = value if isinstance(value, list) else [value]
            extra_eos += [int(i) for i in ids if isinstance(i, int)]
            if eos is None and extra_eos:
                eos = extra_eos[0]
        if "add_bos_token" in config or "add_eos_token" in config:
            probe = backend.encode("", add_special_tokens=True).ids
            has_bos = bos is not None and probe[:1] == [bos]
            has_eos = eos is not None and probe[-1:] == [eos]
            want_bos = bool(config.get("add_bos_token", has_bos))
            want_eos = bool(config.get("add_eos_token", has_eos))
            if (want_bos, want_eos) != (has_bos, has_eos):
                backend.post_processor = _bos_eos_post_processor(backend, bos, eos, want_bos, want_eos)
        template = _hf_chat_template(root, config)
        if not template:
            template = _shipped_template("gemma" if backend.token_to_id("<start_of_turn>") is not None else "chatml")
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            eos_token_ids=extra_eos,
            pad_token_id=pad,
            unk_token_id=unk,
            chat_template=template,
            name=root.name,
        )

    # -- tokens ------------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; special-token text (e.g. `<|im_start|>`) becomes its id. BOS per `add_bos_token`."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.backend.id_to_token(self.eos_token_id)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={sorted(self.eos_token_ids)})"

    # -- chat --------------------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render messages to the prompt text (sandboxed Jinja, HF's conventions). Raises ChatTemplateError."""
        import jinja2

        source = chat_template or self.chat_template or _shipped_template("chatml")
        template = _compile_template(source)
        variables = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": "" if self.pad_token_id is None else self.backend.id_to_token(self.pad_token_id),
            "unk_token": "" if self.unk_token_id is None else self.backend.id_to_token(self.unk_token_id),
            **kwargs,
            "messages": _normalize_messages(messages),
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
        }
        try:
            return template.render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template renders a request's `tools` itself (else the service describes them in the
        system message: service/tools.py)."""
        source = self.chat_template or _shipped_template("chatml")
        return "tools" in source

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """Render and tokenize a chat; BOS is added only if the model wants one and the template did not write it."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        ids = self.encode(text, add_special_tokens=False)
        if self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _hf_chat_template(root: Path, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja (transformers >= 4.43 saves it apart), else tokenizer_config's, picking "default"."""
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None
