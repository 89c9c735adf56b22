"""Reading a Hugging Face checkpoint folder into the canonical decoder (safetensors only)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from kvexport.architectures import get_arch, map_config
from kvexport.config import DecoderConfig
from kvexport.decoder import Decoder
from kvexport.weightmap import WeightMap
from kvexport.errors import CheckpointError, UnsupportedFeatureError, WeightShapeError

# chat_template.jinja: the chat template where the checkpoint keeps it outside tokenizer_config.json
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")
INDEX_FILE = "model.safetensors.index.json"
# a text the model was not trained on, shipped beside its weights: verify reports the perplexity change on it
HELDOUT_FILE = "heldout.txt"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_hf_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise CheckpointError(f"{model_dir} is not a folder; pass a Hugging Face checkpoint folder (config.json + *.safetensors)")
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; a Hugging Face checkpoint folder needs config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); re-download or re-save the checkpoint") from e


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: from the shard index if there is one."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise CheckpointError(
                f"{INDEX_FILE} lists shards that are not in {model_dir}: {', '.join(missing)}; "
                "download every shard of the checkpoint"
            )
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in model_dir.glob("*.bin"))
        hint = (
            f" It has {', '.join(bins)}: kvexport never unpickles weights; re-save them with "
            "`model.save_pretrained(dir, safe_serialization=True)`."
            if bins
            else ""
        )
        raise CheckpointError(f"no *.safetensors weights file in {model_dir}.{hint}")
    return files


@dataclass
class Checkpoint:
    """A checkpoint read into the canonical decoder, plus what the manifest records about it."""

    model_dir: Path
    hf_config: dict
    config: DecoderConfig
    decoder: Decoder
    source_hashes: dict[str, str] = field(default_factory=dict)


class _TensorIndex:
    def __init__(self, files: list[Path]):
        self.where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    self.where[k] = f
        self._handles: dict[Path, object] = {}

    def get(self, name: str) -> torch.Tensor:
        f = self.where[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt").__enter__()
        return self._handles[f].get_tensor(name)  # type: ignore[attr-defined]

    def __enter__(self) -> _TensorIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)  # type: ignore[attr-defined]
        self._handles.clear()


def _resolve(index: _TensorIndex, wm: WeightMap, name: str) -> str | None:
    for p in wm.prefixes:
        if p + name in index.where:
            return p + name
    return None


def load_checkpoint(model_dir: str | Path, max_seq: int | None = None, dtype: torch.dtype = torch.float32,
                    *, hash_sources: bool = True, **decoder_kwargs) -> Checkpoint:
    """Read config.json and safetensors shards into a Decoder; every problem raises a typed error."""
    model_dir = Path(model_dir)
    raw = read_hf_config(model_dir)
    cfg = map_config(raw)
    arch = get_arch(cfg.model_type)
    files = weight_files(model_dir)
    max_seq = max_seq or cfg.max_position_embeddings
    if cfg.position_kind == "learned" and max_seq > cfg.max_position_embeddings:
        raise UnsupportedFeatureError(
            f"max_seq {max_seq} exceeds the {cfg.max_position_embeddings} learned positions of this "
            f"{cfg.model_type} model; pass --max-seq {cfg.max_position_embeddings} or less"
        )
    with torch.device("meta"):
        decoder = Decoder(cfg, max_seq, **decoder_kwargs)
    with _TensorIndex(files) as index:
        wm = arch.weights
        state: dict[str, torch.Tensor] = {}
        used: set[str] = set()
        missing: list[str] = []
        for canonical, param in decoder.named_parameters():  # tied lm_head appears once, as embed_tokens
            source = wm.source(canonical, cfg)
            resolved = [_resolve(index, wm, s) for s in source.names]
            if any(r is None for r in resolved):
                missing += [s for s, r in zip(source.names, resolved) if r is None]
                continue
            parts = [index.get(r) for r in resolved]  # type: ignore[arg-type]
            used.update(resolved)  # type: ignore[arg-type]
            try:
                t = source.transform.load(parts, cfg)
            except RuntimeError:  # parts that do not concatenate or reshape: reported as a shape mismatch below
                t = torch.empty(0)
            if tuple(t.shape) != tuple(param.shape):
                shapes = ", ".join(f"{r} {tuple(index.get(r).shape)}" for r in resolved)  # type: ignore[arg-type]
                raise WeightShapeError(
                    f"weight for {canonical} has shape {tuple(t.shape)} (from {shapes}) but config.json predicts "
                    f"{tuple(param.shape)}; the weights do not belong to this config.json (check hidden_size, "
                    "num_attention_heads, num_key_value_heads, head_dim, intermediate_size, vocab_size)"
                )
            if not t.is_floating_point():
                raise CheckpointError(f"weight {resolved[0]} has dtype {t.dtype}; quantized checkpoints are not supported yet")
            state[canonical] = t.to(dtype)
    if missing:
        raise CheckpointError(
            f"{model_dir} lacks {len(missing)} weight(s) the {cfg.model_type} config needs: "
            + ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            + "; the checkpoint is incomplete or not a " + cfg.model_type + " model"
        )
    unused = sorted(k for k in index.where if k not in used and not k.endswith(wm.ignore_suffixes))
    if cfg.tie_word_embeddings:
        unused = [k for k in unused if _resolve(index, wm, "lm_head.weight") != k]
    if unused:
        raise UnsupportedFeatureError(
            f"the checkpoint has tensors the {cfg.model_type} map does not use: {', '.join(unused[:8])}"
            + (" ..." if len(unused) > 8 else "")
            + "; they belong to a feature kvexport does not model, so the export would be wrong"
        )
    decoder = decoder.to_empty(device="cpu")
    decoder.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        decoder.lm_head.weight = decoder.embed_tokens.weight
    _rebuild_buffers(decoder, cfg, max_seq)  # rope tables were built on meta
    decoder.eval().requires_grad_(False)
    hashes = {}
    if hash_sources:
        for f in [model_dir / "config.json", *files]:
            hashes[f.name] = sha256_file(f)
    return Checkpoint(model_dir, raw, cfg, decoder, hashes)


def _rebuild_buffers(decoder: Decoder, cfg: DecoderConfig, max_seq: int) -> None:
    if cfg.position_kind == "rope":
        decoder.set_rope_tables(decoder.rope_positions)  # past max_seq where every layer may slide on a ring
