"""The hardware plan of a model, decided once from its checkpoint's header before it loads (`plan`: device,
dtype, path, weight forms, KV cache form and memory), applied when it is built (`prepare`), and asked by
the model code instead of each op checking tensors. The paths:

- "cuda": torch ops on the GPU (SDPA prefill, the torch paged-decode reference);
- "cpu-fused": CPU, bfloat16, AMX or AVX2: steps run the whole decoder stack in one native call where
  they fit (models/native_decoder.py), per op otherwise, with the native kernels;
- "cpu-native": CPU, float32 or bfloat16: per op, with the native kernels (kernels/cpu.py) for the
  norms, rotary, K/V writes, decode attention and gated activations;
- "cpu-torch": CPU without the kernels (no compiler, KVSERVE_NATIVE_KERNELS=0, float16): torch ops.

FP8 (models/fp8.py) is a form on the per-op paths, not a path: e4m3 projections (`weights = "fp8"`) where
torch._scaled_mm multiplies them (CUDA with compute capability 8.9 or later; the CPU, for checking the path)
and an e4m3 KV cache (`kv_cache_dtype = "fp8"`); neither runs on the fused CPU decoder, which packs its own
weights and reads bf16 or 8-bit integer caches.

The instruction-set level the kernels are built for is kernels/isa.py's decision.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from kvserve.config import ConfigError, ModelConfig
from kvserve.kernels import cpu as cpu_kernels
from kvserve.kernels import isa
from kvserve.kernels import kv_quant
from kvserve.models import fp8

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_MEMORY = 2 << 30
DEFAULT_GPU_KV_FRACTION = 0.5  # of the GPU memory free before the weights arrive


@dataclass(frozen=True)
class Backend:
    name: str
    native: cpu_kernels.NativeKernels | None = None  # the per-op CPU kernels, where they serve
    invariant: bool = False  # batch-invariant numerics in force (Plan.numerics, on the fused decoder's path)
    int8_activations: bool = False  # quantized matrices multiply 8-bit activations (Plan.activations)
    # Paged attention's kernels off the CPU kernels' path (models/attention.py): "auto" (Triton's on CUDA where
    # they take the cache), "triton" (also on the CPU, in Triton's interpreter: tests, the device check's smoke
    # run) or "torch" (the reference).
    attention: str = "auto"


TORCH = Backend("torch")  # a layer's path until a built model hands it its own (unit tests of single layers)


@dataclass(frozen=True)
class Plan:
    """Where and how a model runs: decided once (`plan`), logged at load, asked nowhere else."""

    device: torch.device
    dtype: torch.dtype
    path: str  # "cuda" | "cpu-fused" | "cpu-native" | "cpu-torch" (see the module docstring)
    quantized_weights: bool  # computes with the checkpoint's quantized matrices, else dequantizes them at load
    onednn_weights: bool  # dense bf16 projections reordered once into oneDNN's layout
    kv_int8: bool  # the KV cache holds 8-bit rows with scales (kv_quant), else the model's dtype
    kv_memory: int  # bytes for the device KV pool
    numerics: str = "fast"  # "batch_invariant" only on the path that gives it (see numerics_in_force)
    activations: str = "bf16"  # what quantized matrices multiply: "bf16", or "int8" (see resolve_activations)
    cuda_graphs: bool = False  # decode-only steps replay captured graphs (see graphs_in_force)
    fp8_weights: bool = False  # the projections are e4m3 with row scales, multiplied by _scaled_mm (models/fp8.py)
    kv_fp8: bool = False  # the KV cache holds e4m3 values (scale 1), else as kv_int8 says
    # The caches stored blocks first, a page of every head one contiguous run (swaps, copies and lower tiers move
    # pages whole), on CUDA, where Triton's kernels read them through their strides; heads first on the CPU, whose
    # native kernels read each head's pages as one run (models/attention.new_kv_cache).
    kv_pages_contiguous: bool = False

    @property
    def fused(self) -> bool:
        return self.path == "cpu-fused"


# Why a path cannot give batch-invariant numerics, for the log and the docs.
_NOT_INVARIANT = {
    "cpu-native": "float32 (and bfloat16 without the fused decoder) runs per op on torch's GEMMs (MKL, oneDNN), "
                  "which choose their blocking by the step's shape",
    "cpu-torch": "the torch ops choose their blocking by the step's shape",
    "cuda": "cuBLAS and SDPA choose kernels by the step's shape; kvserve has no invariant CUDA kernels",
}


def numerics_in_force(requested: str, path: str) -> str:
    """"batch_invariant" where requested and the path gives it (the fused CPU decoder: kernels/gemm.h's gemm
    with one summation order per element, every row attending as it would alone), else "fast", said once."""
    if requested != "batch_invariant" or path in ("cpu-fused", "injected"):
        return requested
    log.warning("numerics = batch_invariant is not available on the %s path (%s): running with numerics = fast; "
                "a token's logits may differ in their last bits with the make-up of its step", path,
                _NOT_INVARIANT.get(path, "no invariant kernels"))
    return "fast"


def resolve_activations(requested: str, native: cpu_kernels.NativeKernels | None, quantized_weights: bool) -> str:
    """What the quantized matrices multiply (engine setting `activations`), chosen per CPU kind by measurement
    (BENCHMARKS.md, "8-bit activations"): "int8" (each step's rows quantized to 8 bits per 16 inputs, integer
    dot products: gemm_quant_int8) on AVX-512 VNNI without AMX, where it is faster than the bf16 paths at
    every step size and batch-invariant by construction; "bf16" elsewhere (AMX multiplies long steps on bf16
    tiles; AVX2 has its own exact 16-bit integer path). Dense matrices always multiply bf16."""
    can = native is not None and native.int8_activations
    if requested == "int8" and not can:
        raise ConfigError("activations = int8 needs the native kernels built with AVX-512 BF16 and VNNI "
                          f"(this build: {', '.join(sorted(native.compiled_isa)) if native else 'none'}); "
                          "use auto or bf16")
    if not quantized_weights:
        return "bf16"
    if requested == "auto":
        return "int8" if can and "amx" not in native.compiled_isa else "bf16"
    return requested


def graphs_in_force(requested: bool, device: torch.device, config: ModelConfig, kv_int8: bool,
                    kv_fp8: bool = False, capability: tuple[int, int] | None = None) -> bool:
    """CUDA graphs for decode-only steps (engine/worker/cuda_graphs.py) where asked and a graph can replay the
    step: on CUDA, with Triton's paged kernels attending (a float cache, an e4m3 one from compute capability 8.9:
    the torch reference would gather the tables' whole width) and no mixture (its routing counts tokens per
    expert on the host). Off by default until a device check has shown replays equal to eager forwards on a real
    card. `capability`: the GPU's (default: asked of the device where an e4m3 cache needs it)."""
    if not requested:
        return False
    if kv_fp8 and device.type == "cuda" and capability is None:
        capability = torch.cuda.get_device_capability(device)
    why = ("not on CUDA" if device.type != "cuda" else "an 8-bit KV cache has no Triton kernel" if kv_int8
           else "an e4m3 KV cache has no Triton kernel before compute capability 8.9"
           if kv_fp8 and capability < fp8.MIN_CAPABILITY
           else "a mixture's routing reads counts back to the host" if config.num_experts else "")
    if why:
        log.warning("cuda_graphs = true has no effect here (%s): every step runs eagerly", why)
    return not why


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, fused: bool = False) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA, on CPUs with native bf16 (avx512_bf16 / AMX), and where the model runs
    on the fused native decoder (`fused`), which reads bf16 weights and widens them in registers on AVX2
    machines; else float32 (torch's bf16 ops on a CPU without bf16 arithmetic are slower than its float32
    ones)."""
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


def fused_shapes_fit(c: ModelConfig) -> bool:
    """The fused decoder's packed layout wants every GEMM's K % 32 and N % 16."""
    q_width, qkv_width = c.num_heads * c.head_dim, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    return not (c.hidden_size % 32 or q_width % 32 or c.intermediate_size % 32 or qkv_width % 16
                or c.moe_intermediate_size % 32)


def fused_decoder_would_serve(config: ModelConfig, tensor_names) -> bool:
    """Whether a checkpoint (its config and tensor names: loader.checkpoint_header) built in bfloat16 on this
    CPU would run fused, told before it is loaded: the kernels run here, the shapes fit, and no projection
    has a bias but Q, K and V's (models/native_decoder.py checks the built model again when it attaches)."""
    native = cpu_kernels.load()
    return (native is not None and native.fused and fused_shapes_fit(config)
            and not any(name.endswith(".bias") and not name.endswith(_QKV_BIASES) for name in tensor_names))


_QKV_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


FP8_DTYPES = (torch.bfloat16, torch.float32)


def check_fp8_weights(device: torch.device, dtype: torch.dtype, config: ModelConfig | None = None,
                      capability: tuple[int, int] | None = None) -> None:
    """Raise ConfigError where weights = fp8 cannot run: a GPU without FP8 tensor cores (`capability`: the
    device's, asked of torch when not given), a dtype other than bfloat16 or float32, or (CUDA) a projection
    whose sizes are not multiples of 16, which the CUDA FP8 GEMMs need. The CPU runs it through torch's
    reference _scaled_mm: to check the path, not for speed."""
    if dtype not in FP8_DTYPES:
        raise ConfigError(f"weights = fp8 computes in bfloat16 or float32, not {str(dtype).removeprefix('torch.')}; "
                          "set dtype = bfloat16 (or auto)")
    if device.type != "cuda":
        return
    capability = tuple(capability or torch.cuda.get_device_capability(device))
    if capability < fp8.MIN_CAPABILITY:
        raise ConfigError(f"weights = fp8 needs a GPU with FP8 tensor cores (compute capability "
                          f"{'.'.join(map(str, fp8.MIN_CAPABILITY))} or later: Ada, Hopper, Blackwell); "
                          f"{device} has {'.'.join(map(str, capability))}: use weights = bf16, int8 or int4")
    if config is not None and not fp8_shapes_fit(config):
        raise ConfigError("weights = fp8 on CUDA needs every projection's sizes to be multiples of 16 "
                          "(torch._scaled_mm); this model's are not: use weights = bf16")


def fp8_shapes_fit(c: ModelConfig) -> bool:
    """Every projection's input and output widths are multiples of 16 (the CUDA FP8 GEMMs' requirement)."""
    q_width, qkv_width = c.num_heads * c.head_dim, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    widths = (c.hidden_size, q_width, qkv_width, c.intermediate_size, c.moe_intermediate_size)
    return all(w % 16 == 0 for w in widths)


def onednn_prepack_available() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def plan(config: ModelConfig, tensor_names, *, device: str = "auto", dtype: str = "auto",
         kv_cache_dtype: str = "auto", kv_cache_memory: int | None = None, native_decoder: bool = True,
         onednn_weights: bool = True, numerics: str = "batch_invariant", activations: str = "auto",
         cuda_graphs: bool = False, weights: str = "auto") -> Plan:
    """The one hardware decision for a checkpoint (its header: config and tensor names) and the engine's
    settings: device, dtype (bf16 where the fused decoder serves, see resolve_dtype), path, whether its
    quantized matrices are kept and what they multiply, whether its projections are fp8 (`weights`), the KV
    cache's form and its memory. FP8 weights or KV keep the steps on the per-op path."""
    dev = resolve_device(device)
    fp8_weights, kv_fp8 = weights == "fp8", kv_cache_dtype == "fp8"
    fused = native_decoder and dev.type == "cpu" and fused_decoder_would_serve(config, tensor_names)
    if fused and (fp8_weights or kv_fp8):
        log.info("the fused decoder takes no fp8 %s: steps run per op", "weights" if fp8_weights else "KV cache")
        fused = False
    dt = resolve_dtype(dtype, dev, fused=fused)
    if kv_cache_dtype not in kv_quant.MODES + ("fp8",) and resolve_dtype(kv_cache_dtype, dev) != dt:
        raise ConfigError(f"kv_cache_dtype = {kv_cache_dtype!r} is not supported: a float KV cache is held in the "
                          f"model's dtype ({str(dt).removeprefix('torch.')}); use auto, int8 or fp8")
    if fp8_weights:
        check_fp8_weights(dev, dt, config)
    per_op = choose(dev, dt)  # the path prepare() starts from; the fused decoder replaces it where it attaches
    packed_gemm = (dt == torch.bfloat16 and per_op.native is not None and per_op.native.fused
                   and not fp8_weights)
    path = "cpu-fused" if fused and packed_gemm else per_op.name
    if kv_cache_memory:
        kv_memory = kv_cache_memory
    elif dev.type == "cuda":
        kv_memory = int(torch.cuda.mem_get_info(dev)[0] * DEFAULT_GPU_KV_FRACTION)
    else:
        kv_memory = DEFAULT_CPU_KV_MEMORY
    return Plan(device=dev, dtype=dt, path=path, quantized_weights=packed_gemm,
                onednn_weights=onednn_weights and dev.type == "cpu" and dt == torch.bfloat16
                and onednn_prepack_available(),
                kv_int8=kv_cache_dtype == "int8", kv_memory=kv_memory,
                numerics=numerics_in_force(numerics, path),
                activations=resolve_activations(activations, per_op.native, packed_gemm),
                cuda_graphs=graphs_in_force(cuda_graphs, dev, config, kv_cache_dtype == "int8",
                                            kv_cache_dtype == "fp8"),
                fp8_weights=fp8_weights, kv_fp8=kv_fp8, kv_pages_contiguous=dev.type == "cuda")


def choose(device: torch.device, dtype: torch.dtype) -> Backend:
    """The per-op path for a model in `dtype` on `device` (a layer outside an engine's plan: tests)."""
    if device.type == "cuda":
        return Backend("cuda")
    native = cpu_kernels.load() if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) else None
    return Backend("cpu-native", native) if native is not None else Backend("cpu-torch")


def prepare(model, the_plan: Plan) -> Backend:
    """Put the weights in the plan's form, in the order that matters: quantized matrices into the packed
    GEMM's layout where its kernels run (CPU, bfloat16, AMX or AVX2), else dense again; fp8 projections
    from the dense ones; then the fused decoder packs the dense projections (and the LM head); then
    oneDNN's reorder, which frees the dense copies. Every layer of `model` then asks the returned backend."""
    backend = choose(the_plan.device, the_plan.dtype)
    if the_plan.quantized_weights:
        model.pack_quantized(backend.native, int8_acts=the_plan.activations == "int8")
    else:
        model.dequantize_weights(the_plan.dtype, the_plan.device)
    if the_plan.fp8_weights:  # before the oneDNN reorder, which then takes only the LM head
        model.to_fp8()
    invariant = the_plan.numerics == "batch_invariant"
    int8_activations = the_plan.activations == "int8"
    backend = replace(backend, int8_activations=int8_activations)
    if the_plan.fused:
        if model.attach_native_decoder(backend.native, invariant, int8_activations):
            model.pack_dense_lm_head(backend.native)
            backend = replace(backend, name="cpu-fused", invariant=invariant)
        else:  # the built model is checked again: a layer the header could not show (a norm convention)
            log.warning("the fused decoder does not take this model; its steps run per op (cpu-native)%s",
                        ", with numerics = fast" if invariant else "")
    if the_plan.onednn_weights:
        model.prepack_onednn()
    model.use_backend(backend)
    return backend
