"""LoRA adapters: their weights (read from PEFT's directory format or llama.cpp's GGUF LoRA) and applying them to a
step's rows, many adapters in one batch (Punica / S-LoRA: each adapter's rows shrunk through its A, then expanded
through its B, added to the base product; no merged copy of any weight).

`read_adapter` gives a `LoRAAdapter` keyed by our module paths ("layers.3.self_attn.qkv_proj"): float32 on the CPU,
B already in the module's row order as loaded (PEFT's separate q/k/v and gate/up adapters packed into the fused
module: their A's stacked, B block-diagonal, an untargeted part's rows zero) with each part's scaling folded in.
`LoRAWeights` holds a model's slots on its device and attaches itself to every attention and dense-MLP projection;
layers.linear adds the delta of each row's slot after the base product, `set_batch` says which slot each token of
the step uses (-1: the base model, whose rows get the base result exactly). The fused CPU decoder reads the same
slots (kernels/lora_cpu.h: the step's rows grouped by adapter inside its one call), so a step with adapters stays
on the fused path.

Batch invariance: per op on the CPU each adapter's rows are multiplied in tiles of TILE rows (the last padded with
zero rows), so every product has one shape whatever the step holds and a row's delta is the same bits alone or
beside others (torch's float32 GEMMs round a row differently with the row count: models/backend._NOT_INVARIANT);
the fused kernel sums each row's products on its own. The base rows' arithmetic is the base model's.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.config import ConfigError, ModelConfig
from kvserve.models.layers import GatedMLP, interleave_gate_up


class LoRAError(ValueError):
    """An adapter that cannot be served: the message names the file and what is wrong with it."""


# PEFT's (and HF's) projection names -> (our module, the part of it: None for the whole module).
_TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "qkv_proj": ("qkv_proj", None), "o_proj": ("o_proj", None),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "gate_up_proj": ("gate_up_proj", None),
            "down_proj": ("down_proj", None)}
_SUBLAYER = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}
SUPPORTED_TARGETS = tuple(_TARGETS)
# A decoder layer's module path in a PEFT adapter (after `base_model.model.`): the text model's, also under a
# multimodal wrapper's language model (Gemma 3 4B+).
_PEFT_MODULE = re.compile(r"^(?:model\.|model\.language_model\.|language_model\.model\.|language_model\.)?"
                          r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")
_PEFT_TENSOR = re.compile(r"^(.+)\.lora_(A|B)(?:\.[^.]+)?\.weight$")
# LoraConfig settings that change what the adapter computes, which we do not: (key, the value that is fine).
_UNSUPPORTED_CONFIG = {"use_dora": "DoRA (use_dora)", "lora_bias": "a bias on lora_B (lora_bias)",
                       "fan_in_fan_out": "fan_in_fan_out", "modules_to_save": "modules_to_save (whole modules)",
                       "trainable_token_indices": "trainable_token_indices", "layer_replication": "layer_replication",
                       "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)", "use_qalora": "QALoRA",
                       "target_parameters": "target_parameters (expert parameters)", "use_bdlora": "BD-LoRA",
                       "arrow_config": "Arrow routing (arrow_config)", "monteclora_config": "MonteCLoRA"}
# Initializations that change the base weights: the adapter is relative to a base we do not have (PEFT converts
# such an adapter to a plain one with save_pretrained(path_initial_model_for_weight_conversion=...)).
_BASE_CHANGING_INIT = ("pissa", "olora", "corda", "astra", "loftq")


@dataclass
class LoRAAdapter:
    name: str
    rank: int  # the adapter's r (largest over its modules); a fused module's pair may have up to parts x rank
    scaling: float  # alpha / r (alpha / sqrt(r) with use_rslora); folded into each B already
    # Our module path -> (A [r, in], B [out, r]) float32 on the CPU: B in the module's output rows as loaded (a fused
    # module's untargeted parts zero), scaled. A fused module's separately trained parts (PEFT's q/k/v, gate/up):
    # their A's stacked, B block-diagonal.
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    # Our module path -> per output part of the module (QKV's q, k, v; gate, up; else the one), the rows of A (and
    # columns of B) it uses: (begin, end), (0, 0) for a part the adapter leaves be. The fused kernel reads only
    # these (B's other entries are zero).
    parts: dict[str, list[tuple[int, int]]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def module_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, list[int]]]:
    """A decoder layer's projections that adapters may target: our name -> (in features, its parts' out rows)."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"self_attn.qkv_proj": (c.hidden_size, [q, kv, kv]), "self_attn.o_proj": (q, [c.hidden_size])}
    if not c.is_moe_layer(layer):
        shapes["mlp.gate_up_proj"] = (c.hidden_size, [c.intermediate_size, c.intermediate_size])
        shapes["mlp.down_proj"] = (c.intermediate_size, [c.hidden_size])
    return shapes


# ---- reading ----------------------------------------------------------------------------------

@dataclass
class _Part:
    """One trained (A, B) pair of the file, placed: our module path, its part (None: the whole module)."""

    key: str  # the file's name for it, for messages
    layer: int
    module: str  # "self_attn.qkv_proj"
    part: int | None
    a: torch.Tensor
    b: torch.Tensor
    scaling: float


def read_adapter(path, config: ModelConfig, max_rank: int, name: str = "") -> LoRAAdapter:
    """A LoRA adapter for a model of `config`: PEFT's directory (adapter_config.json + adapter_model.safetensors)
    or llama.cpp's GGUF LoRA (general.type = adapter, adapter.type = lora). LoRAError for a rank above `max_rank`,
    a target other than the decoder layers' q/k/v/o and dense gate/up/down projections, a LoRA variant (DoRA, a
    bias, ...) or shapes that are not this model's."""
    path = Path(path)
    name = name or (path.stem if path.suffix == ".gguf" else path.name)
    if path.is_dir():
        parts, scaling = _read_peft(path, config)
    elif path.is_file() and _is_gguf(path):
        parts, scaling = _read_gguf(path, config)
    else:
        raise LoRAError(f"{path}: not a LoRA adapter (a PEFT directory with adapter_config.json and "
                        "adapter_model.safetensors, or a GGUF LoRA file)")
    return _assemble(parts, config, max_rank, name, scaling, path)


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup (peft.utils.other.get_pattern_key): the first pattern the module's
    name ends with (as a dotted suffix, by regex)."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _read_peft(path: Path, config: ModelConfig) -> tuple[list[_Part], float]:
    cfg_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not cfg_file.is_file():
        raise LoRAError(f"{path}: no adapter_config.json (not a PEFT adapter directory)")
    if not weights_file.is_file():
        found = " (it has adapter_model.bin: only safetensors are read)" if (path / "adapter_model.bin").exists() \
            else ""
        raise LoRAError(f"{path}: no adapter_model.safetensors{found}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise LoRAError(f"{cfg_file}: not JSON ({e})") from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"{cfg_file}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"{cfg_file}: bias = {cfg['bias']!r} is not supported (only \"none\")")
    for key, what in _UNSUPPORTED_CONFIG.items():
        if cfg.get(key):
            raise LoRAError(f"{cfg_file}: {what} is not supported")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INIT):
        raise LoRAError(f"{cfg_file}: init_lora_weights = {init!r} changes the base weights; convert the adapter to "
                        "a plain LoRA (PEFT: save_pretrained(..., path_initial_model_for_weight_conversion=...))")
    try:
        r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    except (KeyError, TypeError, ValueError):
        raise LoRAError(f"{cfg_file}: needs r and lora_alpha") from None
    rslora = bool(cfg.get("use_rslora"))
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}

    from safetensors.torch import load_file

    tensors = load_file(str(weights_file))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        module_key = key.removeprefix("base_model.model.")
        m = _PEFT_TENSOR.match(module_key)
        if m is None:
            owner = re.match(r"^(.+?)\.(?:base_layer|lora_\w+)\b", module_key)
            if owner is not None:  # a module we do not adapt says so first (a LoRA'd lm_head saves its base too)
                _place(owner.group(1), config, weights_file)
            raise LoRAError(f"{weights_file}: tensor {key!r} is not supported ({_kind_of(key)})")
        pairs.setdefault(m.group(1), {})[m.group(2)] = t
    parts = []
    for module_key, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{weights_file}: {module_key} has lora_{next(iter(ab))} without its pair")
        layer, module, part = _place(module_key, config, weights_file)
        conf_r = int(_pattern_value(rank_pattern, module_key, r))
        a, b = ab["A"].float(), ab["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != conf_r:
            raise LoRAError(f"{weights_file}: {module_key}'s lora_A {tuple(a.shape)} is not [r={conf_r}, in] "
                            "(adapter_config.json's r and rank_pattern)")
        a_alpha = float(_pattern_value(alpha_pattern, module_key, alpha))
        scaling = a_alpha / math.sqrt(conf_r) if rslora else a_alpha / conf_r
        parts.append(_Part(module_key, layer, module, part, a, b, scaling))
    return parts, (alpha / math.sqrt(r) if rslora else alpha / r)


def _kind_of(key: str) -> str:
    if "lora_magnitude_vector" in key:
        return "DoRA"
    if "lora_embedding" in key:
        return "a LoRA of the token embeddings"
    if key.endswith(".bias"):
        return "a bias"
    return "not a lora_A / lora_B weight"


def _place(module_key: str, config: ModelConfig, source) -> tuple[int, str, int | None]:
    """(layer, our module, part) of an adapter's module, or LoRAError for a module we do not adapt."""
    m = _PEFT_MODULE.match(module_key)
    if m is None or m.group(3) not in _TARGETS:
        raise LoRAError(f"{source}: target module {module_key!r} is not supported (LoRA applies to the decoder "
                        f"layers' {', '.join(SUPPORTED_TARGETS)} projections; not embeddings, the LM head or a "
                        "mixture's experts)")
    layer, sub, proj = int(m.group(1)), m.group(2), m.group(3)
    ours, part = _TARGETS[proj]
    if _SUBLAYER[ours] != sub:
        raise LoRAError(f"{source}: target module {module_key!r} is not supported ({proj} of {sub})")
    if layer >= config.num_layers:
        raise LoRAError(f"{source}: {module_key} is in layer {layer}; the model has {config.num_layers} layers")
    if sub == "mlp" and config.is_moe_layer(layer):
        raise LoRAError(f"{source}: {module_key} targets a dense MLP; layer {layer} of the model is a mixture of "
                        "experts (its experts are not adapted)")
    return layer, f"{sub}.{ours}", part


def _read_gguf(path: Path, config: ModelConfig) -> tuple[list[_Part], float]:
    from kvserve.models.gguf_file import GGUFFile
    from kvserve.models.loader import _dequantize, hf_name_for_gguf, unpermute_rope_rows
    from kvserve.models.model_info import ModelLoadError

    file = GGUFFile(path)
    try:
        meta = file.metadata
        if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
            raise LoRAError(f"{path}: not a GGUF LoRA (general.type = {meta.get('general.type')!r}, adapter.type = "
                            f"{meta.get('adapter.type')!r}; want adapter, lora)")
        if meta.get("adapter.alora.invocation_tokens"):
            raise LoRAError(f"{path}: aLoRA (adapter.alora.invocation_tokens) is not supported")
        arch = meta.get("general.architecture")
        if arch != config.architecture:
            raise LoRAError(f"{path}: an adapter for architecture {arch!r}; the model is {config.architecture!r}")
        alpha = float(meta.get("adapter.lora.alpha", 0.0) or 0.0)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for t in file.tensors:
            base, _, kind = t.name.rpartition(".")
            if kind not in ("lora_a", "lora_b"):
                raise LoRAError(f"{path}: tensor {t.name!r} is not supported (not a lora_a / lora_b)")
            pairs.setdefault(base, {})[kind] = torch.from_numpy(_dequantize(file, t).copy()).float()
    finally:
        file.close()
    parts = []
    for base, ab in pairs.items():
        if set(ab) != {"lora_a", "lora_b"}:
            raise LoRAError(f"{path}: {base} has {next(iter(ab))} without its pair")
        try:
            hf = hf_name_for_gguf(base, config.architecture)
        except ModelLoadError:
            hf = base
        layer, module, part = _place(hf.removesuffix(".weight"), config, path)
        a, b = ab["lora_a"], ab["lora_b"]
        if a.dim() != 2 or b.dim() != 2:
            raise LoRAError(f"{path}: {base}'s lora_a / lora_b are not matrices")
        if config.architecture == "llama" and module == "self_attn.qkv_proj" and part in (0, 1):
            # llama.cpp's converter permutes Q and K rows (interleaved RoPE pairs), lora_b's with them: as the
            # loader does for the base weights.
            b = unpermute_rope_rows(b, config.num_heads if part == 0 else config.num_kv_heads)
        rank = a.shape[0]
        parts.append(_Part(base, layer, module, part, a, b, alpha / rank if alpha else 1.0))  # llama.cpp's scale
    rank = max((p.a.shape[0] for p in parts), default=1)
    return parts, (alpha / rank if alpha else 1.0)


def _assemble(parts: list[_Part], config: ModelConfig, max_rank: int, name: str, scaling: float,
              source: Path) -> LoRAAdapter:
    """The pairs checked against the model's shapes and `max_rank`, packed per our module."""
    by_module: dict[str, list[_Part]] = {}
    for p in parts:
        shapes = module_shapes(config, p.layer)
        in_features, rows = shapes[p.module]
        out = sum(rows) if p.part is None else rows[p.part]
        r = p.a.shape[0]
        if r > max_rank:
            raise LoRAError(f"{source}: {p.key} has rank {r}, above the engine's max LoRA rank {max_rank}")
        if tuple(p.a.shape) != (r, in_features) or tuple(p.b.shape) != (out, r):
            raise LoRAError(f"{source}: {p.key}'s shapes A {tuple(p.a.shape)}, B {tuple(p.b.shape)} do not fit the "
                            f"model (want A [r, {in_features}], B [{out}, r]): an adapter for another model?")
        by_module.setdefault(f"layers.{p.layer}.{p.module}", []).append(p)
    weights, spans = {}, {}
    for path, found in by_module.items():
        layer = int(path.split(".")[1])
        in_features, rows = module_shapes(config, layer)[path.split(".", 2)[2]]
        whole = [p for p in found if p.part is None]
        if (whole and len(found) > 1) or len({p.part for p in found}) != len(found):
            raise LoRAError(f"{source}: {path} is targeted twice ({', '.join(p.key for p in found)})")
        if whole:
            (p,) = whole
            weights[path] = (p.a.contiguous(), (p.b * p.scaling).contiguous())
            spans[path] = [(0, p.a.shape[0])] * len(rows)
            continue
        found.sort(key=lambda p: p.part)
        starts = [sum(rows[:i]) for i in range(len(rows))]
        total = sum(p.a.shape[0] for p in found)
        a = torch.cat([p.a for p in found])
        b = torch.zeros(sum(rows), total)
        col, spans[path] = 0, [(0, 0)] * len(rows)
        for p in found:
            r = p.a.shape[0]
            b[starts[p.part]:starts[p.part] + rows[p.part], col:col + r] = p.b * p.scaling
            spans[path][p.part] = (col, col + r)
            col += r
        weights[path] = (a.contiguous(), b)
    if not weights:
        raise LoRAError(f"{source}: the adapter has no LoRA weights")
    rank = max(p.a.shape[0] for p in parts)
    return LoRAAdapter(name=name, rank=rank, scaling=scaling, weights=weights, parts=spans)


# ---- applying ---------------------------------------------------------------------------------

TILE = 16  # rows per product on the CPU: every shrink and expand has this shape (batch invariance)


@dataclass
class _Step:
    tokens: int  # the step's rows
    groups: list[tuple[int, torch.Tensor | None]]  # (slot, its rows on the model's device; None: all), ascending
    token_slots: torch.Tensor  # [tokens] int32 on the CPU, contiguous: each row's slot (the fused decoder's)


class _ModuleSlots:
    """One projection's slots: A [max_loras, capacity, in] and B transposed, [max_loras, capacity, out] (each
    rank's outputs contiguous, as the fused kernel's expand reads them), in the model's dtype; capacity = max_rank
    for each part the module fuses (PEFT's q, k and v adapters stack). `ranks`: the rows of A each slot uses (0:
    the slot leaves this module be); `part_rows` [max_loras, 3, 2] int32 on the CPU: per slot and output part (of
    `part_end`, the parts' ends), the rows it uses (LoRAAdapter.parts), for the fused kernel."""

    def __init__(self, owner: "LoRAWeights", module, path: str, in_features: int, rows: list[int],
                 dtype: torch.dtype, device: torch.device):
        self.owner, self.module, self.path = owner, module, path
        self.in_features, self.out_features = in_features, sum(rows)
        self.part_end = [sum(rows[:i + 1]) for i in range(len(rows))]
        self.capacity = owner.max_rank * len(rows)
        self.a = torch.zeros(owner.max_loras, self.capacity, in_features, dtype=dtype, device=device)
        self.bt = torch.zeros(owner.max_loras, self.capacity, self.out_features, dtype=dtype, device=device)
        self.ranks = [0] * owner.max_loras
        self.part_rows = torch.zeros(owner.max_loras, 3, 2, dtype=torch.int32)

    def add(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows] += (x[rows] A_s^T) B_s^T for each slot s of the step (layers.linear, after the base product)."""
        step = self.owner.step
        if x.shape[0] != step.tokens:
            raise RuntimeError(f"LoRA rows were set for {step.tokens} tokens; {self.path} got {x.shape[0]} "
                               "(LoRAWeights.set_batch once per step, for the step's flattened tokens)")
        for slot, rows in step.groups:
            r = self.ranks[slot]
            if r == 0:
                continue
            a, bt = self.a[slot, :r], self.bt[slot, :r]
            whole = rows is None  # the slot has every row of the step: no gather, no scatter
            xs = x if whole else x.index_select(0, rows)
            delta = _tiled(xs, a, bt) if x.device.type == "cpu" else F.linear(xs, a) @ bt
            if whole:
                out.add_(delta)
            else:
                out.index_add_(0, rows, delta)


def _tiled(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    """(x a^T) bt in products of TILE rows each (zero rows pad the last): one shape, so each row's bits do not
    depend on how many rows share its adapter in the step."""
    n = x.shape[0]
    pad = -n % TILE
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    tiles = [F.linear(t, a) @ bt for t in x.split(TILE)]
    return (tiles[0] if len(tiles) == 1 else torch.cat(tiles))[:n]


class LoRAWeights:
    """A model's adapter slots on its device: per targeted module A [max_loras, max_rank, in] and B^T
    [max_loras, max_rank, out] (max_rank per fused part; zeros where an adapter does not target a module or its
    rank is lower), in the model's dtype; and the current step's rows (`set_batch`). A model with the fused CPU
    decoder hands it the slots' addresses (NativeDecoder.attach_lora)."""

    def __init__(self, model, max_loras: int, max_rank: int):
        if max_loras < 1 or max_rank < 1:
            raise ConfigError(f"max_loras and max_lora_rank must be at least 1 (got {max_loras}, {max_rank})")
        if any(getattr(m, "reduce", None) is not None or getattr(m, "rows_from", None) is not None
               for m in model.modules()):
            raise ConfigError("LoRA adapters are not supported on a tensor-parallel model (its row-parallel "
                              "projections are all-reduced); use tensor_parallel_size = 1 with LoRA")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.model = model
        config = model.config
        dtype, device = model.norm.weight.dtype, model.norm.weight.device
        self.modules: dict[str, _ModuleSlots] = {}
        for i, layer in enumerate(model.layers):
            shapes = module_shapes(config, i)
            targets = {"self_attn.qkv_proj": layer.self_attn.qkv_proj, "self_attn.o_proj": layer.self_attn.o_proj}
            if isinstance(layer.mlp, GatedMLP):
                targets.update({"mlp.gate_up_proj": layer.mlp.gate_up_proj, "mlp.down_proj": layer.mlp.down_proj})
            for name, module in targets.items():
                in_features, rows = shapes[name]
                if module.weight.numel() and tuple(module.weight.shape) != (sum(rows), in_features):
                    raise ConfigError(f"layers.{i}.{name} holds {tuple(module.weight.shape)}, not the config's "
                                      f"{(sum(rows), in_features)}: LoRA needs the whole projection")
                slots = _ModuleSlots(self, module, f"layers.{i}.{name}", in_features, rows, dtype, device)
                self.modules[slots.path] = slots
                module.lora = slots
        self.adapters: list[str | None] = [None] * max_loras  # each slot's adapter's name
        self.step: _Step | None = None
        model.lora = self
        if getattr(model, "native_decoder", None) is not None:
            model.native_decoder.attach_lora(self)

    @property
    def nbytes(self) -> int:
        return sum(s.a.numel() * s.a.element_size() + s.bt.numel() * s.bt.element_size() for s in self.modules.values())

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy the adapter into the slot (what it held before is replaced), B's rows in the module's own order."""
        self._check_slot(slot)
        for path, (a, b) in adapter.weights.items():
            slots = self.modules.get(path)
            if slots is None:
                raise LoRAError(f"adapter {adapter.name!r} targets {path}, which this model does not adapt")
            r = a.shape[0]
            if tuple(a.shape) != (r, slots.in_features) or tuple(b.shape) != (slots.out_features, r):
                raise LoRAError(f"adapter {adapter.name!r}: {path}'s A {tuple(a.shape)}, B {tuple(b.shape)} do not "
                                f"fit the model's [{slots.out_features}, {slots.in_features}] projection")
            if r > slots.capacity:
                raise LoRAError(f"adapter {adapter.name!r}: {path} has rank {r}, above the slots' {slots.capacity} "
                                f"(max LoRA rank {self.max_rank})")
        for path, slots in self.modules.items():
            self._clear(slots, slot)
            if path in adapter.weights:
                a, b = adapter.weights[path]
                r = a.shape[0]
                slots.a[slot, :r].copy_(a)
                slots.bt[slot, :r].copy_(self._row_order(slots, b).T)
                slots.ranks[slot] = r
                slots.part_rows[slot, :len(slots.part_end)] = torch.tensor(adapter.parts[path], dtype=torch.int32)
        self.adapters[slot] = adapter.name

    def _row_order(self, slots: _ModuleSlots, b: torch.Tensor) -> torch.Tensor:
        """B's rows as the module computes its output: the partial-rotary arrangement of QKV's q and k rows
        (CausalLM.arrange_rotary_dims), gate/up's 16-row blocks interleaved where packed so
        (layers.interleave_gate_up)."""
        if slots.path.endswith("qkv_proj"):
            order = self.model.qkv_row_order()
            return b if order is None else b[order]
        if slots.module.gate_up and slots.module.interleaved:
            return interleave_gate_up(b)
        return b

    def clear(self, slot: int) -> None:
        self._check_slot(slot)
        for slots in self.modules.values():
            self._clear(slots, slot)
        self.adapters[slot] = None

    @staticmethod
    def _clear(slots: _ModuleSlots, slot: int) -> None:
        slots.a[slot].zero_()
        slots.bt[slot].zero_()
        slots.ranks[slot] = 0
        slots.part_rows[slot].zero_()

    def set_batch(self, token_slots: torch.Tensor | None) -> None:
        """The step's slot of each token of its flattened batch ([T] int64, -1: the base model), or None: no
        adapter this step (the projections then do nothing more than the base product)."""
        if token_slots is None:
            self.step = None
            return
        slots = token_slots.to("cpu")
        used = torch.unique(slots[slots >= 0]).tolist()
        if not used:
            self.step = None
            return
        if used[-1] >= self.max_loras or int(slots.min()) < -1:
            raise ValueError(f"token slots must lie in -1..{self.max_loras - 1}")
        empty = [s for s in used if self.adapters[s] is None]
        if empty:
            raise LoRAError(f"LoRA slot {empty[0]} holds no adapter")
        device = token_slots.device
        whole = len(used) == 1 and int(slots.min()) >= 0
        groups = [(used[0], None)] if whole else [(s, torch.nonzero(slots == s).flatten().to(device)) for s in used]
        self.step = _Step(slots.shape[0], groups, slots.to(torch.int32).contiguous())

    @property
    def active(self) -> bool:
        return self.step is not None

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot {slot} is not in 0..{self.max_loras - 1}")
