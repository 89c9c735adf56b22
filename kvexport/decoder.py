"""The owned canonical decoder: embedding -> N blocks (norm, attention, MLP) -> norm -> lm_head.

Every family is this module with different `DecoderConfig` data. How a layer applies RoPE, writes
its cache and attends is one strategy object (`KVStep`, kvexport.kvstep) the decoder hands every
layer.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvexport.config import DecoderConfig
from kvexport.errors import UnsupportedFeatureError

# the strategies moved to kvexport.kvstep; the names other modules import from here stay importable
from kvexport.kvstep import (  # noqa: F401
    CONCAT_TORCH,
    IN_PLACE,
    STATIC_TORCH,
    CacheStyle,
    ConcatTorch,
    KVStep,
    Step,
    kv_step,
    rope_inv_freq,
    rope_tables,
    scatter_rows,
    softcapped_attention,
)


# --- modules --------------------------------------------------------------------------------
class Norm(nn.Module):
    """RMSNorm or LayerNorm over the last dim, of width `width`."""

    def __init__(self, width: int, kind: str, eps: float):
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width)) if kind == "layer" else None

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "rms":
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class HeadNorm(Norm):
    """One RMSNorm of width head_dim applied to every head of x (B, S, H*D) (Qwen3's and Gemma 3's q/k norm)."""

    def __init__(self, heads: int, head_dim: int, eps: float):
        super().__init__(head_dim, "rms", eps)
        self.heads = heads

    def forward(self, x: Tensor) -> Tensor:
        B, S, _ = x.shape
        return super().forward(x.view(B, S, self.heads, -1)).view(B, S, -1)  # (B, S, H, D) -> (B, S, H*D)


def block_norm(cfg: DecoderConfig) -> Norm:
    return Norm(cfg.hidden_size, cfg.norm_kind, cfg.norm_eps)


QK_NORMS: dict[str, Callable[[DecoderConfig], tuple[nn.Module, nn.Module]]] = {
    "none": lambda cfg: (nn.Identity(), nn.Identity()),
    "head": lambda cfg: (HeadNorm(cfg.num_attention_heads, cfg.head_dim, cfg.norm_eps),
                         HeadNorm(cfg.num_key_value_heads, cfg.head_dim, cfg.norm_eps)),
    "projection": lambda cfg: (Norm(cfg.q_size, "rms", cfg.norm_eps), Norm(cfg.kv_size, "rms", cfg.norm_eps)),
}

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


class MoeMlp(nn.Module):
    """Top-k routed gated experts (Mixtral, Qwen3-MoE): softmax over the router's logits, the top k kept
    (renormalised to sum to 1 where `norm_topk_prob`), every other expert's weight exactly 0.

    Two exact forms of the same sum, chosen by the step's (token, expert) pairs T*k against the E experts:
    - gathered (T*k < E: decode): Gather the chosen experts' weights, (T, k, h, 2I) and (T, k, I, h), and run
      them as one batched MatMul each: a token reads its k experts, not all E (plus the copy the Gather makes,
      which is why prefill does not use it: T*k copies of an expert's matrices).
    - dense (prefill): every expert on every token (one batched MatMul per projection), summed under a
      (T, E) routing matrix scattered from TopK that is 0 outside the top k.
    Traced with a symbolic token count (torch.export, the ONNX IR), both forms go in the graph under one
    torch.cond (an ONNX If on T*k < E); a run with concrete shapes (eager, TorchScript tracing) takes one.
    Plain ONNX either way: Softmax, TopK, ScatterElements, Gather, MatMul, If.
    """

    Form = Literal["auto", "dense", "gathered"]

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        E, I, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.top_k, self.renormalise, self.num_experts = cfg.num_experts_per_tok, cfg.norm_topk_prob, E
        self.router = nn.Linear(h, E, bias=False)
        self.gate_up = nn.Parameter(torch.empty(E, h, 2 * I))  # per expert x @ gate_up[e] -> [gate, up]
        self.down = nn.Parameter(torch.empty(E, I, h))
        self.act = ACTIVATION_FNS[cfg.activation]
        self.form: MoeMlp.Form = "auto"  # "dense" / "gathered" force one (benchmarks, tests)

    def forward(self, x: Tensor) -> Tensor:
        B, S, h = x.shape
        x = x.reshape(B * S, h)  # (T, h)
        probs = self.router(x).float().softmax(dim=-1)  # (T, E)
        top, chosen = probs.topk(self.top_k, dim=-1)  # (T, k)
        if self.renormalise:
            top = top / top.sum(dim=-1, keepdim=True)
        # (T, E): 0 outside the top k. probs * 0, not zeros_like, which exports as an Expand of a constant.
        # Made here, as the weights' dtype, so neither branch holds a Cast (a precision pass sees them all)
        route = (probs * 0).scatter(-1, chosen, top).to(x.dtype)
        args = (x, route, top.to(x.dtype), chosen)
        T = x.shape[0]
        if self.form != "auto":
            y = self.dense(*args) if self.form == "dense" else self.gathered(*args)
        elif isinstance(T, torch.SymInt):
            y = torch.cond(T * self.top_k < self.num_experts, self.gathered, self.dense, args)
        else:
            y = self.gathered(*args) if T * self.top_k < self.num_experts else self.dense(*args)
        return y.view(B, S, h)

    def dense(self, x: Tensor, route: Tensor, top: Tensor, chosen: Tensor) -> Tensor:
        # x as (1, 1, T, h): OpenVINO's CPU plugin takes this broadcast, not a 2-D or (1, T, h) one by (E, h, 2I)
        gate, up = torch.matmul(x[None, None], self.gate_up).chunk(2, dim=-1)  # (1, E, T, I) each
        y = torch.matmul(self.act(gate) * up, self.down)  # (1, E, T, h)
        return (y * route.t().unsqueeze(-1)).sum(dim=1)[0]  # (T, h)

    def gathered(self, x: Tensor, route: Tensor, top: Tensor, chosen: Tensor) -> Tensor:
        T, h = x.shape
        xs = x.view(T, 1, 1, h)
        gate, up = torch.matmul(xs, self.gate_up[chosen]).chunk(2, dim=-1)  # (T, k, 1, I) each
        y = torch.matmul(self.act(gate) * up, self.down[chosen])  # (T, k, 1, h)
        return (y.squeeze(2) * top.unsqueeze(-1)).sum(dim=1)  # (T, h)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.q_norm, self.k_norm = QK_NORMS[cfg.qk_norm](cfg)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.rot = cfg.effective_rotary_dim if cfg.position_kind == "rope" else 0

    def forward(self, x: Tensor, step: Step, past_k: Tensor, past_v: Tensor,
                last: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """(o_proj output, keys, values): the output for every new row, or for the last only where `last`."""
        q, k, v = self.project(x, step)
        attend = step.kv.attend_ring if step.ring else step.kv.attend
        y, k_all, v_all = attend(q, k, v, step, past_k, past_v, self.cfg)
        return self.output(y, last), k_all, v_all

    def project(self, x: Tensor, step: Step) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, S, hidden) -> q (B, H_q, S, D), k and v (B, H_kv, S, D); q/k norm, then RoPE."""
        cfg = self.cfg
        B, S, _ = x.shape
        Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, k, v = self.qkv_proj(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)  # (B, S, H*D)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.rot:
            q, k = step.kv.rope(q, step, Hq, self.rot), step.kv.rope(k, step, Hkv, self.rot)
        q = q.view(B, S, Hq, D).transpose(1, 2)  # (B, H_q, S, D)
        k = k.view(B, S, Hkv, D).transpose(1, 2)  # (B, H_kv, S, D)
        v = v.view(B, S, Hkv, D).transpose(1, 2)  # (B, H_kv, S, D)
        return q, k, v

    def output(self, y: Tensor, last: bool = False) -> Tensor:
        """Attention result y (B, H_q, S, D) -> o_proj of (B, S, H_q*D), of its last row (B, 1, H_q*D) where `last`."""
        B, H, S, D = y.shape
        y = y.transpose(1, 2).reshape(B, S, H * D)
        return self.o_proj(y[:, -1:] if last else y)


class Block(nn.Module):
    """Pre-norm: x + f(norm(x)); post-norm (OLMo 2): x + norm(f(x)); sandwich (Gemma 2 and 3): x + norm(f(norm(x)));
    parallel (GPT-NeoX): x + attn + mlp."""

    def __init__(self, cfg: DecoderConfig, index: int = 0):
        super().__init__()
        pre, post = cfg.norm_position in ("pre", "sandwich"), cfg.norm_position in ("post", "sandwich")
        self.parallel, self.residual_scale = cfg.parallel_residual, cfg.residual_scale
        self.attn_norm = block_norm(cfg) if pre else nn.Identity()
        self.attn = Attention(cfg)
        self.post_attn_norm = block_norm(cfg) if post else nn.Identity()
        self.mlp_norm = block_norm(cfg) if pre else nn.Identity()
        self.mlp = MoeMlp(cfg) if cfg.is_moe_layer(index) else Mlp(cfg)
        self.post_mlp_norm = block_norm(cfg) if post else nn.Identity()

    def forward(self, x: Tensor, step: Step, past_k: Tensor, past_v: Tensor,
                last: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """(residual stream after the block, keys, values). `last`: the stream of the last row only (B, 1, hidden):
        the keys and values of every row still go to the cache, but nothing after the attention is computed for
        rows whose output no one reads (Decoder.decode, last_token_only)."""
        a, k, v = self.attn(self.attn_norm(x), step, past_k, past_v, last)
        return self.combine(x[:, -1:] if last else x, a), k, v

    def combine(self, x: Tensor, a: Tensor) -> Tensor:
        """The residual stream after this block, given its attention output `a`."""
        a = self.branch(self.post_attn_norm(a))
        if self.parallel:
            return x + a + self.feed_forward(x)
        h = x + a
        return h + self.feed_forward(h)

    def feed_forward(self, x: Tensor) -> Tensor:
        return self.branch(self.post_mlp_norm(self.mlp(self.mlp_norm(x))))

    def branch(self, y: Tensor) -> Tensor:
        return y if self.residual_scale is None else y * self.residual_scale


class Decoder(nn.Module):
    """forward(input_ids, position_ids, write_index, attention_mask, *past) -> (logits, *present).

    Static style: past/present are (B, H_kv, cache_len, D) and write_index (B,) says where the
    new rows go; the concat style drops write_index and grows the cache by S each call.
    past/present alternate key, value per layer: the graph's inputs and outputs, one tensor each.
    `kv` (a KVStep) decides the op set and cache style; `configured` switches it for a while.
    """

    def __init__(self, cfg: DecoderConfig, max_seq: int, *, kv: KVStep = STATIC_TORCH, last_token_only: bool = False,
                 ring: bool = False):
        super().__init__()
        self.cfg, self.max_seq = cfg, max_seq
        self.kv, self.last_token_only, self.ring = kv, last_token_only, ring
        self.windows = tuple(cfg.window_of(i) for i in range(cfg.num_hidden_layers))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # the embedding scale rounded to each model dtype first, as transformers' Gemma does (the same
        # multiply as an unrounded one in fp32); made here, on the CPU, as tracing cannot read a tensor's value
        self.embedding_scales = {dt: torch.tensor(cfg.embedding_scale or 1.0, dtype=dt, device="cpu").item()
                                 for dt in (torch.float32, torch.float16, torch.bfloat16)}
        if cfg.position_kind == "learned":
            self.embed_positions = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        else:
            self.set_rope_tables(self.rope_positions)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        # per layer: its window and whether it reads the sliding layers' own RoPE tables (Gemma 3)
        self.layer_kinds = tuple((w, cfg.rope_local is not None and cfg.rope_of(i) is cfg.rope_local)
                                 for i, w in enumerate(self.windows))
        self.norm = block_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def cache_style(self) -> CacheStyle:
        return self.kv.style

    @property
    def ring_layers(self) -> tuple[int, ...]:
        """Layers whose cache is a ring of `ring_window` slots: the sliding ones, where rings are on (a strategy
        that keeps rings: the static styles, intel's stateful concat) and the window fits in max_seq (a longer
        one never slides within the cache)."""
        if not self.ring or not self.kv.keeps_rings:
            return ()
        return tuple(i for i, w in enumerate(self.windows) if w is not None and w <= self.max_seq)

    @property
    def ring_window(self) -> int | None:
        """The ring layers' window (one mask input serves them all, so they share it); None without rings."""
        windows = {self.windows[i] for i in self.ring_layers}
        if len(windows) > 1:
            raise UnsupportedFeatureError(f"sliding layers with different windows {sorted(windows)} on ring caches: "
                                          "one ring mask serves one window; export with full-length caches")
        return windows.pop() if windows else None

    @property
    def rope_positions(self) -> int:
        """Rows of the RoPE tables: max_seq, or the model's own max_position_embeddings where every layer may
        slide on a ring (its positions then go past max_seq)."""
        if all(w is not None and w <= self.max_seq for w in self.windows):
            return max(self.max_seq, self.cfg.max_position_embeddings)
        return self.max_seq

    @property
    def max_positions(self) -> int:
        """How far positions go: past max_seq only where every layer keeps a ring."""
        return self.rope_positions if len(self.ring_layers) == self.cfg.num_hidden_layers else self.max_seq

    @contextlib.contextmanager
    def configured(self, *, kv: KVStep | None = None, last_token_only: bool | None = None,
                   ring: bool | None = None) -> Iterator[Decoder]:
        """Use another strategy (logits width, ring caches) inside the block; the previous ones come back after it."""
        saved = self.kv, self.last_token_only, self.ring
        try:
            self.kv = saved[0] if kv is None else kv
            self.last_token_only = saved[1] if last_token_only is None else last_token_only
            self.ring = saved[2] if ring is None else ring
            yield self
        finally:
            self.kv, self.last_token_only, self.ring = saved

    def set_rope_tables(self, max_seq: int) -> None:
        """(Re)make the RoPE buffers (max_seq, rot/2): rope_cos/rope_sin of cfg.rope, and rope_local_cos/
        rope_local_sin of cfg.rope_local where the sliding layers have their own (Gemma 3)."""
        for name, rope in (("rope", self.cfg.rope), ("rope_local", self.cfg.rope_local)):
            if rope is not None:
                cos, sin = rope_tables(self.cfg, max_seq, rope)
                self.register_buffer(f"{name}_cos", cos, persistent=False)
                self.register_buffer(f"{name}_sin", sin, persistent=False)

    def cache_shape(self, batch: int, cache_len: int) -> tuple[int, int, int, int]:
        return (batch, self.cfg.num_key_value_heads, cache_len, self.cfg.head_dim)  # BHSD

    def forward(self, input_ids: Tensor, position_ids: Tensor, *inputs: Tensor) -> tuple[Tensor, ...]:
        if not self.ring_layers:
            write_index, mask, past = self.kv.split(inputs)
            return self.decode(input_ids, self.step(position_ids, write_index, mask, self.kv), past)
        # with rings: write_index, attention_mask (absent when every layer is a ring), the rings' mask, *past
        n = len(inputs) - 2 * self.cfg.num_hidden_layers
        write_index, masks, past = inputs[0], inputs[1:n], inputs[n:]
        step = self.step(position_ids, write_index, masks[0] if len(masks) == 2 else None, self.kv)  # type: ignore[arg-type]
        return self.decode(input_ids, step._replace(ring_mask=masks[-1]), past)

    def step(self, position_ids: Tensor, write_index: Tensor | None, mask: Tensor, kv: KVStep) -> Step:
        return Step(position_ids, write_index, mask, getattr(self, "rope_cos", None), getattr(self, "rope_sin", None), kv)

    def decode(self, input_ids: Tensor, step: Step, past: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """(logits, *presents) for input_ids (B, S) given one step's shared inputs and the past caches."""
        x = self.embed(input_ids, step.position_ids)
        # one banded mask per distinct window, made once in the graph and shared by its layers
        rings = self.ring_layers  # their mask comes banded over the ring (kvexport.runtime.ring)
        kinds = [(*kind, i in rings) for i, kind in enumerate(self.layer_kinds)]
        bands = {w: step.kv.window_mask(step, w) for w in sorted({w for w, _, ring in kinds if w is not None and not ring})}
        steps = {kind: self.layer_step(step, *kind, bands) for kind in dict.fromkeys(kinds)}
        presents: list[Tensor] = []
        last = len(self.layers) - 1 if self.last_token_only else -1
        for i, layer in enumerate(self.layers):
            # the last layer under last_token_only: o_proj, the MLP and the head for the last row only (the rows
            # before it are wanted only for their keys and values): on bench-125m's 12 layers ~6% of a long
            # prompt's projection work less (a peer does the same: llama.cpp's last-layer output ids)
            x, k, v = layer(x, steps[kinds[i]], past[2 * i], past[2 * i + 1], last=i == last)
            presents += [k, v]
        return (self.head(x), *presents)

    def layer_step(self, step: Step, window: int | None, local_rope: bool, ring: bool, bands: dict[int, Tensor]) -> Step:
        """The step as a layer of this kind sees it: its window's band of the mask (a ring layer: the rings' mask),
        its RoPE tables."""
        if ring:
            step = step._replace(mask=step.ring_mask, window=window, ring=True)
        elif window is not None:
            step = step._replace(mask=bands[window], window=window)
        if local_rope:
            step = step._replace(cos=self.rope_local_cos, sin=self.rope_local_sin)
        return step

    def embed(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """(B, S) ids -> (B, S, hidden) residual stream entering the first block."""
        cfg = self.cfg
        x = self.embed_tokens(input_ids)  # (B, S, hidden)
        if cfg.embedding_scale is not None:
            x = x * self.embedding_scales[x.dtype]
        if cfg.position_kind == "learned":
            x = x + self.embed_positions(position_ids)
        return x

    def head(self, x: Tensor) -> Tensor:
        """Final norm and lm_head: (B, S, hidden) -> logits (B, S, vocab); under last_token_only the last layer
        hands over its last row alone (decode), so S is 1."""
        logits = self.lm_head(self.norm(x))
        if self.cfg.logit_divisor is not None:
            logits = logits / self.cfg.logit_divisor
        if self.cfg.final_logit_softcap is not None:
            cap = self.cfg.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
