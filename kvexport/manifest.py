"""manifest.json: the one contract between frontend, backends and runtime (docs/manifest.md)."""
from __future__ import annotations

import json
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvexport.config import DecoderConfig
from kvexport.errors import InputError, ManifestError

SCHEMA_VERSION = 1
MANIFEST_FILE = "manifest.json"

# Required keys and their JSON types, per section. Validation is explicit so that a bad
# manifest fails with the field's name, not with a KeyError deep in a backend.
_SCHEMA: dict[str, dict[str, type | tuple[type, ...]]] = {
    "": {"schema_version": int, "kvexport_version": str, "model": dict, "ir": dict, "cache": dict,
         "inputs": list, "outputs": list, "tokenizer": dict, "files": dict},
    "model": {"family": str, "name": str, "config": dict, "source_files": dict, "num_parameters": int},
    "ir": {"file": str, "opset": int, "cache_style": str, "last_token_only": bool, "dtype": str},
    "cache": {"style": str, "layout": str, "dtype": str, "max_seq": int, "num_layers": int,
              "kv_heads": int, "head_dim": int, "capacity_dim": str, "pairs": list},
    "tokenizer": {"files": list, "bos_token_id": (int, type(None)), "eos_token_ids": list,
                  "pad_token_id": (int, type(None))},
}
_TARGET: dict[str, type | tuple[type, ...]] = {
    "backend": str, "precision": str, "engine_files": list, "fingerprint": dict, "options": dict,
}


@dataclass
class Manifest:
    """Parsed manifest; `raw` is the JSON dict (kept whole so unknown optional fields survive)."""

    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def config(self) -> DecoderConfig:
        d = self.raw["model"]["config"]
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(DecoderConfig)})
        if unknown:
            raise ManifestError(
                f"this artifact's model config has fields this kvexport does not know ({', '.join(unknown)}): it was "
                "written by another kvexport version. Rebuild it from its checkpoint with `kvexport build`")
        return DecoderConfig.from_dict(d)

    @property
    def cache(self) -> dict[str, Any]:
        return self.raw["cache"]

    @property
    def max_seq(self) -> int:
        return int(self.raw["cache"]["max_seq"])

    @property
    def target(self) -> dict[str, Any] | None:
        return self.raw.get("target")

    @property
    def inputs(self) -> list[dict[str, Any]]:
        return self.raw["inputs"]

    @property
    def outputs(self) -> list[dict[str, Any]]:
        return self.raw["outputs"]

    def kv_pairs(self) -> list[tuple[str, str]]:
        return [(p["input"], p["output"]) for p in self.raw["cache"]["pairs"]]

    def to_json(self) -> str:
        return json.dumps(self.raw, indent=2, sort_keys=False) + "\n"

    def write(self, folder: Path) -> None:
        validate(self.raw)
        tmp = folder / (MANIFEST_FILE + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(folder / MANIFEST_FILE)  # atomic: a crash never leaves half a manifest


def validate(raw: Any) -> None:
    """Raise ManifestError naming the first field that is missing or of the wrong type."""
    if not isinstance(raw, dict):
        raise ManifestError("manifest.json must hold a JSON object")
    version = raw.get("schema_version")
    if isinstance(version, int) and version > SCHEMA_VERSION:
        raise ManifestError(
            f"manifest schema_version {version} is newer than this kvexport understands ({SCHEMA_VERSION}); "
            "upgrade kvexport (pip install -U kvexport) or rebuild the artifact with this version"
        )
    for section, fields in _SCHEMA.items():
        obj = raw if section == "" else raw.get(section)
        if not isinstance(obj, dict):
            raise ManifestError(f"manifest.json: `{section}` is missing or not an object")
        _check_fields(obj, fields, section)
    if raw.get("target") is not None:
        _check_fields(raw["target"], _TARGET, "target")
        if not isinstance(raw["target"].get("deferred", False), bool):
            raise ManifestError("manifest.json: `target.deferred` has the wrong type")
        buffers = raw["target"].get("ring_buffers", 1)  # optional: 2 where each ring has a swap buffer
        if type(buffers) is not int or buffers not in (1, 2):
            raise ManifestError(f"manifest.json: `target.ring_buffers` is 1 or 2, not {buffers!r}; rebuild the artifact")
    for kind in ("inputs", "outputs"):
        for i, io in enumerate(raw[kind]):
            _check_fields(io, {"name": str, "dtype": str, "shape": list}, f"{kind}[{i}]")
    weights = raw["ir"].get("weights")  # optional: manifests written before it lack it
    if weights is not None:
        if not isinstance(weights, dict):
            raise ManifestError("manifest.json: `ir.weights` has the wrong type")
        for name, w in weights.items():
            if not isinstance(w, dict):
                raise ManifestError(f"manifest.json: `ir.weights.{name}` has the wrong type")
            _check_fields(w, {"initializer": str, "transposed": bool, "shape": list}, f"ir.weights.{name}")
    for i, p in enumerate(raw["cache"]["pairs"]):
        _check_fields(p, {"layer": int, "kind": str, "input": str, "output": str}, f"cache.pairs[{i}]")
    if raw["cache"]["layout"] != "BHSD":
        raise ManifestError(f"manifest.json: cache.layout {raw['cache']['layout']!r} is not supported (BHSD)")
    if raw["cache"]["style"] not in ("static", "concat"):
        raise ManifestError(f"manifest.json: cache.style {raw['cache']['style']!r} is not static or concat")


def _check_fields(obj: dict, fields: dict[str, type | tuple[type, ...]], where: str) -> None:
    for key, typ in fields.items():
        if key not in obj:
            raise ManifestError(f"manifest.json: `{where + '.' if where else ''}{key}` is missing")
        if not isinstance(obj[key], typ) or (typ is int and isinstance(obj[key], bool)):
            raise ManifestError(f"manifest.json: `{where + '.' if where else ''}{key}` has the wrong type")


def read(folder: Path) -> Manifest:
    path = Path(folder) / MANIFEST_FILE
    if not path.is_file():
        raise ManifestError(f"{path} is missing: {folder} is not a kvexport artifact (make one with `kvexport build`)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path} is not valid JSON ({e}); the artifact is corrupted, rebuild it") from e
    validate(raw)
    return Manifest(raw)


def check_max_seq(max_seq: int | None) -> None:
    """Refuse a cache capacity below one slot (None: the model's own max_position_embeddings)."""
    if max_seq is not None and max_seq < 1:
        raise InputError(f"--max-seq must be at least 1 (or left out for the model's max_position_embeddings), got {max_seq}")


def check_output(out: Path, source: Path | None = None) -> None:
    """Refuse an output folder whose replacing would lose data, before any work: `out` may be new, an empty
    folder or an earlier kvexport artifact (it holds manifest.json), which the finished one then replaces. A
    file, a folder holding anything else, or the checkpoint being read (or a folder holding it) is refused."""
    out = Path(out)
    if source is not None:
        src, dst = Path(source).resolve(), out.resolve()
        if src == dst or dst in src.parents:
            raise InputError(f"-o {out} would replace the checkpoint being read ({source}): give another output folder")
    if not out.exists():
        return
    if not out.is_dir():
        raise InputError(f"-o {out} is a file: give a folder path (a new one, or an earlier kvexport artifact to "
                         "replace)")
    if not (out / MANIFEST_FILE).is_file() and any(out.iterdir()):
        raise InputError(f"-o {out} is a folder that is not a kvexport artifact (no {MANIFEST_FILE}) and is not "
                         "empty: kvexport replaces only its own artifacts; give a new folder or remove this one first")
