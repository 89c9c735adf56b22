"""The intel target's decode steps through kvexport's own matmul over NNCF's compressed weights.

At batch 1 a decode step reads every weight once, so its time is the weights' bytes over the rate they are read.
On the 2-core AMX Xeon, OpenVINO 2026.4's CPU plugin read bench-1b's int4 (INT4_ASYM, group 128) weights at ~12
GB/s in a decode step, about half the two cores' read bandwidth, and its int8 ones at ~14 GB/s (docs/performance.md).
The op `kvexport.QGemv` (kvexport_intel/native/qgemv.cpp) computes such a matmul from the weights where the IR keeps
them (u4 or u8 values, u4 or u8 zero points, f16 scales: no copy, no repacking), with AVX512-VNNI dot products over
activations quantized to int8 per 32 values, as the plugin's own dynamic quantization does.

Under bf16 activations the op also takes the f32 weights an fp32/bf16 engine's IR holds (bits 16): the decode form
reads a bf16 copy of each, which the op's library rounds at load (kvexport_qgemv_bf16: nearest even, as the plugin's
own conversion), with AVX512-BF16 dot products (on the AMX Xeon 1.12x the plugin's bf16 matmuls on bench-1b).

It replaces the compressed matmuls of the paged form that runs decode steps (PagedRows' request); prompts run a
second paged form over the same block caches with the plugin's matmuls (its AMX kernels are faster for many
rows), as do steps of more than GEMV_ROWS rows. Over bf16 copies, where the op was compiled for AMX-BF16, its tiles
take those steps instead (choose_rows): one paged form then runs every step over the one copy, where the plugin's
second form would prepare a second. The op is compiled like the i8 cache's (kvexport_intel.extension).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from kvexport.errors import BackendUnavailableError, InputError
from kvexport_intel.extension import NATIVE, compile_op, missing_compiler
from kvexport_intel.isa import PRECISIONS

SOURCE = NATIVE / "qgemv.cpp"
OP_TYPE = "QGemv"
# rows a step may have for the decode form to take it: the op's time grows with its rows (each row's dot products
# are its own), the plugin's barely over a few. On the 2-core AMX Xeon the op took bench-1b's int4 g128 step from
# 65 to 46 ms at one row (docs/performance.md); on 8192 x 2048 int4 matrices it took 1.44x its one-row time at 2
# rows, 1.89x at 3, 2.28x at 4: about the plugin's step at 2 rows, slower from 3.
GEMV_ROWS = 2
CHOICES = ("auto", "kvexport", "openvino")
FLOAT_WEIGHTS = PRECISIONS  # fp32/bf16 artifacts, whose IR holds f32 weights: the op reads bf16 copies of them
# a build of the op a process may ask for through its environment, so that the loops other CPUs run are tested on
# this one: KVEXPORT_QGEMV_PORTABLE=1 without AVX512-VNNI (one build a process: two would register the same op)
VARIANTS = {"KVEXPORT_QGEMV_PORTABLE": ("-mno-avx512vnni", "-mno-avx512bf16")}


def library() -> Path:
    """The op's extension library, compiled here the first time (BackendUnavailableError where it cannot be)."""
    flags = sum((extra for name, extra in VARIANTS.items() if os.environ.get(name) == "1"), ())
    return compile_op(SOURCE, "qgemv", "kvexport's decode matmul (QGemv)",
                      "load with --option decode_matmul=openvino", flags)


def kernel(lib: Path, bf16: bool = False) -> str:
    """What the library computes with, as compiled for this CPU: int8/int4 weights "AVX512-VNNI" or "portable", bf16
    weights (bf16=True) "AVX512-BF16" or "portable"."""
    said = getattr(ctypes.CDLL(str(lib)), "kvexport_qgemv_bf16_kernel" if bf16 else "kvexport_qgemv_kernel")
    said.restype = ctypes.c_char_p
    return said().decode()


def rows_kernel(lib: Path) -> str:
    """What the library's steps of more than GEMV_ROWS rows (prompts) over bf16 weights compute with: "AMX-BF16" where
    it was compiled for AMX and the kernel lends this process the tiles, else "" (a row at a time, as decode
    steps)."""
    said = ctypes.CDLL(str(lib)).kvexport_qgemv_bf16_rows_kernel
    said.restype = ctypes.c_char_p
    return said().decode()


def bf16_copies(weights: str | None, activations: str | None) -> bool:
    """Whether the decode form's f32 weights become the op's bf16 copies: float weights run at bf16 activations."""
    return weights in FLOAT_WEIGHTS and activations == "bf16"


@functools.lru_cache(maxsize=None)
def _bf16_converter(lib: Path) -> Any:
    convert = ctypes.CDLL(str(lib)).kvexport_qgemv_bf16
    convert.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    convert.restype = None
    return convert


def to_bf16(lib: Path, values: np.ndarray) -> Any:
    """`values` (f32) rounded to bf16 (nearest even) by the op's library, as the bytes of an OpenVINO u8 tensor (memory
    OpenVINO owns: a Constant over it keeps it, where one over a numpy array's memory would not keep the array)."""
    import openvino as ov

    src = np.ascontiguousarray(values, dtype=np.float32)
    dst = ov.Tensor(ov.Type.u8, ov.Shape([src.size * 2]))
    _bf16_converter(lib)(src.ctypes.data, dst.data.ctypes.data, src.size)
    return dst


def choose(asked: str | None, flags: set[str], weights: str | None, compile: bool = True,
           activations: str = "bf16") -> tuple[bool, str]:
    """Whether the decode form takes kvexport's matmul, and why: `asked` the load option decode_matmul (None: auto),
    `flags` this CPU's, `weights` the artifact's weight dtype (int8, int4, fp32, bf16), `activations` the precision the
    engine runs in ("bf16" or "fp32": f32 or bf16 weights take the op only under bf16, which rounds them to bf16 as
    the plugin does). compile=False (what `kvexport doctor` asks) only looks for the compiler instead of compiling
    the op."""
    asked = asked or "auto"
    if asked not in CHOICES:
        raise InputError(f"decode_matmul must be one of {', '.join(CHOICES)}, not {asked!r}")
    if asked == "openvino":
        return False, "decode_matmul=openvino was asked for: the plugin's matmuls"
    floats = weights in FLOAT_WEIGHTS
    if not floats and weights not in ("int8", "int4"):
        return False, f"{weights} weights: the plugin's matmuls (kvexport's decode matmul takes int8/int4/bf16 weights)"
    if floats and activations != "bf16":
        return False, (f"{weights} weights at f32 activations: the plugin's f32 matmuls (kvexport's decode matmul "
                       "takes float weights under bf16 activations, as bf16)")
    isa = "AVX512-BF16" if floats else "AVX512-VNNI"
    if asked == "auto" and not {"avx512f", "avx512bw", "avx512_bf16" if floats else "avx512_vnni"} <= flags:
        return False, (f"this CPU lacks {isa}, which kvexport's decode matmul is written for: the plugin's "
                       "matmuls (decode_matmul=kvexport runs its portable loops)")
    if not compile:
        missing = missing_compiler()
        if missing is not None:
            return False, f"kvexport's decode matmul is compiled with a C++ compiler and {missing!r} is not on PATH"
        return True, "kvexport's QGemv (" + (isa if ("avx512_bf16" if floats else "avx512_vnni") in flags
                                             else "portable") + ")"
    try:
        lib = library()
    except BackendUnavailableError as e:
        if asked == "kvexport":
            raise
        return False, f"kvexport's decode matmul cannot be compiled here ({e}): the plugin's matmuls"
    return True, f"kvexport's QGemv ({kernel(lib, floats)})"


def choose_rows(asked: str | None, lib: Path) -> tuple[bool, str]:
    """Whether steps of more than GEMV_ROWS rows (prompts, batches) of a float engine whose decode steps read the op's
    bf16 copies take the op too (`asked`: the load option prompt_matmul, None for auto), and why: its AMX-BF16 tiles,
    over the same copies, in the same paged form; else a second form with the plugin's matmuls, which prepares a
    second copy. On the AMX Xeon, bench-1b's prompts took as long either way (docs/performance.md)."""
    asked = asked or "auto"
    if asked not in CHOICES:
        raise InputError(f"prompt_matmul must be one of {', '.join(CHOICES)}, not {asked!r}")
    if asked == "openvino":
        return False, "prompt_matmul=openvino was asked for: a second paged form with the plugin's matmuls"
    if rows_kernel(lib) != "AMX-BF16":
        why = "kvexport's prompt matmul is written for AMX-BF16, which this CPU (or its kernel) does not lend"
        if asked == "kvexport":
            raise BackendUnavailableError(f"{why}: load with prompt_matmul=auto or openvino")
        return False, f"{why}: a second paged form with the plugin's matmuls"
    return True, ("kvexport's QGemv (AMX-BF16) over the decode steps' bf16 copies: one paged form, one copy of the "
                  "weights")


def available_memory() -> int | None:
    """Bytes of memory the kernel says a new allocation can take (/proc/meminfo's MemAvailable); None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def copy_fits(asked: str | None, copy_bytes: int, available: int | None) -> tuple[bool, str | None]:
    """Whether float weights' decode steps may take the op where prompts keep the plugin's matmuls (choose_rows): its
    bf16 copy (`copy_bytes`) is then a second copy of the weights beside the plugin's: under auto only while it takes
    at most half the memory `available`, so that a model whose one bf16 copy fits this machine is not pushed out of
    it by the second (decode_matmul=kvexport takes it anyway). Returns (fits, why not)."""
    if (asked or "auto") != "auto" or available is None or 2 * copy_bytes <= available:
        return True, None
    gib = 2 ** 30
    return False, (f"the decode matmul's bf16 copy of the weights ({copy_bytes / gib:.1f} GiB, a second copy beside "
                   f"the plugin's) would take more than half of the memory available ({available / gib:.1f} GiB): "
                   "the plugin's matmuls (decode_matmul=kvexport takes it anyway)")


def _bytes(node: Any) -> Any:
    """A u8 Constant over a Constant's bytes (the IR's own memory, not a copy)."""
    import openvino as ov

    raw = np.ascontiguousarray(node.get_data()).view(np.uint8).reshape(-1)
    # the view keeps the original constant's memory alive (numpy's base chain) as long as the new one lives
    return ov.op.Constant(ov.Tensor(raw, [raw.size], ov.Type.u8), shared_memory=True).output(0)


def compressed_weight(matmul: Any) -> tuple[Any, Any, Any, int, int, int, int] | None:
    """(values, zero points, scales, bits, N, K, group) of a MatMul X @ W^T whose W is NNCF's decompression,
    reshaped from groups and converted to f32 as the IR holds it: asymmetric, (Convert(values) - Convert(zero
    points)) * scales (u4 or u8), or INT4_SYM's Convert(values) * scales (i4; zero points None). None for any other
    weight, or one the op does not take (4 bits: groups of 32, 64 or a multiple of 128, over a multiple of 128
    inputs; 8 bits: one group a row, over a multiple of 64)."""
    import openvino as ov

    attrs = matmul.get_attributes()
    if attrs.get("transpose_a") or not attrs.get("transpose_b"):
        return None
    node = matmul.input_value(1).get_node()
    for skip in ("Convert", "Reshape"):
        if node.get_type_name() == skip:
            node = node.input_value(0).get_node()
    if node.get_type_name() != "Multiply":
        return None
    values, scales = node.input_value(0).get_node(), node.input_value(1).get_node()
    if scales.get_type_name() != "Constant" or scales.get_element_type() not in (ov.Type.f16, ov.Type.f32):
        return None
    z = None
    if values.get_type_name() == "Subtract":
        cw, cz = values.input_value(0).get_node(), values.input_value(1).get_node()
        if cz.get_type_name() != "Convert" or cz.input_value(0).get_node().get_type_name() != "Constant":
            return None
        values, z = cw, cz.input_value(0).get_node()
    if values.get_type_name() != "Convert" or values.input_value(0).get_node().get_type_name() != "Constant":
        return None
    w = values.input_value(0).get_node()
    shape, et = list(w.get_output_shape(0)), w.get_element_type()
    zt = None if z is None else z.get_element_type()
    if len(shape) == 3 and (et, zt) in ((ov.Type.u4, ov.Type.u4), (ov.Type.i4, None)):
        n, k, group, bits = shape[0], shape[1] * shape[2], shape[2], 4
        if group not in (32, 64) and group % 128:
            return None
    elif len(shape) == 2 and et == ov.Type.u8 and zt == ov.Type.u8:
        n, k, group, bits = shape[0], shape[1], shape[1], 8
    else:
        return None
    groups = k // group
    if k % (128 if bits == 4 else 64) or int(np.prod(scales.get_output_shape(0))) != n * groups or \
            (z is not None and int(np.prod(z.get_output_shape(0))) != n * groups):
        return None
    return w, z, scales, bits, n, k, group


def float_weight(matmul: Any) -> tuple[Any, int, int] | None:
    """(constant, N, K) of a MatMul X @ W^T whose W is an f32 Constant [N, K] (the IR of fp32/bf16 engines), else
    None."""
    import openvino as ov

    attrs = matmul.get_attributes()
    w = matmul.input_value(1).get_node()
    if attrs.get("transpose_a") or not attrs.get("transpose_b") or w.get_type_name() != "Constant" or \
            w.get_element_type() != ov.Type.f32 or len(w.get_output_shape(0)) != 2:
        return None
    n, k = (int(d) for d in w.get_output_shape(0))
    return w, n, k


def _copy_key(w: Any, n: int, k: int) -> tuple[Any, ...]:
    """What tells an f32 weight of one form of an engine from another's: its name, shape and a strided sample of its
    values (two forms read from one IR name a weight alike; a projection cut in one form and not in the other
    differs in shape or values)."""
    values = w.get_data().reshape(-1)
    sample = values[:: max(1, values.size // 4096)]
    return w.get_friendly_name(), n, k, hashlib.sha256(np.ascontiguousarray(sample).tobytes()).hexdigest()


def to_qgemv(model: Any, lib: Path, floats: bool = False, copies: dict[tuple[Any, ...], Any] | None = None) -> int:
    """Replace every MatMul over a compressed weight the op takes (compressed_weight), and with `floats` (an fp32/bf16
    engine run at bf16 activations) every one over an f32 weight (float_weight: the op then reads a bf16 copy the
    library rounds, the only copy this form holds), by kvexport's QGemv over the same constants' bytes, in place;
    returns how many were replaced. Without `floats` an f32 weight keeps the plugin's matmul (a compressed engine's
    uncompressed layer, or any run at f32 activations, stays exact). `copies` (a session's) keeps each bf16 copy
    made, so that a second form of the same engine reads the first's instead of making its own."""
    import openvino as ov
    from openvino.utils.node_factory import NodeFactory

    factory = NodeFactory()
    factory.add_extension(str(lib))
    done = 0
    unused = None
    for matmul in [op for op in model.get_ordered_ops() if op.get_type_name() == "MatMul"]:
        found = compressed_weight(matmul)
        plain = float_weight(matmul) if found is None and floats else None
        if plain is not None:
            w, n, k = plain
            if unused is None:  # bf16 reads neither zero points nor scales
                unused = (ov.op.Constant(np.zeros(1, np.uint8)).output(0),
                          ov.op.Constant(np.ones(1, np.float32)).output(0))
            key = _copy_key(w, n, k)
            tensor = None if copies is None else copies.get(key)
            if tensor is None:
                tensor = to_bf16(lib, w.get_data())
                if copies is not None:
                    copies[key] = tensor
            copy = ov.op.Constant(tensor, shared_memory=True)
            op = factory.create(OP_TYPE, [matmul.input_value(0), copy.output(0), *unused],
                                {"n": n, "k": k, "group": k, "bits": 16, "flip": 0})
            op.set_friendly_name(matmul.get_friendly_name())
            matmul.output(0).replace(op.output(0))
            done += 1
            continue
        if found is None:
            continue
        w, z, scales, bits, n, k, group = found
        if z is None:  # INT4_SYM: signed values, which the op flips into v + 8 against zero points of 8
            eights = ov.op.Constant(np.full(-(-n * (k // group) // 2), 0x88, np.uint8)).output(0)
        op = factory.create(OP_TYPE, [matmul.input_value(0), _bytes(w), eights if z is None else _bytes(z),
                                      scales.output(0)],
                            {"n": n, "k": k, "group": group, "bits": bits, "flip": int(z is None)})
        op.set_friendly_name(matmul.get_friendly_name())
        matmul.output(0).replace(op.output(0))
        done += 1
    if done:
        model.validate_nodes_and_infer_types()
    return done
