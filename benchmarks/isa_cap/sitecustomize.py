"""Caps a Python peer's CPU probes at a lower instruction-set level, for a suite session run at
KVSERVE_CPU_ISA below the CPU's own (one machine measuring what another kind of machine runs).

The suite puts this folder first on a peer's PYTHONPATH, with BENCH_PEER_ISA set to the level. torch's
own kernels are capped by ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA (kvserve.kernels.isa.torch_env), but
vLLM's CPU build picks its kernel library (_C, _C_AVX512, _C_AVX2), its attention ISA and its AMX paths
from torch.cpu's probes (get_capabilities), which read the hardware: here they answer as the capped
level's CPU would.
"""
import os

_HIDDEN = {"avx2": ("avx512", "amx", "avx10"), "avx512": ("amx",)}.get(os.environ.get("BENCH_PEER_ISA", ""))
if _HIDDEN:
    from types import MappingProxyType

    import torch.cpu

    _hardware = torch.cpu.get_capabilities

    def _capped():
        return MappingProxyType({name: (False if name.startswith(_HIDDEN) and isinstance(value, bool) else value)
                                 for name, value in _hardware().items()})

    torch.cpu.get_capabilities = _capped
