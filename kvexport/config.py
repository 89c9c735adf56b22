"""The canonical decoder's configuration: every family is expressed as one of these."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

NormKind = Literal["rms", "layer"]
PositionKind = Literal["rope", "learned"]
MlpKind = Literal["gated", "plain"]
Activation = Literal["silu", "gelu", "gelu_tanh", "relu"]
RopeType = Literal["default", "linear", "llama3", "longrope"]
# pre: x + f(norm(x)) (Llama); post: x + norm(f(x)) (OLMo 2); sandwich: x + norm(f(norm(x))) (Gemma 2 and 3)
NormPosition = Literal["pre", "post", "sandwich"]
QKNorm = Literal["none", "head", "projection"]  # RMSNorm of q and k: per head (Qwen3) or whole projection (OLMo 2)


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: RopeType = "default"
    factor: float = 1.0
    # llama3 scaling
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope (Phi-3): per-frequency divisors below / from original_max_position_embeddings, and
    # the factor cos and sin are multiplied by
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class DecoderConfig:
    """Field names follow Hugging Face where one exists (`num_key_value_heads`, `head_dim`)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_kind: NormKind = "rms"
    norm_eps: float = 1e-6
    norm_position: NormPosition = "pre"
    qk_norm: QKNorm = "none"
    position_kind: PositionKind = "rope"
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_local: RopeConfig | None = None  # the sliding layers' own RoPE (Gemma 3); None: `rope` in every layer
    rotary_dim: int = 0  # 0 means the whole head_dim
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    mlp_kind: MlpKind = "gated"
    activation: Activation = "silu"
    tie_word_embeddings: bool = False
    parallel_residual: bool = False
    sliding_window: int | None = None
    # per layer, transformers' names ("full_attention" / "sliding_attention"); empty: every layer alike
    # (all sliding where sliding_window is set: Mistral, Starcoder2)
    layer_types: tuple[str, ...] = ()
    embedding_scale: float | None = None  # embeddings times this (Granite's embedding_multiplier)
    residual_scale: float | None = None  # each block's branch times this before the residual add (Granite)
    logit_divisor: float | None = None  # logits divided by this (Granite's logits_scaling)
    attention_scale: float | None = None  # None: 1/sqrt(head_dim)
    attn_logit_softcap: float | None = None  # attention scores -> c * tanh(scores / c) before the mask (Gemma 2)
    final_logit_softcap: float | None = None  # logits -> c * tanh(logits / c) (Gemma 2)
    # mixture of experts (Mixtral, Qwen3-MoE); 0 experts: every layer has the dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top k
    moe_intermediate_size: int = 0  # each expert's width (intermediate_size stays the dense layers')
    norm_topk_prob: bool = True  # the top-k probabilities renormalised to sum to 1 (Mixtral always)
    dense_layers: tuple[int, ...] = ()  # layers with the dense MLP in a MoE model (Qwen3-MoE's mlp_only_layers)
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def effective_rotary_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def window_of(self, index: int) -> int | None:
        """Layer `index`'s sliding attention window (a key at most window - 1 positions behind the query
        is seen), or None where it attends to the whole past."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[index] != "sliding_attention":
            return None
        return self.sliding_window

    def rope_of(self, index: int) -> RopeConfig:
        """Layer `index`'s RoPE: `rope_local` in a sliding layer where the model has one, else `rope`."""
        sliding = bool(self.layer_types) and self.layer_types[index] == "sliding_attention"
        return self.rope_local if self.rope_local is not None and sliding else self.rope

    def is_moe_layer(self, index: int) -> bool:
        return self.num_experts > 0 and index not in self.dense_layers

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_id"] = list(self.eos_token_id)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DecoderConfig:
        d = dict(d)
        d["rope"] = _rope_from(d.get("rope", {}))
        if d.get("rope_local") is not None:
            d["rope_local"] = _rope_from(d["rope_local"])
        d["eos_token_id"] = tuple(d.get("eos_token_id", ()))
        d["dense_layers"] = tuple(d.get("dense_layers", ()))
        d["layer_types"] = tuple(d.get("layer_types", ()))
        return cls(**d)

    def num_parameters(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        mlp = (3 if self.mlp_kind == "gated" else 2) * h * i
        moe = self.num_experts * (3 * h * self.moe_intermediate_size + h)  # experts and router
        mlps = sum(moe if self.is_moe_layer(n) else mlp for n in range(self.num_hidden_layers))
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        if self.position_kind == "learned":
            emb += self.max_position_embeddings * h
        return self.num_hidden_layers * attn + mlps + emb


def _rope_from(d: dict[str, Any]) -> RopeConfig:
    rope = dict(d)
    for k in ("short_factor", "long_factor"):
        rope[k] = tuple(rope.get(k, ()))
    return RopeConfig(**rope)
