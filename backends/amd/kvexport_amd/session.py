"""The loaded AOTInductor package as a Session: direct calls on CPU, a captured HIP/CUDA graph per decode on GPU."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvexport.errors import ContextOverflowError, InputError
from kvexport.runtime.session import Session


@dataclass
class DecodeBuffers:
    """Static inputs of the one-token step: a captured graph reads these addresses on every replay."""

    input_ids: Tensor  # (B, 1) int64
    position_ids: Tensor  # (B, 1) int64
    write_index: Tensor  # (B,) int64
    mask: Tensor  # (B, 1, 1, cache_len) bool; slots past the held ones stay False
    host: tuple[Tensor, ...] | None = None  # pinned staging copies (GPU only)


@dataclass
class AotiState:
    batch: int
    caches: list[Tensor]  # past/present alternating key, value per layer: (B, H_kv, cache_len, D)
    held: int = 0  # slots T every row holds
    decode: DecodeBuffers | None = None
    graph: Any = None  # torch.cuda.CUDAGraph of the decode step (hipGraph on ROCm)
    graph_logits: Tensor | None = None  # the captured step's output buffer
    replays: int = 0
    captures: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class AotiSession(Session):
    """One AOTInductor runner over caches this session allocates at max_seq slots (policy "fixed").

    The package mutates the cache inputs in place, so a step copies nothing but its small inputs.
    """

    def __init__(self, runner: Any, *, device: str, dtype: torch.dtype, num_layers: int, kv_heads: int,
                 head_dim: int, max_seq: int, vocab_size: int, max_batch: int, use_graph: bool,
                 facts: dict[str, Any]):
        if use_graph and device == "cpu":
            raise InputError("graph capture needs a GPU; this package runs on the CPU (drop --option graphs)")
        self.runner, self.device, self.dtype = runner, device, dtype
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.max_seq, self.vocab_size, self.max_batch = max_seq, vocab_size, max_batch
        self.use_graph = use_graph
        self.facts = facts
        # One runner serves every state, so calls into it are serialized here: GPU runners are loaded
        # single-threaded (no internal pool, as graph capture needs), and concurrent calls into the
        # CPU runner deadlocked in its own wait for a free model (seen under pytest, 2 cores).
        self._lock = threading.Lock()

    # --- state --------------------------------------------------------------------------------
    def new_state(self, batch: int, capacity: int) -> AotiState:
        if not 1 <= batch <= self.max_batch:
            raise InputError(f"batch {batch} is outside 1..{self.max_batch}, the batch range this package was "
                             "compiled for; rebuild with a larger --max-batch")
        if capacity > self.max_seq:
            raise ContextOverflowError(f"the request needs {capacity} cache slots; this engine holds at most "
                                       f"{self.max_seq} (rebuild with a larger --max-seq)")
        shape = (batch, self.kv_heads, self.max_seq, self.head_dim)  # (B, H_kv, S_max, D)
        caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2 * self.num_layers)]
        return AotiState(batch=batch, caches=caches)

    def release(self, state: AotiState) -> None:
        state.graph, state.graph_logits, state.decode = None, None, None
        state.caches = []

    def cache_bytes(self, state: AotiState) -> int:
        return sum(c.numel() * c.element_size() for c in state.caches)

    def describe(self) -> dict[str, Any]:
        return {**self.facts, "cache_policy": "fixed", "cache_len": self.max_seq, "graph_capture": self.use_graph,
                "max_batch": self.max_batch}

    # --- step ---------------------------------------------------------------------------------
    def step(self, state: AotiState, input_ids: np.ndarray, position_ids: np.ndarray,
             attention_mask: np.ndarray) -> np.ndarray:
        B, S = self._check(state, input_ids, position_ids, attention_mask)
        T = state.held
        if S == 1:
            logits = self._decode(state, input_ids, position_ids, attention_mask)
        else:
            logits = self._prefill(state, input_ids, position_ids, attention_mask)
        state.held = T + S
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
        if T + S > self.max_seq:
            raise ContextOverflowError(f"{T} slots held + {S} new tokens pass this engine's {self.max_seq} slots; "
                                       "shorten the request or rebuild with a larger --max-seq")
        if mask.dtype != np.bool_ or mask.shape != (B, 1, S, T + S):
            raise InputError(f"attention_mask must be bool {(B, 1, S, T + S)}; got {mask.dtype}{mask.shape}")
        return B, S

    def _run(self, inputs: list[Tensor]) -> Tensor:
        return self.runner.boxed_run(inputs)[0]

    def _prefill(self, state: AotiState, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray) -> np.ndarray:
        B, S = ids.shape
        T = state.held
        full = np.zeros((B, 1, S, self.max_seq), dtype=np.bool_)  # (B, 1, S, cache_len)
        full[..., : T + S] = mask
        dev = self.device
        inputs = [torch.from_numpy(ids).to(dev), torch.from_numpy(pos).to(dev),
                  torch.full((B,), T, dtype=torch.long, device=dev), torch.from_numpy(full).to(dev), *state.caches]
        with self._lock:
            out = self._run(inputs)
        return out[:, -1, :].cpu().numpy()

    def _decode_buffers(self, state: AotiState) -> DecodeBuffers:
        B, dev = state.batch, self.device
        buf = DecodeBuffers(
            input_ids=torch.zeros(B, 1, dtype=torch.long, device=dev),
            position_ids=torch.zeros(B, 1, dtype=torch.long, device=dev),
            write_index=torch.zeros(B, dtype=torch.long, device=dev),
            mask=torch.zeros(B, 1, 1, self.max_seq, dtype=torch.bool, device=dev),
        )
        if dev != "cpu":  # pinned host copies so the per-token uploads are async DMA, not pageable copies
            buf.host = tuple(torch.empty_like(t, device="cpu").pin_memory()
                             for t in (buf.input_ids, buf.position_ids, buf.write_index, buf.mask))
            buf.host[3].zero_()
        return buf

    def _decode(self, state: AotiState, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray) -> np.ndarray:
        if state.decode is None:
            state.decode = self._decode_buffers(state)
        buf, T = state.decode, state.held
        if buf.host is None:  # CPU: the static buffers are host memory already
            self._fill(buf.input_ids, buf.position_ids, buf.write_index, buf.mask, ids, pos, mask, T)
            with self._lock:
                out = self._run([buf.input_ids, buf.position_ids, buf.write_index, buf.mask, *state.caches])
            return out[:, -1, :].numpy()
        with self._lock:
            h_ids, h_pos, h_wi, h_mask = buf.host
            self._fill(h_ids, h_pos, h_wi, h_mask, ids, pos, mask, T)
            for dst, src in zip((buf.input_ids, buf.position_ids, buf.write_index, buf.mask), buf.host):
                dst.copy_(src, non_blocking=True)
            if not self.use_graph:
                out = self._run([buf.input_ids, buf.position_ids, buf.write_index, buf.mask, *state.caches])
            else:
                if state.graph is None:
                    self._capture(state)
                state.graph.replay()
                state.replays += 1
                out = state.graph_logits
            # .cpu() waits for the step; the pinned inputs may be rewritten only after it
            return out[:, -1, :].cpu().numpy()

    @staticmethod
    def _fill(ids_t: Tensor, pos_t: Tensor, wi_t: Tensor, mask_t: Tensor, ids: np.ndarray, pos: np.ndarray,
              mask: np.ndarray, T: int) -> None:
        ids_t.numpy()[:] = ids
        pos_t.numpy()[:] = pos
        wi_t.fill_(T)
        # slots past T+1 were never set (T only grows within a state), so only the held ones are written
        mask_t.numpy()[..., : T + 1] = mask

    def _capture(self, state: AotiState) -> None:
        """Capture this state's decode step once; replays reuse its buffers and cache addresses.

        The warm-up runs the real step on a side stream (lazy kernel loading and workspace
        allocation cannot happen under capture); it writes the same K/V rows the replay writes
        again, so it changes nothing the replay would not.
        """
        buf = state.decode
        assert buf is not None
        inputs = [buf.input_ids, buf.position_ids, buf.write_index, buf.mask, *state.caches]
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
