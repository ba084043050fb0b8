"""Load a checkpoint (GGUF file or Hugging Face safetensors directory) into HF-named torch tensors.

HF names and conventions are canonical: the GGUF path undoes what llama.cpp's converter did
(Q/K row permutation for Llama attention, +1 on Gemma norm weights) so that both sources feed the
same model code, and parity with transformers can be checked on identical weights.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from kvserve.config import ModelConfig
from kvserve.models import backend
from kvserve.models.gguf_file import GGUFFile, GGUFTensor
from kvserve.models.model_info import (LLAMA_LAYOUT, ModelInfo, ModelLoadError, config_from_gguf,
                                       longrope_attention_factor, longrope_scaling, model_format, read_hf_config,
                                       tokenizer_for)
from kvserve.models import quant
from kvserve.models.quant import QuantizedMatrix

if TYPE_CHECKING:
    from kvserve.models.parallel import TensorParallel

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    """HF-named tensors: matrices kept quantized (QuantizedMatrix) as `weights` says, the rest dense
    (float32, or the `dtype` asked for: an 8B model's dense matrices never exist in float32 at once)."""

    config: ModelConfig
    tensors: dict[str, "torch.Tensor | QuantizedMatrix"]
    path: Path
    format: str  # "gguf" | "hf"
    metadata: dict | None = None  # GGUF key/values (the tokenizer is built from them without a second read)
    weights: str = "auto"  # the setting it was loaded with (models/quant.WEIGHT_MODES)
    # How each matrix is held: (GGUF type name or dtype, "int8" / "int4" / "dense", exact) -> count.
    forms: dict[tuple[str, str, bool], int] = field(default_factory=dict)

    def dense_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor dense (quantized matrices as the float32 weights they hold): a reference's input."""
        return {name: t.dequantize() if isinstance(t, QuantizedMatrix) else t for name, t in self.tensors.items()}


# ---- the load's progress ---------------------------------------------------------------------

PROGRESS_MIN_BYTES = 256 << 20  # a smaller checkpoint loads in moments: no bar
PROGRESS_INTERVAL_S = 5.0  # at most a line this often


class _LogLines:
    """A file for tqdm that writes each refresh of its bar as an INFO line of this module's logger."""

    def write(self, text: str) -> None:
        line = text.strip("\r\n ")
        if line:
            log.info("%s", line)

    def flush(self) -> None:
        pass


def load_progress(total_bytes: int, tensors: int, what: str):
    """The load's progress bar (bytes read, tensors converted, rate) as log lines every few seconds, not carriage
    returns on stderr: a server's log is a file, where a live bar would be one line per update."""
    from tqdm import tqdm

    return tqdm(total=total_bytes, desc=f"loading {what}", unit="B", unit_scale=True, unit_divisor=1024,
                mininterval=PROGRESS_INTERVAL_S, ascii=True, file=_LogLines(), postfix=f"0/{tensors} tensors",
                disable=total_bytes < PROGRESS_MIN_BYTES or not log.isEnabledFor(logging.INFO))


def _advance(bar, nbytes: int, done: int, tensors: int) -> None:
    bar.set_postfix_str(f"{done}/{tensors} tensors", refresh=False)
    bar.update(nbytes)


# ---- GGUF ------------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    # A mixture of experts: the router, and each projection of every expert stacked [E, rows, cols] in one
    # tensor (split here into the experts' own HF names: "{}" is the expert).
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.{}.gate_proj", "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
}
_GEMMA3_LAYER_NAMES = {**_GGUF_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm"}
# Phi-3 keeps its projections fused as the checkpoint has them: QKV, and gate with up ([gate; up]) as `ffn_up`.
_PHI3_LAYER_NAMES = {**_GGUF_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_LAYER_NAMES = {"gemma3": _GEMMA3_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES}


ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's RoPE scaling as llama.cpp's converter writes it: a factor per frequency
ROPE_LONG, ROPE_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"  # Phi-3's LongRoPE factors
CONFIG_TENSORS = (ROPE_FREQS, ROPE_LONG, ROPE_SHORT)  # read into the config, not weights


def gguf_config(file: GGUFFile) -> ModelConfig:
    """The file's config: its metadata's, with a `rope_freqs` tensor's factors (Llama 3.1) or the long and
    short factors (Phi-3's LongRoPE) as its RoPE scaling."""
    config = config_from_gguf(file.metadata)
    if config.vocab_size == 0:  # no token list in the metadata: the embedding table's rows (before any split)
        embed = next(t for t in file.tensors if t.name == "token_embd.weight")
        config = replace(config, vocab_size=embed.shape[1])
    found = {t.name: tuple(float(f) for f in _dequantize(file, t).reshape(-1)) for t in file.tensors
             if t.name in CONFIG_TENSORS}
    rotated = (config.rotary_dim or config.head_dim) // 2
    for name, factors in found.items():
        if len(factors) != rotated:
            raise ModelLoadError(f"{name} has {len(factors)} factors; {rotated} rotated frequencies need as many")
    if ROPE_FREQS in found:
        config = replace(config, rope_scaling={"rope_type": "factors", "factors": found[ROPE_FREQS]})
    elif ROPE_LONG in found and ROPE_SHORT in found:
        meta, arch = file.metadata, config.architecture
        original = int(meta.get(f"{arch}.rope.scaling.original_context_length") or config.max_position_embeddings)
        factor = meta.get(f"{arch}.rope.scaling.attn_factor")
        config = replace(config, rope_scaling=longrope_scaling(
            found[ROPE_SHORT], found[ROPE_LONG], original,
            float(factor) if factor is not None else longrope_attention_factor(
                config.max_position_embeddings / original, original)))
    return config


def hf_name_for_gguf(name: str, arch: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if parts[0] != "blk" or len(parts) != 4:
        raise ModelLoadError(f"unexpected GGUF tensor name {name!r}")
    table = _LAYER_NAMES.get(arch, _GGUF_LAYER_NAMES)
    if parts[2] not in table:
        raise ModelLoadError(f"unexpected GGUF tensor name {name!r}")
    return f"model.layers.{parts[1]}.{table[parts[2]]}.{parts[3]}"


def is_router(name: str) -> bool:
    """A mixture's router matrix: held in float32 whatever the weights' setting (models/moe.py)."""
    return name.endswith("mlp.gate.weight")


def form_of(name: str, bits: int, weights: str) -> str:
    """How a loaded matrix will be computed from, for the load log: "int8" / "int4", "fp8" (a projection under
    weights = fp8, converted when the model is built; not the embeddings, the LM head or a router) or "dense"."""
    if bits:
        return f"int{bits}"
    return "fp8" if weights == "fp8" and name.endswith("_proj.weight") else "dense"


def expert_names(name: str, count: int) -> list[str]:
    """The HF names of a stacked expert tensor's experts (a name without "{}": itself)."""
    return [name.format(e) for e in range(count)] if "{}" in name else [name]


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> rotate-half layout)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dense(stored: np.ndarray, qtype: int) -> np.ndarray:
    """Stored rows (GGUFFile.data: a tensor's, or one expert's of a stack) as float32 [..., rows, cols]."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType(qtype)
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.array(stored, dtype=np.float32)  # own the memory: the file's map is closed after loading
    return quants.dequantize(stored, qtype)


DENSE_CHUNK = 1 << 22  # values dequantized at a time into a dense matrix


def _dense_matrix(stored: np.ndarray, qtype: int, dtype: torch.dtype) -> torch.Tensor:
    """A stored [rows, ...] matrix as a dense [rows, cols] one in `dtype`, dequantized a block of rows at a time: the
    same values as `_dense(stored).to(dtype)` without the whole in float32 (an 8B model's embedding table would be
    2 GB, and gguf's numpy dequantization makes float32 temporaries as large again)."""
    rows = stored.shape[0]
    out = torch.empty((rows, _dense(stored[:1], qtype).shape[1]), dtype=dtype)
    step = max(1, DENSE_CHUNK // out.shape[1])
    for start in range(0, rows, step):
        out[start:start + step] = torch.from_numpy(_dense(stored[start:start + step], qtype))
    return out


def _own(t: "torch.Tensor | QuantizedMatrix") -> "torch.Tensor | QuantizedMatrix":
    """The tensor in memory of its own: a slice that is a view (a rank's rows) would keep the whole matrix alive."""
    if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone()
    return t


def row_span(shard: "TensorParallel", name: str, shape: tuple[int, ...], config: ModelConfig) -> tuple[int, int] | None:
    """The rows [start, stop) of the HF-named tensor of `shape` that are this rank's part, where its part is a run of
    whole rows (Q, K, V, gate and up, the vocabulary's rows: what models/parallel.py cuts as a view), so a load
    reads or dequantizes those alone; None where it is every row or not a run of them (columns, a fused tensor's
    parts, a padded run): the whole is read, then cut. The split is asked of `shard.slice` on a meta tensor."""
    whole = torch.empty(shape, device="meta")
    part = shard.slice(name, whole, config)
    if part is whole or part._base is not whole or not part.is_contiguous() or part.shape[1:] != whole.shape[1:]:
        return None
    start = part.storage_offset() // max(1, int(np.prod(shape[1:])))
    return start, start + part.shape[0]


def _dequantize(file: GGUFFile, tensor: GGUFTensor) -> np.ndarray:
    return _dense(file.data(tensor), tensor.type).reshape(tuple(reversed(tensor.shape)))  # GGUF lists ne0 first


def _type_name(qtype: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


def load_gguf(path: str | os.PathLike, weights: str = "auto", dtype: torch.dtype = torch.float32,
              int8_acts: bool = False, shard: "TensorParallel | None" = None) -> Checkpoint:
    """Every matrix at the bits `weights` gives its type (models/quant.weight_bits; `int8_acts`: 8-bit
    activations will multiply them, so Q6_K may stay at 6 bits and Q4_K and Q6_K keep their K-quant forms),
    the others dense: 2-D ones in `dtype`, norms in float32. Each tensor is read from the memory-mapped file and
    converted (with `shard`, cut to this rank's slice: models/parallel.py, dense weights; a run of rows is
    dequantized alone, row_span) as it comes, its pages then dropped: the load holds what it keeps and the
    tensors in conversion."""
    path = Path(path)
    file = GGUFFile(path)
    meta = file.metadata
    config = gguf_config(file)
    arch = config.architecture
    forms: dict[tuple[str, str, bool], int] = {}

    def convert(t: GGUFTensor) -> list[tuple[str, "torch.Tensor | QuantizedMatrix"]]:
        name = hf_name_for_gguf(t.name, arch)
        stored = file.data(t)
        if "{}" in name:  # each expert of a stacked [E, rows, cols] tensor, a matrix of its own
            pairs = [pair for e, expert in enumerate(expert_names(name, t.shape[2]))
                     for pair in convert_matrix(t, expert, stored[e])]
        else:
            pairs = convert_matrix(t, name, stored)
        del stored
        file.release(t)  # converted (every form copies what it keeps): its pages need not stay resident
        return pairs

    def convert_matrix(t: GGUFTensor, name: str, stored: np.ndarray) -> list[tuple[str, "torch.Tensor | QuantizedMatrix"]]:
        """One matrix (or vector) from its stored rows (uint8 blocks when quantized)."""
        bits = quant.weight_bits(t.type, weights, int8_acts) if stored.ndim >= 2 and not is_router(name) else 0
        heads = None
        if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            heads = config.num_heads
        elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            heads = config.num_kv_heads
        span = None
        if bits and t.type not in quant.FLOAT_TYPES:
            value = quant.from_gguf(stored, t.type, bits, supers=int8_acts)
        elif not bits and stored.ndim == 2 and not is_router(name):  # a dense matrix in `dtype`
            if shard is not None and heads is None:  # (Q and K rows are permuted first: the whole is cut)
                span = row_span(shard, name, (stored.shape[0], t.shape[0]), config)
            value = _dense_matrix(stored if span is None else stored[span[0]:span[1]], t.type, dtype)
        else:
            w = torch.from_numpy(_dense(stored, t.type))
            if arch == "gemma3" and name.endswith("norm.weight"):
                w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norm scale; HF stores w
            value = quant.quantize(w, bits) if bits else w
        if heads is not None:
            value = value.map_rows(lambda x: unpermute_rope_rows(x, heads)) if isinstance(value, QuantizedMatrix) \
                else unpermute_rope_rows(value, heads)
        if len(t.shape) >= 2:
            form = form_of(name, bits, weights)
            key = (_type_name(t.type), form, form == "dense" or bool(bits) and quant.is_exact(t.type, bits))
            forms[key] = forms.get(key, 0) + 1
        if shard is not None and span is None:
            value = _own(shard.slice(name, value, config))
        return [(name, value)]

    todo = [t for t in file.tensors if t.name not in CONFIG_TENSORS]
    tensors: dict[str, "torch.Tensor | QuantizedMatrix"] = {}
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool, \
                load_progress(sum(t.nbytes for t in todo), len(todo), path.name) as bar:
            for done, (t, pairs) in enumerate(zip(todo, pool.map(convert, todo)), 1):
                tensors.update(pairs)
                _advance(bar, t.nbytes, done, len(todo))
    finally:
        file.close()
    if "lm_head.weight" in tensors:
        config = replace(config, tie_word_embeddings=False)
    return Checkpoint(config=config, tensors=tensors, path=path, format="gguf", metadata=meta, weights=weights,
                      forms=forms)


# ---- Hugging Face safetensors directory -------------------------------------------------------

def load_hf_dir(path: str | os.PathLike, weights: str = "auto", dtype: torch.dtype | None = None,
                shard: "TensorParallel | None" = None) -> Checkpoint:
    """The checkpoint's tensors as stored (or in `dtype`); weights int8 / int4 quantize every matrix here
    (auto and bf16 keep them dense: a safetensors checkpoint holds 16- or 32-bit floats). Read tensor by tensor
    into memory of its own (read_safetensor), each converted (and, with `shard`, cut to this rank's slice) before
    the next is read: the load holds what it keeps and one tensor more, never a whole file."""
    path = Path(path)
    config = read_hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files (only safetensors checkpoints are supported)")
    bits = quant.weight_bits(quant.F32, weights)
    forms: dict[tuple[str, str, bool], int] = {}

    def keep(name: str, t: torch.Tensor, cut: bool = False) -> "torch.Tensor | QuantizedMatrix":
        """The tensor as kept (`cut`: already this rank's part)."""
        if shard is not None and not cut:
            t = _own(shard.slice(name, t, config))
        if is_router(name):
            return t.float()
        if t.dim() != 2:
            return t
        form = form_of(name, bits, weights)
        key = (str(t.dtype).removeprefix("torch."), form, form == "dense")
        forms[key] = forms.get(key, 0) + 1
        return quant.quantize(t, bits) if bits else t if dtype is None else t.to(dtype)

    def text_name(stored: str) -> str | None:
        """The tensor's name in the text model (None: not read, a vision tower's or a tied LM head)."""
        # Multimodal Gemma 3 checkpoints nest the text model under language_model.
        name = stored.replace("language_model.model.", "model.").replace("model.language_model.", "model.")
        if name.startswith(("vision_tower", "multi_modal_projector", "model.vision_tower",
                            "model.multi_modal_projector")):
            return None
        if config.tie_word_embeddings and name == "lm_head.weight":
            return None
        return name

    headers = {f: safetensors_header(f) for f in files}
    todo = [(f, stored, entry) for f, (_, entries) in headers.items() for stored, entry in sorted(entries.items())
            if text_name(stored) is not None]
    size = lambda entry: entry["data_offsets"][1] - entry["data_offsets"][0]  # noqa: E731
    tensors: dict[str, "torch.Tensor | QuantizedMatrix"] = {}
    with load_progress(sum(size(e) for _, _, e in todo), len(todo), path.name) as bar:
        for done, (f, stored, entry) in enumerate(todo, 1):
            name, span = text_name(stored), None
            if shard is not None:
                renamed = list(hf_expert_tensors(name, torch.empty(entry["shape"], device="meta")))
                if len(renamed) == 1:  # (a stack of experts is split first, each expert then cut)
                    name = renamed[0]
                    span = row_span(shard, name, tuple(entry["shape"]), config)
            with open(f, "rb", buffering=0) as handle:
                t = read_safetensor(handle, headers[f][0], entry, span)
            if span is not None:
                tensors[name] = keep(name, t, cut=True)
            else:
                for expert_name, t in hf_expert_tensors(name, t).items():
                    tensors[expert_name] = keep(expert_name, t)
            del t
            _advance(bar, size(entry), done, len(todo))
    return Checkpoint(config=config, tensors=tensors, path=path, format="hf", weights=weights, forms=forms)


_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def safetensors_header(file: str | os.PathLike) -> tuple[int, dict[str, dict]]:
    """A .safetensors file's header (8 bytes of length, then JSON): (the offset its data starts at, each tensor's
    dtype, shape and data_offsets by name)."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


def read_safetensor(f, start: int, entry: dict, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """One tensor of an open .safetensors file (`start`, `entry`: its header's), or its `rows` [first, stop), read
    into memory of its own. Not mapped: a mapped file's pages, once read, count in the process's memory as long as
    the file stays mapped (by any tensor of it)."""
    dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ModelLoadError(f"{f.name}: safetensors dtype {entry['dtype']} is not supported")
    begin, end = entry["data_offsets"]
    shape = list(entry["shape"])
    if rows is not None:
        row = (end - begin) // max(1, shape[0])
        begin, end = begin + rows[0] * row, begin + rows[1] * row
        shape[0] = rows[1] - rows[0]
    out = torch.empty(end - begin, dtype=torch.uint8)
    buffer = memoryview(out.numpy())
    f.seek(start + begin)
    got = 0
    while got < len(buffer):
        n = f.readinto(buffer[got:])
        if not n:
            raise ModelLoadError(f"{f.name} is truncated: {entry['dtype']} {entry['shape']} ends past its end")
        got += n
    return out.view(dtype).reshape(shape)


_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def hf_expert_tensors(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A safetensors tensor under the experts' canonical names (Qwen3-MoE's hub names: `mlp.gate`,
    `mlp.experts.{e}.{gate,up,down}_proj`): Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2` renamed,
    transformers 5's stacked `mlp.experts.gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] split."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    parts = name.split(".")
    if len(parts) > 4 and parts[-4] == "experts" and parts[-2] in _MIXTRAL_EXPERT:
        parts[-2] = _MIXTRAL_EXPERT[parts[-2]]
        return {".".join(parts): t}
    if name.endswith("mlp.experts.gate_up_proj"):
        base = name.removesuffix("gate_up_proj")
        gate, up = t.chunk(2, dim=1)
        return {**{f"{base}{e}.gate_proj.weight": g.contiguous() for e, g in enumerate(gate)},
                **{f"{base}{e}.up_proj.weight": u.contiguous() for e, u in enumerate(up)}}
    if name.endswith("mlp.experts.down_proj"):
        base = name.removesuffix("down_proj")
        return {f"{base}{e}.down_proj.weight": d.contiguous() for e, d in enumerate(t)}
    return {".".join(parts): t}


def checkpoint_header(path: str | os.PathLike) -> tuple[ModelConfig, set[str]]:
    """A checkpoint's config and tensor names (HF names), read without its weights: what the engine decides
    the dtype from before it loads them in that dtype."""
    path = Path(path)
    if model_format(path) == "hf":
        names: set[str] = set()
        for f in sorted(path.glob("*.safetensors")):
            names.update(safetensors_header(f)[1])  # (a mixture's experts under the names they are stored by)
        return read_hf_config(path), names
    file = GGUFFile(path)
    try:
        config = gguf_config(file)
        names = {e for t in file.tensors if t.name not in CONFIG_TENSORS
                 for e in expert_names(hf_name_for_gguf(t.name, config.architecture), config.num_experts)}
    finally:
        file.close()
    return config, names


def load_checkpoint(path: str | os.PathLike, weights: str = "auto", dtype: torch.dtype = torch.float32,
                    int8_acts: bool = False, shard: "TensorParallel | None" = None) -> Checkpoint:
    """The checkpoint at `path` with its matrices in the forms `weights` gives them (models/quant.py), dense
    2-D tensors in `dtype`; `int8_acts`: 8-bit activations will multiply them (Plan.activations), so the
    forms only those kernels read are allowed (Q6_K at 6 bits, the K-quant forms). `shard`: only this
    tensor-parallel rank's slices are kept (a dense `weights` setting: bf16 or fp8); the config stays the whole
    model's."""
    path = Path(path)
    if model_format(path) == "hf":
        return load_hf_dir(path, weights, None if dtype == torch.float32 else dtype, shard)
    return load_gguf(path, weights, dtype, int8_acts, shard)


def weights_label(checkpoint: Checkpoint, quantized: bool, dtype: torch.dtype) -> str:
    """What the model computes from, for /v1/models and the load log: the quantized forms in use
    ("int4+int8"; "fp8+bfloat16": e4m3 projections, the embeddings and LM head in bf16), or the dtype where
    every matrix is dense (also where the kernels that read quantized weights do not run, which dequantize
    them)."""
    forms = {form for _, form, _ in checkpoint.forms}
    kept = sorted((f for f in forms if f.startswith("int")), key=lambda f: int(f[3:])) if quantized else []
    kept += ["fp8"] if "fp8" in forms else []
    dense = str(dtype).removeprefix("torch.")
    if not kept:
        return dense
    return "+".join(kept) + (f"+{dense}" if "dense" in forms else "")


def describe_forms(forms: dict[tuple[str, str, bool], int]) -> str:
    """'112 Q4_K as int4, 33 Q6_K requantized to int8, 196 BF16 quantized to fp8, ...' (the load log)."""
    parts = []
    for (kind, form, exact), count in sorted(forms.items(), key=lambda item: -item[1]):
        floats = kind in ("F32", "F16", "BF16") or kind.startswith(("float", "bfloat"))
        how = "dense" if form == "dense" else f"as {form}" if exact else \
            f"{'quantized' if floats else 'requantized'} to {form}"
        parts.append(f"{count} {kind} {how}")
    return ", ".join(parts)


def checkpoint_info(checkpoint: Checkpoint, name: str = "") -> ModelInfo:
    """The loaded checkpoint's config and tokenizer (a GGUF's metadata is not read again)."""
    return ModelInfo(checkpoint.config, tokenizer_for(checkpoint.path, checkpoint.format, checkpoint.metadata, name))


def model_class(config: ModelConfig):
    if config.architecture in LLAMA_LAYOUT:
        from kvserve.models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    if config.architecture == "gemma3":
        from kvserve.models.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    raise ModelLoadError(f"no model code for architecture {config.architecture!r}")


def return_freed_memory() -> None:
    """Hand the allocator's freed pages back to the system. Loading converts every matrix through
    temporaries of up to tens of MB in several threads; glibc keeps such freed chunks in its arenas, so an
    8B model's load would otherwise leave the process's RSS about twice the weights it holds."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def plan_for(checkpoint: Checkpoint, dtype: str | torch.dtype = "auto", device: str = "cpu", **settings) -> backend.Plan:
    """The hardware plan of an already loaded checkpoint (tests, tools; an engine plans from the header)."""
    return backend.plan(checkpoint.config, set(checkpoint.tensors), device=device, dtype=dtype, **settings)


def build_model(checkpoint: Checkpoint, the_plan: backend.Plan, max_positions: int | None = None,
                consume: bool = False, attention_window: tuple[int, int] | None = None):
    """Instantiate the model on the plan's device in its dtype, load the checkpoint's weights into it and
    prepare it for the plan's path (models/backend.py).

    consume: the checkpoint gives up its tensors to the model (an engine's load: each quantized matrix is
    then freed as soon as it is packed, so the weights are never held twice). attention_window: (sinks,
    window) of the sinks + window policy (EngineConfig.attention_policy), else the model's own attention.
    """
    config = checkpoint.config.with_attention_window(attention_window)
    if max_positions is not None:  # rotary tables only as long as the engine will ever use
        config = replace(config, max_position_embeddings=min(config.max_position_embeddings, max_positions))
    model = model_class(config)(config)
    model.load_weights(checkpoint.tensors)
    if consume:
        checkpoint.tensors = {}
    model = model.to(device=the_plan.device, dtype=the_plan.dtype)
    backend.prepare(model, the_plan)
    model.eval()
    if consume:
        return_freed_memory()
    return model
