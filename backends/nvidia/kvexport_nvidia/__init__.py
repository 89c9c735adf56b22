"""kvexport's nvidia target: TensorRT engines with in-place KV cache, fused attention and CUDA-graph decode."""
from __future__ import annotations

from kvexport_nvidia.backend import NvidiaBackend

__all__ = ["NvidiaBackend"]
