"""Hugging Face checkpoints written without network or `transformers`.

The embedded default model (`kvexport build` with no MODEL_DIR): a small Llama-style model trained
on the Python standard library's sources, shipped in kvexport/default_model (see
docs/default-model.md). Seeded random-init tiny configs of every registered family (tests) and
`bench-125m` (benchmarks). Every checkpoint gets a byte-level tokenizer that decodes every id of
its vocabulary to text.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvexport.architectures import get_arch, map_config
from kvexport.checkpoint import HELDOUT_FILE, INDEX_FILE
from kvexport.config import DecoderConfig
from kvexport.decoder import Decoder

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIALS = (PAD, BOS, EOS)  # ids 0, 1, 2; bytes follow at 3..258
BYTE_VOCAB = len(SPECIALS) + 256

_LLAMA_TINY: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-5,
    hidden_act="silu", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)

# One tiny config per registered family (the meta-test fails when a family lacks one).
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**_LLAMA_TINY, "model_type": "llama",
              "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 32}},
    "mistral": {**_LLAMA_TINY, "model_type": "mistral", "sliding_window": 24,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "qwen2": {**_LLAMA_TINY, "model_type": "qwen2", "tie_word_embeddings": True,
              "use_sliding_window": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": None,
             "n_positions": 256, "vocab_size": 320, "activation_function": "gelu_new",
             "layer_norm_epsilon": 1e-5, "bos_token_id": 1, "eos_token_id": 2},
    "qwen3": {**_LLAMA_TINY, "model_type": "qwen3", "head_dim": 32, "use_sliding_window": False,  # head_dim != 64/4
              "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    "olmo2": {**_LLAMA_TINY, "model_type": "olmo2", "rms_norm_eps": 1e-6,
              "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    "granite": {**_LLAMA_TINY, "model_type": "granite", "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                "attention_multiplier": 0.125, "logits_scaling": 4.0,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "gpt_neox": {"model_type": "gpt_neox", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "vocab_size": 320, "max_position_embeddings": 256,
                 "layer_norm_eps": 1e-5, "hidden_act": "gelu", "use_parallel_residual": True,
                 "attention_bias": True, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    # longrope: the tests stay below original_max_position_embeddings (short factors), as transformers'
    # uncached forward of a text past it would switch every position to the long ones
    "phi3": {**_LLAMA_TINY, "model_type": "phi3", "original_max_position_embeddings": 128,
             "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                                 "short_factor": [1.0, 1.05, 1.1, 1.2, 1.4, 1.7, 2.0, 2.5],
                                 "long_factor": [1.0, 1.3, 1.8, 2.6, 3.7, 5.0, 6.5, 8.0]}},
    "starcoder2": {"model_type": "starcoder2", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
                   "max_position_embeddings": 256, "norm_epsilon": 1e-5, "hidden_act": "gelu_pytorch_tanh",
                   "use_bias": True, "sliding_window": 24, "tie_word_embeddings": True, "bos_token_id": 1,
                   "eos_token_id": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
}

BENCH_125M: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
    "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}

# The embedded default: trained weights (kvexport/default_model), built in seconds.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"
DEFAULT_MODEL: dict[str, Any] = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
DEFAULT_SEED = 0  # `make-checkpoint default --seed N` with any other N: random weights of the same shape
_DEFAULT_FILES = ("tokenizer.json", "tokenizer_config.json", HELDOUT_FILE)

NAMED_MODELS: dict[str, dict[str, Any]] = {
    "bench-125m": BENCH_125M,
    "default": DEFAULT_MODEL,
    **{f"tiny-{k}": v for k, v in TINY_CONFIGS.items()},
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (what ByteLevel pre-tokenizers use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _text_pieces() -> list[str]:
    """Multi-byte text pieces (a byte-level BPE's tokens learned on stdlib sources), in merge order."""
    data = json.loads((DEFAULT_MODEL_DIR / "pieces.json").read_text(encoding="utf-8"))
    return list(data["pieces"])


def extra_tokens(n: int) -> list[str]:
    """n distinct multi-byte strings for ids 259.. : the learned pieces, then pairs of them.

    Deterministic (no RNG): pair k joins piece i = k mod P and piece (k // P + 31 * i) mod P,
    a distinct pair for every k < P * P.
    """
    pieces = _text_pieces()
    out: list[str] = []
    seen: set[str] = set()
    for p in pieces:
        if len(out) == n:
            return out
        if p not in seen:
            seen.add(p)
            out.append(p)
    k = 0
    while len(out) < n:
        if k >= len(pieces) ** 2:
            raise ValueError(f"cannot make {n} distinct tokens from {len(pieces)} pieces")
        i, r = k % len(pieces), k // len(pieces)
        s = pieces[i] + pieces[(r + 31 * i) % len(pieces)]
        k += 1
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def write_tokenizer(out_dir: str | Path, vocab_size: int = BYTE_VOCAB) -> None:
    """tokenizer.json covering ids [0, vocab_size): <pad>=0, <s>=1, </s>=2, one token per byte at
    3..258, and above that multi-byte text pieces, so that every id the model emits decodes to
    text. Text still encodes byte by byte (no merges): a prompt's ids are its bytes + 3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    out = Path(out_dir)
    b2u = _bytes_to_unicode()
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({b2u[b]: len(SPECIALS) + b for b in range(256)})
    for text in extra_tokens(max(0, vocab_size - BYTE_VOCAB)):
        vocab["".join(b2u[b] for b in text.encode("utf-8"))] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
         "model_max_length": 1 << 20}, indent=2))


def write_byte_tokenizer(out_dir: Path) -> None:
    """The tokenizer of a 259-id vocabulary: specials and bytes only."""
    write_tokenizer(out_dir, BYTE_VOCAB)


def random_decoder(cfg: DecoderConfig, seed: int) -> Decoder:
    """Seeded init scaled 1/sqrt(fan_in) so that activations and logits are O(1), not near-uniform."""
    g = torch.Generator().manual_seed(seed)
    dec = Decoder(cfg, max_seq=1)
    for name, p in dec.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    return dec


def write_checkpoint(hf_config: dict[str, Any], out_dir: str | Path, *, seed: int = 0,
                     dtype: torch.dtype = torch.float32, shard_bytes: int | None = None) -> Path:
    """Write a seeded random checkpoint folder that `transformers` and kvexport both load."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = map_config(hf_config)
    wm = get_arch(cfg.model_type).weights
    tensors: dict[str, torch.Tensor] = {}
    for canonical, p in random_decoder(cfg, seed).named_parameters():
        source = wm.source(canonical)  # written through its transform's inverse
        for hf_name, part in zip(source.names, source.transform.save(p.detach(), cfg), strict=True):
            tensors[wm.prefixes[0] + hf_name] = part.contiguous().to(dtype)
    _save_tensors(tensors, out, shard_bytes)
    cfg_out = {**hf_config, "torch_dtype": str(dtype).removeprefix("torch."), "architectures": None}
    (out / "config.json").write_text(json.dumps(cfg_out, indent=2))
    write_tokenizer(out, int(cfg.vocab_size))
    return out


def write_default(out_dir: str | Path, *, dtype: torch.dtype = torch.float32,
                  shard_bytes: int | None = None) -> Path:
    """Copy the trained default model (weights, config, tokenizer, heldout.txt) into out_dir."""
    from safetensors.torch import load_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype) for k, v in load_file(str(DEFAULT_MODEL_DIR / "model.safetensors")).items()}
    _save_tensors(tensors, out, shard_bytes)
    cfg_out = {**DEFAULT_MODEL, "torch_dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(cfg_out, indent=2))
    for name in _DEFAULT_FILES:
        shutil.copyfile(DEFAULT_MODEL_DIR / name, out / name)
    return out


def _save_tensors(tensors: dict[str, torch.Tensor], out: Path, shard_bytes: int | None) -> None:
    if shard_bytes is None:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def write_named(name: str, out_dir: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                shard_bytes: int | None = None) -> Path:
    """Write one of NAMED_MODELS (`bench-125m`, `default`, `tiny-llama`, ...).

    `default` with seed DEFAULT_SEED is the trained model; every other (name, seed) is seeded random init.
    """
    if name not in NAMED_MODELS:
        from kvexport.errors import InputError

        raise InputError(f"unknown model name {name!r}; choose one of {', '.join(sorted(NAMED_MODELS))}")
    if name == "default" and seed == DEFAULT_SEED:
        return write_default(out_dir, dtype=dtype, shard_bytes=shard_bytes)
    return write_checkpoint(NAMED_MODELS[name], out_dir, seed=seed, dtype=dtype, shard_bytes=shard_bytes)
