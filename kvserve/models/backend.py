"""The hardware path of a loaded model, decided once, when it is built (`prepare`), and asked by the model
code instead of each op checking tensors:

- "cuda": torch ops on the GPU (SDPA prefill, the torch paged-decode reference);
- "cpu-fused": CPU, bfloat16, AMX or AVX2: steps run the whole decoder stack in one native call where
  they fit (models/native_decoder.py), per op otherwise, with the native kernels;
- "cpu-native": CPU, float32 or bfloat16: per op, with the native kernels (kernels/cpu.py) for the
  norms, rotary, K/V writes, decode attention and gated activations;
- "cpu-torch": CPU without the kernels (no compiler, KVSERVE_NATIVE_KERNELS=0, float16): torch ops.

The instruction-set level the kernels are built for is kernels/isa.py's decision.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvserve.kernels import cpu as cpu_kernels


@dataclass(frozen=True)
class Backend:
    name: str
    native: cpu_kernels.NativeKernels | None = None  # the per-op CPU kernels, where they serve


TORCH = Backend("torch")  # a layer's path until a built model hands it its own (unit tests of single layers)


def choose(device: torch.device, dtype: torch.dtype) -> Backend:
    """The per-op path for a model in `dtype` on `device`."""
    if device.type == "cuda":
        return Backend("cuda")
    native = cpu_kernels.load() if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) else None
    return Backend("cpu-native", native) if native is not None else Backend("cpu-torch")


def prepare(model, device: torch.device, dtype: torch.dtype, *, onednn_weights: bool = True,
            native_decoder: bool = True) -> Backend:
    """Choose the path and put the weights in its form, in the order that matters: quantized matrices into
    the packed GEMM's layout where its kernels run (CPU, bfloat16, AMX or AVX2), else dense again; then
    the fused decoder packs the dense projections (and the LM head); then oneDNN's reorder, which frees
    the dense copies. Every layer of `model` then asks the returned backend."""
    from kvserve.models.layers import onednn_prepack_available

    backend = choose(device, dtype)
    cpu_bf16 = device.type == "cpu" and dtype == torch.bfloat16
    packed_gemm = cpu_bf16 and backend.native is not None and backend.native.fused
    if packed_gemm:
        model.pack_quantized(backend.native)
    else:
        model.dequantize_weights(dtype, device)
    if native_decoder and packed_gemm and model.attach_native_decoder(backend.native):
        model.pack_dense_lm_head(backend.native)
        backend = replace(backend, name="cpu-fused")
    if onednn_weights and cpu_bf16 and onednn_prepack_available():
        model.prepack_onednn()
    model.use_backend(backend)
    return backend


def quantized_weights_run(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on `device` in `dtype` computes with quantized weights (else prepare dequantizes them)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    native = cpu_kernels.load()
    return native is not None and native.fused
