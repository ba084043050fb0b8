"""Load a checkpoint (GGUF file or Hugging Face safetensors directory) into HF-named torch tensors.

HF names and conventions are canonical: the GGUF path undoes what llama.cpp's converter did
(Q/K row permutation for Llama attention, +1 on Gemma norm weights) so that both sources feed the
same model code, and parity with transformers can be checked on identical weights.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvserve.config import ModelConfig
from kvserve.kernels import isa
from kvserve.models import backend
from kvserve.models.gguf_file import GGUFFile, GGUFTensor
from kvserve.models.model_info import (ModelInfo, ModelLoadError, config_from_gguf, model_format, read_hf_config,
                                       tokenizer_for)
from kvserve.models.int4 import Q4_0, Q4_1, Int4Weight, unpack_gguf_q4



@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # HF names, float32 unless the file stored another float dtype
    path: Path
    format: str  # "gguf" | "hf"
    metadata: dict | None = None  # GGUF key/values (the tokenizer is built from them without a second read)
    int4: dict[str, Int4Weight] = field(default_factory=dict)  # the file's own Q4_0/Q4_1 matrices, unpacked


# ---- dtype and device ------------------------------------------------------------------------

def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, fused: bool = False) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA, on CPUs with native bf16 (avx512_bf16 / AMX), and where the model runs
    on the fused native decoder (`fused`: models/native_decoder.NativeDecoder.would_serve), which reads
    bf16 weights and widens them in registers on AVX2 machines; else float32 (torch's bf16 ops on a CPU
    without bf16 arithmetic are slower than its float32 ones)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda" or (device.type == "cpu" and (isa.native_bf16() or fused)):
            return torch.bfloat16
        return torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return names[dtype]


# ---- GGUF ------------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA3_LAYER_NAMES = {**_GGUF_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm"}


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
    table = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _GGUF_LAYER_NAMES
    if parts[2] not in table:
        raise ModelLoadError(f"unexpected GGUF tensor name {name!r}")
    return f"model.layers.{parts[1]}.{table[parts[2]]}.{parts[3]}"


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> rotate-half layout)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(file: GGUFFile, tensor: GGUFTensor) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    data = file.data(tensor)
    qtype = GGMLQuantizationType(tensor.type)
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        data = np.array(data, dtype=np.float32)  # own the memory: the file's map is closed after loading
    else:
        data = quants.dequantize(data, qtype)
    return data.reshape(tuple(reversed(tensor.shape)))  # GGUF lists ne0 (innermost) first


def load_gguf(path: str | os.PathLike) -> Checkpoint:
    path = Path(path)
    file = GGUFFile(path)
    meta = file.metadata
    config = config_from_gguf(meta)
    arch = config.architecture
    tensors: dict[str, torch.Tensor] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        arrays = list(pool.map(lambda t: _dequantize(file, t), file.tensors))
    int4: dict[str, Int4Weight] = {}
    for t, array in zip(file.tensors, arrays):
        name = hf_name_for_gguf(t.name, arch)
        w = torch.from_numpy(np.asarray(array, dtype=np.float32))
        packed = None
        if t.type in (Q4_0, Q4_1) and len(t.shape) == 2 and name.startswith("model.layers."):
            packed = unpack_gguf_q4(file.data(t), t.type)
        heads = None
        if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            heads = config.num_heads
        elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            heads = config.num_kv_heads
        elif arch == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norm scale; HF stores w
        if heads is not None:
            w = unpermute_rope_rows(w, heads)
            if packed is not None:
                packed = packed.permute_rows(lambda x, h=heads: unpermute_rope_rows(x, h))
        tensors[name] = w
        if packed is not None:
            int4[name] = packed
    if config.vocab_size == 0:
        from dataclasses import replace

        config = replace(config, vocab_size=tensors["model.embed_tokens.weight"].shape[0])
    if "lm_head.weight" in tensors:
        from dataclasses import replace

        config = replace(config, tie_word_embeddings=False)
    del arrays
    file.close()
    return Checkpoint(config=config, tensors=tensors, path=path, format="gguf", metadata=meta, int4=int4)


# ---- Hugging Face safetensors directory -------------------------------------------------------

def load_hf_dir(path: str | os.PathLike) -> Checkpoint:
    from safetensors.torch import load_file

    path = Path(path)
    config = read_hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files (only safetensors checkpoints are supported)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            # Multimodal Gemma 3 checkpoints nest the text model under language_model.
            name = name.replace("language_model.model.", "model.").replace("model.language_model.", "model.")
            if name.startswith(("vision_tower", "multi_modal_projector", "model.vision_tower",
                                "model.multi_modal_projector")):
                continue
            tensors[name] = t
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return Checkpoint(config=config, tensors=tensors, path=path, format="hf")


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    path = Path(path)
    return load_hf_dir(path) if model_format(path) == "hf" else load_gguf(path)


def checkpoint_info(checkpoint: Checkpoint, name: str = "") -> ModelInfo:
    """The loaded checkpoint's config and tokenizer (a GGUF's metadata is not read again)."""
    return ModelInfo(checkpoint.config, tokenizer_for(checkpoint.path, checkpoint.format, checkpoint.metadata, name))


def model_class(config: ModelConfig):
    if config.architecture == "llama":
        from kvserve.models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    if config.architecture == "gemma3":
        from kvserve.models.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    raise ModelLoadError(f"no model code for architecture {config.architecture!r}")


def build_model(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device,
                max_positions: int | None = None, int4_decode: bool = True, onednn_weights: bool = True,
                native_decoder: bool = True):
    """Instantiate the model on `device` in `dtype`, load the checkpoint's weights into it and prepare it
    for its hardware path (models/backend.py; the flags below switch parts of that path off).

    int4_decode: on the CPU in bfloat16, also keep the file's Q4_0/Q4_1 matrices packed for
    small-batch decode (see models/int4.py), unless the native decoder attached (it serves those).
    onednn_weights: on the CPU in bfloat16, reorder the projection weights once into oneDNN's blocked
    layout (see layers.prepack_onednn), instead of on every matmul.
    native_decoder: on the CPU in bfloat16 with AMX or AVX2, run steps through the fused native
    decoder (see models/native_decoder.py).
    """
    from dataclasses import replace

    config = checkpoint.config
    if max_positions is not None:  # rotary tables only as long as the engine will ever use
        config = replace(config, max_position_embeddings=min(config.max_position_embeddings, max_positions))
    model = model_class(config)(config)
    model.load_weights(checkpoint.tensors)
    model = model.to(device=device, dtype=dtype)
    backend.prepare(model, device, dtype, checkpoint.int4, int4_decode=int4_decode, onednn_weights=onednn_weights,
                    native_decoder=native_decoder)
    model.eval()
    return model

