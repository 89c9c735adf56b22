"""Hugging Face checkpoints written without network or `transformers`.

The embedded default model (`kvexport build` with no MODEL_DIR): a small Llama-style model trained
on the Python standard library's sources, shipped in kvexport/default_model (see
docs/default-model.md). Seeded random-init tiny configs of every registered family (tests) and
`bench-125m`, `bench-1b` and the mixture-of-experts `bench-moe` (mixtral) and `bench-qwen3-moe` (benchmarks).
Every checkpoint gets a byte-level tokenizer that decodes every id of its vocabulary to text.
"""
from __future__ import annotations

import copy
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
    "mixtral": {**_LLAMA_TINY, "model_type": "mixtral", "intermediate_size": 64, "num_local_experts": 4,
                "num_experts_per_tok": 2, "sliding_window": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    # layer 0 dense (mlp_only_layers), layer 1 routed without renormalising its top-k probabilities
    "qwen3_moe": {**_LLAMA_TINY, "model_type": "qwen3_moe", "head_dim": 32, "use_sliding_window": False,
                  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": [0],
                  "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    # no layer_types: transformers' pattern (sliding, global, sliding, global); window 16, well inside the
    # tests' sequences; head_dim and query_pre_attn_scalar unlike hidden/heads; softcaps small enough that
    # tanh bends the tiny model's attention scores and logits
    "gemma2": {"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "query_pre_attn_scalar": 24,
               "vocab_size": 320, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
               "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 16, "attn_logit_softcapping": 5.0,
               "final_logit_softcapping": 8.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
               "pad_token_id": 0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    # 6 layers of transformers' 5 sliding : 1 global pattern; the global layer's RoPE scaled (linear), the
    # sliding ones' with their own base
    "gemma3_text": {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
                    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "query_pre_attn_scalar": 48,
                    "vocab_size": 320, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
                    "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 16, "tie_word_embeddings": True,
                    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                    "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
}

BENCH_125M: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
    "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}

# Llama-3.2-1B's shape (its llama3 RoPE scaling included), seeded random: quantized work and realistic sizes.
BENCH_1B: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}
# Mixture-of-experts decode speed (issue 13): 1.10B parameters in all, top-2 of 8 experts of width 1024 per layer
# (about 0.44B read per decoded token), one per routed family
BENCH_MOE: dict[str, Any] = {
    "model_type": "mixtral", "hidden_size": 2048, "intermediate_size": 1024, "num_local_experts": 8,
    "num_experts_per_tok": 2, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "sliding_window": None, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}
BENCH_QWEN3_MOE: dict[str, Any] = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 1024,
    "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 64, "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "use_sliding_window": False, "tie_word_embeddings": False, "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 0, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}
# shards a named model is written in unless --shard-mb says otherwise (bench-1b: ~4.9 GB fp32 in 5)
DEFAULT_SHARD_BYTES: dict[str, int] = {"bench-1b": 2**30, "bench-moe": 2**30, "bench-qwen3-moe": 2**30}

# The embedded default: trained weights (kvexport/default_model), built in seconds.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"
DEFAULT_MODEL: dict[str, Any] = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
DEFAULT_SEED = 0  # `make-checkpoint default --seed N` with any other N: random weights of the same shape
_DEFAULT_FILES = ("tokenizer.json", "tokenizer_config.json", HELDOUT_FILE)

NAMED_MODELS: dict[str, dict[str, Any]] = {
    "bench-125m": BENCH_125M,
    "bench-1b": BENCH_1B,
    "bench-moe": BENCH_MOE,
    "bench-qwen3-moe": BENCH_QWEN3_MOE,
    "default": DEFAULT_MODEL,
    **{f"tiny-{k}": v for k, v in TINY_CONFIGS.items()},
}


def transformers_config(hf_config: dict[str, Any]) -> Any:
    """`transformers.AutoConfig.for_model` of one of these dicts (or one made from them), built from a deep copy:
    transformers writes into nested dicts (phi3's rope_parameters gains original_max_position_embeddings), which
    would change TINY_CONFIGS for everything that runs after it in the process."""
    import transformers

    return transformers.AutoConfig.for_model(**copy.deepcopy(hf_config))


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


def _init_value(name: str, shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    """Seeded init scaled 1/sqrt(fan_in) so that activations and logits are O(1), not near-uniform."""
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if len(shape) == 1:
        return 0.05 * torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) / math.sqrt(shape[1])


def random_decoder(cfg: DecoderConfig, seed: int) -> Decoder:
    """The decoder that write_checkpoint(seed) writes, in memory."""
    g = torch.Generator().manual_seed(seed)
    dec = Decoder(cfg, max_seq=1)
    for name, p in dec.named_parameters():
        with torch.no_grad():
            p.copy_(_init_value(name, p.shape, g))
    return dec


def _hf_parts(cfg: DecoderConfig, canonical: str, p: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint tensors (HF name, value) that one canonical parameter is written as."""
    wm = get_arch(cfg.model_type).weights
    source = wm.source(canonical, cfg)  # written through its transform's inverse
    return [(wm.prefixes[0] + hf, part) for hf, part in zip(source.names, source.transform.save(p, cfg), strict=True)]


def write_checkpoint(hf_config: dict[str, Any], out_dir: str | Path, *, seed: int = 0,
                     dtype: torch.dtype = torch.float32, shard_bytes: int | None = None) -> Path:
    """Write a seeded random checkpoint folder that `transformers` and kvexport both load.

    Parameters are drawn one at a time and each shard is written as soon as it is complete, so
    memory holds one shard, never the whole model (bench-1b is ~4.9 GB in fp32)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = map_config(hf_config)
    with torch.device("meta"):  # names and shapes only: no memory, no draws
        layout = Decoder(cfg, max_seq=1)
    plan = [(n, t.numel() * dtype.itemsize) for c, p in layout.named_parameters() for n, t in _hf_parts(cfg, c, p)]
    writer = _ShardWriter(out, plan, shard_bytes)
    g = torch.Generator().manual_seed(seed)
    for canonical, p in layout.named_parameters():  # the draws of random_decoder, in its order
        for hf_name, part in _hf_parts(cfg, canonical, _init_value(canonical, p.shape, g)):
            writer.add(hf_name, part.contiguous().to(dtype))
    writer.close()
    cfg_out = {**hf_config, "torch_dtype": str(dtype).removeprefix("torch."),
               "architectures": [get_arch(hf_config["model_type"]).hf_class]}  # what peers' converters pick a class by
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
    writer = _ShardWriter(out, [(k, t.numel() * t.element_size()) for k, t in tensors.items()], shard_bytes)
    for k, t in tensors.items():
        writer.add(k, t)
    writer.close()


class _ShardWriter:
    """Safetensors shards of at most shard_bytes (one file when None), planned from (name, bytes)
    up front so that each shard is written, and its tensors dropped, once its last tensor arrives."""

    def __init__(self, out: Path, plan: list[tuple[str, int]], shard_bytes: int | None):
        self.out, self.total = out, sum(b for _, b in plan)
        self.shards: list[list[str]] = [[]]
        size = 0
        for name, nbytes in plan:
            if shard_bytes is not None and self.shards[-1] and size + nbytes > shard_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append(name)
            size += nbytes
        self.shard_of = {name: i for i, names in enumerate(self.shards) for name in names}
        self.pending: dict[int, dict[str, torch.Tensor]] = {}
        self.sharded = shard_bytes is not None

    def file_name(self, i: int) -> str:
        return f"model-{i + 1:05d}-of-{len(self.shards):05d}.safetensors" if self.sharded else "model.safetensors"

    def add(self, name: str, tensor: torch.Tensor) -> None:
        i = self.shard_of[name]
        held = self.pending.setdefault(i, {})
        held[name] = tensor
        if len(held) == len(self.shards[i]):
            save_file(held, str(self.out / self.file_name(i)), metadata={"format": "pt"})
            del self.pending[i]

    def close(self) -> None:
        assert not self.pending, f"tensors never given for shards {sorted(self.pending)}"
        if self.sharded:
            weight_map = {name: self.file_name(i) for name, i in self.shard_of.items()}
            (self.out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": self.total},
                                                           "weight_map": weight_map}, indent=2))


def write_named(name: str, out_dir: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                shard_bytes: int | None = None) -> Path:
    """Write one of NAMED_MODELS (`bench-125m`, `default`, `tiny-llama`, ...).

    `default` with seed DEFAULT_SEED is the trained model; every other (name, seed) is seeded random init.
    """
    if name not in NAMED_MODELS:
        from kvexport.errors import InputError

        raise InputError(f"unknown model name {name!r}; choose one of {', '.join(sorted(NAMED_MODELS))}")
    if shard_bytes is None:
        shard_bytes = DEFAULT_SHARD_BYTES.get(name)
    if name == "default" and seed == DEFAULT_SEED:
        return write_default(out_dir, dtype=dtype, shard_bytes=shard_bytes)
    return write_checkpoint(NAMED_MODELS[name], out_dir, seed=seed, dtype=dtype, shard_bytes=shard_bytes)
