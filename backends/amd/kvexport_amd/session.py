"""The loaded AOTInductor package as a Session: direct calls on CPU, a captured HIP/CUDA graph per decode on GPU."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvexport.errors import ContextOverflowError, InputError
from kvexport.runtime.ring import RingSpec, chunks, sliding_mask
from kvexport.runtime.session import Session


@dataclass
class DecodeBuffers:
    """Static inputs of the one-token step: a captured graph reads these addresses on every replay."""

    input_ids: Tensor  # (B, 1) int64
    position_ids: Tensor  # (B, 1) int64
    write_index: Tensor  # (B,) int64
    mask: Tensor | None  # (B, 1, 1, cache_len) bool; slots past the held ones stay False (None: every layer a ring)
    ring_mask: Tensor | None = None  # (B, 1, 1, W+1) bool: the ring layers' mask (kvexport.runtime.ring)
    host: tuple[Tensor, ...] | None = None  # pinned staging copies (GPU only)

    def inputs(self) -> list[Tensor]:
        """The package's inputs before the caches, in its order."""
        return [t for t in (self.input_ids, self.position_ids, self.write_index, self.mask, self.ring_mask)
                if t is not None]


@dataclass
class AotiState:
    batch: int
    caches: list[Tensor]  # past/present alternating key, value per layer: (B, H_kv, cache_len or W, D)
    held: int = 0  # slots T every row holds
    decode: DecodeBuffers | None = None
    graph: Any = None  # torch.cuda.CUDAGraph of the decode step (hipGraph on ROCm)
    graph_logits: Tensor | None = None  # the captured step's output buffer
    replays: int = 0
    captures: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class AotiSession(Session):
    """One AOTInductor runner over caches this session allocates at max_seq slots (policy "fixed"), a
    sliding-window layer's ring at its window's (`ring`, from the manifest: RingSpec.of).

    The package mutates the cache inputs in place, so a step copies nothing but its small inputs.
    """

    def __init__(self, runner: Any, *, device: str, dtype: torch.dtype, num_layers: int, kv_heads: int,
                 head_dim: int, max_seq: int, vocab_size: int, max_batch: int, use_graph: bool,
                 facts: dict[str, Any], ring: RingSpec | None = None):
        if use_graph and device == "cpu":
            raise InputError("graph capture needs a GPU; this package runs on the CPU (drop --option graphs)")
        self.runner, self.device, self.dtype = runner, device, dtype
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.max_seq, self.vocab_size, self.max_batch = max_seq, vocab_size, max_batch
        self.use_graph = use_graph
        self.facts = facts
        self.ring = ring
        self.full_mask = ring is None or not ring.every_layer  # some layer keeps a full-length cache
        self.limit = max_seq if self.full_mask else ring.max_positions  # type: ignore[union-attr]
        # One runner serves every state, so calls into it are serialized here: GPU runners are loaded
        # single-threaded (no internal pool, as graph capture needs), and concurrent calls into the
        # CPU runner deadlocked in its own wait for a free model (seen under pytest, 2 cores).
        self._lock = threading.Lock()

    # --- state --------------------------------------------------------------------------------
    def new_state(self, batch: int, capacity: int) -> AotiState:
        if not 1 <= batch <= self.max_batch:
            raise InputError(f"batch {batch} is outside 1..{self.max_batch}, the batch range this package was "
                             "compiled for; rebuild with a larger --max-batch")
        if capacity > self.limit:
            raise ContextOverflowError(f"the request needs {capacity} cache slots; this engine holds at most "
                                       f"{self.limit} (rebuild with a larger --max-seq)")
        ring = self.ring
        caches = [torch.zeros((batch, self.kv_heads, ring.window if ring and ring.is_ring(k) else self.max_seq,
                               self.head_dim), dtype=self.dtype, device=self.device)  # (B, H_kv, S_max or W, D)
                  for k in range(2 * self.num_layers)]
        return AotiState(batch=batch, caches=caches)

    def release(self, state: AotiState) -> None:
        state.graph, state.graph_logits, state.decode = None, None, None
        state.caches = []

    def cache_bytes(self, state: AotiState) -> int:
        return sum(c.numel() * c.element_size() for c in state.caches)

    def describe(self) -> dict[str, Any]:
        return {**self.facts, "cache_policy": "fixed", "cache_len": self.max_seq, "graph_capture": self.use_graph,
                "max_batch": self.max_batch,
                "ring": None if self.ring is None else {"window": self.ring.window, "layers": sorted(self.ring.layers)}}

    # --- step ---------------------------------------------------------------------------------
    def step(self, state: AotiState, input_ids: np.ndarray, position_ids: np.ndarray,
             attention_mask: np.ndarray) -> np.ndarray:
        B, S = self._check(state, input_ids, position_ids, attention_mask)
        T = state.held
        # a ring takes at most its window's rows a call (more would overwrite each other): longer steps in pieces
        for a, b in chunks(S, self.ring.window if self.ring else None):
            ids, pos, mask = input_ids[:, a:b], position_ids[:, a:b], attention_mask[:, :, a:b, : T + b]
            logits = self._decode(state, ids, pos, mask) if b - a == 1 else self._prefill(state, ids, pos, mask)
            state.held = T + b
        return logits

    def _check(self, state: AotiState, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray) -> tuple[int, int]:
        if not state.caches:
            raise InputError("this state was released; make a new one with new_state()")
        if ids.dtype != np.int64 or pos.dtype != np.int64 or ids.ndim != 2 or pos.shape != ids.shape:
            raise InputError(f"input_ids and position_ids must be int64 (B, S) arrays of one shape; got "
                             f"{ids.dtype}{ids.shape} and {pos.dtype}{pos.shape}")
        B, S = ids.shape
        if B != state.batch:
            raise InputError(f"this state holds {state.batch} rows, the step has {B}")
        T = state.held
        if T + S > self.limit:
            raise ContextOverflowError(f"{T} slots held + {S} new tokens pass this engine's {self.limit} slots; "
                                       "shorten the request or rebuild with a larger --max-seq")
        if mask.dtype != np.bool_ or mask.shape != (B, 1, S, T + S):
            raise InputError(f"attention_mask must be bool {(B, 1, S, T + S)}; got {mask.dtype}{mask.shape}")
        return B, S

    def _run(self, inputs: list[Tensor]) -> Tensor:
        return self.runner.boxed_run(inputs)[0]

    def _prefill(self, state: AotiState, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray) -> np.ndarray:
        B, S = ids.shape
        T = state.held
        dev = self.device
        masks = []
        if self.full_mask:
            full = np.zeros((B, 1, S, self.max_seq), dtype=np.bool_)  # (B, 1, S, cache_len)
            full[..., : T + S] = mask
            masks.append(full)
        if self.ring is not None:
            masks.append(sliding_mask(mask, self.ring.window, self.ring.window))  # (B, 1, S, W+S)
        # the package reads its inputs at contiguous strides (it checks them only under AOTI_RUNTIME_CHECK_INPUTS):
        # a ring's piece of a longer step (step's chunks) is a strided view, so each input is copied dense first
        ids, pos = np.ascontiguousarray(ids), np.ascontiguousarray(pos)
        inputs = [torch.from_numpy(ids).to(dev), torch.from_numpy(pos).to(dev),
                  torch.full((B,), T, dtype=torch.long, device=dev),
                  *(torch.from_numpy(np.ascontiguousarray(m)).to(dev) for m in masks), *state.caches]
        with self._lock:
            out = self._run(inputs)
        return out[:, -1, :].cpu().numpy()

    def _decode_buffers(self, state: AotiState) -> DecodeBuffers:
        B, dev = state.batch, self.device
        buf = DecodeBuffers(
            input_ids=torch.zeros(B, 1, dtype=torch.long, device=dev),
            position_ids=torch.zeros(B, 1, dtype=torch.long, device=dev),
            write_index=torch.zeros(B, dtype=torch.long, device=dev),
            mask=torch.zeros(B, 1, 1, self.max_seq, dtype=torch.bool, device=dev) if self.full_mask else None,
            ring_mask=(torch.zeros(B, 1, 1, self.ring.window + 1, dtype=torch.bool, device=dev)
                       if self.ring is not None else None),
        )
        if dev != "cpu":  # pinned host copies so the per-token uploads are async DMA, not pageable copies
            buf.host = tuple(torch.zeros_like(t, device="cpu").pin_memory() for t in buf.inputs())
        return buf

    def _decode(self, state: AotiState, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray) -> np.ndarray:
        if state.decode is None:
            state.decode = self._decode_buffers(state)
        buf, T = state.decode, state.held
        if buf.host is None:  # CPU: the static buffers are host memory already
            self._fill(buf.inputs(), ids, pos, mask, T)
            with self._lock:
                out = self._run([*buf.inputs(), *state.caches])
            return out[:, -1, :].numpy()
        with self._lock:
            self._fill(list(buf.host), ids, pos, mask, T)
            for dst, src in zip(buf.inputs(), buf.host):
                dst.copy_(src, non_blocking=True)
            if not self.use_graph:
                out = self._run([*buf.inputs(), *state.caches])
            else:
                if state.graph is None:
                    self._capture(state)
                state.graph.replay()
                state.replays += 1
                out = state.graph_logits
            # .cpu() waits for the step; the pinned inputs may be rewritten only after it
            return out[:, -1, :].cpu().numpy()

    def _fill(self, tensors: list[Tensor], ids: np.ndarray, pos: np.ndarray, mask: np.ndarray, T: int) -> None:
        """Write one decode step's inputs into `tensors` (host memory, in DecodeBuffers.inputs order)."""
        ids_t, pos_t, wi_t, *masks = tensors
        ids_t.numpy()[:] = ids
        pos_t.numpy()[:] = pos
        wi_t.fill_(T)
        if self.full_mask:
            # slots past T+1 were never set (T only grows within a state), so only the held ones are written
            masks.pop(0).numpy()[..., : T + 1] = mask
        if self.ring is not None:
            masks.pop(0).numpy()[:] = sliding_mask(mask, self.ring.window, self.ring.window)

    def _capture(self, state: AotiState) -> None:
        """Capture this state's decode step once; replays reuse its buffers and cache addresses.

        The warm-up runs the real step on a side stream (lazy kernel loading and workspace
        allocation cannot happen under capture); it writes the same K/V rows the replay writes
        again, so it changes nothing the replay would not.
        """
        buf = state.decode
        assert buf is not None
        inputs = [*buf.inputs(), *state.caches]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(list(inputs))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            state.graph_logits = self._run(list(inputs))
        state.graph = graph
        state.captures += 1
