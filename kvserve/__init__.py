"""kvserve: an LLM serving platform (paged KV cache, continuous batching, tenants, admission control)."""
from kvserve.kernels import isa as _isa

_isa.apply_to_torch()  # before anything imports torch: it reads its CPU dispatch ceilings once

__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The public API, imported on first use: importing kvserve.config (or any lower module) loads no engine,
    # and LLM pulls in torch.
    if name == "LLM":
        from kvserve.engine.worker.llm_engine import LLM

        return LLM
    if name == "LoRARequest":
        from kvserve.engine.lora import LoRARequest

        return LoRARequest
    if name == "SamplingParams":
        from kvserve.engine.sampling import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from kvserve.engine.structured.params import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(name)
