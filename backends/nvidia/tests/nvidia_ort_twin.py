"""A Session that runs the nvidia target's lowered graph on ONNX Runtime CPU (tests only).

It holds the lowered IR (fp16, cache pinned to max_seq, RoPE in (B, N, S, H) form) to the same
slot model and fixed-capacity cache as the TensorRT session, so kvexport.verify can compare the
graph TensorRT would import with the PyTorch reference on a machine without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from kvexport.errors import ContextOverflowError
from kvexport.manifest import Manifest
from kvexport.runtime.ring import RingSpec, step_pieces
from kvexport.runtime.session import Session
from kvexport_nvidia.runtime import step_feeds

MAX_SEQ = 64  # the tiny test artifacts cache length
NP = {"tensor(float16)": np.float16, "tensor(float)": np.float32}


@dataclass
class TwinState:
    batch: int
    caches: list[np.ndarray]
    held: int = 0


def twin_options() -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    # ONNX Runtime fuses DequantizeLinear(int8/int4) + MatMul into MatMulNBits, by default at accuracy
    # level 4 (activations quantized to int8): a rounding TensorRT's weight-only GEMM does not do. Level 0
    # keeps the activations in float, as TensorRT's dequantize-then-GEMM does.
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    return so


class OrtTwinSession(Session):
    def __init__(self, onnx_path: Path, manifest: Manifest):
        so = twin_options()
        self.sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
        self.max_seq, self.vocab_size = manifest.max_seq, manifest.config.vocab_size
        self.pairs = manifest.kv_pairs()
        types = {i.name: i.type for i in self.sess.get_inputs()}
        self.cache_dtype = NP[types[self.pairs[0][0]]]
        c = manifest.cache
        self.ring = RingSpec.of(manifest)  # sliding layers on rings of R = min(window, max_seq) slots
        self.limit = self.ring.limit(self.max_seq) if self.ring else self.max_seq
        self.slots = [self.ring.length(self.max_seq) if self.ring and self.ring.is_ring(k) else self.max_seq
                      for k in range(len(self.pairs))]
        self.head = (c["kv_heads"], c["head_dim"])
        self.full_mask = "attention_mask" in {i.name for i in self.sess.get_inputs()}

    def new_state(self, batch: int, capacity: int) -> TwinState:
        if capacity > self.limit:  # as the TensorRT session does
            raise ContextOverflowError(f"{capacity} slots exceed the limit {self.limit}")
        return TwinState(batch, [np.zeros((batch, self.head[0], n, self.head[1]), self.cache_dtype) for n in self.slots])

    def cache_bytes(self, state: Any) -> int:
        """What the TensorRT session holds: these buffers, and a ring's second buffer beside each ring."""
        return sum(c.nbytes * (2 if self.ring and self.ring.is_ring(k) else 1) for k, c in enumerate(state.caches))

    def step(self, state: Any, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        logits = np.empty(0)
        limit = self.ring.length(self.max_seq) if self.ring else None
        for piece in step_pieces(input_ids, position_ids, attention_mask, limit):
            logits = self._piece(state, *piece)
        return logits

    def _piece(self, state: Any, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        B, S = input_ids.shape
        feeds = step_feeds(state.held, input_ids, position_ids, attention_mask, max_seq=self.max_seq, ring=self.ring,
                           full_mask=self.full_mask)
        feeds.update({past: c for (past, _), c in zip(self.pairs, state.caches)})
        out = self.sess.run(["logits", *[p for _, p in self.pairs]], feeds)
        state.caches = out[1:]
        state.held += S
        assert out[0].dtype == np.float32  # the lowering casts the logits back to fp32
        return out[0][:, -1, :]
