"""Ring caches of sliding-window layers: where each ring slot's token came from, and the mask over it.

A sliding layer with window W keeps `length` = min(W, capacity) slots. A step writes its S new rows at
slots write_index .. write_index+S-1 taken modulo `length` (TensorScatter's circular mode), and attends,
before that write, over the ring followed by the S new rows (`length + S` keys): the mask built here says
which of them each new token may see. Ring slot j then holds the latest slot t < write_index with
t = j (mod length); it is visible to the query at slot q when t >= 0, t held a real token (the caller's
mask over held slots says so) and q - t < W. While length < W no slot has wrapped (the runtime grows the
ring with the rest of the cache until it is W long), so the rule is the same at every size.

A step may not write more than `length` rows at once (the write would overwrite itself): `chunks` cuts a
longer prefill into pieces of at most W tokens, and a runtime never lets a request need more than the
ring holds before the ring is W long.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

MASK_INPUT = "sliding_attention_mask"
RING_DIM = "ring_len"  # the ring caches' symbolic slot count (at most the window)
RING_MASK_DIM = "ring_keys"  # the sliding mask's last dim: ring_len + seq


@dataclass(frozen=True)
class RingSpec:
    """Which layers keep a ring, its window, and how far positions may go (from manifest `cache.ring`)."""

    window: int
    layers: frozenset[int]
    num_layers: int
    max_positions: int  # every layer a ring: the model's own limit, past max_seq; else max_seq

    @classmethod
    def of(cls, manifest: Any) -> RingSpec | None:
        """The IR's rings (manifest `cache.ring`), or the engine's own where its target keeps rings that its IR
        does not (`target.ring`, with its own max_positions: intel's stateful engine from a concat IR)."""
        engine = (manifest.target or {}).get("ring")
        ring = engine or manifest.cache.get("ring")
        if not ring:
            return None
        limit = (engine or manifest.cache).get("max_positions", manifest.max_seq)
        return cls(int(ring["window"]), frozenset(int(i) for i in ring["layers"]), int(manifest.cache["num_layers"]),
                   int(limit))

    @property
    def every_layer(self) -> bool:
        """No layer keeps a full-length cache: requests are bounded by max_positions, not max_seq."""
        return len(self.layers) == self.num_layers

    def limit(self, max_seq: int) -> int:
        """Slots a request may hold: max_positions where every layer is a ring, else max_seq."""
        return self.max_positions if self.every_layer else max_seq

    def length(self, capacity: int) -> int:
        """Slots of a ring in a cache whose full-length layers hold `capacity`."""
        return min(self.window, capacity)

    def is_ring(self, pair_index: int) -> bool:
        """Whether cache pair k (layer k // 2: key, value) is a ring."""
        return pair_index // 2 in self.layers


def ring_slots(write: np.ndarray, length: int) -> np.ndarray:
    """(B,) slots held before the write -> (B, length): the slot whose token ring slot j holds (< 0: none yet)."""
    last = np.asarray(write, dtype=np.int64)[:, None] - 1  # (B, 1)
    return last - np.mod(last - np.arange(length)[None, :], length)


def sliding_mask(held: np.ndarray, length: int, window: int) -> np.ndarray:
    """The caller's mask over held slots, (B, 1, S, T+S) bool, -> the ring layers' (B, 1, S, length+S):
    each ring slot's token (if it holds one and it is inside the window), then the S new tokens."""
    B, _, S, total = held.shape
    T = total - S
    t = ring_slots(np.array([T]), length)[0]  # (length,)
    q = T + np.arange(S)[:, None]  # (S, 1) the new tokens' slots
    ring = held[..., np.maximum(t, 0)] & ((t >= 0) & (q - t < window))  # (B, 1, S, length)
    new = held[..., T:] & ((q - (T + np.arange(S))[None, :]) < window)  # (B, 1, S, S)
    return np.concatenate([ring, new], axis=-1)


def row_sliding_mask(write: np.ndarray, S: int, length: int, window: int, live: np.ndarray | None = None) -> np.ndarray:
    """Rows with no padding (a scheduler's rows), row b writing S tokens at slot write[b]: (B, 1, S, length+S).
    A row that is not `live` sees only its own new token (it runs to keep the batch whole; its output is dropped)."""
    B = len(write)
    t = ring_slots(write, length)[:, None, :]  # (B, 1, length)
    q = np.asarray(write)[:, None, None] + np.arange(S)[None, :, None]  # (B, S, 1)
    ring = (t >= 0) & (q - t < window)  # (B, S, length)
    s = np.arange(S)
    new = np.broadcast_to((s[None, :] <= s[:, None]) & ((s[:, None] - s[None, :]) < window), (B, S, S))
    if live is not None:
        ring = ring & live[:, None, None]
        new = np.where(live[:, None, None], new, np.eye(S, dtype=bool)[None])
    return np.concatenate([ring, new], axis=-1)[:, None]


def chunks(S: int, limit: int | None) -> list[tuple[int, int]]:
    """[a, b) pieces of a step of S tokens, none longer than `limit` (None: one piece)."""
    if not limit or S <= limit:
        return [(0, S)]
    return [(a, min(a + limit, S)) for a in range(0, S, limit)]


def step_pieces(input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
                limit: int | None) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """A step's (input_ids, position_ids, attention_mask) cut into `chunks` of at most `limit` tokens: piece
    [a, b) of S new tokens over T held slots gets the mask's rows a..b over the T + b slots held after it."""
    S = input_ids.shape[1]
    T = attention_mask.shape[-1] - S
    for a, b in chunks(S, limit):
        yield input_ids[:, a:b], position_ids[:, a:b], attention_mask[:, :, a:b, : T + b]


class CacheBytes(NamedTuple):
    """One row's cache bytes at some slots held: what `kvexport inspect` prints beside each other."""

    held: int  # with the rings, their swap buffers included
    swap: int  # of `held`, the rings' second buffers (target.ring_buffers 2), else 0
    full: int  # were every layer full length


def cache_bytes(manifest: Any, slots: int, itemsize: int) -> CacheBytes:
    """One row's cache bytes at `slots` held, from the manifest's geometry. An engine that writes each ring into
    a second buffer swapped with it every step (the target records `ring_buffers`: 2) holds each ring twice."""
    c = manifest.cache
    per_slot = 2 * int(c["kv_heads"]) * int(c["head_dim"]) * itemsize  # K and V of one layer
    spec = RingSpec.of(manifest)
    full = int(c["num_layers"]) * slots * per_slot
    if spec is None:
        return CacheBytes(full, 0, full)
    ring = len(spec.layers) * min(spec.window, slots) * per_slot
    swap = (int((manifest.target or {}).get("ring_buffers", 1)) - 1) * ring
    return CacheBytes((int(c["num_layers"]) - len(spec.layers)) * slots * per_slot + ring + swap, swap, full)
