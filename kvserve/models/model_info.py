"""What a model file says about its model without the weights: the architecture (ModelConfig) and the
tokenizer with its chat template. No torch: a gateway tokenizes and checks context with these alone,
and the loader builds on them.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from kvserve.config import ModelConfig
from kvserve.models.gguf_file import read_gguf_metadata
from kvserve.models.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma3")
# The Llama layout and its variants (models/llama.py): what each adds to Llama's layer.
LLAMA_LAYOUT = {"llama": {}, "qwen2": {"attention_bias": True}, "qwen3": {"qk_norm": True},
                "qwen3moe": {"qk_norm": True}, "phi3": {}}
_HF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe", "MixtralForCausalLM": "llama",
            "Phi3ForCausalLM": "phi3",
            "Gemma3ForCausalLM": "gemma3", "Gemma3ForConditionalGeneration": "gemma3"}
_HF_MODEL_TYPE = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                  "qwen3_moe": "qwen3moe", "phi3": "phi3", "gemma3_text": "gemma3",
                  "gemma3": "gemma3"}
# Default RoPE bases where a file leaves them out (transformers' defaults; real files carry theirs).
_DEFAULT_THETA = {"llama": 10000.0, "qwen2": 10000.0, "qwen3": 10000.0, "qwen3moe": 10000.0, "phi3": 10000.0,
                  "gemma3": 1_000_000.0}


class ModelLoadError(RuntimeError):
    pass


def _gguf_rope_scaling(kind: str | None, factor) -> dict | None:
    """A GGUF's `rope.scaling.*` keys as a rope_scaling dict (Llama 3.1's per-frequency factors come as the
    `rope_freqs` tensor instead: loader.load_gguf). Kinds whose arithmetic is not here refuse to load."""
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    raise ModelLoadError(f"GGUF RoPE scaling {kind!r} is not supported (supported: linear, Llama 3.1's "
                         f"rope_freqs factors)")


def config_from_gguf(meta: dict) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})")

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    rope_dims = int(get("rope.dimension_count", 0) or 0)  # Phi-3's: the rotated dims of a head (partial rotary)
    head_dim = int(get("attention.key_length", 0) or (rope_dims if arch != "phi3" else 0) or hidden // heads)
    vocab = int(get("vocab_size", 0) or 0)
    common = dict(
        architecture=arch, hidden_size=hidden, intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")), num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
        rms_norm_eps=float(f"{float(get('attention.layer_norm_rms_epsilon', 1e-6)):.6g}"),  # undo float32 storage
        max_position_embeddings=int(get("context_length", 4096)), vocab_size=vocab,
        name=str(meta.get("general.name", "")),
        rope_theta=float(get("rope.freq_base", _DEFAULT_THETA[arch])),
        rope_scaling=_gguf_rope_scaling(get("rope.scaling.type"), get("rope.scaling.factor")),
    )
    if arch in LLAMA_LAYOUT:
        window = get("attention.sliding_window")  # Mistral v0.1's, where a converter wrote it
        experts = int(get("expert_count", 0) or 0)  # Qwen3-MoE; Mixtral is a `llama` file with experts
        moe = dict(num_experts=experts, experts_per_token=int(get("expert_used_count", 0) or 0),
                   moe_intermediate_size=int(get("expert_feed_forward_length", 0) or get("feed_forward_length")),
                   norm_topk_prob=bool(get("expert_weights_norm", True))) if experts else {}
        return ModelConfig(sliding_window=int(window) if window else None,
                           rotary_dim=rope_dims if 0 < rope_dims < head_dim else None, **LLAMA_LAYOUT[arch], **moe,
                           **common)
    # Gemma 3: the local RoPE base and the 5:1 layer pattern are not stored in the GGUF; these are
    # Gemma 3's fixed values (the same defaults transformers fills in).
    return ModelConfig(rope_local_theta=10000.0, sliding_window=int(get("attention.sliding_window", 512)),
                       sliding_window_pattern=6, query_pre_attn_scalar=float(head_dim), **common)


def _hf_rope_scaling(cfg: dict) -> dict | None:
    """`rope_scaling` (older config.json files) or a non-default `rope_parameters` (transformers 5's); LongRoPE
    (Phi-3's "su"/"longrope") as `longrope_scaling` writes it."""
    scaling = cfg.get("rope_scaling")
    params = cfg.get("rope_parameters") or {}
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
        original = scaling.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
        factor = scaling.get("factor") or cfg.get("max_position_embeddings", original) / original
        return longrope_scaling(scaling["short_factor"], scaling["long_factor"], original,
                                scaling.get("attention_factor") or longrope_attention_factor(factor, original))
    return scaling


def longrope_attention_factor(factor: float, original: int) -> float:
    """LongRoPE's scale on cos and sin, from the context's growth (max / original positions), as Phi-3's
    reference and llama.cpp's converter compute it."""
    return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0


def longrope_scaling(short, long, original: int, attention_factor: float) -> dict:
    """LongRoPE (Phi-3, Phi-4-mini): a factor per frequency, `short` below `original` positions and `long`
    from there on (models/layers.Rotary), cos and sin scaled by `attention_factor`."""
    return {"rope_type": "longrope", "short_factor": tuple(float(f) for f in short),
            "long_factor": tuple(float(f) for f in long), "original_max_position_embeddings": int(original),
            "attention_factor": float(attention_factor)}


def _hf_rotary_dim(cfg: dict, head_dim: int) -> int | None:
    """Partial rotary (Phi-4-mini's partial_rotary_factor, top level or in rope_parameters): the rotated dims."""
    factor = cfg.get("partial_rotary_factor") or (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    return int(head_dim * factor) if factor < 1.0 else None


def _hf_moe(cfg: dict, arch: str) -> dict:
    """A config.json's mixture of experts as ModelConfig fields (none for a dense model): Qwen3-MoE's
    (`num_experts`, `norm_topk_prob`, dense layers from `mlp_only_layers` and `decoder_sparse_step`) or
    Mixtral's (`num_local_experts`, always renormalised)."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    if not experts:
        return {}
    if cfg.get("shared_expert_intermediate_size"):
        raise ModelLoadError("shared experts (Qwen2-MoE) are not supported")
    if arch == "qwen3moe":
        step = cfg.get("decoder_sparse_step") or 1
        only = set(cfg.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(cfg["num_hidden_layers"]) if i in only or (i + 1) % step)
        return dict(num_experts=experts, experts_per_token=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["moe_intermediate_size"],
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense)
    return dict(num_experts=experts, experts_per_token=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)


def config_from_hf(cfg: dict) -> ModelConfig:
    if "text_config" in cfg:  # multimodal wrapper (Gemma 3 4B+): use the text tower's config
        cfg = {**cfg["text_config"], "architectures": cfg.get("architectures")}
    archs = cfg.get("architectures") or []
    arch = next((_HF_ARCH[a] for a in archs if a in _HF_ARCH), None) or _HF_MODEL_TYPE.get(cfg.get("model_type", ""))
    if arch is None:
        raise ModelLoadError(f"HF architecture {archs or cfg.get('model_type')} is not supported "
                             f"(supported: {', '.join(sorted(_HF_ARCH))})")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    common = dict(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", arch == "gemma3"), name=cfg.get("_name_or_path", ""),
    )
    rope_params = cfg.get("rope_parameters") or {}
    if arch in LLAMA_LAYOUT:
        theta = cfg.get("rope_theta") or rope_params.get("rope_theta", _DEFAULT_THETA[arch])
        variant = dict(LLAMA_LAYOUT[arch])
        if arch in ("qwen3", "qwen3moe"):
            variant["attention_bias"] = bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window")
        if arch in ("qwen2", "qwen3", "qwen3moe"):  # Qwen's configs carry a window they do not use unless told to
            if cfg.get("use_sliding_window"):
                raise ModelLoadError("Qwen's use_sliding_window (a window on the upper layers only) is not supported")
            window = None
        return ModelConfig(rope_theta=theta, rope_scaling=_hf_rope_scaling(cfg), sliding_window=window,
                           rotary_dim=_hf_rotary_dim(cfg, head_dim), **variant, **_hf_moe(cfg, arch), **common)
    global_theta = cfg.get("rope_theta") or rope_params.get("full_attention", {}).get("rope_theta", 1_000_000.0)
    local_theta = cfg.get("rope_local_base_freq") or rope_params.get("sliding_attention", {}).get(
        "rope_theta", 10000.0)
    pattern = cfg.get("sliding_window_pattern") or 6
    layer_types = cfg.get("layer_types")
    if layer_types:  # derive the period from the explicit list (first full layer index + 1)
        pattern = layer_types.index("full_attention") + 1 if "full_attention" in layer_types else pattern
    return ModelConfig(rope_theta=global_theta, rope_local_theta=local_theta, rope_scaling=cfg.get("rope_scaling"),
                       sliding_window=cfg.get("sliding_window", 512), sliding_window_pattern=pattern,
                       query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", head_dim), **common)


@dataclass(frozen=True)
class ModelInfo:
    """What a model file says about the model without its weights: enough to tokenize, apply the chat
    template and check a prompt against the context (a gateway holds these, not the weights)."""

    config: ModelConfig
    tokenizer: Tokenizer

    def encode(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None,
               tools: list[dict] | None = None) -> list[int]:
        """A prompt (text, or token ids checked against the vocabulary) or chat messages (through the
        chat template, with `tools` where it renders them) -> token ids. ValueError for input the model
        cannot take."""
        if messages is not None:
            return self.tokenizer.encode_chat(messages, tools=tools)
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not prompt:
            raise ValueError("prompt must not be empty")
        vocab = self.config.vocab_size
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return list(prompt)


def model_format(path: Path) -> str:
    """"hf" for a checkpoint directory, "gguf" for a .gguf file; ModelLoadError for anything else."""
    if path.is_dir():
        return "hf"
    if path.suffix == ".gguf" and path.is_file():
        return "gguf"
    if not path.exists():
        raise ModelLoadError(f"model file or directory not found: {path}")
    raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face checkpoint directory")


def read_hf_config(path: Path) -> ModelConfig:
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise ModelLoadError(f"{path} is not a Hugging Face checkpoint directory: no config.json")
    return config_from_hf(json.loads(cfg_path.read_text()))


def tokenizer_for(path: Path, fmt: str, metadata: dict | None = None, name: str = "") -> Tokenizer:
    """The model's tokenizer: from the GGUF metadata (read here unless given), or the directory's tokenizer.json."""
    if fmt == "gguf":
        return Tokenizer.from_gguf_metadata(metadata if metadata is not None else read_gguf_metadata(path),
                                            name=name or path.name)
    return Tokenizer.from_hf_dir(path)


def read_model_info(path: str | os.PathLike, name: str = "") -> ModelInfo:
    """The config and tokenizer of a .gguf file (its metadata only) or a HF checkpoint directory."""
    path = Path(path)
    fmt = model_format(path)
    if fmt == "hf":
        return ModelInfo(read_hf_config(path), tokenizer_for(path, fmt))
    meta = read_gguf_metadata(path)
    return ModelInfo(config_from_gguf(meta), tokenizer_for(path, fmt, meta, name))
