"""Where each canonical decoder tensor comes from in a Hugging Face checkpoint, and how it is reshaped.

Every entry names its checkpoint tensors and one `Transform` with an inverse: `load` turns the
checkpoint's tensors into the canonical one, `save` turns a canonical tensor back into the
checkpoint's (kvexport/zoo.py writes the test checkpoints with it, so each transform is exercised
against transformers in both directions).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from kvexport.config import DecoderConfig


class Transform:
    """checkpoint tensors -> canonical tensor (`load`) and back (`save`)."""

    def load(self, parts: list[Tensor], cfg: DecoderConfig) -> Tensor:
        raise NotImplementedError

    def save(self, t: Tensor, cfg: DecoderConfig) -> list[Tensor]:
        raise NotImplementedError


class Same(Transform):
    def load(self, parts: list[Tensor], cfg: DecoderConfig) -> Tensor:
        (t,) = parts
        return t

    def save(self, t: Tensor, cfg: DecoderConfig) -> list[Tensor]:
        return [t]


@dataclass(frozen=True)
class Concat(Transform):
    """Several tensors stacked along dim 0 (q, k, v -> qkv_proj); `sizes` gives each one's rows."""

    sizes: Callable[[DecoderConfig], tuple[int, ...]]

    def load(self, parts: list[Tensor], cfg: DecoderConfig) -> Tensor:
        return torch.cat(parts, dim=0)

    def save(self, t: Tensor, cfg: DecoderConfig) -> list[Tensor]:
        return list(t.split(list(self.sizes(cfg)), dim=0))


class Transpose(Transform):
    """GPT-2's Conv1D stores (in, out); nn.Linear holds (out, in)."""

    def load(self, parts: list[Tensor], cfg: DecoderConfig) -> Tensor:
        (t,) = parts
        return t.t()

    def save(self, t: Tensor, cfg: DecoderConfig) -> list[Tensor]:
        return [t.t()]


@dataclass(frozen=True)
class Offset(Transform):
    """The checkpoint stores w - delta (Gemma's norms compute x * (1 + w)): canonical = stored + delta."""

    delta: float

    def load(self, parts: list[Tensor], cfg: DecoderConfig) -> Tensor:
        (t,) = parts
        return t + self.delta

    def save(self, t: Tensor, cfg: DecoderConfig) -> list[Tensor]:
        return [t - self.delta]


class DeinterleaveHeads(Transform):
    """GPT-NeoX's query_key_value rows are per head [q_h, k_h, v_h] (H, 3, D); canonical is [q; k; v] (3, H, D)."""

    def load(self, parts: list[Tensor], cfg: DecoderConfig) -> Tensor:
        (t,) = parts
        H, D = cfg.num_attention_heads, cfg.head_dim
        return t.reshape(H, 3, D, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    def save(self, t: Tensor, cfg: DecoderConfig) -> list[Tensor]:
        H, D = cfg.num_attention_heads, cfg.head_dim
        return [t.reshape(3, H, D, *t.shape[1:]).transpose(0, 1).reshape(t.shape)]


@dataclass(frozen=True)
class Experts(Transform):
    """One nn.Linear weight (rows, in) per expert, or several concatenated along rows (w1, w3 -> [gate; up]),
    stacked into the canonical (E, in, rows): MatMul's right-hand operand for every expert at once.

    The source names hold `{e}`, expanded expert by expert (e0's names, e1's, ...): see `expand_experts`."""

    per_expert: int = 1  # checkpoint tensors per expert, concatenated along their rows

    def load(self, parts: list[Tensor], cfg: DecoderConfig) -> Tensor:
        n = self.per_expert
        return torch.stack([torch.cat(parts[e * n:(e + 1) * n], dim=0).t() for e in range(len(parts) // n)])

    def save(self, t: Tensor, cfg: DecoderConfig) -> list[Tensor]:
        return [part for w in t for part in w.t().chunk(self.per_expert, dim=0)]


def expand_experts(names: tuple[str, ...], cfg: DecoderConfig | None) -> tuple[str, ...]:
    """Names holding `{e}` -> one copy per expert, expert-major; names without it are returned as they are."""
    if not any("{e}" in n for n in names):
        return names
    if cfg is None:
        raise ValueError(f"{names[0]} names one tensor per expert: pass the config, whose num_experts says how many")
    return tuple(n.replace("{e}", str(e)) for e in range(cfg.num_experts) for n in names)


SAME, TRANSPOSE, DEINTERLEAVE_HEADS = Same(), Transpose(), DeinterleaveHeads()
EXPERT_GATE_UP, EXPERT_DOWN = Experts(per_expert=2), Experts(per_expert=1)
QKV = Concat(lambda c: (c.q_size, c.kv_size, c.kv_size))
GATE_UP = Concat(lambda c: (c.intermediate_size, c.intermediate_size))


@dataclass(frozen=True)
class Source:
    names: tuple[str, ...]  # checkpoint tensor names (relative to the layer prefix inside a layer)
    transform: Transform = SAME


def tensor(name: str, transform: Transform = SAME) -> Source:
    return Source((name,), transform)


def proj(*names: str, transform: Transform = SAME, weight: Transform | None = None) -> dict[str, Source]:
    """weight and bias of a linear layer made of `names` (concatenated by `transform`)."""
    return {"weight": Source(tuple(f"{n}.weight" for n in names), weight or transform),
            "bias": Source(tuple(f"{n}.bias" for n in names), transform)}


def layer_map(entries: Mapping[str, Mapping[str, Source]]) -> dict[str, Source]:
    """{"attn.o_proj": proj(...)} -> {"attn.o_proj.weight": ..., "attn.o_proj.bias": ...}."""
    return {f"{k}.{kind}": src for k, d in entries.items() for kind, src in d.items()}


@dataclass(frozen=True)
class WeightMap:
    """Canonical name -> Source. `layer` names are relative to `layer_prefix` (formatted with the layer index)."""

    globals: Mapping[str, Source]
    layer_prefix: str
    layer: Mapping[str, Source]
    prefixes: tuple[str, ...] = ("",)  # checkpoint may or may not carry the base-model prefix
    ignore_suffixes: tuple[str, ...] = ()  # non-parameter buffers some checkpoints carry

    def source(self, canonical: str, cfg: DecoderConfig | None = None) -> Source:
        """The checkpoint tensors (full names, without an optional prefix) behind one canonical tensor.

        `cfg` is needed only for per-expert entries (names with `{e}`)."""
        if canonical.startswith("layers."):
            _, i, rest = canonical.split(".", 2)
            src = self.layer[rest]
            names = tuple(self.layer_prefix.format(i=i) + s for s in src.names)
            return Source(expand_experts(names, cfg), src.transform)
        return self.globals[canonical]
