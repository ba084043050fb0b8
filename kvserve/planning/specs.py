"""What the planner plans with: model architectures and accelerators, as data with their sources.

The shipped tables (`data/models.toml`, `data/accelerators.toml`) hold published figures, each with the
URL it came from; a model may also be given by the path of a Hugging Face `config.json` (or its
directory) or a GGUF file, and this machine's CPU by a calibration file (`kvserve plan calibrate`).
Accelerator figures are datasheet peaks; how much of a peak a real engine reaches is the roofline's
business (planning/roofline.py), not the spec's. `data/quantization.toml` holds the quality of quantized
weights as measured here on small models, which a plan proposing such weights states as its assumption.
"""
from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path

DATA = Path(__file__).parent / "data"


class UnknownSpec(ValueError):
    """A model or accelerator the planner does not know; the message lists the names it does know."""


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape: everything the memory and step-time arithmetic needs."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    architecture: str = "llama"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    attention_bias: bool = False
    sliding_window: int | None = None  # tokens a sliding layer attends to
    sliding_window_pattern: int | None = None  # every Nth layer is global; None with a window: all sliding
    # Mixture of experts. A dense model keeps the defaults (one expert of intermediate_size, every layer); 0
    # experts (as the engine's ModelConfig writes a dense model) is dense too.
    num_experts: int = 1  # routed experts per MoE layer (E; 0 or 1: dense)
    experts_per_token: int = 1  # routed experts each token goes to (k, 1..E)
    moe_intermediate_size: int | None = None  # one expert's FFN width (None: intermediate_size, as Mixtral's)
    num_shared_experts: int = 0  # experts every token goes to besides its k, each moe_intermediate_size wide
    num_dense_layers: int = 0  # layers with a dense MLP of intermediate_size instead of experts (DeepSeek's first k)
    params_b: float | None = None  # the published parameter count (a cross-check only)
    active_params_b: float | None = None  # the published parameters per token (MoE; a cross-check only)
    source: str = ""
    aliases: tuple[str, ...] = ()

    def __post_init__(self):
        for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                  "vocab_size"):
            self._check_int(f, 1)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name!r}: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        self._check_int("num_experts", 0)
        if self.is_moe:
            self._check_int("experts_per_token", 1, self.num_experts)
            if self.moe_intermediate_size is not None:
                self._check_int("moe_intermediate_size", 1)
            self._check_int("num_shared_experts", 0)
            self._check_int("num_dense_layers", 0, self.num_layers)
        else:
            self._check_int("experts_per_token", 0, 1)
            if self.num_shared_experts or self.num_dense_layers or self.moe_intermediate_size is not None:
                raise ValueError(f"model {self.name!r}: shared experts, dense layers and moe_intermediate_size "
                                 f"describe a mixture of experts; num_experts {self.num_experts} is dense")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"model {self.name!r}: sliding_window must be positive")

    def _check_int(self, f: str, lo: int, hi: int | None = None) -> None:
        v = getattr(self, f)
        if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
            span = f"from {lo} to {hi}" if hi is not None else ("positive" if lo == 1 else f"at least {lo}")
            raise ValueError(f"model {self.name!r}: {f} must be an integer {span}, got {v!r}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def expert_intermediate_size(self) -> int:
        """One expert's FFN width (a dense model's one "expert" is its MLP)."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is routed experts (0 for a dense model)."""
        return self.num_layers - self.num_dense_layers if self.is_moe else 0

    @property
    def num_sliding_layers(self) -> int:
        if self.sliding_window is None:
            return 0
        if not self.sliding_window_pattern:
            return self.num_layers
        return self.num_layers - self.num_layers // self.sliding_window_pattern


@dataclass(frozen=True)
class AcceleratorSpec:
    """One accelerator's datasheet: memory, bandwidth, dense peak FLOP/s, its link to its neighbours, a price."""

    name: str
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    bf16_flops: float  # dense FLOP/s
    fp8_flops: float | None = None  # None: no fp8 tensor cores (fp8 weights are widened, at bf16 speed)
    attention_flops: float | None = None  # what attention reaches when it differs from the GEMMs (measured machines)
    interconnect: str = ""
    interconnect_bandwidth: float = 0.0  # bytes/s per direction to another device of the node
    max_per_node: int = 1
    price_per_hour: float = 0.0  # USD per device-hour
    vendor: str = ""
    source: str = ""
    price_source: str = ""
    note: str = ""
    aliases: tuple[str, ...] = ()
    # Measured machines (kvserve plan calibrate) carry what a datasheet does not: the step's fixed
    # time and per-sequence time, and the efficiencies already folded into the figures above.
    calibrated: dict | None = None

    def __post_init__(self):
        for f in ("memory_bytes", "memory_bandwidth", "bf16_flops"):
            if not getattr(self, f) > 0:
                raise ValueError(f"accelerator {self.name!r}: {f} must be positive")
        if self.price_per_hour < 0 or self.max_per_node < 1:
            raise ValueError(f"accelerator {self.name!r}: price_per_hour >= 0 and max_per_node >= 1")

    def flops(self, fp8: bool) -> float:
        return self.fp8_flops if fp8 and self.fp8_flops else self.bf16_flops


@dataclass(frozen=True)
class WeightQuality:
    """How far one weight format moved small models from float32 where it was measured (data/quantization.toml,
    written by benchmarks/quality.py --tradeoff): what a plan that proposes the format assumes of its quality."""

    dtype: str
    measured: tuple[tuple[str, float, float], ...]  # (model, mean KLD in nats, top-1 agreement)
    machine: str
    date: str
    page: str

    def assumption(self) -> str:
        figures = "; ".join(f"{m}: KLD {kld:.4f}, top-1 {top1:.1%}" for m, kld, top1 in self.measured)
        return (f"{self.dtype} weights: {figures} against float32, measured on {self.machine} ({self.date}, "
                f"{self.page}); assumed to carry over to this model and accelerator")


_MODEL_KEYS = {f.name for f in fields(ModelSpec)}


def model_from_dict(row: dict) -> ModelSpec:
    """A ModelSpec from a table row or a calibration file's record (unknown keys ignored)."""
    row = {k: v for k, v in row.items() if k in _MODEL_KEYS and v is not None}
    row["aliases"] = tuple(row.get("aliases", ()))
    return ModelSpec(**row)


def _accelerator_from_row(row: dict) -> AcceleratorSpec:
    unit = 10**9 if row.get("memory_unit", "GB") == "GB" else 1 << 30
    return AcceleratorSpec(
        name=row["name"], memory_bytes=int(row["memory_gib"] * unit),
        memory_bandwidth=row["memory_bandwidth_gbs"] * 1e9, bf16_flops=row["bf16_tflops"] * 1e12,
        fp8_flops=row["fp8_tflops"] * 1e12 if row.get("fp8_tflops") else None,
        interconnect=row.get("interconnect", ""), interconnect_bandwidth=row.get("interconnect_gbs", 0) * 1e9,
        max_per_node=row.get("max_per_node", 1), price_per_hour=row.get("price_per_hour", 0.0),
        vendor=row.get("vendor", ""), source=row.get("source", ""), price_source=row.get("price_source", ""),
        note=row.get("note", ""), aliases=tuple(row.get("aliases", ())))


@cache
def known_models() -> dict[str, ModelSpec]:
    with open(DATA / "models.toml", "rb") as f:
        return {m.name: m for m in map(model_from_dict, tomllib.load(f)["model"])}


@cache
def known_accelerators() -> dict[str, AcceleratorSpec]:
    with open(DATA / "accelerators.toml", "rb") as f:
        return {a.name: a for a in map(_accelerator_from_row, tomllib.load(f)["accelerator"])}


def weight_quality_from_toml(doc: dict) -> dict[str, WeightQuality]:
    """data/quantization.toml's rows grouped by weight format."""
    by: dict[str, list] = {}
    for r in doc.get("weights", []):
        by.setdefault(r["dtype"], []).append((r["model"], float(r["kld"]), float(r["top1"])))
    return {d: WeightQuality(d, tuple(rows), doc["machine"], doc["date"], doc.get("page", ""))
            for d, rows in by.items()}


@cache
def known_weight_quality() -> dict[str, WeightQuality]:
    with open(DATA / "quantization.toml", "rb") as f:
        return weight_quality_from_toml(tomllib.load(f))


def _lookup(name: str, table: dict, what: str, hint: str):
    key = name.strip().lower()
    for spec in table.values():
        if key == spec.name or key in (a.lower() for a in spec.aliases):
            return spec
    raise UnknownSpec(f"unknown {what} {name!r}; known: {', '.join(sorted(table))}. {hint}")


MODEL_HINT = "Or pass the path of a Hugging Face config.json (or its directory) or of a .gguf file."


def model_spec(name_or_path: str) -> ModelSpec:
    """A model by its name in the table, or read from a config.json, a checkpoint directory or a GGUF file."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        if path.suffix == ".gguf":
            return spec_from_gguf(path)
        try:
            cfg = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UnknownSpec(f"{path}: not a JSON config ({e}). {MODEL_HINT}") from None
        return spec_from_hf_config(cfg, name=path.parent.name or path.stem, source=str(path))
    if name_or_path.lower().startswith("cpu"):
        raise UnknownSpec(f"{name_or_path!r} names a machine, not a model. {MODEL_HINT}")
    return _lookup(name_or_path, known_models(), "model", MODEL_HINT)


def spec_from_hf_config(cfg: dict, name: str = "", source: str = "") -> ModelSpec:
    """A ModelSpec from a Hugging Face config.json's fields (Llama, Mistral, Qwen2, Gemma 3; Mixtral, Qwen-MoE)."""
    if "text_config" in cfg:  # a multimodal wrapper: the text tower decides the serving cost
        cfg = {**cfg["text_config"], "_name_or_path": cfg.get("_name_or_path")}
    try:
        heads = cfg["num_attention_heads"]
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        pattern = cfg.get("sliding_window_pattern")
        layer_types = cfg.get("layer_types")
        if layer_types and "full_attention" in layer_types:
            pattern = layer_types.index("full_attention") + 1
        model_type = cfg.get("model_type", "llama")
        if window and pattern is None and model_type.startswith("gemma3"):
            pattern = 6
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 1
        moe = _hf_moe_fields(cfg, cfg["num_hidden_layers"]) if experts > 1 else {}
        return ModelSpec(
            name=name or cfg.get("_name_or_path") or model_type, architecture=model_type,
            num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"], tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            sliding_window=window, sliding_window_pattern=pattern,
            num_experts=experts, experts_per_token=cfg.get("num_experts_per_tok") or 1, **moe, source=source)
    except KeyError as e:
        raise UnknownSpec(f"config {source or name!r} has no {e.args[0]!r}: not a decoder-only transformer "
                          f"config this planner reads. {MODEL_HINT}") from None


def _hf_moe_fields(cfg: dict, layers: int) -> dict:
    """A mixture of experts' widths and layers from its config.json: Mixtral (experts of intermediate_size),
    Qwen2/3-MoE (moe_intermediate_size; mlp_only_layers and decoder_sparse_step make layers dense; Qwen2's one
    shared expert counted in experts' widths), DeepSeek (n_shared_experts, the first first_k_dense_replace
    layers dense, then every moe_layer_freq-th)."""
    width = cfg.get("moe_intermediate_size")
    shared = cfg.get("n_shared_experts") or 0
    if not shared and width and cfg.get("shared_expert_intermediate_size"):
        shared = max(1, round(cfg["shared_expert_intermediate_size"] / width))
    dense_only, step = set(cfg.get("mlp_only_layers") or ()), cfg.get("decoder_sparse_step") or 1
    first, freq = cfg.get("first_k_dense_replace") or 0, cfg.get("moe_layer_freq") or 1
    dense = sum(1 for i in range(layers) if i in dense_only or (i + 1) % step or i < first or i % freq)
    return {"moe_intermediate_size": width, "num_shared_experts": shared, "num_dense_layers": dense}


def spec_from_gguf(path: Path) -> ModelSpec:
    from kvserve.models.gguf_file import GGUFFile

    gguf = GGUFFile(path)
    meta, tensor_names = gguf.metadata, {t.name for t in gguf.tensors}
    gguf.close()
    arch = meta.get("general.architecture", "")

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    if get("block_count") is None:
        raise UnknownSpec(f"{path}: GGUF architecture {arch!r} has no block count. {MODEL_HINT}")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    vocab = int(get("vocab_size", 0) or len(meta.get("tokenizer.ggml.tokens", ())) or 0)
    window = get("attention.sliding_window")
    experts = int(get("expert_count", 1) or 1)
    return ModelSpec(
        name=str(meta.get("general.name") or path.stem), architecture=arch, num_layers=int(get("block_count")),
        hidden_size=hidden, num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", 0) or hidden // heads),
        intermediate_size=int(get("feed_forward_length")), vocab_size=vocab,
        tie_word_embeddings="output.weight" not in tensor_names,
        max_position_embeddings=int(get("context_length", 8192)),
        sliding_window=int(window) if window else None,
        sliding_window_pattern=6 if window and arch == "gemma3" else None,
        num_experts=experts, experts_per_token=int(get("expert_used_count", 1) or 1) if experts > 1 else 1,
        moe_intermediate_size=(int(get("expert_feed_forward_length", 0) or 0) or None) if experts > 1 else None,
        num_shared_experts=int(get("expert_shared_count", 0) or 0) if experts > 1 else 0,
        num_dense_layers=int(get("leading_dense_block_count", 0) or 0) if experts > 1 else 0,
        source=str(path))


def calibration_path(model: str) -> Path:
    """Where `kvserve plan calibrate` keeps this machine's calibration for a served model."""
    from kvserve.config import kvserve_home

    return kvserve_home() / "calibration" / f"{model}.json"


def accelerator_spec(name_or_path: str, model: str | tuple[str, ...] | None = None) -> AcceleratorSpec:
    """An accelerator by name, or a measured machine: `cpu` (this machine's calibration for `model`, the
    first of its names that has one) or the path of a calibration file."""
    path = Path(name_or_path).expanduser()
    if path.suffix == ".json" and path.is_file():
        return calibrated_spec(json.loads(path.read_text()))
    if name_or_path.lower() in ("cpu", "this", "local"):
        names = (model,) if isinstance(model, str) else tuple(model or ())
        for n in names:
            if calibration_path(n).is_file():
                return calibrated_spec(json.loads(calibration_path(n).read_text()))
        first = names[0] if names else "MODEL"
        raise UnknownSpec(f"no calibration of this machine for model {first!r} at {calibration_path(first)}: run "
                          f"`kvserve plan calibrate --model {first}` first (it profiles the real engine for "
                          f"about a minute)")
    return _lookup(name_or_path, known_accelerators(), "accelerator",
                   "Or `cpu` for this machine once `kvserve plan calibrate` has measured it, or a calibration .json.")


def calibrated_spec(doc: dict) -> AcceleratorSpec:
    """The AcceleratorSpec a calibration file describes (see planning/calibrate.py)."""
    m = doc["machine"]
    return AcceleratorSpec(name=m["name"], memory_bytes=int(m["memory_bytes"]),
                           memory_bandwidth=float(m["memory_bandwidth"]), bf16_flops=float(m["flops"]),
                           attention_flops=float(m["attention_flops"]) if m.get("attention_flops") else None,
                           max_per_node=1, price_per_hour=float(m.get("price_per_hour", 0.0)), vendor="cpu",
                           source=doc.get("source", "kvserve plan calibrate"), note=m.get("note", ""),
                           calibrated=doc)
