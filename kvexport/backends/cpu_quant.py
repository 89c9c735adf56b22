"""cpu int8/int4 weights: ONNX Runtime's own MatMulNBits quantizer over the optimized engine graph."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import onnx

BITS = {"int8": 8, "int4": 4}  # the weight modes this module makes
# int4: 32, as onnxruntime-genai's model builder; int8: 32 too (docs/backends/cpu.md has the measurement)
DEFAULT_GROUP_SIZE = {"int4": 32, "int8": 32}
LM_HEAD_BITS_UNDER_INT4 = 8  # the logits' projection is the most sensitive matmul; 8 bits as genai's builder
# int8 dot products in hardware: MatMulNBits then quantizes activations per block and multiplies in int8
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def accuracy_level(flags: set[str]) -> tuple[int, str]:
    """MatMulNBits' `accuracy_level` for a CPU with these ISA flags, and why."""
    have = [f for f in INT8_DOT_FLAGS if f in flags]
    if have:
        return 4, f"accuracy_level 4 (int8 compute): this CPU has {', '.join(have)}"
    # without VNNI too: on an AVX2-only AMD EPYC (Zen 3) level 4 ran one int4 matmul 2-5x faster than
    # level 0, and int8 at level 0 15x slower than fp32 (docs/backends/cpu.md)
    return 4, "accuracy_level 4 (int8 compute): measured faster than 0 (fp32 compute) on AVX2 without VNNI"


def lm_head(model: onnx.ModelProto, output: str = "logits") -> str | None:
    """The MatMul that makes `output` (the first one met walking back from it), or None."""
    producer = {o: n for n in model.graph.node for o in n.output}
    todo, seen = [output], set()
    while todo:
        name = todo.pop(0)
        node = producer.get(name)
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        if node.op_type == "MatMul":
            return node.name
        todo.extend(node.input)
    return None


def _quantize(model: onnx.ModelProto, bits: int, group_size: int, level: int, *, include: list[str] | None = None,
              exclude: list[str] | None = None) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    config = DefaultWeightOnlyQuantConfig(block_size=group_size, is_symmetric=True, accuracy_level=level, bits=bits,
                                          op_types_to_quantize=("MatMul",))
    q = MatMulNBitsQuantizer(model, bits=bits, block_size=group_size, is_symmetric=True, accuracy_level=level,
                             nodes_to_include=include, nodes_to_exclude=exclude, algo_config=config)
    q.process()
    return q.model.model


def quantize_engine(model_path: Path, data_name: str, weights: str, group_size: int, flags: set[str],
                    progress: Callable[[str], None]) -> dict[str, Any]:
    """Rewrite the optimized graph at model_path (external data in data_name beside it) with every MatMul on a
    constant weight as MatMulNBits: `weights` bits (int4: the lm_head at 8), RTN, symmetric, blocks of
    group_size along K. Returns the record for the manifest's target.weights."""
    import onnx

    level, why = accuracy_level(flags)
    t0 = time.perf_counter()
    model = onnx.load(str(model_path))  # the weights too: the quantizer reads them
    head = lm_head(model)
    quiet = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    before, quiet.level = quiet.level, logging.WARNING  # one INFO line per node otherwise
    try:
        bits = BITS[weights]
        head_bits = LM_HEAD_BITS_UNDER_INT4 if bits == 4 else bits
        keep_apart = [head] if head is not None and head_bits != bits else None
        model = _quantize(model, bits, group_size, level, exclude=keep_apart)
        if keep_apart:
            model = _quantize(model, head_bits, group_size, level, include=keep_apart)
    finally:
        quiet.setLevel(before)
    matmuls = sum(n.op_type == "MatMul" for n in model.graph.node)
    nbits = sum(n.op_type == "MatMulNBits" for n in model.graph.node)
    (model_path.parent / data_name).unlink(missing_ok=True)  # onnx appends to an existing data file
    onnx.save_model(model, str(model_path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data_name, size_threshold=1024)
    progress(f"cpu: {nbits} matmuls to MatMulNBits {weights} (group {group_size}, lm_head {head_bits}-bit, "
             f"{why}) in {time.perf_counter() - t0:.1f}s")
    return {"method": "rtn", "symmetric": True, "accuracy_level": level, "accuracy_level_reason": why,
            "lm_head_bits": head_bits if head is not None else None, "matmulnbits_nodes": nbits,
            "float_matmuls_left": matmuls, "embeddings": "fp32 Gather"}
