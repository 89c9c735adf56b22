"""The intel target's `i8` cache: kvexport's own int8 blocks under its own paged-attention op.

OpenVINO 2026.4's only 8-bit cache (`u8`) stores an f32 scale and an f32 zero point per token and head: 72 bytes per
64 values at head_dim 64, 0.281x an f32 cache. Its `KV_CACHE_PRECISION` has no symmetric int8, and a scale group
wider than the head does not compile. The `i8` cache stores each token's key and value for one KV head as head_dim
int8 values with one f32 scale (68 bytes per 64: 0.266x), through the op `kvexport.Int8PagedAttention`
(kvexport_intel/native/int8_paged_attention.cpp), which replaces each PagedAttentionExtension of the engine's paged
form (kvexport_intel.paged.to_paged) and takes the same sequence inputs.

The op is an OpenVINO extension library compiled from that one source file the first time an `i8` engine compiles
its paged form (kvexport_intel.extension: about 3 s once). Nothing of it comes from an artifact. The state
(batches, rings) has no such cache: an `i8` engine's stateful calls hold OpenVINO's u8.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from kvexport.errors import BackendUnavailableError
from kvexport_intel.extension import NATIVE, compile_op, missing_compiler
from kvexport_intel.isa import auto_precision
from kvexport_intel.paged import KEY_CACHE, PA_OP

SOURCE = NATIVE / "int8_paged_attention.cpp"
OP_TYPE = "Int8PagedAttention"
BLOCK = 32  # tokens a block, as OpenVINO's CPU plugin pages its own caches
SCALE_BYTES = 4  # each slot's f32 scale, held in its block after the values
# the op takes PagedAttentionExtension's first ports (OpenVINO 2026.4) in its order, the caches (KEY_CACHE and the
# port after it) new ones
PA_INPUTS, QUERY = 11, 0


# builds of the op a process may ask for through its environment, so that the kernels other CPUs run are tested on
# this one: KVEXPORT_I8_AVX2=1 without AVX-512 (an AVX2 Zen 3's: AVX2 kernels, prompts in int16 pairs),
# KVEXPORT_I8_PORTABLE=1 without AVX2 (the portable loops alone), KVEXPORT_I8_F32_PROMPTS=1 with every kernel in f32,
# prompts' and decode steps' (with AVX-512: an AVX-512 CPU without VNNI and AVX512-BF16, Skylake; beside
# KVEXPORT_I8_AVX2: the AVX2 kernels in f32), KVEXPORT_I8_NO_BF16=1 without AVX512-BF16 (VNNI scores, f32 weighted
# values: Cascade Lake, Ice Lake), KVEXPORT_I8_NO_AMX=1 without AMX (an AMX CPU's prompts in VNNI and AVX512-BF16, as a
# Sapphire Rapids without AMX would, or a Zen 4). One build a process: two builds of the op cannot be loaded in one process (they
# register the same op).
VARIANTS = {"KVEXPORT_I8_AVX2": ("-mno-avx512f",), "KVEXPORT_I8_PORTABLE": ("-mno-avx2",),
            "KVEXPORT_I8_F32_PROMPTS": ("-DKVEXPORT_I8_F32_PROMPTS",), "KVEXPORT_I8_NO_BF16": ("-mno-avx512bf16",),
            "KVEXPORT_I8_NO_AMX": ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")}


def library() -> Path:
    """The op's extension library, compiled here the first time (BackendUnavailableError where it cannot be)."""
    flags = sum((extra for name, extra in VARIANTS.items() if os.environ.get(name) == "1"), ())
    return compile_op(SOURCE, "int8", "the i8 cache's attention op", "load with --option kv_precision=u8", flags)


# the head sizes whose prompts the op computes on AMX tiles where the CPU has them (attend_tile_amx)
AMX_HEAD_DIMS = (32, 64, 96, 128)


def int8_format(flags: set[str], compile: bool = True, activations: str | None = None,
                head_dim: int | None = None) -> tuple[str, str]:
    """The format `--kv int8` takes where the build names none (--option kv_precision=u8 or i8), and why: `i8` where
    this CPU runs the op's vector kernels (AVX-512, or AVX2 with FMA), the op compiles here (this compiles it, once;
    compile=False, as `kvexport doctor` asks, only looks for the compiler) and, on an AMX CPU under bf16 activations
    (where OpenVINO's u8 kernel computes prompts on AMX tiles), the op's prompts run on AMX tiles too (head sizes
    AMX_HEAD_DIMS, where Linux grants the process the tiles); else OpenVINO's `u8`. `activations` ("fp32" or
    "bf16"): the build's inference precision, None: this CPU's automatic one; `head_dim`: the model's (None: one of
    AMX_HEAD_DIMS, as doctor assumes)."""
    other = "; --option kv_precision=i8 asks for kvexport's i8 cache regardless"
    if "avx512f" in flags:
        isa = "AVX-512"
    elif {"avx2", "fma"} <= flags:
        isa = "AVX2"
    else:
        return "u8", ("this CPU has neither AVX-512 nor AVX2 with FMA, which the i8 cache's kernels are written for "
                      "(elsewhere it runs portable loops, several times slower than OpenVINO's u8)" + other)
    activations = activations or auto_precision(flags)
    amx = {"amx_tile", "amx_int8", "amx_bf16"} <= flags
    u8_on_tiles = ("amx_bf16" in flags or "amx_int8" in flags) and activations == "bf16"
    size = head_dim or AMX_HEAD_DIMS[0]
    if u8_on_tiles and (not amx or size not in AMX_HEAD_DIMS):
        lacking = f"head_dim {head_dim}" if amx else "this CPU (it lacks one of AMX-TILE, AMX-INT8, AMX-BF16)"
        return "u8", ("under bf16 activations OpenVINO's u8 kernel computes prompts on this CPU's AMX tiles, which the "
                      f"i8 cache's prompt kernel does not for {lacking} (its AMX form takes head sizes "
                      f"{', '.join(map(str, AMX_HEAD_DIMS))}; on a 2-core AMX Xeon its vector kernels took 1.6x "
                      "u8's time for a 4096-token prompt)" + other)
    missing = missing_compiler() if not compile else None
    if missing is not None:
        return "u8", f"the i8 cache's op is compiled with a C++ compiler and {missing!r} is not on PATH"
    try:
        if compile:
            lib = library()
            if u8_on_tiles and "prompts: AMX" not in kernels(lib, size):
                return "u8", ("under bf16 activations OpenVINO's u8 kernel computes prompts on this CPU's AMX tiles, "
                              "and the i8 cache's op as compiled here runs no prompt on them (it needs the compiler's "
                              "AMX intrinsics, and Linux 5.16 or later, which grants a process the tiles on request)"
                              + other)
    except BackendUnavailableError as e:
        return "u8", f"the i8 cache's op cannot be compiled here: {e}"
    return "i8", ("kvexport's int8 blocks: one f32 scale per token and KV head (0.266x an f32 cache at head_dim 64; "
                  f"u8 keeps a scale and a zero point, 0.281x), their {isa} kernels on this CPU"
                  + (", prompts on AMX tiles (on a 2-core AMX Xeon under bf16 activations: a 4096-token prompt "
                     "0.94x u8's time, decode steps 1.16x u8's speed there, 0.92-0.97x after 512 tokens, 0.88-0.92x after 32)"
                     if amx and u8_on_tiles else
                     " (with AMX, under f32 activations: there u8 decoded 0.83x the i8 cache at 4096 tokens, its "
                     "prompts level)" if amx else "") + "; "
                  "--option kv_precision=u8 for OpenVINO's u8")


def kernels(lib: Path, head_dim: int) -> str:
    """What the library's kernels for `head_dim` compute with (for instance "decode: AVX-512, scores int8 (VNNI),
    weighted values f32; prompts: AVX-512, scores int8 (VNNI), weighted values bf16 (AVX512-BF16)"), as the library
    itself says."""
    import ctypes

    said = ctypes.CDLL(str(lib)).kvexport_i8_kernels
    said.restype, said.argtypes = ctypes.c_char_p, [ctypes.c_int64]
    return said(head_dim).decode()


def to_int8_blocks(model: Any, *, kv_heads: int, head_dim: int, lib: Path) -> int:
    """Replace every PagedAttentionExtension of the paged `model` (to_paged's) by kvexport's Int8PagedAttention over
    new int8 cache inputs key_cache.i / value_cache.i of shape (blocks, kv_heads, BLOCK, head_dim + 4), in place;
    returns how many were replaced. The query heads are read off each op's query input, (tokens, heads x head_dim)."""
    import openvino as ov
    import openvino.opset13 as opset
    from openvino.utils.node_factory import NodeFactory

    factory = NodeFactory()
    factory.add_extension(str(lib))
    old, new = [], []
    for pa in [op for op in model.get_ordered_ops() if op.get_type_name() == PA_OP]:
        inputs = [pa.input_value(i) for i in range(PA_INPUTS)]
        heads = pa.get_input_partial_shape(QUERY)[1].get_length() // head_dim
        caches = []
        for port in (KEY_CACHE, KEY_CACHE + 1):
            param = inputs[port].get_node()
            name = inputs[port].get_any_name()
            cache = opset.parameter([-1, kv_heads, BLOCK, head_dim + SCALE_BYTES], ov.Type.i8, name=name)
            cache.output(0).get_tensor().set_names({name})
            old.append(param)
            caches.append(cache)
            inputs[port] = cache.output(0)
        op = factory.create(OP_TYPE, inputs, {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                                              "block_size": BLOCK})
        op.set_friendly_name(pa.get_friendly_name())
        pa.output(0).replace(op.output(0))
        new.extend(caches)
    for param in old:
        model.remove_parameter(param)
    model.add_parameters(new)
    model.validate_nodes_and_infer_types()
    return len(new) // 2


def slot_bytes(kv_heads: int, head_dim: int) -> int:
    """Bytes an i8 cache holds per token per layer: key and value, each head_dim int8 values and an f32 scale a
    KV head."""
    return 2 * kv_heads * (head_dim + SCALE_BYTES)


def dequantize(blocks: np.ndarray, head_dim: int) -> np.ndarray:
    """An i8 cache's blocks (n, kv_heads, BLOCK, head_dim + 4) as the f32 values they hold: (n, kv_heads, BLOCK,
    head_dim). The layout: per block and KV head, BLOCK rows of head_dim int8 values, then BLOCK f32 scales."""
    n, kv = blocks.shape[:2]
    raw = np.ascontiguousarray(blocks).reshape(n, kv, -1)
    values = raw[:, :, :BLOCK * head_dim].reshape(n, kv, BLOCK, head_dim).astype(np.float32)
    scales = raw[:, :, BLOCK * head_dim:].copy().view(np.float32).reshape(n, kv, BLOCK, 1)
    return values * scales
