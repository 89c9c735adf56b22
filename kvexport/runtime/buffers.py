"""Aligned host buffers and the capacity ladder that sizes growing caches."""
from __future__ import annotations

import numpy as np

ALIGN = 128  # bytes: cache-line pairs / AVX-512 friendly, and what the runtime promises


def aligned_zeros(shape: tuple[int, ...], dtype: np.dtype | type, align: int = ALIGN) -> np.ndarray:
    """A zero-filled array whose data pointer is a multiple of `align` bytes.

    Zeros, not garbage: unwritten cache slots are masked out, but a masked -inf score times a
    NaN left in memory would still poison the attention sum.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    offset = (-raw.ctypes.data) % align
    arr = raw[offset : offset + nbytes].view(dtype).reshape(shape)
    assert arr.ctypes.data % align == 0
    return arr


def regrow(old: list[np.ndarray], shapes: list[tuple[int, ...]], dtype: np.dtype | type) -> tuple[list[np.ndarray], int]:
    """Caches of `shapes` (BHSD) replacing `old` (empty: first allocation), and the bytes copied.

    A cache whose shape is unchanged (a ring already at its window) keeps its buffer; a longer one is
    a new aligned buffer holding the old one's slots at its start (a ring shorter than its window never
    wrapped, so its slots are in order too)."""
    new, copied = [], 0
    for k, shape in enumerate(shapes):
        prev = old[k] if old else None
        if prev is not None and prev.shape == shape:
            new.append(prev)
            continue
        buf = aligned_zeros(shape, dtype)
        if prev is not None:
            buf[:, :, : prev.shape[2]] = prev
            copied += prev.nbytes
        new.append(buf)
    return new, copied


def capacity_ladder(max_seq: int, start: int = 64) -> list[int]:
    """Capacities a growing cache steps through: 64, 96, 128, 192, 256, 384, ... up to max_seq.

    Steps alternate x1.5 and x1.33 (powers of two and their 1.5x), so a cache never holds more
    than 1.5x the slots in use, and the copy is paid once per step, never per token.
    """
    steps, c = [], start
    while c < max_seq:
        steps.append(c)
        steps.append(c * 3 // 2)
        c *= 2
    steps = sorted({s for s in steps if s < max_seq})
    return [*steps, max_seq]


def capacity_for(needed: int, max_seq: int, start: int = 64) -> int:
    """Smallest ladder step that holds `needed` slots."""
    for c in capacity_ladder(max_seq, start):
        if c >= needed:
            return c
    return max_seq
