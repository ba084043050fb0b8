"""Write tiny randomly initialised Llama / Qwen2 / Qwen3 / Qwen3-MoE / Gemma 3 models as GGUF files, the way
llama.cpp's converter would (Q/K rows permuted for Llama only, Qwen2's Q, K and V biases, Qwen3's and Gemma's
per-head QK norms, Gemma norms stored as 1 + w, quantized matrices; Qwen3-MoE's float32 router and experts
stacked into one 3-D tensor per projection), so unit tests run the real loading path in milliseconds. The
tokenizer metadata is copied from SmolLM2's GGUF (padded with unused tokens to a real model's vocabulary where
`vocab` asks: the benchmarks' shapes).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class TinySpec:
    arch: str = "llama"  # "llama" | "qwen2" | "qwen3" | "qwen3moe" | "gemma3"
    hidden: int = 64
    intermediate: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    context: int = 512
    sliding_window: int = 8
    quant: str = "Q8_0"  # type of the attention/MLP matrices: F32, F16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K (K % 256)
    seed: int = 0
    vocab: int | None = None  # None: the tokenizer's own; more: padded with unused tokens
    chat_template: str | None = None  # None: the tokenizer file's own
    # Mixture of experts (arch "qwen3moe", which needs them; 0: a dense MLP): every layer's MLP is
    # num_experts gated MLPs of moe_intermediate, experts_per_token of them chosen per token by the router
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0

    def __post_init__(self):
        if (self.arch == "qwen3moe") != (self.num_experts > 0):
            raise ValueError("arch 'qwen3moe' and only it has experts: set num_experts, experts_per_token and "
                             "moe_intermediate with it")
        if self.num_experts and not (0 < self.experts_per_token <= self.num_experts and self.moe_intermediate > 0):
            raise ValueError(f"bad mixture of experts: {self.experts_per_token} of {self.num_experts} experts of "
                             f"{self.moe_intermediate}")


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols % 256 == 0) -> Q6_K blocks, uint8 [rows, cols / 256 * 210], in ggml's layout
    (gguf-py has no K-quant quantizer): per 16 values a scale d * sc (sc int8, d fp16 per 256), q in -32..31
    stored as q + 32 (128 B of low nibbles, 64 B of top bit pairs, 16 B of sc, d)."""
    rows, cols = w.shape
    b = w.astype(np.float32).reshape(-1, 16, 16)  # [blocks, sub-blocks, values]
    sub = np.abs(b).max(-1) / 31
    d = (sub.max(-1) / 127).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    sc = np.where(df > 0, np.round(sub / np.where(df > 0, df, 1)), 0).clip(-128, 127).astype(np.int8)
    step = (df * sc)[..., None]
    q = np.where(step > 0, np.round(b / np.where(step > 0, step, 1)), 0).clip(-32, 31)
    u = (q + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [blocks, half, quarter, l]: value 128 h + 32 quarter + l
    ql = np.concatenate([(u[:, :, 0] & 15) | ((u[:, :, 2] & 15) << 4), (u[:, :, 1] & 15) | ((u[:, :, 3] & 15) << 4)],
                        axis=-1)
    qh = (u[:, :, 0] >> 4) | ((u[:, :, 1] >> 4) << 2) | ((u[:, :, 2] >> 4) << 4) | ((u[:, :, 3] >> 4) << 6)
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)],
                            axis=-1)
    return blocks.reshape(rows, -1)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols % 256 == 0) -> Q4_K blocks, uint8 [rows, cols / 256 * 144], in ggml's layout:
    per 32 values w = d sc q - dmin m (q 0..15; sc, m 6-bit; d, dmin fp16 per 256): d, dmin, 12 B of sc and m
    (get_scale_min_k4's packing), 128 B of nibbles (per 64 values, the first 32 in the low nibbles)."""
    rows, cols = w.shape
    b = w.astype(np.float32).reshape(-1, 8, 32)  # [blocks, sub-blocks, values]
    lo = np.minimum(b.min(-1), 0)  # m >= 0 offsets only: a sub-block above zero starts at zero
    step = (b.max(-1) - lo) / 15
    d = (step.max(-1) / 63).astype(np.float16)
    dmin = ((-lo).max(-1) / 63).astype(np.float16)
    df, dmf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.where(df > 0, np.round(step / np.where(df > 0, df, 1)), 0).clip(0, 63).astype(np.uint8)
    m = np.where(dmf > 0, np.round(-lo / np.where(dmf > 0, dmf, 1)), 0).clip(0, 63).astype(np.uint8)
    scale, offset = (df * sc)[..., None], (dmf * m)[..., None]
    q = np.where(scale > 0, np.round((b + offset) / np.where(scale > 0, scale, 1)), 0).clip(0, 15).astype(np.uint8)
    packed = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=-1)
    pairs = q.reshape(-1, 4, 2, 32)  # [blocks, 64-value groups, first/second 32, values]
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qs], axis=-1)
    return blocks.reshape(rows, -1)


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _copy_tokenizer_fields(writer, source_gguf: str, vocab: int | None = None,
                           chat_template: str | None = None) -> int:
    import gguf

    reader = gguf.GGUFReader(source_gguf)
    f = reader.fields
    tokens = f["tokenizer.ggml.tokens"].contents()
    types = f["tokenizer.ggml.token_type"].contents()
    if vocab is not None and vocab > len(tokens):
        pad = vocab - len(tokens)
        # Normal tokens (printable ASCII, as byte-level BPE spells them): a random model that samples them
        # streams text, where a control token would stream nothing and blur TTFT and TPOT
        tokens = [*tokens, *(f"<unused_{i}>" for i in range(pad))]
        types = [*types, *[int(gguf.TokenType.NORMAL)] * pad]
    writer.add_tokenizer_model(f["tokenizer.ggml.model"].contents())
    if "tokenizer.ggml.pre" in f:
        writer.add_tokenizer_pre(f["tokenizer.ggml.pre"].contents())
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if "tokenizer.ggml.merges" in f:
        writer.add_token_merges(f["tokenizer.ggml.merges"].contents())
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("unknown_token_id", writer.add_unk_token_id), ("padding_token_id", writer.add_pad_token_id)):
        if f"tokenizer.ggml.{key}" in f:
            add(int(f[f"tokenizer.ggml.{key}"].contents()))
    if "tokenizer.ggml.add_bos_token" in f:
        writer.add_add_bos_token(bool(f["tokenizer.ggml.add_bos_token"].contents()))
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    elif "tokenizer.chat_template" in f:
        writer.add_chat_template(f["tokenizer.chat_template"].contents())
    return len(tokens)


def write_shape(writer, name: str, layers: int, context: int, hidden: int, intermediate: int, heads: int,
                kv_heads: int, head_dim: int, eps: float, vocab: int) -> None:
    """The metadata every decoder's GGUF has (llama.cpp's keys under the writer's architecture)."""
    writer.add_name(name)
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_vocab_size(vocab)


def write_tiny_gguf(path: str | Path, spec: TinySpec, tokenizer_gguf: str, keep_float: bool = True) -> dict[str, np.ndarray]:
    """Write the file; returns the float32 HF-convention weights it was made from (before quantization),
    unless keep_float is False (a model of a real one's size: its float32 copy would not fit in memory)."""
    import gguf
    from gguf import GGMLQuantizationType as T, quants

    rng = np.random.default_rng(spec.seed)
    writer = gguf.GGUFWriter(str(path), spec.arch)
    vocab = _copy_tokenizer_fields(writer, tokenizer_gguf, spec.vocab, spec.chat_template)
    write_shape(writer, f"tiny-{spec.arch}", spec.layers, spec.context, spec.hidden, spec.intermediate, spec.heads,
                spec.kv_heads, spec.head_dim, 1e-6 if spec.arch == "gemma3" else 1e-5, vocab)
    if spec.arch == "gemma3":
        writer.add_rope_freq_base(1_000_000.0)
        writer.add_sliding_window(spec.sliding_window)
    else:
        writer.add_rope_freq_base(10000.0 if spec.arch == "llama" else 1_000_000.0)
        writer.add_rope_dimension_count(spec.head_dim)
    if spec.num_experts:  # Qwen3MoeModel's keys (feed_forward_length stays: the dense size, unused)
        writer.add_expert_count(spec.num_experts)
        writer.add_expert_used_count(spec.experts_per_token)
        writer.add_expert_feed_forward_length(spec.moe_intermediate)

    def rand(*shape, scale=None):
        scale = scale if scale is not None else 1.0 / np.sqrt(shape[-1])
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    class Kept(dict):  # the float32 weights, or a dict that forgets them once written
        def __setitem__(self, key, value):
            if keep_float:
                super().__setitem__(key, value)

    hf: dict[str, np.ndarray] = Kept()
    qtype = T[spec.quant]
    embeddings = rand(vocab, spec.hidden, scale=0.5)
    hf["model.embed_tokens.weight"] = embeddings

    def quantized(w: np.ndarray) -> np.ndarray:
        if qtype in (T.Q6_K, T.Q4_K):  # ours quantize rows of a 2-D matrix
            rows = w.reshape(-1, w.shape[-1])
            return (quantize_q6_k(rows) if qtype == T.Q6_K else quantize_q4_k(rows)).reshape(*w.shape[:-1], -1)
        return quants.quantize(w, qtype)

    def add(name: str, w: np.ndarray, quantize: bool) -> None:
        if quantize and qtype not in (T.F32,):
            writer.add_tensor(name, quantized(w), raw_shape=quants.quant_shape_to_byte_shape(w.shape, qtype),
                              raw_dtype=qtype)
        else:
            writer.add_tensor(name, w)

    def add_experts(name: str, rows: int, cols: int) -> np.ndarray | None:
        """One projection of every expert, stacked [E, rows, cols] as the converter merges them; drawn and
        quantized an expert at a time (the same numbers as one draw), so a real model's size fits in memory.
        Returns the float32 stack where the weights are kept."""
        store = qtype not in (T.F32,)
        out, kept = None, []
        for e in range(spec.num_experts):
            w = rand(rows, cols)
            if keep_float:
                kept.append(w)
            q = quantized(w) if store else w
            if out is None:
                out = np.empty((spec.num_experts, *q.shape), q.dtype)
            out[e] = q
        if store:
            writer.add_tensor(name, out, raw_shape=quants.quant_shape_to_byte_shape(
                (spec.num_experts, rows, cols), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, out)
        return np.stack(kept) if keep_float else None

    def tensor_name(tensor: "gguf.MODEL_TENSOR", layer: int) -> str:
        return gguf.TENSOR_NAMES[tensor].format(bid=layer) + ".weight"

    add("token_embd.weight", embeddings, quantize=spec.quant != "F32")
    del embeddings
    norm_offset = 1.0 if spec.arch == "gemma3" else 0.0

    def norm(name_hf: str, name_gguf: str) -> None:
        w = (rng.standard_normal(spec.hidden if "self_attn" not in name_hf else spec.head_dim) * 0.1
             + (0.0 if spec.arch == "gemma3" else 1.0)).astype(np.float32)
        hf[name_hf] = w
        add(name_gguf, w + norm_offset, quantize=False)

    q_rows, kv_rows = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    for i in range(spec.layers):
        p, g = f"model.layers.{i}.", f"blk.{i}."
        mats = {"self_attn.q_proj": (q_rows, spec.hidden), "self_attn.k_proj": (kv_rows, spec.hidden),
                "self_attn.v_proj": (kv_rows, spec.hidden), "self_attn.o_proj": (spec.hidden, q_rows)}
        if not spec.num_experts:
            mats.update({"mlp.gate_proj": (spec.intermediate, spec.hidden),
                         "mlp.up_proj": (spec.intermediate, spec.hidden),
                         "mlp.down_proj": (spec.hidden, spec.intermediate)})
        gguf_names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                      "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                      "mlp.down_proj": "ffn_down"}
        for name, shape in mats.items():
            w = rand(*shape)
            hf[p + name + ".weight"] = w
            stored = w
            if spec.arch == "llama" and name == "self_attn.q_proj":
                stored = permute_rope_rows(w, spec.heads)
            elif spec.arch == "llama" and name == "self_attn.k_proj":
                stored = permute_rope_rows(w, spec.kv_heads)
            add(g + gguf_names[name] + ".weight", stored, quantize=True)
            if spec.arch == "qwen2" and name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                bias = rand(shape[0], scale=0.5)
                hf[p + name + ".bias"] = bias
                add(g + gguf_names[name] + ".bias", bias, quantize=False)
        if spec.num_experts:
            # transformers' Qwen3-MoE names: router mlp.gate [E, hidden]; experts.gate_up_proj [E, 2 inter,
            # hidden] (gate rows first), experts.down_proj [E, hidden, inter]. The router stays float32.
            router = rand(spec.num_experts, spec.hidden)
            hf[p + "mlp.gate.weight"] = router
            add(tensor_name(gguf.MODEL_TENSOR.FFN_GATE_INP, i), router, quantize=False)
            inter = spec.moe_intermediate
            gate = add_experts(tensor_name(gguf.MODEL_TENSOR.FFN_GATE_EXP, i), inter, spec.hidden)
            up = add_experts(tensor_name(gguf.MODEL_TENSOR.FFN_UP_EXP, i), inter, spec.hidden)
            down = add_experts(tensor_name(gguf.MODEL_TENSOR.FFN_DOWN_EXP, i), spec.hidden, inter)
            if keep_float:
                hf[p + "mlp.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
                hf[p + "mlp.experts.down_proj"] = down
        norm(p + "input_layernorm.weight", g + "attn_norm.weight")
        if spec.arch in ("qwen3", "qwen3moe"):
            norm(p + "self_attn.q_norm.weight", g + "attn_q_norm.weight")
            norm(p + "self_attn.k_norm.weight", g + "attn_k_norm.weight")
        if spec.arch == "gemma3":
            norm(p + "post_attention_layernorm.weight", g + "post_attention_norm.weight")
            norm(p + "pre_feedforward_layernorm.weight", g + "ffn_norm.weight")
            norm(p + "post_feedforward_layernorm.weight", g + "post_ffw_norm.weight")
            norm(p + "self_attn.q_norm.weight", g + "attn_q_norm.weight")
            norm(p + "self_attn.k_norm.weight", g + "attn_k_norm.weight")
        else:
            norm(p + "post_attention_layernorm.weight", g + "ffn_norm.weight")
    norm("model.norm.weight", "output_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf
