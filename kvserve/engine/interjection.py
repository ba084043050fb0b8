"""Interjections: an interactive prompt that arrives while a step with batch work runs goes first,
inside that step, at its next decoder-layer boundary (EngineCore.step, AsyncLLM._interject).

The model reads `flag` once per layer (op by op in CausalLM.forward, or inside the fused CPU decoder);
when another thread has raised it, the model calls `run()`, which runs the interjected step nested
in this one, then finishes its own layers. At most one per step.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Interjection:
    """Lets a step stop between decoder layers so that another runs first: another thread raises `flag`;
    the model (op by op in CausalLM.forward, or inside the fused CPU decoder) calls `run()` at the next
    layer boundary and then finishes its layers. The engine's interactive interjections (EngineCore.step)."""

    flag: ctypes.c_int32
    run: Callable[[], None]
