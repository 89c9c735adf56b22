"""kvexport's native quantized matmul for ONNX Runtime (qmatmul.c beside this file), and the load-time swap to it.

The `cpu` target's int4 engines hold ONNX Runtime's standard `MatMulNBits` nodes on disk. When such an engine is
loaded on a CPU with AVX512-VNNI or AVX2+FMA and the library was built at install (setup.py), every 4-bit node the
kernel takes (symmetric blocks, float scales, block size a multiple of 32) becomes `ai.kvexport.QMatMul`, with
the same inputs and attributes, in the graph handed to ONNX Runtime; the file is not changed. Activations are
quantized to int8 per 32-block, as MatMulNBits does at accuracy_level 4 (which takes the weights' block instead,
where that is wider): at blocks of 32 the two agree to summation order. Every other node stays ONNX Runtime's
(docs/backends/cpu.md).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DOMAIN = "ai.kvexport"
OP = "QMatMul"
LIBRARY = Path(__file__).with_name("libkvexport_qmatmul.so")
REQUIRE_ENV = "KVEXPORT_REQUIRE_NATIVE"  # set (CI): a missing library is an error, not a fallback
ISA_ENV = "KVEXPORT_QMATMUL_ISA"  # "avx2": the AVX2 kernel on a CPU that has AVX512-VNNI as well


@dataclass(frozen=True)
class Kernel:
    """Which quantized-matmul kernel a load will use, and why."""

    usable: bool
    isa: str  # "avx512-vnni", "avx2" or "" where unusable
    why: str

    def record(self, swapped: int = 0) -> dict[str, Any]:
        name = f"kvexport QMatMul ({self.isa})" if self.usable and swapped else "onnxruntime MatMulNBits"
        return {"kernel": name, "nodes": swapped, "why": self.why}


NOT_ASKED = Kernel(False, "", "not asked")  # a session made without asking for the kernel (an fp32 floor)


def isa_of(flags: set[str]) -> str:
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        return "avx512-vnni"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return ""


def kernel(flags: set[str] | None = None, library: Path | None = None) -> Kernel:
    """Whether this machine can run the native kernel: the library built at install (`library`, by default
    LIBRARY) and the ISA it needs."""
    library = LIBRARY if library is None else library
    if flags is None:
        from kvexport.doctor import read_cpu_flags

        flags = read_cpu_flags()
    isa = isa_of(flags)
    if isa and os.environ.get(ISA_ENV) == "avx2":
        isa = "avx2"  # the library reads the same variable (tests run both kernels where the CPU has both)
    if not library.is_file():
        why = ("not built: pip install found no ONNX Runtime C API headers or no C compiler "
               "(run kvexport/native/fetch_ort_headers.sh, then pip install again)")
        if os.environ.get(REQUIRE_ENV):
            from kvexport.errors import BackendUnavailableError

            raise BackendUnavailableError(f"kvexport's native quantized matmul is {why}; {REQUIRE_ENV} is set")
        return Kernel(False, "", why)
    if not isa:
        return Kernel(False, "", "this CPU has neither AVX512-VNNI nor AVX2+FMA")
    return Kernel(True, isa, f"this CPU has {isa}")


def _attrs(node: Any) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


# The widths swapped in at load. The op computes 8-bit blocks too (on AVX512-VNNI), but on the Zen 4 measured
# ONNX Runtime's 8-bit kernel already reads at the memory's rate: bench-1b's int8 decode step ran 0.94x with
# ours (prefill 1.3-1.5x), so 8-bit nodes stay ONNX Runtime's (docs/backends/cpu.md).
SWAP_BITS = (4,)


def takes(node: Any, dtypes: dict[str, int], isa: str = "avx512-vnni", widths: tuple[int, ...] = SWAP_BITS) -> bool:
    """A MatMulNBits node the kernel computes and `widths` names: 4 bits, or 8 where `isa` is AVX512-VNNI (AVX2's
    u8 x s8 multiply would saturate on 8-bit weights); A/B/scales only (symmetric), float scales, blocks of a
    multiple of 32 that divide K. `dtypes`: initializer name -> ONNX data type."""
    from onnx import TensorProto

    if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
        return False
    inputs = list(node.input)
    if len(inputs) < 3 or any(inputs[3:]):  # zero points, g_idx or bias
        return False
    a = _attrs(node)
    block, k = int(a.get("block_size", 0)), int(a.get("K", 0))
    bits = int(a.get("bits", 4))
    return ((bits == 4 or (bits == 8 and isa == "avx512-vnni")) and bits in widths
            and block >= 32 and block % 32 == 0 and k % block == 0
            and dtypes.get(inputs[1]) == TensorProto.UINT8 and dtypes.get(inputs[2]) == TensorProto.FLOAT)


def swap(model: Any, isa: str = "avx512-vnni", widths: tuple[int, ...] = SWAP_BITS, huge_pages: bool = True) -> int:
    """Turn each MatMulNBits node of `widths` bits the kernel takes on `isa` into ai.kvexport.QMatMul, in place;
    the number swapped. `huge_pages`: whether the kernel asks for huge pages for its packed weights."""
    from onnx import helper

    dtypes = {t.name: t.data_type for t in model.graph.initializer}
    n = 0
    for node in model.graph.node:
        if takes(node, dtypes, isa, widths):
            node.op_type, node.domain = OP, DOMAIN
            kept = [a for a in node.attribute if a.name in ("K", "N", "bits", "block_size")]
            del node.attribute[:]
            node.attribute.extend([*kept, helper.make_attribute("huge_pages", int(huge_pages))])
            n += 1
    if n and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return n


def open_session(model_path: Path, options: Any, kern: Kernel, huge_pages: bool = True) -> tuple[Any, int]:
    """An ONNX Runtime CPU session of `model_path` with the kernel swapped in where it applies (its weights read
    from the graph's own external-data folder), and the number of nodes swapped; 0 where none applies, in which
    case the file is loaded as it is."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(model_path), load_external_data=False) if kern.usable else None
    n = swap(model, kern.isa, huge_pages=huge_pages) if model is not None else 0
    if not n:
        return ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"]), 0
    options.register_custom_ops_library(str(LIBRARY))
    options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                     str(model_path.parent))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]), n
