"""Weight-only int8/int4 for TensorRT: each MatMul weight becomes a quantized initializer + DequantizeLinear.

What TensorRT documents (operators Dequantize, "Explicit Quantization", "Working with Quantized
Types", TensorRT 10.x/11): quantization is symmetric (a zero point, if given, must be all zeros);
the scale must be a build-time constant, a 1-D tensor for per-channel or of the input's rank for
block quantization, blocked along the last or second-to-last dimension; INT4 is weight-only and
takes block scales; INT4 initializers pack two values a byte, the first in the low nibble (ONNX's
INT4 layout too). The parser turns ONNX `DequantizeLinear` (opset 21+, `block_size`) into
IDequantizeLayer with that block shape, and a strongly typed network (trt_build.network_flags)
keeps the DQ in front of the GEMM. So:
- int4: INT4 weights (K, N), one scale per `group_size` rows of K and column N: scale (K/g, N),
  axis 0, block_size g. The lm_head, and a layer whose K is not a multiple of g, get int8 instead.
- int8: INT8 weights, one scale per output column N: scale (N,), axis 1 (per-channel), the form
  TensorRT's INT8 weights have always taken (its INT8 block scales are newer).
Scales are written fp32 here; convert_precision then makes them the engine's fp16/bf16, the type
the DequantizeLinear output (and so the GEMM) takes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kvexport.errors import InputError

WeightMode = Literal["int8", "int4"]
MODES: tuple[WeightMode, ...] = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)
QMAX = {"int8": 127, "int4": 7}  # symmetric: -QMAX..QMAX (TensorRT clamps int4 to [-8, 7])
LM_HEAD = "lm_head/"  # the IR names the head's MatMul lm_head/MatMul_0


@dataclass
class WeightReport:
    mode: str
    group_size: int | None
    int4_layers: int = 0
    int8_layers: int = 0
    int8_instead_of_int4: list[str] = field(default_factory=list)  # lm_head, and K not a multiple of the group

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def check_mode(mode: str, group_size: int | None) -> None:
    if mode not in MODES:
        raise InputError(f"the nvidia target quantizes weights to int8 or int4, not {mode!r}")
    if mode == "int4" and group_size not in GROUP_SIZES:
        raise InputError(f"nvidia int4 takes --group-size {', '.join(map(str, GROUP_SIZES))}, not {group_size}")


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(K, N) fp32 -> int8 (K, N) and scale (N,): w ~ q * scale[None, :]."""
    scale = np.maximum(np.abs(w).max(axis=0) / QMAX["int8"], 1e-12).astype(np.float32)
    q = np.clip(np.rint(w / scale[None, :]), -QMAX["int8"], QMAX["int8"]).astype(np.int8)
    return q, scale


def quantize_int4(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(K, N) fp32, K a multiple of group_size -> q in [-7, 7] as int8 (K, N) and scale (K/g, N):
    w ~ q * scale[k // g, n]."""
    K, N = w.shape
    blocks = w.reshape(K // group_size, group_size, N)  # (G, g, N)
    scale = np.maximum(np.abs(blocks).max(axis=1) / QMAX["int4"], 1e-12).astype(np.float32)  # (G, N)
    q = np.clip(np.rint(blocks / scale[:, None, :]), -QMAX["int4"], QMAX["int4"]).astype(np.int8)
    return q.reshape(K, N), scale


def pack_int4(q: np.ndarray) -> bytes:
    """Signed 4-bit values, row-major, two a byte with the first in the low nibble (ONNX and TensorRT)."""
    flat = (q.reshape(-1).astype(np.int16) & 0xF).astype(np.uint8)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8).tobytes()


def dequantize(q: np.ndarray, scale: np.ndarray, group_size: int | None) -> np.ndarray:
    """The DequantizeLinear the graph holds, in numpy: per-channel (scale (N,)) or blocked along K."""
    if scale.ndim == 1:
        return q.astype(np.float32) * scale[None, :].astype(np.float32)
    assert group_size is not None
    return q.astype(np.float32) * np.repeat(scale.astype(np.float32), group_size, axis=0)


def quantize_weights(model: onnx.ModelProto, mode: WeightMode, group_size: int | None) -> WeightReport:
    """Every MatMul whose second input is a 2-D fp32 initializer reads it through a DequantizeLinear
    of an int8/int4 initializer instead; the fp32 initializer is removed. In place, before precision
    conversion. Raises InputError for a bad mode or group size."""
    check_mode(mode, group_size)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    uses: dict[str, int] = {}
    for node in g.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    report = WeightReport(mode=mode, group_size=group_size if mode == "int4" else None)
    new_nodes: list[onnx.NodeProto] = []
    drop: set[str] = set()
    for node in g.node:
        w = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if w is None or len(w.dims) != 2 or w.data_type != TensorProto.FLOAT or uses[w.name] != 1:
            new_nodes.append(node)
            continue
        arr = numpy_helper.to_array(w).astype(np.float32)  # (K, N)
        K, N = arr.shape
        layer = "int8" if mode == "int8" else "int4"
        if layer == "int4" and (node.name.startswith(LM_HEAD) or K % group_size):  # type: ignore[operator]
            layer = "int8"
            report.int8_instead_of_int4.append(node.name)
        base = w.name
        if layer == "int4":
            q, scale = quantize_int4(arr, group_size)  # type: ignore[arg-type]
            qt = helper.make_tensor(f"{base}/int4", TensorProto.INT4, [K, N], pack_int4(q), raw=True)
            attrs = {"axis": 0, "block_size": group_size}
            report.int4_layers += 1
        else:
            q, scale = quantize_int8(arr)
            qt = numpy_helper.from_array(q, f"{base}/int8")
            attrs = {"axis": 1}
            report.int8_layers += 1
        st = numpy_helper.from_array(scale, f"{base}/scale")
        g.initializer.extend([qt, st])
        drop.add(base)
        dq = helper.make_node("DequantizeLinear", [qt.name, st.name], [base], name=f"{node.name}/DequantizeLinear",
                              **attrs)
        new_nodes += [dq, node]  # the MatMul keeps reading `base`, now the DequantizeLinear's output
    kept = [i for i in g.initializer if i.name not in drop]
    del g.initializer[:]
    g.initializer.extend(kept)
    del g.node[:]
    g.node.extend(new_nodes)
    return report


def initializer_bytes(model: onnx.ModelProto) -> int:
    """Bytes of every initializer at its stored width (INT4: half a byte a value), scales included."""
    total = 0
    for t in model.graph.initializer:
        n = int(np.prod(t.dims)) if t.dims else 1
        if t.data_type in (TensorProto.INT4, TensorProto.UINT4):
            total += (n + 1) // 2
        else:
            total += n * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return total
