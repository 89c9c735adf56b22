"""The owned canonical decoder: embedding -> N blocks (norm, attention, MLP) -> norm -> lm_head.

Every family is this module with different `DecoderConfig` data. Two op flavours:
`onnx_ops=True` emits the ONNX-native ops the IR contract names (RotaryEmbedding, TensorScatter,
Attention); `onnx_ops=False` is plain torch (for eager use and torch.export/AOTInductor).
Both compute the same function; tests hold them to each other and to `transformers`.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
import torch.onnx.ops as onnx_ops
from torch import Tensor, nn

from kvexport.config import DecoderConfig

CacheStyle = Literal["static", "concat"]


# --- cache write --------------------------------------------------------------------------
def scatter_rows(cache: Tensor, update: Tensor, write_index: Tensor) -> Tensor:
    """Functional cache write: rows write_index[b] .. write_index[b]+S of `cache` := update.

    cache (B, H_kv, L, D), update (B, H_kv, S, D), write_index (B,) -> (B, H_kv, L, D)
    """
    B, H, S, D = update.shape
    idx = write_index[:, None] + torch.arange(S, device=update.device)[None, :]  # (B, S)
    idx = idx[:, None, :, None].expand(B, H, S, D)  # (B, H_kv, S, D)
    return cache.scatter(2, idx, update)


def write_rows_inplace(cache: Tensor, update: Tensor, write_index: Tensor) -> Tensor:
    """The same write, into `cache` itself (returned): cache[b, :, write_index[b] + s] = update[b, :, s].

    torch.export traces it as index_put on the graph input, which AOTInductor keeps in place
    (the functional scatter compiles to whole-cache copies). Selected by Decoder(inplace_cache=True).
    """
    B, H, S, D = update.shape
    rows = write_index[:, None] + torch.arange(S, device=update.device)[None, :]  # (B, S)
    batch = torch.arange(B, device=update.device)[:, None]  # (B, 1)
    cache[batch, :, rows] = update.transpose(1, 2)  # the indexed view is (B, S, H_kv, D)
    return cache


@torch.library.custom_op("kvexport::tensor_scatter", mutates_args=())
def tensor_scatter(cache: Tensor, update: Tensor, write_index: Tensor) -> Tensor:
    """Emitted as ONNX TensorScatter-24 (mode=linear, axis=-2) by kvexport.export."""
    return scatter_rows(cache, update, write_index)


@tensor_scatter.register_fake
def _tensor_scatter_fake(cache: Tensor, update: Tensor, write_index: Tensor) -> Tensor:
    return torch.empty_like(cache)


# --- rotary ---------------------------------------------------------------------------------
def rope_inv_freq(cfg: DecoderConfig) -> Tensor:
    """Inverse frequencies (rot/2,) in float64, with the config's scaling applied."""
    rot = cfg.effective_rotary_dim
    rope = cfg.rope
    inv = 1.0 / (rope.theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    if rope.type == "linear":
        inv = inv / rope.factor
    elif rope.type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rope_tables(cfg: DecoderConfig, max_seq: int) -> tuple[Tensor, Tensor]:
    """cos, sin tables (max_seq, rot/2), float32: the 2-D form RotaryEmbedding-23 takes."""
    freqs = torch.outer(torch.arange(max_seq, dtype=torch.float64), rope_inv_freq(cfg))
    return freqs.cos().float(), freqs.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor, num_heads: int, rot: int) -> Tensor:
    """Non-interleaved (rotate-half) RoPE on x (B, S, H*D) -> (B, S, H*D), plain torch."""
    B, S, _ = x.shape
    x = x.view(B, S, num_heads, -1)  # (B, S, H, D)
    c = cos[position_ids][:, :, None, :]  # (B, S, 1, rot/2)
    s = sin[position_ids][:, :, None, :]
    half = rot // 2
    x1, x2, rest = x[..., :half], x[..., half:rot], x[..., rot:]
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)
    return out.reshape(B, S, -1)


# --- modules --------------------------------------------------------------------------------
class Norm(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.kind, self.eps = cfg.norm_kind, cfg.norm_eps
        self.weight = nn.Parameter(torch.ones(cfg.hidden_size))
        self.bias = nn.Parameter(torch.zeros(cfg.hidden_size)) if cfg.norm_kind == "layer" else None

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "rms":
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


ACTIVATION_FNS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class Mlp(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gated = cfg.mlp_kind == "gated"
        width = cfg.intermediate_size * (2 if self.gated else 1)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)  # gate rows first
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACTIVATION_FNS[cfg.activation]

    def forward(self, x: Tensor) -> Tensor:
        h = self.gate_up_proj(x)  # (B, S, 2I) or (B, S, I)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return self.down_proj(h)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, owner: Decoder):
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self._owner = [owner]  # list: not a submodule, just a back-reference for the mode flags

    def forward(
        self, x: Tensor, position_ids: Tensor, write_index: Tensor | None, mask: Tensor, past_k: Tensor, past_v: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        cfg, owner = self.cfg, self._owner[0]
        Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        q, k, v = self.project(x, position_ids)
        if owner.cache_style == "static":
            assert write_index is not None
            write = tensor_scatter if owner.onnx_ops else write_rows_inplace if owner.inplace_cache else scatter_rows
            k_all = write(past_k, k, write_index)  # (B, H_kv, L, D): the whole cache
            v_all = write(past_v, v, write_index)
            if owner.onnx_ops:
                y = onnx_ops.attention(q, k_all, v_all, mask, q_num_heads=Hq, kv_num_heads=Hkv, scale=cfg.scale)[0]
            else:
                y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=cfg.scale, enable_gqa=True)
        elif owner.onnx_ops:
            # concat style through Attention's own past/present: (B, H_kv, P, D) -> (B, H_kv, P+S, D)
            y, k_all, v_all, _ = onnx_ops.attention(
                q, k, v, mask, past_k, past_v, q_num_heads=Hq, kv_num_heads=Hkv, scale=cfg.scale
            )
        else:
            k_all = torch.cat([past_k, k], dim=2)  # (B, H_kv, P+S, D)
            v_all = torch.cat([past_v, v], dim=2)
            y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=cfg.scale, enable_gqa=True)
        return self.output(y), k_all, v_all

    def project(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, S, hidden) -> q (B, H_q, S, D), k and v (B, H_kv, S, D), RoPE applied."""
        cfg, owner = self.cfg, self._owner[0]
        B, S, _ = x.shape
        Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, k, v = self.qkv_proj(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)  # (B, S, H*D)
        if cfg.position_kind == "rope":
            rot = cfg.effective_rotary_dim
            if owner.onnx_ops:
                rot_attr = 0 if rot == D else rot
                q = onnx_ops.rotary_embedding(q, owner.rope_cos, owner.rope_sin, position_ids, num_heads=Hq, rotary_embedding_dim=rot_attr)
                k = onnx_ops.rotary_embedding(k, owner.rope_cos, owner.rope_sin, position_ids, num_heads=Hkv, rotary_embedding_dim=rot_attr)
            else:
                q = apply_rope(q, owner.rope_cos, owner.rope_sin, position_ids, Hq, rot)
                k = apply_rope(k, owner.rope_cos, owner.rope_sin, position_ids, Hkv, rot)
        q = q.view(B, S, Hq, D).transpose(1, 2)  # (B, H_q, S, D)
        k = k.view(B, S, Hkv, D).transpose(1, 2)  # (B, H_kv, S, D)
        v = v.view(B, S, Hkv, D).transpose(1, 2)  # (B, H_kv, S, D)
        return q, k, v

    def output(self, y: Tensor) -> Tensor:
        """Attention result y (B, H_q, S, D) -> o_proj of (B, S, H_q*D)."""
        B, H, S, D = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, S, H * D))


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig, owner: Decoder):
        super().__init__()
        self.parallel = cfg.parallel_residual
        self.attn_norm = Norm(cfg)
        self.attn = Attention(cfg, owner)
        self.mlp_norm = Norm(cfg)
        self.mlp = Mlp(cfg)

    def forward(self, x: Tensor, position_ids: Tensor, write_index: Tensor | None, mask: Tensor, past_k: Tensor, past_v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        a, k, v = self.attn(self.attn_norm(x), position_ids, write_index, mask, past_k, past_v)
        return self.combine(x, a), k, v

    def combine(self, x: Tensor, a: Tensor) -> Tensor:
        """The residual stream after this block, given its attention output `a`."""
        if self.parallel:
            return x + a + self.mlp(self.mlp_norm(x))
        h = x + a
        return h + self.mlp(self.mlp_norm(h))


class Decoder(nn.Module):
    """forward(input_ids, position_ids, write_index, attention_mask, *past) -> (logits, *present).

    Static style: past/present are (B, H_kv, cache_len, D) and write_index (B,) says where the
    new rows go; the concat style drops write_index and grows the cache by S each call.
    past/present alternate key, value per layer.
    """

    def __init__(
        self,
        cfg: DecoderConfig,
        max_seq: int,
        *,
        cache_style: CacheStyle = "static",
        last_token_only: bool = False,
        onnx_ops: bool = False,
        inplace_cache: bool = False,
    ):
        super().__init__()
        self.cfg, self.max_seq = cfg, max_seq
        self.cache_style, self.last_token_only, self.onnx_ops = cache_style, last_token_only, onnx_ops
        self.inplace_cache = inplace_cache  # static torch path: mutate past instead of returning new tensors
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if cfg.position_kind == "learned":
            self.embed_positions = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        else:
            cos, sin = rope_tables(cfg, max_seq)
            self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq, rot/2)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.layers = nn.ModuleList(Block(cfg, self) for _ in range(cfg.num_hidden_layers))
        self.norm = Norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def cache_shape(self, batch: int, cache_len: int) -> tuple[int, int, int, int]:
        return (batch, self.cfg.num_key_value_heads, cache_len, self.cfg.head_dim)  # BHSD

    def forward(self, input_ids: Tensor, position_ids: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        if self.cache_style == "static":
            write_index, mask, past = rest[0], rest[1], rest[2:]
        else:
            write_index, mask, past = None, rest[0], rest[1:]
        x = self.embed(input_ids, position_ids)
        presents: list[Tensor] = []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, position_ids, write_index, mask, past[2 * i], past[2 * i + 1])
            presents += [k, v]
        return (self.head(x), *presents)

    def embed(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """(B, S) ids -> (B, S, hidden) residual stream entering the first block."""
        cfg = self.cfg
        x = self.embed_tokens(input_ids)  # (B, S, hidden)
        if cfg.embedding_scale is not None:
            x = x * cfg.embedding_scale
        if cfg.position_kind == "learned":
            x = x + self.embed_positions(position_ids)
        return x

    def head(self, x: Tensor) -> Tensor:
        """Final norm and lm_head: (B, S, hidden) -> logits (B, S or 1, vocab)."""
        cfg = self.cfg
        x = self.norm(x)
        if self.last_token_only:
            x = x[:, -1:, :]  # (B, 1, hidden)
        logits = self.lm_head(x)
        if cfg.final_logit_softcap is not None:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
        return logits
