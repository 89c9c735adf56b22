"""The architecture table: Hugging Face `model_type` -> config mapping + weight-name map.

Adding a family is adding an entry here (and its tiny config in `kvexport/zoo.py`'s TINY_CONFIGS; see docs/adding-an-architecture.md), never a
branch elsewhere. Canonical tensor names are those of `kvexport.decoder.Decoder`.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvexport.config import Activation, DecoderConfig, RopeConfig
from kvexport.errors import UnsupportedArchitectureError, UnsupportedFeatureError
from kvexport.weightmap import GATE_UP, QKV, TRANSPOSE, WeightMap, layer_map, proj, tensor

ACTIVATIONS: dict[str, Activation] = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}
ROPE_TYPES = ("default", "linear", "llama3")


class ConfigReader:
    """Reads an HF config dict and collects every problem instead of stopping at the first."""

    def __init__(self, model_type: str, raw: Mapping[str, Any]):
        self.model_type = model_type
        self.raw = raw
        self.problems: list[str] = []

    def get(self, key: str, default: Any = None) -> Any:
        v = self.raw.get(key, default)
        return default if v is None else v

    def require(self, key: str) -> Any:
        if self.raw.get(key) is None:
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

    def rope(self) -> RopeConfig:
        # transformers >= 5 writes `rope_parameters`; 4.x wrote `rope_theta` + `rope_scaling`.
        params = dict(self.get("rope_parameters", {}) or {})
        if not params:
            params = dict(self.get("rope_scaling", {}) or {})
            params.setdefault("rope_theta", self.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            self.unsupported("rope_parameters.rope_type", rope_type, ", ".join(ROPE_TYPES))
            rope_type = "default"
        return RopeConfig(
            theta=float(params.get("rope_theta", 10000.0)),
            type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        )

    def eos(self) -> tuple[int, ...]:
        e = self.get("eos_token_id")
        if e is None:
            return ()
        return tuple(e) if isinstance(e, list | tuple) else (int(e),)


def _llama_like(r: ConfigReader, **overrides: Any) -> DecoderConfig:
    hidden = r.require("hidden_size")
    heads = r.require("num_attention_heads") or 1
    head_dim = r.get("head_dim", hidden // heads)
    partial = float(r.get("partial_rotary_factor", 1.0))
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


def _map_qwen2(r: ConfigReader) -> DecoderConfig:
    layer_types = r.get("layer_types", [])
    if r.get("use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        r.unsupported("use_sliding_window", True, "Qwen2 with full attention in every layer")
    return _llama_like(r, qkv_bias=True, o_bias=False)


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
LLAMA_GLOBALS = {
    "embed_tokens.weight": tensor("model.embed_tokens.weight"),
    "norm.weight": tensor("model.norm.weight"),
    "norm.bias": tensor("model.norm.bias"),
    "lm_head.weight": tensor("lm_head.weight"),
}
LLAMA_WEIGHTS = WeightMap(LLAMA_GLOBALS, "model.layers.{i}.", LLAMA_LAYER, ignore_suffixes=("rotary_emb.inv_freq",))

GPT2_WEIGHTS = WeightMap(
    globals={
        "embed_tokens.weight": tensor("wte.weight"),
        "embed_positions.weight": tensor("wpe.weight"),
        "norm.weight": tensor("ln_f.weight"),
        "norm.bias": tensor("ln_f.bias"),
        "lm_head.weight": tensor("lm_head.weight"),
    },
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


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    map_config: Callable[[ConfigReader], DecoderConfig]
    weights: WeightMap
    notes: str = ""


ARCHITECTURES: dict[str, ArchSpec] = {
    spec.model_type: spec
    for spec in (
        ArchSpec("llama", _map_llama, LLAMA_WEIGHTS, "RoPE (default, linear, llama3 scaling), GQA"),
        ArchSpec("mistral", _map_mistral, LLAMA_WEIGHTS, "Llama + sliding-window attention"),
        ArchSpec("qwen2", _map_qwen2, LLAMA_WEIGHTS, "Llama + q/k/v bias"),
        ArchSpec("gpt2", _map_gpt2, GPT2_WEIGHTS, "learned positions, fused Conv1D c_attn, LayerNorm, GELU"),
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
    if cfg.num_attention_heads and cfg.num_key_value_heads and cfg.num_attention_heads % cfg.num_key_value_heads:
        r.problems.append(
            f"num_attention_heads={cfg.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={cfg.num_key_value_heads}"
        )
    if cfg.effective_rotary_dim % 2:
        r.problems.append(f"rotary dimension {cfg.effective_rotary_dim} must be even")
    return cfg, r.problems


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
