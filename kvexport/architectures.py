"""The architecture table: Hugging Face `model_type` -> config mapping + weight-name map.

Adding a family is adding an entry here (and its tiny config in `kvexport/zoo.py`'s TINY_CONFIGS; see docs/adding-an-architecture.md), never a
branch elsewhere. Canonical tensor names are those of `kvexport.decoder.Decoder`.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvexport.config import Activation, DecoderConfig, RopeConfig
from kvexport.errors import UnsupportedArchitectureError, UnsupportedFeatureError
from kvexport.weightmap import (DEINTERLEAVE_HEADS, EXPERT_DOWN, EXPERT_GATE_UP, GATE_UP, QKV, TRANSPOSE, Offset,
                                Source, WeightMap, layer_map, proj, tensor)

ACTIVATIONS: dict[str, Activation] = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}
ROPE_TYPES = ("default", "linear", "llama3", "longrope")


class ConfigReader:
    """Reads an HF config dict and collects every problem instead of stopping at the first."""

    def __init__(self, model_type: str, raw: Mapping[str, Any]):
        self.model_type = model_type
        self.raw = raw
        self.problems: list[str] = []
        self.missing: list[str] = []  # required keys the config lacks

    def get(self, key: str, default: Any = None) -> Any:
        v = self.raw.get(key, default)
        return default if v is None else v

    def require(self, key: str) -> Any:
        if self.raw.get(key) is None:
            self.missing.append(key)
            self.problems.append(f"config.json has no `{key}`, which {self.model_type} needs")
            return 0
        return self.raw[key]

    def unsupported(self, key: str, value: Any, supported: str) -> None:
        self.problems.append(
            f"{self.model_type}: `{key}` = {value!r} is not supported (supported: {supported})"
        )

    def activation(self, key: str, default: str) -> Activation:
        name = self.get(key, default)
        if name not in ACTIVATIONS:
            self.unsupported(key, name, ", ".join(sorted(ACTIVATIONS)))
            return "silu"
        return ACTIVATIONS[name]

    def rope_parameters(self) -> dict[str, Any]:
        # transformers >= 5 writes `rope_parameters`; 4.x wrote `rope_theta` + `rope_scaling`.
        params = dict(self.get("rope_parameters", {}) or {})
        if not params:
            params = dict(self.get("rope_scaling", {}) or {})
            params.setdefault("rope_theta", self.get("rope_theta", 10000.0))
        return params

    def partial_rotary_factor(self) -> float:
        return float(self.rope_parameters().get("partial_rotary_factor", self.get("partial_rotary_factor", 1.0)))

    def rope(self, params: Mapping[str, Any] | None = None, where: str = "rope_parameters") -> RopeConfig:
        """The RoPE of `params` (default: the config's one `rope_parameters`); `where` names them in problems."""
        params = self.rope_parameters() if params is None else params
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            self.unsupported(f"{where}.rope_type", rope_type, ", ".join(ROPE_TYPES))
            rope_type = "default"
        original = int(params.get("original_max_position_embeddings", self.get("original_max_position_embeddings", 8192)))
        extra: dict[str, Any] = {}
        if rope_type == "longrope":
            extra = self._longrope(params, original)
        return RopeConfig(
            theta=float(params.get("rope_theta", 10000.0)),
            type=rope_type,
            factor=float(params.get("factor", 1.0) or 1.0),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=original,
            **extra,
        )

    def _longrope(self, params: Mapping[str, Any], original: int) -> dict[str, Any]:
        """Phi-3's short/long factors and the cos/sin multiplier transformers derives when none is given."""
        short, long = tuple(params.get("short_factor") or ()), tuple(params.get("long_factor") or ())
        if not short or len(short) != len(long):
            self.unsupported("rope_parameters.short_factor/long_factor", (len(short), len(long)),
                             "two lists of rotary_dim/2 numbers")
        factor = params.get("factor") or self.get("max_position_embeddings", original) / original
        attention = params.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return dict(short_factor=tuple(map(float, short)), long_factor=tuple(map(float, long)),
                    attention_factor=float(attention))

    def optional(self, key: str, default: float | None) -> float | None:
        """A number transformers reads as `config.key`: its class default where the key is absent, None
        where it is null (a feature turned off), else positive."""
        v = self.raw[key] if key in self.raw else default
        if v is not None and not v > 0:
            self.unsupported(key, v, "a positive number or null")
            return None
        return None if v is None else float(v)

    def eos(self) -> tuple[int, ...]:
        e = self.get("eos_token_id")
        if e is None:
            return ()
        return tuple(e) if isinstance(e, list | tuple) else (int(e),)


def _llama_like(r: ConfigReader, **overrides: Any) -> DecoderConfig:
    hidden = r.require("hidden_size")
    heads = r.require("num_attention_heads") or 1
    head_dim = r.get("head_dim", hidden // heads)
    partial = r.partial_rotary_factor()
    bias = bool(r.get("attention_bias", False))
    fields: dict[str, Any] = dict(
        model_type=r.model_type,
        vocab_size=r.require("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=r.require("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=r.get("num_key_value_heads", heads),
        head_dim=head_dim,
        intermediate_size=r.require("intermediate_size"),
        max_position_embeddings=r.get("max_position_embeddings", 2048),
        norm_kind="rms",
        norm_eps=float(r.get("rms_norm_eps", 1e-6)),
        position_kind="rope",
        rope=r.rope(),
        rotary_dim=0 if partial == 1.0 else int(head_dim * partial),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(r.get("mlp_bias", False)),
        mlp_kind="gated",
        activation=r.activation("hidden_act", "silu"),
        tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
        bos_token_id=r.get("bos_token_id"),
        eos_token_id=r.eos(),
        pad_token_id=r.get("pad_token_id"),
    )
    fields.update(overrides)
    return DecoderConfig(**fields)


def _map_llama(r: ConfigReader) -> DecoderConfig:
    return _llama_like(r)


def _map_mistral(r: ConfigReader) -> DecoderConfig:
    return _llama_like(r, sliding_window=r.get("sliding_window"))


def _full_attention_only(r: ConfigReader) -> None:
    layer_types = r.get("layer_types", [])
    if r.get("use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        r.unsupported("use_sliding_window", True, f"{r.model_type} with full attention in every layer")


def _map_qwen2(r: ConfigReader) -> DecoderConfig:
    _full_attention_only(r)
    return _llama_like(r, qkv_bias=True, o_bias=False)


def _map_qwen3(r: ConfigReader) -> DecoderConfig:
    _full_attention_only(r)
    return _llama_like(r, qk_norm="head")


def _map_olmo2(r: ConfigReader) -> DecoderConfig:
    return _llama_like(r, norm_position="post", qk_norm="projection")


def _map_granite(r: ConfigReader) -> DecoderConfig:
    return _llama_like(
        r,
        embedding_scale=float(r.get("embedding_multiplier", 1.0)),
        residual_scale=float(r.get("residual_multiplier", 1.0)),
        attention_scale=float(r.get("attention_multiplier", 1.0)),
        logit_divisor=float(r.get("logits_scaling", 1.0)),
    )


def _map_phi3(r: ConfigReader) -> DecoderConfig:
    return _llama_like(r, sliding_window=r.get("sliding_window"))


def _map_starcoder2(r: ConfigReader) -> DecoderConfig:
    bias = bool(r.get("use_bias", True))
    return _llama_like(r, norm_kind="layer", norm_eps=float(r.get("norm_epsilon", 1e-5)), qkv_bias=bias, o_bias=bias,
                       mlp_bias=bias, mlp_kind="plain", activation=r.activation("hidden_act", "gelu_pytorch_tanh"),
                       tie_word_embeddings=bool(r.get("tie_word_embeddings", True)),
                       sliding_window=r.get("sliding_window"))


def _experts(r: ConfigReader, count: int, width: int) -> dict[str, Any]:
    """The DecoderConfig fields of `count` routed experts of `width` each (0 experts: a dense model)."""
    k = int(r.get("num_experts_per_tok", 2))
    if count and not 0 < k <= count:
        r.unsupported("num_experts_per_tok", k, f"1 to num_experts ({count})")
    return dict(num_experts=int(count), num_experts_per_tok=k if count else 0, moe_intermediate_size=int(width))


def _map_mixtral(r: ConfigReader) -> DecoderConfig:
    # softmax over every expert, then the top k renormalised: the softmax of the top-k logits
    return _llama_like(r, sliding_window=r.get("sliding_window"),
                       **_experts(r, r.require("num_local_experts"), r.require("intermediate_size")))


def _map_qwen3_moe(r: ConfigReader) -> DecoderConfig:
    _full_attention_only(r)
    layers = int(r.require("num_hidden_layers"))
    count = r.get("num_experts", r.get("num_local_experts", 0))  # transformers 5 writes num_local_experts
    step, only = int(r.get("decoder_sparse_step", 1)), set(r.get("mlp_only_layers", []))
    if step < 1:
        r.unsupported("decoder_sparse_step", step, "1 or more")
        step = 1
    return _llama_like(r, qk_norm="head", norm_topk_prob=bool(r.get("norm_topk_prob", False)),
                       dense_layers=tuple(i for i in range(layers) if i in only or (i + 1) % step),
                       **_experts(r, count, r.get("moe_intermediate_size", 0) if count else 0))


def _map_gpt_neox(r: ConfigReader) -> DecoderConfig:
    heads = r.require("num_attention_heads") or 1
    kv = r.get("num_key_value_heads", heads)
    if kv != heads:
        r.unsupported("num_key_value_heads", kv, f"num_attention_heads ({heads}): GPT-NeoX has no grouped-query attention")
    bias = bool(r.get("attention_bias", True))
    return _llama_like(r, num_key_value_heads=heads, norm_kind="layer", norm_eps=float(r.get("layer_norm_eps", 1e-5)),
                       qkv_bias=bias, o_bias=bias, mlp_bias=True, mlp_kind="plain",
                       activation=r.activation("hidden_act", "gelu"),
                       parallel_residual=bool(r.get("use_parallel_residual", True)))


LAYER_KINDS = ("full_attention", "sliding_attention")


def _layer_types(r: ConfigReader, pattern: int) -> tuple[str, ...]:
    """`layer_types`, or transformers' default where a Gemma config has none: every `pattern`-th layer
    global, the others sliding."""
    layers = int(r.require("num_hidden_layers"))
    types = tuple(r.get("layer_types") or
                  ("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)))
    if len(types) != layers or not set(types) <= set(LAYER_KINDS):
        r.unsupported("layer_types", list(types), f"{layers} entries (one per layer), each one of {', '.join(LAYER_KINDS)}")
        return ()
    return types


def _gemma(r: ConfigReader, pattern: int, **overrides: Any) -> DecoderConfig:
    """What Gemma 2 and Gemma 3 share: (1 + w) RMSNorms before and after both sublayers (the weight map's
    offset), embeddings times sqrt(hidden_size), a gelu-tanh gated MLP, query_pre_attn_scalar, and sliding
    layers alternating with global ones. Defaults are transformers' where config.json omits a key."""
    if r.get("use_bidirectional_attention", False):
        r.unsupported("use_bidirectional_attention", True, "false (causal attention)")
    bias = bool(r.get("attention_bias", False))
    return _llama_like(
        r, head_dim=int(r.get("head_dim", 256)), norm_position="sandwich", qkv_bias=bias, o_bias=bias,
        activation=r.activation("hidden_activation", "gelu_pytorch_tanh"),
        tie_word_embeddings=bool(r.get("tie_word_embeddings", True)),
        embedding_scale=float(np.float32(r.require("hidden_size") ** 0.5)),  # transformers keeps it as float32
        attention_scale=float(r.get("query_pre_attn_scalar", 256)) ** -0.5,
        sliding_window=int(r.get("sliding_window", 4096)), layer_types=_layer_types(r, pattern), **overrides)


def _map_gemma2(r: ConfigReader) -> DecoderConfig:
    return _gemma(r, 2, attn_logit_softcap=r.optional("attn_logit_softcapping", 50.0),
                  final_logit_softcap=r.optional("final_logit_softcapping", 30.0))


def _gemma3_ropes(r: ConfigReader) -> tuple[RopeConfig, RopeConfig]:
    """Gemma 3's global and local RoPE. transformers 5 keys `rope_parameters` by layer type; 4.x wrote
    rope_theta (and rope_scaling) for the global layers and rope_local_base_freq for the sliding ones."""
    params = dict(r.get("rope_parameters") or {})
    if not set(params) <= set(LAYER_KINDS):
        r.unsupported("rope_parameters", sorted(params), f"one entry per layer type ({', '.join(LAYER_KINDS)})")
        params = {}
    full = {**(params.get("full_attention") or {}), **(r.get("rope_scaling") or {})}
    full.setdefault("rope_theta", r.get("rope_theta", 1_000_000.0))
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    local.setdefault("rope_theta", r.get("rope_local_base_freq", 10_000.0))
    return r.rope(full, "rope_parameters.full_attention"), r.rope(local, "rope_parameters.sliding_attention")


def _map_gemma3_text(r: ConfigReader) -> DecoderConfig:
    full, local = _gemma3_ropes(r)
    return _gemma(r, int(r.get("sliding_window_pattern", 6)), qk_norm="head", rope=full, rope_local=local,
                  attn_logit_softcap=r.optional("attn_logit_softcapping", None),
                  final_logit_softcap=r.optional("final_logit_softcapping", None))


def _map_gpt2(r: ConfigReader) -> DecoderConfig:
    hidden = r.require("n_embd")
    heads = r.require("n_head") or 1
    if r.get("scale_attn_by_inverse_layer_idx", False):
        r.unsupported("scale_attn_by_inverse_layer_idx", True, "false")
    if r.get("add_cross_attention", False):
        r.unsupported("add_cross_attention", True, "false (decoder-only)")
    return DecoderConfig(
        model_type=r.model_type,
        vocab_size=r.require("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=r.require("n_layer"),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=r.get("n_inner", 4 * hidden),
        max_position_embeddings=r.get("n_positions", 1024),
        norm_kind="layer",
        norm_eps=float(r.get("layer_norm_epsilon", 1e-5)),
        position_kind="learned",
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        mlp_kind="plain",
        activation=r.activation("activation_function", "gelu_new"),
        tie_word_embeddings=True,
        attention_scale=None if r.get("scale_attn_weights", True) else 1.0,
        bos_token_id=r.get("bos_token_id"),
        eos_token_id=r.eos(),
        pad_token_id=r.get("pad_token_id"),
    )


LLAMA_LAYER = layer_map(
    {
        "attn_norm": {"weight": tensor("input_layernorm.weight")},
        "attn.qkv_proj": proj("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", transform=QKV),
        "attn.o_proj": proj("self_attn.o_proj"),
        "mlp_norm": {"weight": tensor("post_attention_layernorm.weight")},
        "mlp.gate_up_proj": proj("mlp.gate_proj", "mlp.up_proj", transform=GATE_UP),
        "mlp.down_proj": proj("mlp.down_proj"),
    }
)
def model_globals(embed: str, norm: str, lm_head: str, **more: Source) -> dict[str, Source]:
    """Embedding, final norm (weight, and bias for LayerNorm) and output head."""
    return {"embed_tokens.weight": tensor(f"{embed}.weight"), **{f"norm.{k}": v for k, v in proj(norm).items()},
            "lm_head.weight": tensor(f"{lm_head}.weight"), **more}


LLAMA_GLOBALS = model_globals("model.embed_tokens", "model.norm", "lm_head")
LLAMA_WEIGHTS = WeightMap(LLAMA_GLOBALS, "model.layers.{i}.", LLAMA_LAYER, ignore_suffixes=("rotary_emb.inv_freq",))

GPT2_WEIGHTS = WeightMap(
    globals=model_globals("wte", "ln_f", "lm_head", **{"embed_positions.weight": tensor("wpe.weight")}),
    layer_prefix="h.{i}.",
    layer=layer_map(
        {
            "attn_norm": proj("ln_1"),
            "attn.qkv_proj": proj("attn.c_attn", weight=TRANSPOSE),  # Conv1D: (in, out)
            "attn.o_proj": proj("attn.c_proj", weight=TRANSPOSE),
            "mlp_norm": proj("ln_2"),
            "mlp.gate_up_proj": proj("mlp.c_fc", weight=TRANSPOSE),
            "mlp.down_proj": proj("mlp.c_proj", weight=TRANSPOSE),
        }
    ),
    prefixes=("transformer.", ""),
    ignore_suffixes=("attn.bias", "attn.masked_bias"),
)


QWEN3_WEIGHTS = WeightMap(LLAMA_GLOBALS, "model.layers.{i}.", {
    **LLAMA_LAYER,
    "attn.q_norm.weight": tensor("self_attn.q_norm.weight"),  # (head_dim,): one norm for every head
    "attn.k_norm.weight": tensor("self_attn.k_norm.weight"),
}, ignore_suffixes=("rotary_emb.inv_freq",))

OLMO2_WEIGHTS = WeightMap(LLAMA_GLOBALS, "model.layers.{i}.", {
    **{k: v for k, v in LLAMA_LAYER.items() if not k.startswith(("attn_norm.", "mlp_norm."))},
    "attn.q_norm.weight": tensor("self_attn.q_norm.weight"),  # (q_size,): over the whole projection
    "attn.k_norm.weight": tensor("self_attn.k_norm.weight"),
    "post_attn_norm.weight": tensor("post_attention_layernorm.weight"),  # after attention, before the residual add
    "post_mlp_norm.weight": tensor("post_feedforward_layernorm.weight"),
}, ignore_suffixes=("rotary_emb.inv_freq",))

PHI3_WEIGHTS = WeightMap(LLAMA_GLOBALS, "model.layers.{i}.", layer_map({
    "attn_norm": {"weight": tensor("input_layernorm.weight")},
    "attn.qkv_proj": proj("self_attn.qkv_proj"),  # already [q; k; v]
    "attn.o_proj": proj("self_attn.o_proj"),
    "mlp_norm": {"weight": tensor("post_attention_layernorm.weight")},
    "mlp.gate_up_proj": proj("mlp.gate_up_proj"),  # already [gate; up]
    "mlp.down_proj": proj("mlp.down_proj"),
}), ignore_suffixes=("rotary_emb.inv_freq",))

STARCODER2_WEIGHTS = WeightMap(LLAMA_GLOBALS, "model.layers.{i}.", layer_map({
    "attn_norm": proj("input_layernorm"),
    "attn.qkv_proj": proj("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", transform=QKV),
    "attn.o_proj": proj("self_attn.o_proj"),
    "mlp_norm": proj("post_attention_layernorm"),
    "mlp.gate_up_proj": proj("mlp.c_fc"),
    "mlp.down_proj": proj("mlp.c_proj"),
}), ignore_suffixes=("rotary_emb.inv_freq",))

# routed experts: router (E, h) and each expert's gate/up/down stacked; `{e}` is the expert's index
MIXTRAL_WEIGHTS = WeightMap(LLAMA_GLOBALS, "model.layers.{i}.", {
    **{k: v for k, v in LLAMA_LAYER.items() if not k.startswith("mlp.")},
    "mlp.router.weight": tensor("block_sparse_moe.gate.weight"),
    "mlp.gate_up": Source(("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight"),
                          EXPERT_GATE_UP),
    "mlp.down": tensor("block_sparse_moe.experts.{e}.w2.weight", EXPERT_DOWN),
}, ignore_suffixes=("rotary_emb.inv_freq",))

QWEN3_MOE_WEIGHTS = WeightMap(LLAMA_GLOBALS, "model.layers.{i}.", {
    **QWEN3_WEIGHTS.layer,  # dense layers (mlp_only_layers, decoder_sparse_step) keep Qwen3's MLP
    "mlp.router.weight": tensor("mlp.gate.weight"),
    "mlp.gate_up": Source(("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"), EXPERT_GATE_UP),
    "mlp.down": tensor("mlp.experts.{e}.down_proj.weight", EXPERT_DOWN),
}, ignore_suffixes=("rotary_emb.inv_freq",))

GPT_NEOX_WEIGHTS = WeightMap(
    globals=model_globals("gpt_neox.embed_in", "gpt_neox.final_layer_norm", "embed_out"),
    layer_prefix="gpt_neox.layers.{i}.",
    layer=layer_map({
        "attn_norm": proj("input_layernorm"),
        "attn.qkv_proj": proj("attention.query_key_value", transform=DEINTERLEAVE_HEADS),  # rows per head: q_h, k_h, v_h
        "attn.o_proj": proj("attention.dense"),
        "mlp_norm": proj("post_attention_layernorm"),
        "mlp.gate_up_proj": proj("mlp.dense_h_to_4h"),
        "mlp.down_proj": proj("mlp.dense_4h_to_h"),
    }),
    ignore_suffixes=("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias"),
)


# Gemma's RMSNorm computes x * (1 + w): the canonical norm weight is the stored one plus 1
PLUS_ONE = Offset(1.0)


def _plus_one(name: str) -> dict[str, Source]:
    return {"weight": tensor(f"{name}.weight", PLUS_ONE)}


GEMMA2_WEIGHTS = WeightMap(
    {"embed_tokens.weight": tensor("model.embed_tokens.weight"), "norm.weight": tensor("model.norm.weight", PLUS_ONE),
     "lm_head.weight": tensor("lm_head.weight")},
    "model.layers.{i}.",
    {
        **{k: v for k, v in LLAMA_LAYER.items() if not k.startswith(("attn_norm.", "mlp_norm."))},
        **layer_map({
            "attn_norm": _plus_one("input_layernorm"),
            "post_attn_norm": _plus_one("post_attention_layernorm"),
            "mlp_norm": _plus_one("pre_feedforward_layernorm"),
            "post_mlp_norm": _plus_one("post_feedforward_layernorm"),
        }),
    },
    ignore_suffixes=("rotary_emb.inv_freq",),
)

GEMMA3_WEIGHTS = WeightMap(GEMMA2_WEIGHTS.globals, "model.layers.{i}.", {
    **GEMMA2_WEIGHTS.layer,
    **layer_map({"attn.q_norm": _plus_one("self_attn.q_norm"), "attn.k_norm": _plus_one("self_attn.k_norm")}),
}, ignore_suffixes=("rotary_emb.inv_freq",))


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    hf_class: str  # transformers' causal-LM class, written to a made checkpoint's `architectures`
    map_config: Callable[[ConfigReader], DecoderConfig]
    weights: WeightMap
    notes: str = ""
    modelled: tuple[str, ...] = ()  # config keys of features elsewhere refused (_UNMODELLED) that this family computes


ARCHITECTURES: dict[str, ArchSpec] = {
    spec.model_type: spec
    for spec in (
        ArchSpec("llama", "LlamaForCausalLM", _map_llama, LLAMA_WEIGHTS, "RoPE (default, linear, llama3 scaling), GQA"),
        ArchSpec("mistral", "MistralForCausalLM", _map_mistral, LLAMA_WEIGHTS, "Llama + sliding-window attention"),
        ArchSpec("qwen2", "Qwen2ForCausalLM", _map_qwen2, LLAMA_WEIGHTS, "Llama + q/k/v bias"),
        ArchSpec("gpt2", "GPT2LMHeadModel", _map_gpt2, GPT2_WEIGHTS,
                 "learned positions, fused Conv1D c_attn, LayerNorm, GELU"),
        ArchSpec("qwen3", "Qwen3ForCausalLM", _map_qwen3, QWEN3_WEIGHTS, "Llama + per-head q/k RMSNorm before RoPE"),
        ArchSpec("olmo2", "Olmo2ForCausalLM", _map_olmo2, OLMO2_WEIGHTS,
                 "norms after attention and MLP; q/k RMSNorm over the projection"),
        ArchSpec("granite", "GraniteForCausalLM", _map_granite, LLAMA_WEIGHTS,
                 "Llama + embedding, residual, attention and logit multipliers"),
        ArchSpec("gpt_neox", "GPTNeoXForCausalLM", _map_gpt_neox, GPT_NEOX_WEIGHTS,
                 "per-head interleaved query_key_value, partial rotary, parallel residual, LayerNorm with bias"),
        ArchSpec("phi3", "Phi3ForCausalLM", _map_phi3, PHI3_WEIGHTS,
                 "fused qkv_proj and gate_up_proj, LongRoPE (short/long factors)"),
        ArchSpec("starcoder2", "Starcoder2ForCausalLM", _map_starcoder2, STARCODER2_WEIGHTS,
                 "LayerNorm with bias, GELU MLP, sliding window"),
        ArchSpec("mixtral", "MixtralForCausalLM", _map_mixtral, MIXTRAL_WEIGHTS,
                 "Mistral + top-k routed experts (softmax of the top-k logits)"),
        ArchSpec("qwen3_moe", "Qwen3MoeForCausalLM", _map_qwen3_moe, QWEN3_MOE_WEIGHTS,
                 "Qwen3 + top-k routed experts (norm_topk_prob), dense mlp_only_layers / decoder_sparse_step"),
        ArchSpec("gemma2", "Gemma2ForCausalLM", _map_gemma2, GEMMA2_WEIGHTS,
                 "(1 + w) RMSNorms before and after attention and MLP, scaled embeddings, gelu-tanh, attention and "
                 "final logit softcapping, sliding layers alternating with global ones",
                 modelled=("attn_logit_softcapping", "final_logit_softcapping", "layer_types")),
        ArchSpec("gemma3_text", "Gemma3ForCausalLM", _map_gemma3_text, GEMMA3_WEIGHTS,
                 "Gemma 2 + (1 + w) per-head q/k norms, the sliding layers' own RoPE base (5 sliding : 1 global), "
                 "no softcapping by default",
                 modelled=("attn_logit_softcapping", "final_logit_softcapping", "layer_types", "rope_parameters")),
    )
}


def get_arch(model_type: str) -> ArchSpec:
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"model_type {model_type!r} is not supported. Supported: {', '.join(sorted(ARCHITECTURES))}. "
            "To add a family, add an ArchSpec entry to kvexport/architectures.py (see docs/adding-an-architecture.md)."
        ) from None


def config_problems(raw: Mapping[str, Any]) -> tuple[DecoderConfig | None, list[str]]:
    """Map an HF config dict to a DecoderConfig and list every problem found (empty = supported)."""
    model_type = raw.get("model_type")
    if model_type is None:
        return None, ["config.json has no `model_type`; it is not a Hugging Face transformer config"]
    if model_type not in ARCHITECTURES:
        try:
            get_arch(model_type)
        except UnsupportedArchitectureError as e:
            return None, [str(e)]
    r = ConfigReader(model_type, raw)
    cfg = ARCHITECTURES[model_type].map_config(r)
    experts = ("num_local_experts", "num_experts") if cfg.num_experts else ()
    unmodelled = _unmodelled_features(raw, modelled=ARCHITECTURES[model_type].modelled + experts)
    if r.missing:  # checks derived from a missing field would judge its placeholder, not the checkpoint
        return cfg, r.problems + unmodelled
    if cfg.num_attention_heads and cfg.num_key_value_heads and cfg.num_attention_heads % cfg.num_key_value_heads:
        r.problems.append(
            f"num_attention_heads={cfg.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={cfg.num_key_value_heads}"
        )
    if cfg.effective_rotary_dim % 2:
        r.problems.append(f"rotary dimension {cfg.effective_rotary_dim} must be even")
    if cfg.rope.type == "longrope" and len(cfg.rope.short_factor) != cfg.effective_rotary_dim // 2:
        r.problems.append(f"`rope_parameters`: longrope has {len(cfg.rope.short_factor)} short/long factors but the "
                          f"rotary dimension {cfg.effective_rotary_dim} has {cfg.effective_rotary_dim // 2} "
                          "frequencies (supported: one factor per frequency)")
    return cfg, r.problems + unmodelled


# Config keys whose non-default value changes what the model computes in a way no family here models.
_UNMODELLED: dict[str, str] = {
    "attn_logit_softcapping": "attention logit softcapping",
    "final_logit_softcapping": "final logit softcapping",
    "num_local_experts": "mixture-of-experts layers",
    "num_experts": "mixture-of-experts layers",
}


def _unmodelled_features(raw: Mapping[str, Any], modelled: tuple[str, ...] = ()) -> list[str]:
    """Features any family's config may carry that the decoder does not compute (less the `modelled` keys of
    this family): named, not ignored."""
    found = [f"`{k}` = {raw[k]!r}: {what} is not supported" for k, what in _UNMODELLED.items()
             if raw.get(k) and k not in modelled]
    kinds = sorted(set(raw.get("layer_types") or ()))
    if len(kinds) > 1 and "layer_types" not in modelled:
        found.append(f"`layer_types` mixes {', '.join(kinds)}: layers with different attention kinds are not "
                     "supported (every layer must use the same kind)")
    params = raw.get("rope_parameters") or {}
    if (isinstance(params, Mapping) and params and all(isinstance(v, Mapping) for v in params.values())
            and "rope_parameters" not in modelled):
        found.append(f"`rope_parameters` per layer kind ({', '.join(sorted(params))}): one RoPE for every "
                     "layer is supported")
    return found


def map_config(raw: Mapping[str, Any]) -> DecoderConfig:
    """Map an HF config dict, raising a typed error that lists every problem."""
    model_type = raw.get("model_type")
    if model_type is not None and model_type not in ARCHITECTURES:
        get_arch(model_type)
    cfg, problems = config_problems(raw)
    if problems or cfg is None:
        raise UnsupportedFeatureError(
            "the checkpoint uses features kvexport does not support:\n  - "
            + "\n  - ".join(problems)
            + "\nRun `kvexport export MODEL_DIR --check` to list every problem; see docs/adding-an-architecture.md."
        )
    return cfg
