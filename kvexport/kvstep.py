"""How a decoder layer applies RoPE, writes its cache and attends: the `KVStep` strategies.

The decoder (kvexport.decoder) hands every layer one strategy object: static ONNX ops
(RotaryEmbedding, TensorScatter, Attention: what the IR contract names), static torch, static
torch in place (AOTInductor), and concat in either op set; the static ones also keep a sliding
layer's cache as a ring of its window. All compute the same function; tests hold them to each
other and to `transformers`. Also here: the cache writes they use and the RoPE tables.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import ClassVar, Literal, NamedTuple

import torch
import torch.nn.functional as F
import torch.onnx.ops as onnx_ops
from torch import Tensor

from kvexport.config import DecoderConfig, RopeConfig


CacheStyle = Literal["static", "concat"]


# --- cache write --------------------------------------------------------------------------
def _write_rows(cache: Tensor, write_index: Tensor, S: int, circular: bool) -> Tensor:
    """(B, S) cache slots that S new rows go to: write_index[b] + s, modulo the cache's slots on a ring."""
    rows = write_index[:, None] + torch.arange(S, device=write_index.device)[None, :]
    return rows % cache.shape[2] if circular else rows


def scatter_rows(cache: Tensor, update: Tensor, write_index: Tensor, *, circular: bool = False) -> Tensor:
    """Functional cache write: rows write_index[b] .. write_index[b]+S of `cache` := update; `circular`
    takes them modulo the cache's slots (a sliding layer's ring; S must not exceed its slots).

    cache (B, H_kv, L, D), update (B, H_kv, S, D), write_index (B,) -> (B, H_kv, L, D)
    """
    B, H, S, D = update.shape
    idx = _write_rows(cache, write_index, S, circular)  # (B, S)
    idx = idx[:, None, :, None].expand(B, H, S, D)  # (B, H_kv, S, D)
    return cache.scatter(2, idx, update)


def write_rows_inplace(cache: Tensor, update: Tensor, write_index: Tensor, *, circular: bool = False) -> Tensor:
    """The same write, into `cache` itself (returned): cache[b, :, write_index[b] + s] = update[b, :, s].

    torch.export traces it as index_put on the graph input, which AOTInductor keeps in place
    (the functional scatter compiles to whole-cache copies). The IN_PLACE strategy.
    """
    B, H, S, D = update.shape
    rows = _write_rows(cache, write_index, S, circular)  # (B, S)
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


@torch.library.custom_op("kvexport::ring_scatter", mutates_args=())
def ring_scatter(cache: Tensor, update: Tensor, write_index: Tensor) -> Tensor:
    """Emitted as ONNX TensorScatter-24 (mode=circular, axis=-2) by kvexport.export: a ring's write."""
    return scatter_rows(cache, update, write_index, circular=True)


ring_scatter.register_fake(_tensor_scatter_fake)


# --- rotary ---------------------------------------------------------------------------------
def rope_inv_freq(cfg: DecoderConfig, *, long: bool = False, rope: RopeConfig | None = None) -> Tensor:
    """Inverse frequencies (rot/2,) in float64 of `rope` (default: cfg.rope), with its scaling applied.

    longrope divides them by its short factors, or by its long ones where `long` (positions from
    original_max_position_embeddings on)."""
    rot = cfg.effective_rotary_dim
    rope = rope or cfg.rope
    inv = 1.0 / (rope.theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    if rope.type == "linear":
        inv = inv / rope.factor
    elif rope.type == "longrope":
        inv = inv / torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float64)
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


def rope_tables(cfg: DecoderConfig, max_seq: int, rope: RopeConfig | None = None) -> tuple[Tensor, Tensor]:
    """cos, sin tables (max_seq, rot/2) of `rope` (default: cfg.rope), float32: the 2-D form RotaryEmbedding-23 takes.

    Each row is its position's angles. longrope's rows from original_max_position_embeddings on use
    the long factors, which is what transformers applies to a token at that position when it
    decodes with a cache (its uncached forward of a longer text switches every row)."""
    rope = rope or cfg.rope
    pos = torch.arange(max_seq, dtype=torch.float64)[:, None]  # (max_seq, 1)
    inv = rope_inv_freq(cfg, rope=rope)[None, :]  # (1, rot/2)
    if rope.type == "longrope":
        long = pos >= rope.original_max_position_embeddings
        inv = torch.where(long, rope_inv_freq(cfg, long=True, rope=rope)[None, :], inv)  # (max_seq, rot/2)
    freqs = pos * inv
    a = rope.attention_factor
    return (freqs.cos() * a).float(), (freqs.sin() * a).float()


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


# --- how a layer writes its cache and attends: one strategy, handed to every layer -----------------
class Step(NamedTuple):
    """What the layers of one forward call share. `Decoder.decode` hands a sliding-window layer a copy
    whose mask is banded to its window (`KVStep.window_mask`) and whose `window` says which."""

    position_ids: Tensor  # (B, S) absolute positions
    write_index: Tensor | None  # (B,) first cache slot written (static styles); None for concat
    mask: Tensor  # (B, 1, S, cache_len) static, (B, 1, S, P+S) concat; True (additive: 0) = attend
    cos: Tensor | None  # (max_seq, rot/2) rope tables; None for learned positions
    sin: Tensor | None
    kv: KVStep
    window: int | None = None  # this layer's sliding window, already in `mask`; None: the whole past
    # sliding layers on a ring (Decoder.ring_layers): their mask (B, 1, S, R+S) over the ring's R slots and the S
    # new rows; a ring layer's own copy has it as `mask` and `ring` True
    ring_mask: Tensor | None = None
    ring: bool = False


class KVStep:
    """How a layer applies RoPE, writes its cache and attends. Subclasses fix the op set and cache style."""

    style: ClassVar[CacheStyle]
    keeps_rings: ClassVar[bool] = False  # implements attend_ring: Decoder.ring_layers may put sliding layers on rings

    def split(self, inputs: tuple[Tensor, ...]) -> tuple[Tensor | None, Tensor, tuple[Tensor, ...]]:
        """The decoder's inputs after position_ids -> (write_index or None, mask, past caches)."""
        raise NotImplementedError

    def rope(self, x: Tensor, step: Step, num_heads: int, rot: int) -> Tensor:
        """x (B, S, H*D) -> the same with RoPE on the first `rot` dims of every head."""
        raise NotImplementedError

    def attend(self, q: Tensor, k: Tensor, v: Tensor, step: Step, past_k: Tensor, past_v: Tensor,
               cfg: DecoderConfig) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, H_q, S, D), new k/v (B, H_kv, S, D) -> y (B, H_q, S, D) and the layer's present k, v."""
        raise NotImplementedError

    def attend_ring(self, q: Tensor, k: Tensor, v: Tensor, step: Step, past_k: Tensor, past_v: Tensor,
                    cfg: DecoderConfig) -> tuple[Tensor, Tensor, Tensor]:
        """`attend` for a sliding layer whose cache is a ring of its window's slots (static styles)."""
        raise NotImplementedError(f"the {self.style} cache keeps no ring")

    def window_mask(self, step: Step, window: int) -> Tensor:
        """step.mask narrowed to what a layer with a `window`-token sliding window sees."""
        return window_band(step.mask, step.write_index, step.position_ids.shape[1], window)


def window_band(mask: Tensor, write_index: Tensor | None, seq: int, window: int) -> Tensor:
    """`mask` (B, 1, S, L) and keys at cache slot j < window slots behind the query's slot.

    A new token's slot is write_index[b] + s (static) or P + s with P = L - S past rows (concat), and every
    real token's slot is its row's offset plus its position, so the slot difference is the position
    difference. Plain ops (Range, Sub, Less, And), so each backend runs the band in its own graph and the
    runtime's mask carries causality and padding only."""
    L = mask.shape[-1]
    s = torch.arange(seq, device=mask.device)
    q = s[None, :] + (write_index[:, None] if write_index is not None else L - seq)  # (B or 1, S) query slots
    band = (q[:, None, :, None] - torch.arange(L, device=mask.device)) < window  # (B or 1, 1, S, L)
    if mask.dtype == torch.bool:
        return mask & band
    return torch.where(band, mask, -1e30)  # an additive float mask: -1e30, finite in f32 and bf16


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, cfg: DecoderConfig) -> Tensor:
    if cfg.attn_logit_softcap is not None:
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        return softcapped_attention(q, k, v, mask, cfg.scale, cfg.attn_logit_softcap, group)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=cfg.scale, enable_gqa=True)


def softcapped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, cap: float,
                         group: int) -> Tensor:
    """Attention whose scores are capped before the mask: cap * tanh(q.k * scale / cap) (Gemma 2), the
    matmul-softmax form, as torch's SDPA has no softcap. q (B, H_q, S, D); k, v (B, H_kv, L, D), each K/V
    head serving `group` = H_q / H_kv query heads; mask bool (True = attend) or additive -> (B, H_q, S, D)."""
    B, H, S, D = q.shape
    # each K/V head broadcast over its `group` query heads: a repeated (B, H_q, L, D) copy (repeat_interleave) or
    # `group * S` rows as one matrix (views over S) give torch.export guards on a ring's dynamic L = R + S that it
    # cannot prove, and the export of a ring model fails
    if group > 1:
        q = q.view(B, H // group, group, S, D)
        k, v, mask = k[:, :, None], v[:, :, None], mask[:, :, None]  # (B, H_kv, 1, L, D); mask (B, 1, 1, S, L)
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / cap) * cap  # (B, H_kv, group, S, L)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask
    out = torch.matmul(scores.softmax(dim=-1), v)
    return out.reshape(B, H, S, v.shape[-1]) if group > 1 else out


class _Static(KVStep):
    style = "static"
    keeps_rings = True
    ring_write: Callable[[Tensor, Tensor, Tensor], Tensor]

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, cfg: DecoderConfig) -> Tensor:
        """Grouped-query attention of q (B, H_q, S, D) over k, v (B, H_kv, N, D) under mask (B, 1, S, N)."""
        raise NotImplementedError

    def attend_ring(self, q: Tensor, k: Tensor, v: Tensor, step: Step, past_k: Tensor, past_v: Tensor,
                    cfg: DecoderConfig) -> tuple[Tensor, Tensor, Tensor]:
        """The ring (B, H_kv, R, D) as it stands, then the S new rows: attend over those R + S keys (step.mask
        says which ring slots hold a token inside the window), then write the new rows at write_index modulo R.
        The write takes its rows from the concatenation, so it runs after the ring was read: an in-place write
        going first would overwrite rows that the earlier tokens of a chunk still see."""
        R = past_k.shape[2]
        k_all, v_all = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)  # (B, H_kv, R+S, D)
        y = self.attention(q, k_all, v_all, step.mask, cfg)
        return (y, self.ring_write(past_k, k_all[:, :, R:], step.write_index),
                self.ring_write(past_v, v_all[:, :, R:], step.write_index))

    def split(self, inputs: tuple[Tensor, ...]) -> tuple[Tensor | None, Tensor, tuple[Tensor, ...]]:
        return inputs[0], inputs[1], inputs[2:]


class _Concat(KVStep):
    style = "concat"

    def split(self, inputs: tuple[Tensor, ...]) -> tuple[Tensor | None, Tensor, tuple[Tensor, ...]]:
        return None, inputs[0], inputs[1:]


class _TorchRope(KVStep):
    def rope(self, x: Tensor, step: Step, num_heads: int, rot: int) -> Tensor:
        return apply_rope(x, step.cos, step.sin, step.position_ids, num_heads, rot)  # type: ignore[arg-type]


class _OnnxRope(KVStep):
    def rope(self, x: Tensor, step: Step, num_heads: int, rot: int) -> Tensor:
        rot_attr = 0 if rot * num_heads == x.shape[-1] else rot  # 0: the whole head
        return onnx_ops.rotary_embedding(x, step.cos, step.sin, step.position_ids, num_heads=num_heads,
                                         rotary_embedding_dim=rot_attr)


class StaticTorch(_Static, _TorchRope):
    """Functional scatter into the whole preallocated cache, then SDPA over it (eager, torch.export)."""

    write = staticmethod(scatter_rows)
    ring_write = staticmethod(functools.partial(scatter_rows, circular=True))

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, cfg: DecoderConfig) -> Tensor:
        return _sdpa(q, k, v, mask, cfg)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, step: Step, past_k: Tensor, past_v: Tensor,
               cfg: DecoderConfig) -> tuple[Tensor, Tensor, Tensor]:
        k_all = self.write(past_k, k, step.write_index)  # (B, H_kv, L, D): the whole cache
        v_all = self.write(past_v, v, step.write_index)
        return self.attention(q, k_all, v_all, step.mask, cfg), k_all, v_all


class InPlaceTorch(StaticTorch):
    """StaticTorch writing into the past tensors themselves (AOTInductor keeps them in place)."""

    write = staticmethod(write_rows_inplace)
    ring_write = staticmethod(functools.partial(write_rows_inplace, circular=True))


class StaticOnnx(_Static, _OnnxRope):
    """TensorScatter-24 into the cache, Attention-24 over it: the IR contract's static graph."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, step: Step, past_k: Tensor, past_v: Tensor,
               cfg: DecoderConfig) -> tuple[Tensor, Tensor, Tensor]:
        k_all = tensor_scatter(past_k, k, step.write_index)  # (B, H_kv, L, D)
        v_all = tensor_scatter(past_v, v, step.write_index)
        return self.attention(q, k_all, v_all, step.mask, cfg), k_all, v_all

    ring_write = staticmethod(ring_scatter)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, cfg: DecoderConfig) -> Tensor:
        return onnx_ops.attention(q, k, v, mask, q_num_heads=cfg.num_attention_heads,
                                  kv_num_heads=cfg.num_key_value_heads, scale=cfg.scale,
                                  softcap=cfg.attn_logit_softcap or 0.0)[0]


class ConcatTorch(_Concat, _TorchRope):
    """present = cat(past, new) along the sequence: (B, H_kv, P, D) -> (B, H_kv, P+S, D)."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, step: Step, past_k: Tensor, past_v: Tensor,
               cfg: DecoderConfig) -> tuple[Tensor, Tensor, Tensor]:
        k_all = torch.cat([past_k, k], dim=2)  # (B, H_kv, P+S, D)
        v_all = torch.cat([past_v, v], dim=2)
        return _sdpa(q, k_all, v_all, step.mask, cfg), k_all, v_all


class ConcatOnnx(_Concat, _OnnxRope):
    """The concat style through Attention-24's own past/present inputs and outputs."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, step: Step, past_k: Tensor, past_v: Tensor,
               cfg: DecoderConfig) -> tuple[Tensor, Tensor, Tensor]:
        y, k_all, v_all, _ = onnx_ops.attention(q, k, v, step.mask, past_k, past_v, q_num_heads=cfg.num_attention_heads,
                                                kv_num_heads=cfg.num_key_value_heads, scale=cfg.scale,
                                                softcap=cfg.attn_logit_softcap or 0.0)
        return y, k_all, v_all


STATIC_TORCH, IN_PLACE, STATIC_ONNX = StaticTorch(), InPlaceTorch(), StaticOnnx()
CONCAT_TORCH, CONCAT_ONNX = ConcatTorch(), ConcatOnnx()
_KV_STEPS: dict[tuple[CacheStyle, bool], KVStep] = {
    ("static", False): STATIC_TORCH, ("static", True): STATIC_ONNX,
    ("concat", False): CONCAT_TORCH, ("concat", True): CONCAT_ONNX,
}


def kv_step(style: CacheStyle, *, onnx_ops: bool = False) -> KVStep:
    """The strategy for a cache style in ONNX ops (export) or plain torch."""
    return _KV_STEPS[style, onnx_ops]
