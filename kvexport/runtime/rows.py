"""Cache rows for continuous batching: a fixed set of rows, each holding its own number of slots.

`Engine.prefill/decode` drive a Batch whose rows are left-padded so that every row holds the same
number of slots. A continuous-batching scheduler needs the opposite: rows that start and finish at
different times, so each row keeps its own slot count (its absolute position) and a retired row is
handed to the next request without touching the others.

Two implementations:
- `BoundRows` (cpu target): one cache buffer of `rows` rows, (rows, kv_heads, capacity, head_dim)
  per layer and kind, bound in place through IOBinding. A decode step runs every row of the
  prefix [0, hi) in one engine call, each row writing at its own slot (the IR's per-row
  `write_index`); a prefill chunk runs on one row alone by binding that row's slice of the same
  buffers. Nothing is copied per step; the buffers grow along the capacity ladder (one copy per
  step of the ladder, never per token).
- `StateRows` (any Session): one Session state of batch 1 per row, stepped one row at a time.
  Correct on every backend but without the batching gain.
- A backend's own rows (`Session.batched_rows`): the intel target's `PagedRows` runs every row in
  one OpenVINO infer through paged attention over block caches (backends/intel/kvexport_intel/paged.py).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from kvexport.errors import ArtifactError, ContextOverflowError, InputError
from kvexport.runtime.buffers import aligned_zeros, capacity_for, regrow
from kvexport.runtime.ring import MASK_INPUT, chunks, row_sliding_mask
from kvexport.runtime.session import Session


def run_step(sess: Any, binding: Any) -> None:
    """One engine call. ONNX Runtime's own failure inside a step (the graph asked past what it was built for: a
    manifest.json edited to a larger max_seq, say; the manifest is not hashed) becomes a typed error."""
    try:
        sess.run_with_iobinding(binding)
    except Exception as e:  # onnxruntime raises its own RuntimeError/Fail types
        raise ArtifactError(f"ONNX Runtime failed inside an engine step: {e}. The engine graph and its manifest.json "
                            "may not match (an edited max_seq, say): restore the manifest or rebuild the artifact") from e


class Rows(ABC):
    """`rows` cache rows; row r holds `held[r]` slots, slot i holding the token at position i."""

    rows: int
    max_seq: int
    batched: bool = False  # True where one decode call serves every row

    def __init__(self, rows: int, max_seq: int):
        if rows < 1:
            raise InputError(f"a scheduler needs at least one row, got {rows}")
        self.rows, self.max_seq = rows, max_seq
        self.held = np.zeros(rows, dtype=np.int64)

    @abstractmethod
    def reset(self, row: int, capacity: int) -> None:
        """Hand `row` to a new request that will need at most `capacity` slots; it holds none."""

    @abstractmethod
    def extend(self, row: int, ids: np.ndarray) -> np.ndarray:
        """Append `ids` (S,) to one row (a prefill chunk); returns the last token's logits (V,),
        a view that the next call overwrites."""

    @abstractmethod
    def decode(self, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Append one token to each of `rows` (sorted, distinct); returns their logits (n, V),
        a view that the next call overwrites."""

    def free(self, row: int) -> None:  # noqa: B027 - optional hook
        """`row`'s request retired: what it holds may go to other rows (it is reset before its next use)."""

    def release(self) -> None:  # noqa: B027 - optional hook
        """Free the buffers."""

    @property
    def limit(self) -> int:
        """Slots a row may hold: max_seq, or more where every layer of the model slides on a ring."""
        return int(getattr(getattr(self, "s", None), "limit", self.max_seq))

    def _check(self, row: int, extra: int) -> None:
        if self.held[row] + extra > self.limit:
            raise ContextOverflowError(f"row {row} would hold {self.held[row] + extra} slots, more than "
                                       f"{'max_seq=' if self.limit == self.max_seq else 'the model limit of '}"
                                       f"{self.limit}")

    def _causal(self, start: int, n: int, width: int) -> np.ndarray:
        """(n, width) bool: token start+i sees slots 0..start+i (a sliding-window layer's graph bands it)."""
        q = np.arange(start, start + n)[:, None]
        k = np.arange(width)[None, :]
        return k <= q


def rows_for(session: Session, rows: int) -> Rows:
    """The fastest row cache this session supports."""
    from kvexport.backends.cpu import CpuSession

    if isinstance(session, CpuSession):
        return BoundRows(session, rows)
    own = session.batched_rows(rows)
    return own if own is not None else StateRows(session, rows)


class BoundRows(Rows):
    batched = True

    def __init__(self, session: Any, rows: int, start_capacity: int = 64):
        super().__init__(rows, session.max_seq)
        self.s = session
        self.dtype = session.cache_dtype
        self.capacity = 0
        self.caches: list[np.ndarray] = []
        self.logits = aligned_zeros((rows, 1, session.vocab_size), np.float32)
        self.binding = session.sess.io_binding()
        self._bound: tuple[int, int, int] | None = None  # (lo, hi, capacity) the binding's caches point at
        self.bytes_copied = 0
        self.grow_events: list[int] = []
        self._grow(capacity_for(start_capacity, self.max_seq))

    # --- buffers ------------------------------------------------------------------------------
    def _grow(self, capacity: int) -> None:
        """(Re)allocate every cache at `capacity` slots (a ring: at most its window), copying the held slots
        once; a ring already at its window keeps its buffer."""
        shapes = [(self.rows, self.s.kv_heads, n, self.s.head_dim) for n in self.s.cache_lengths(capacity)]
        new, copied = regrow(self.caches, shapes, self.dtype)
        self.bytes_copied += copied
        if self.caches:
            self.grow_events.append(capacity)
        self.caches, self.capacity, self._bound = new, capacity, None

    def _ensure(self, slots: int) -> None:
        slots = min(slots, self.max_seq)  # a ring-only model's rows pass max_seq; its rings stop at the window
        if slots > self.capacity:
            self._grow(capacity_for(slots, self.max_seq))

    def cache_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def release(self) -> None:
        self.caches = []
        self.binding.clear_binding_inputs()
        self.binding.clear_binding_outputs()

    def _bind(self, lo: int, hi: int) -> None:
        """Point the binding's past/present (the same address: updated in place) and logits at rows [lo, hi)."""
        if self._bound == (lo, hi, self.capacity):
            return
        n = hi - lo
        b = self.binding
        for (inp, out), buf in zip(self.s.pairs, self.caches):
            shape = (n, *buf.shape[1:])
            ptr = buf[lo].ctypes.data  # row lo's slice: rows [lo, hi) are contiguous in C order
            b.bind_input(inp, "cpu", 0, self.dtype, shape, ptr)
            b.bind_output(out, "cpu", 0, self.dtype, shape, ptr)
        b.bind_output("logits", "cpu", 0, np.float32, (n, 1, self.logits.shape[-1]), self.logits[lo].ctypes.data)
        self._bound = (lo, hi, self.capacity)

    def _run(self, lo: int, hi: int, ids: np.ndarray, pos: np.ndarray, write: np.ndarray, mask: np.ndarray,
             live: np.ndarray | None = None) -> None:
        """One engine call on rows [lo, hi); `live` False marks rows that run only to keep the batch whole."""
        self._bind(lo, hi)
        b = self.binding
        b.bind_cpu_input("input_ids", np.ascontiguousarray(ids, dtype=np.int64))
        b.bind_cpu_input("position_ids", np.ascontiguousarray(pos, dtype=np.int64))
        b.bind_cpu_input("write_index", np.ascontiguousarray(write, dtype=np.int64))
        if "attention_mask" in self.s.input_names:  # absent where every layer is a ring
            b.bind_cpu_input("attention_mask", np.ascontiguousarray(mask))
        ring = self.s.ring
        if ring is not None:
            b.bind_cpu_input(MASK_INPUT, row_sliding_mask(write, ids.shape[1], ring.length(self.capacity),
                                                          ring.window, live))
        run_step(self.s.sess, b)

    # --- rows ---------------------------------------------------------------------------------
    def reset(self, row: int, capacity: int) -> None:
        if capacity > self.limit:
            raise ContextOverflowError(f"a request of {capacity} slots exceeds {self.limit}, the most a row holds")
        self.held[row] = 0

    def extend(self, row: int, ids: np.ndarray) -> np.ndarray:
        self._check(row, len(ids))
        ring = self.s.ring  # a ring takes at most its window's rows a call: a longer chunk goes in pieces
        for a, b in chunks(len(ids), ring.window if ring is not None else None):
            out = self._extend(row, ids[a:b])
        return out

    def _extend(self, row: int, ids: np.ndarray) -> np.ndarray:
        S = len(ids)
        h = int(self.held[row])
        self._ensure(h + S)
        mask = np.zeros((1, 1, S, self.capacity), dtype=bool)
        mask[0, 0] = self._causal(h, S, self.capacity)
        self._run(row, row + 1, np.asarray(ids).reshape(1, S), np.arange(h, h + S).reshape(1, S),
                  np.array([h]), mask)
        self.held[row] = h + S
        return self.logits[row, 0]

    def decode(self, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        for r in rows:
            self._check(int(r), 1)
        hi = int(rows.max()) + 1
        # rows in [0, hi) that take no token this step (free, or between prefill chunks) still run:
        # each writes a throwaway token at its next free slot, which its next real write replaces,
        # and sees only that slot, so its numbers stay finite and touch no other row.
        write = self.held[:hi].copy()
        ids = np.zeros((hi, 1), dtype=np.int64)
        ids[rows, 0] = tokens
        self._ensure(int(write.max()) + 1)
        k = np.arange(self.capacity)[None, :]
        mask = k <= write[:, None]
        idle = np.ones(hi, dtype=bool)
        idle[rows] = False
        mask[idle] = k[0] == write[idle, None]
        self._run(0, hi, ids, write.reshape(hi, 1), write, mask[:, None, None, :], ~idle)
        self.held[rows] += 1
        return self.logits[rows, 0]


class StateRows(Rows):
    """One Session state of batch 1 per row (any backend)."""

    def __init__(self, session: Session, rows: int):
        super().__init__(rows, session.max_seq)
        self.s = session
        self.states: list[Any] = [None] * rows
        self.out = np.zeros((rows, session.vocab_size), dtype=np.float32)

    def reset(self, row: int, capacity: int) -> None:
        if self.states[row] is not None:
            self.s.release(self.states[row])
        self.states[row] = self.s.new_state(1, capacity)
        self.held[row] = 0

    def extend(self, row: int, ids: np.ndarray) -> np.ndarray:
        S = len(ids)
        self._check(row, S)
        h = int(self.held[row])
        mask = self._causal(h, S, h + S)[None, None]
        logits = self.s.step(self.states[row], np.asarray(ids, dtype=np.int64).reshape(1, S),
                             np.arange(h, h + S).reshape(1, S), mask)
        self.held[row] = h + S
        return logits[0]

    def decode(self, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        for i, (r, t) in enumerate(zip(rows, tokens)):
            self.out[i] = self.extend(int(r), np.array([t]))
        return self.out[: len(rows)]

    def release(self) -> None:
        for i, st in enumerate(self.states):
            if st is not None:
                self.s.release(st)
                self.states[i] = None
