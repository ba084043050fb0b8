"""The models TOML that serves a plan, and the commands that start it: the planner's answer in the settings
`kvserve serve --fleet` and `kvserve fleet apply` read (docs/fleet.md, docs/tensor-parallel.md). Pure text, no I/O.

A plan's deployment maps onto one `[[models]]` table: its tensor-parallel degree (`tensor_parallel_size`), its
weight and KV dtypes (`dtype`, `weights`, `kv_cache_dtype`), its batch (`max_num_seqs`) and context
(`max_model_len`), and a `[models.fleet]` table of its replicas, each reserving its devices. The checkpoint is
the operator's: `source` is left for them to fill in.
"""
from __future__ import annotations

from kvserve.planning.search import Plan

# The planner's weight dtype -> (EngineConfig.dtype, EngineConfig.weights).
_WEIGHTS = {"fp32": ("float32", "bf16"), "bf16": ("bfloat16", "bf16"), "fp16": ("float16", "bf16"),
            "fp8": ("bfloat16", "fp8"), "int8": ("bfloat16", "int8"), "int4": ("bfloat16", "int4")}
# The planner's KV dtype -> CacheConfig.kv_cache_dtype ("auto": the model's dtype).
_KV = {"fp32": "auto", "bf16": "auto", "fp16": "auto", "fp8": "fp8"}


def models_toml(p: Plan, model_id: str, source: str = "") -> str:
    """One `[[models]]` table (and its `[models.fleet]`) that serves plan `p` of model `model_id`."""
    c, d = p.candidate, p.candidate.deployment
    gpu = d.accelerator.calibrated is None  # a datasheet's accelerator; a calibrated one is a measured CPU machine
    dtype, weights = _WEIGHTS[d.weight_dtype]
    lines = ["[[models]]", f'id = "{model_id}"',
             f'source = "{source}"' if source else 'source = ""  # your checkpoint of the model: a directory or a .gguf',
             f'device = "{"cuda" if gpu else "cpu"}"', f'dtype = "{dtype}"', f'weights = "{weights}"',
             f'kv_cache_dtype = "{_KV[d.kv_dtype]}"', f"max_num_seqs = {c.max_num_seqs}"]
    if d.max_model_len:
        lines.append(f"max_model_len = {d.max_model_len}")
    if d.tp > 1:
        lines.append(f"tensor_parallel_size = {d.tp}")
    lines += ["", "[models.fleet]", f"replicas = {p.replicas}", f"gpus = {d.tp if gpu else 0}"]
    return "\n".join(lines) + "\n"


def serve_commands(path: str = "plan.toml") -> list[str]:
    """How to serve the TOML: a new fleet, or a rolling update of a running one."""
    return [f"kvserve serve --fleet --config {path}", f"kvserve fleet apply {path}"]
