"""Next-token choice from logits: greedy, temperature, top-k, top-p, all seeded."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvexport.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> np.ndarray:
    """logits (B, V) float32 -> token ids (B,) int64.

    Greedy at temperature 0. Otherwise softmax(logits / temperature) restricted to the top_k
    largest logits (exactly k, ties broken by position) and then to the nucleus (the fewest most
    likely tokens whose probability reaches top_p); a token outside either set is never drawn.
    """
    if params.greedy:
        return logits.argmax(axis=-1).astype(np.int64)
    x = logits.astype(np.float64)
    # shift before dividing: a tiny temperature sends the rest to -inf and the best to 0, never inf - inf
    with np.errstate(over="ignore"):  # a subnormal temperature: -inf for all but the best, as intended
        z = (x - x.max(axis=-1, keepdims=True)) / params.temperature
    V = z.shape[-1]
    if params.top_k and params.top_k < V:
        top = np.argpartition(-z, params.top_k - 1, axis=-1)[:, : params.top_k]  # exactly k per row
        kept = np.full_like(z, -np.inf)
        np.put_along_axis(kept, top, np.take_along_axis(z, top, axis=-1), axis=-1)
        z = kept
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        keep_sorted = np.cumsum(sorted_p, axis=-1) - sorted_p < params.top_p  # always keeps the top token
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
    # inverse CDF over the unnormalized mass: u < total, so the first c > u has p > 0 (a token
    # outside the kept set has p == 0 and is never picked, even where rounding leaves total < 1)
    c = np.cumsum(p, axis=-1)
    u = rng.random((p.shape[0], 1)) * c[:, -1:]
    return (c <= u).sum(axis=-1).astype(np.int64)
