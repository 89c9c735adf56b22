"""Artifact folders (`NAME.kvx/`): writing the IR into one, hashing its files, checking them on load."""
from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

import kvexport
from kvexport import manifest as mf
from kvexport.checkpoint import TOKENIZER_FILES, Checkpoint, load_checkpoint, sha256_file
from kvexport.decoder import CacheStyle
from kvexport.errors import ArtifactError, InputError
from kvexport.export import CACHE_LEN, OPSET, export_onnx, io_specs
from kvexport.manifest import Manifest
from kvexport.runtime.ring import MASK_INPUT, RING_DIM

Progress = Callable[[str], None]
VERIFY_FILE = "verify.json"
UNHASHED = {mf.MANIFEST_FILE, mf.MANIFEST_FILE + ".tmp"}


def _tree(folder: Path) -> list[str]:
    """Every file under folder (relative posix paths), the manifest and its atomic-write temp excluded."""
    return [rel for p in sorted(folder.rglob("*"))
            if p.is_file() and (rel := p.relative_to(folder).as_posix()) not in UNHASHED]


def hash_tree(folder: Path) -> dict[str, str]:
    """sha256 of every file under folder (relative posix paths), manifest excluded."""
    return {rel: sha256_file(folder / rel) for rel in _tree(folder)}


def named_files(manifest: Manifest) -> dict[str, str]:
    """Files the manifest names by role (IR, tokenizer, engine, verification report) -> the role.
    Each must also be listed with its sha256 in `files`."""
    raw = manifest.raw
    named = {raw["ir"]["file"]: "the IR"}
    if raw["ir"].get("data_file"):
        named[raw["ir"]["data_file"]] = "the IR's external data"
    named.update({f: "a tokenizer file" for f in raw["tokenizer"]["files"]})
    named.update({f: "an engine file" for f in (raw.get("target") or {}).get("engine_files", [])})
    report = (raw.get("verification") or {}).get("file")
    if report:
        named[report] = "the verification report"
    return named


def check_integrity(folder: Path, manifest: Manifest) -> None:
    """The artifact's files are exactly the ones `files` lists, each with its sha256, and every file
    the manifest names (IR, tokenizer, engine files) is among them. Raises ArtifactError naming each
    file that fails; runs before any backend opens an engine file (Backend.load)."""
    folder = Path(folder)
    listed: dict[str, str] = manifest.raw["files"]
    present = set(_tree(folder))
    rebuild = "rebuild the artifact with `kvexport build`"
    problems = [f"{folder / rel} is missing from the artifact" for rel in sorted(set(listed) - present)]
    problems += [f"{folder / rel} is not listed in manifest.json's `files` (kvexport loads only files whose "
                 "sha256 the manifest records): remove it if you added it" for rel in sorted(present - set(listed))]
    problems += [f"manifest.json names {rel} as {role} but lists no sha256 for it in `files`"
                 for rel, role in named_files(manifest).items() if rel not in listed]
    if not problems:
        problems = [f"{folder / rel} does not match the sha256 in manifest.json: the file was truncated or edited"
                    for rel in sorted(listed) if sha256_file(folder / rel) != listed[rel]]
    if problems:
        raise ArtifactError("; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
                            + f". kvexport never loads an artifact that fails this check: {rebuild}.")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def new_manifest(ck: Checkpoint, *, max_seq: int, cache_style: CacheStyle, last_token_only: bool,
                 dtype: torch.dtype, tokenizer_files: list[str], weights: dict[str, dict] | None = None,
                 ring: bool = False) -> Manifest:
    cfg = ck.config
    with ck.decoder.configured(ring=ring, last_token_only=last_token_only):  # the graph's IO, logits width included
        ins, outs = io_specs(ck.decoder, cache_style, _dtype_name(dtype))
        rings, window, max_positions = ck.decoder.ring_layers, ck.decoder.ring_window, ck.decoder.max_positions
    capacity_dim = CACHE_LEN if cache_style == "static" else "total_seq"
    pairs = [
        {"layer": i, "kind": kind, "input": f"past_key_values.{i}.{kind}", "output": f"present.{i}.{kind}"}
        for i in range(cfg.num_hidden_layers) for kind in ("key", "value")
    ]
    raw = {
        "schema_version": mf.SCHEMA_VERSION,
        "kvexport_version": kvexport.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": {
            "family": cfg.model_type,
            "name": ck.model_dir.name,
            "config": cfg.to_dict(),
            "num_parameters": cfg.num_parameters(),
            "source_files": ck.source_hashes,
        },
        "ir": {"file": "model.onnx", "data_file": "model.onnx.data", "opset": OPSET,
               "cache_style": cache_style, "last_token_only": last_token_only, "dtype": _dtype_name(dtype),
               **({"weights": weights} if weights is not None else {})},
        "cache": {
            "style": cache_style, "layout": "BHSD", "dtype": _dtype_name(dtype), "max_seq": max_seq,
            "num_layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "capacity_dim": capacity_dim,
            "sliding_window": cfg.sliding_window, "quantization": None, "pairs": pairs,
            # each layer's window and the dim that counts its slots: a ring of at most `window` slots, or full length
            "layers": [{"layer": i, "window": cfg.window_of(i), "slots": RING_DIM if i in rings else capacity_dim}
                       for i in range(cfg.num_hidden_layers)],
            "ring": {"window": window, "layers": list(rings), "slots_dim": RING_DIM, "mask_input": MASK_INPUT}
            if rings else None,
            "max_positions": max_positions,
        },
        "inputs": [s.to_dict() for s in ins],
        "outputs": [s.to_dict() for s in outs],
        "tokenizer": {
            "files": tokenizer_files,
            "bos_token_id": cfg.bos_token_id,
            "eos_token_ids": list(cfg.eos_token_id),
            "pad_token_id": cfg.pad_token_id,
        },
        "target": None,
        "verification": None,
        "files": {},
    }
    return Manifest(raw)


def export_artifact(
    model_dir: str | Path,
    out: str | Path,
    *,
    max_seq: int | None = None,
    cache_style: CacheStyle = "static",
    last_token_only: bool = True,
    dtype: torch.dtype = torch.float32,
    overwrite: bool = True,
    ring: bool = False,
    progress: Progress | None = None,
) -> Path:
    """HF checkpoint folder -> artifact folder holding the IR, tokenizer and manifest (no engine yet).

    ring: sliding-window layers keep a window-sized ring cache (static style; `kvexport build` asks for it where
    the target runs one, Capabilities.ring_cache)."""
    say = progress or (lambda _m: None)
    out = Path(out)
    if out.exists() and not overwrite:
        raise InputError(f"{out} exists; pass --force to replace it")
    mf.check_output(out, Path(model_dir))
    mf.check_max_seq(max_seq)
    say(f"reading {model_dir}")
    ck = load_checkpoint(model_dir, max_seq=max_seq)
    max_seq = ck.decoder.max_seq
    trained = ck.config.max_position_embeddings
    if max_seq > trained:  # learned positions are refused above; rotary ones extrapolate, untrained
        say(f"note: --max-seq {max_seq} is past this model's max_position_embeddings ({trained}): positions beyond "
            f"{trained} were never trained, so text there is the model's extrapolation, not what it was made for")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ir = export_onnx(ck, tmp, cache_style=cache_style, last_token_only=last_token_only, dtype=dtype, ring=ring,
                     progress=say)
    tok_files = []
    for name in TOKENIZER_FILES:
        src = Path(model_dir) / name
        if src.is_file():
            shutil.copy2(src, tmp / name)
            tok_files.append(name)
    m = new_manifest(ck, max_seq=max_seq, cache_style=cache_style, last_token_only=last_token_only,
                     dtype=dtype, tokenizer_files=tok_files, weights=ir.weights, ring=ring)
    release_weights(ck)
    del ck
    finish(tmp, m)
    # replace the old artifact only once the new one is complete: no data lost on failure
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    say(f"wrote {out}")
    return out


def release_weights(ck: Checkpoint) -> None:
    """Free the decoder's weights once the IR holds them. The exporter's graphs stay reachable after
    torch.onnx.export returns (onnxscript 0.7's module-level rewrite rules keep the last graph they
    matched), and through them the parameters: emptying each one frees its memory whoever holds it, so
    the backend build that follows does not start with a second model (bench-1b: 5.5 GiB of it)."""
    for t in [*ck.decoder.parameters(), *ck.decoder.buffers()]:
        t.data = torch.empty(0, dtype=t.dtype)


def finish(folder: Path, m: Manifest) -> None:
    """Hash every file (verify.json included: it is written before this runs) and write the manifest last."""
    m.raw["files"] = hash_tree(folder)
    m.write(folder)


def open_artifact(path: str | Path, *, verify_hashes: bool = True) -> tuple[Path, Manifest]:
    folder = Path(path)
    if not folder.is_dir():
        raise ArtifactError(f"{folder} is not an artifact folder; make one with `kvexport build MODEL_DIR -o {folder}`")
    m = mf.read(folder)
    if verify_hashes:
        check_integrity(folder, m)
    return folder, m
