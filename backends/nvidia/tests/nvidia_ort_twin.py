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
from kvexport.runtime.session import Session

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
        self.cache_shape = (c["kv_heads"], self.max_seq, c["head_dim"])

    def new_state(self, batch: int, capacity: int) -> TwinState:
        if capacity > self.max_seq:  # as the TensorRT session does
            raise ContextOverflowError(f"{capacity} slots exceed max_seq {self.max_seq}")
        return TwinState(batch, [np.zeros((batch, *self.cache_shape), self.cache_dtype) for _ in self.pairs])

    def step(self, state: Any, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        B, S = input_ids.shape
        full = np.zeros((B, 1, S, self.max_seq), dtype=np.bool_)
        full[..., : attention_mask.shape[-1]] = attention_mask
        feeds = {"input_ids": input_ids, "position_ids": position_ids,
                 "write_index": np.full((B,), state.held, dtype=np.int64), "attention_mask": full}
        feeds.update({past: c for (past, _), c in zip(self.pairs, state.caches)})
        out = self.sess.run(["logits", *[p for _, p in self.pairs]], feeds)
        state.caches = out[1:]
        state.held += S
        assert out[0].dtype == np.float32  # the lowering casts the logits back to fp32
        return out[0][:, -1, :]
