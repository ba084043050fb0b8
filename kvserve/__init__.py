"""kvserve: an LLM serving platform (paged KV cache, continuous batching, tenants, admission control)."""
from kvserve.kernels import isa as _isa

_isa.apply_to_torch()  # before anything imports torch: it reads its CPU dispatch ceilings once

from kvserve.engine.sampling import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch; import it lazily so pure-logic modules stay light.
    if name == "LLM":
        from kvserve.engine.llm_engine import LLM

        return LLM
    raise AttributeError(name)
