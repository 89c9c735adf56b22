"""kvexport's native ops for ONNX Runtime (the C sources beside this file, one library), and the load-time swap to them.

The `cpu` target's engines hold ONNX Runtime's standard nodes on disk; the library built at install (setup.py)
replaces some of them in the graph handed to ONNX Runtime when an engine is loaded, with the same inputs and
attributes; the file is not changed (docs/backends/cpu.md):

- `ai.kvexport.QMatMul` (qmatmul.c), on a CPU with AVX512-VNNI or AVX2+FMA, for every 4-bit `MatMulNBits` it takes
  (symmetric blocks, float scales, block size a multiple of 32). Activations are quantized to int8 per 32-block,
  as MatMulNBits does at accuracy_level 4 (which takes the weights' block instead, where that is wider): at blocks
  of 32 the two agree to summation order.
- `ai.kvexport.Int8CacheAttention` (attention.c), on a CPU with AVX-512 or AVX2+FMA, for every `GroupQueryAttention`
  over an int8 cache (`--kv int8`) it takes: the same bytes stored, the attention in fp32 over them, in another order.
  Such nodes sit in the one-token branch of the engine's own If (kvexport.backends.cpu_kv); where the op's tiled
  prompt kernel runs (AVX-512, head size 32, 64 or 128), that If's condition becomes "several new tokens in several
  batch rows", so one row's prompt runs the op too. With AVX512-VNNI that prompt kernel takes the scores and the
  weighted values in int16 (the int8 rows widened, each query row scaled to 15 bits, the weights to 1/32767):
  outputs within about 1e-4 of the fp32 order's, far inside what the int8 cache itself moves them
  (docs/backends/cpu.md).
- `ai.kvexport.Fp32CacheAttention` (the same kernel over a float cache, and a tiled one for prompts on AVX-512 at
  head size 64 or 128), likewise, for every `GroupQueryAttention` of an fp32-cache engine it takes: each such node goes
  under an If on "one new token" (or, where the tiled kernel runs, "one new token or one batch row"), ONNX
  Runtime's node in the other branch.

Every other node stays ONNX Runtime's.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DOMAIN = "ai.kvexport"
OP = "QMatMul"
ATTENTION_OP = "Int8CacheAttention"
FP32_ATTENTION_OP = "Fp32CacheAttention"
LIBRARY = Path(__file__).with_name("libkvexport_native.so")
REQUIRE_ENV = "KVEXPORT_REQUIRE_NATIVE"  # set (CI): a missing library is an error, not a fallback
ISA_ENV = "KVEXPORT_QMATMUL_ISA"  # "avx2": the AVX2 kernel on a CPU that has AVX512-VNNI as well
ATTENTION_ISA_ENV = "KVEXPORT_ATTENTION_ISA"  # "avx512" or "avx2": that narrower attention kernel on a wider CPU
TILED_HEAD_SIZES = (64, 128)  # the head sizes attention.c's tiled prompt kernel takes (AVX-512 only)
# and over an int8 cache, 32 too (one layer of the default model's heads over a 1,024-token prompt: 3.5 ms in int16,
# 4.5 ms in float, against ONNX Runtime's fp32 form's 6.7 ms and more; over a float cache the tiled kernel took
# 7.3 ms there, so fp32 caches keep ONNX Runtime's kernel for prompts at 32)
INT8_TILED_HEAD_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class Kernel:
    """Which kernel a load will use for one kind of node (kvexport's, `ours`, or ONNX Runtime's, `theirs`), and why."""

    usable: bool
    isa: str  # "avx512-vnni", "avx2", "avx512" or "" where unusable
    why: str
    ours: str = f"kvexport {OP}"
    theirs: str = "onnxruntime MatMulNBits"

    def for_fp32(self) -> "Kernel":
        """The same choice, named for the fp32-cache op (which has no VNNI form: its keys are float)."""
        isa = "avx512" if self.isa == "avx512-vnni" else self.isa
        return Kernel(self.usable, isa, self.why, **FP32_ATTENTION_NAMES)

    def record(self, swapped: int = 0) -> dict[str, Any]:
        name = f"{self.ours} ({self.isa})" if self.usable and swapped else self.theirs
        return {"kernel": name, "nodes": swapped, "why": self.why}


NOT_ASKED = Kernel(False, "", "not asked")  # a session made without asking for the kernel (an fp32 floor)
ATTENTION_NAMES = {"ours": f"kvexport {ATTENTION_OP}", "theirs": "onnxruntime GroupQueryAttention"}
FP32_ATTENTION_NAMES = {"ours": f"kvexport {FP32_ATTENTION_OP}", "theirs": "onnxruntime GroupQueryAttention"}
ATTENTION_NOT_ASKED = Kernel(False, "", "not asked", **ATTENTION_NAMES)


def isa_of(flags: set[str]) -> str:
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        return "avx512-vnni"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return ""


def _flags(flags: set[str] | None) -> set[str]:
    if flags is None:
        from kvexport.doctor import read_cpu_flags

        return read_cpu_flags()
    return flags


def _unbuilt(library: Path) -> str | None:
    """Why the library cannot be loaded (None: it can); raises where REQUIRE_ENV asks for it."""
    if library.is_file():
        return None
    why = ("not built: pip install found no ONNX Runtime C API headers or no C compiler "
           "(run kvexport/native/fetch_ort_headers.sh, then pip install again)")
    if os.environ.get(REQUIRE_ENV):
        from kvexport.errors import BackendUnavailableError

        raise BackendUnavailableError(f"kvexport's native library is {why}; {REQUIRE_ENV} is set")
    return why


def _choose(isa: str, env: str, library: Path | None, lacking: str, kernels: tuple[str, ...],
            **names: str) -> Kernel:
    """The Kernel record for an op whose best ISA on this CPU is `isa` ("" for none) among its `kernels`, widest
    first: `env` naming a narrower one of them takes that one instead (the library reads the same variable; tests
    run every kernel the CPU has)."""
    ask = os.environ.get(env, "")
    if isa and ask in kernels and kernels.index(ask) > kernels.index(isa):
        isa = ask
    why = _unbuilt(LIBRARY if library is None else library)
    if why:
        return Kernel(False, "", why, **names)
    if not isa:
        return Kernel(False, "", f"this CPU has neither {lacking}", **names)
    return Kernel(True, isa, f"this CPU has {isa}", **names)


def kernel(flags: set[str] | None = None, library: Path | None = None) -> Kernel:
    """Whether this machine can run the native quantized matmul: the library built at install (`library`, by
    default LIBRARY) and the ISA it needs."""
    return _choose(isa_of(_flags(flags)), ISA_ENV, library, "AVX512-VNNI nor AVX2+FMA", ("avx512-vnni", "avx2"))


def attention_isa_of(flags: set[str]) -> str:
    if "fma" in flags and isa_of(flags) == "avx512-vnni":
        return "avx512-vnni"  # attention.c's cpu_isa() 3: an int8 cache's prompts in int16
    if {"avx512f", "fma"} <= flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return ""


def attention_kernel(flags: set[str] | None = None, library: Path | None = None) -> Kernel:
    """Whether this machine can run the native attention over a cache (int8 or fp32): the library and AVX-512 or
    AVX2+FMA. Its record names the int8 op; a session whose swap took fp32-cache nodes names the other
    (`Kernel.for_fp32`)."""
    return _choose(attention_isa_of(_flags(flags)), ATTENTION_ISA_ENV, library, "AVX-512 nor AVX2+FMA",
                   ("avx512-vnni", "avx512", "avx2"), **ATTENTION_NAMES)


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


# GroupQueryAttention attributes the attention op computes at these values only (ONNX Runtime's defaults)
ATTENTION_DEFAULTS = {"softcap": 0.0, "local_window_size": -1, "qk_output": 0, "rotary_interleaved": 0,
                      "sliding_window_cache": 0, "causal": 1}
ATTENTION_KEPT = ("num_heads", "kv_num_heads", "scale", "do_rotary")


def _plain_attention(node: Any) -> tuple[dict[str, Any], list[str]] | None:
    """A GroupQueryAttention the op computes at these attributes (causal, no softcap, local window, smooth softmax,
    head sink or qk output, rotation (if any) rotate-half): its attributes and its 14 inputs; else None."""
    if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft" or len(node.input) > 14:
        return None
    a = _attrs(node)
    inputs = list(node.input) + [""] * (14 - len(node.input))
    if (int(a.get("smooth_softmax", 0)) == 1 or inputs[11]
            or not all(a.get(k, v) == v for k, v in ATTENTION_DEFAULTS.items())):
        return None
    return a, inputs


def takes_attention(node: Any) -> bool:
    """A GroupQueryAttention the int8 attention op computes: an 8-bit cache with per-tensor or per-channel scales,
    and otherwise what _plain_attention takes."""
    plain = _plain_attention(node)
    if plain is None:
        return False
    a, inputs = plain
    quant = {a.get("k_quant_type", b"NONE"), a.get("v_quant_type", b"NONE")}
    return (int(a.get("kv_cache_bit_width", 0)) == 8 and quant <= {b"PER_CHANNEL", b"PER_TENSOR"}
            and bool(inputs[12]) and bool(inputs[13]))


def float_caches(graph: Any) -> set[str]:
    """The names of `graph`'s float inputs of rank 4: the caches an fp32-cache engine binds."""
    from onnx import TensorProto

    return {i.name for i in graph.input if i.type.tensor_type.elem_type == TensorProto.FLOAT
            and len(i.type.tensor_type.shape.dim) == 4}


def takes_fp32_attention(node: Any, caches: set[str]) -> bool:
    """A GroupQueryAttention the fp32 attention op computes: no quantized cache (no kv_cache_bit_width, k_scale or
    v_scale), past key and value read from `caches` (the graph's float cache inputs, which the engine binds as
    present too), and otherwise what _plain_attention takes."""
    plain = _plain_attention(node)
    if plain is None:
        return False
    a, inputs = plain
    return (int(a.get("kv_cache_bit_width", 0)) == 0 and not inputs[12] and not inputs[13]
            and inputs[3] in caches and inputs[4] in caches)


def _one_token_branch(graph: Any, node: Any, prompts: bool = False) -> list[Any]:
    """An If on "`node`'s query holds one token" (with `prompts`: "... or one batch row", where the op's tiled prompt
    kernel runs) whose then-branch is kvexport's fp32 attention op and whose else branch is `node` (ONNX Runtime's,
    for the rest), each writing the If's outputs, which are `node`'s (the engine binds the presents to the cache
    buffers, and the branch's kernel writes them in place)."""
    from onnx import TensorProto, helper

    scope = (node.name or node.output[0]) + "/one_token"
    graph.initializer.append(helper.make_tensor(f"{scope}/one", TensorProto.INT64, [1], [1]))
    tokens = helper.make_node("Shape", [node.input[0]], [f"{scope}/tokens"], start=1, end=2)
    made = [tokens]
    if prompts:
        made += [helper.make_node("Shape", [node.input[0]], [f"{scope}/rows"], start=0, end=2),
                 helper.make_node("ReduceMin", [f"{scope}/rows"], [f"{scope}/fewest"], keepdims=1)]
        tokens = made[-1]
    one = helper.make_node("Equal", [tokens.output[0], f"{scope}/one"], [f"{scope}/cond"])
    branches = []
    for form in ("one", "many"):
        n = type(node)()
        n.CopyFrom(node)
        n.name = f"{scope}/{form}"
        del n.output[:]
        n.output.extend(f"{scope}/{form}/{o}" for o in node.output)
        if form == "one":
            _retype(n, FP32_ATTENTION_OP, ATTENTION_KEPT, [])
        branches.append(helper.make_graph([n], f"{scope}/{form}", [], [
            helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in n.output]))
    branch = helper.make_node("If", [f"{scope}/cond"], list(node.output), name=f"{scope}/If",
                              then_branch=branches[0], else_branch=branches[1])
    return [*made, one, branch]


def _graphs(graph: Any) -> Any:
    """`graph` and every subgraph under it (If branches, loop bodies)."""
    from onnx import AttributeProto

    yield graph
    for node in graph.node:
        for a in node.attribute:
            if a.type == AttributeProto.GRAPH:
                yield from _graphs(a.g)
            elif a.type == AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _graphs(g)


def _retype(node: Any, op: str, kept: tuple[str, ...], extra: list[Any]) -> None:
    node.op_type, node.domain = op, DOMAIN
    keep = [a for a in node.attribute if a.name in kept]
    del node.attribute[:]
    node.attribute.extend([*keep, *extra])


def _head_size(graph: Any, name: str) -> int:
    """The last dimension of `graph`'s input `name` where it is a number, else 0."""
    for i in graph.input:
        if i.name == name:
            return int(i.type.tensor_type.shape.dim[-1].dim_value)
    return 0


def _int8_prompts_to_the_op(graph: Any) -> int:
    """Where every If on the int8 engine's "several new tokens" condition (kvexport.backends.cpu_kv) holds the int8
    op in its one-token branch at a head size the tiled kernel takes (INT8_TILED_HEAD_SIZES), feed those Ifs "several
    new tokens in several batch rows" instead, so that one row's prompt runs the op's tiled kernel and several
    rows' keep the fp32 form; the number rewired."""
    from onnx import TensorProto, helper

    from kvexport.backends.cpu_kv import PREFIX

    many = f"{PREFIX}/many"
    ifs = [n for n in graph.node if n.op_type == "If" and n.input and n.input[0] == many]
    ops = [[m for a in n.attribute if a.name == "else_branch" for m in a.g.node] for n in ifs]
    if not ifs or not all(len(o) == 1 and o[0].op_type == ATTENTION_OP and o[0].domain == DOMAIN
                          and _head_size(graph, o[0].input[3]) in INT8_TILED_HEAD_SIZES for o in ops):
        return 0
    rows = f"{PREFIX}/rows"
    graph.initializer.append(helper.make_tensor(f"{rows}/one", TensorProto.INT64, [1], [1]))
    made = [helper.make_node("Shape", ["input_ids"], [rows], start=0, end=1),
            helper.make_node("Greater", [rows, f"{rows}/one"], [f"{rows}/several"]),
            helper.make_node("And", [many, f"{rows}/several"], [f"{many}_rows"])]
    at = next(i for i, n in enumerate(graph.node) if many in n.output) + 1
    for n in ifs:
        n.input[0] = f"{many}_rows"
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes[:at] + made + nodes[at:])
    return len(ifs)


def swap(model: Any, isa: str = "avx512-vnni", widths: tuple[int, ...] = SWAP_BITS, huge_pages: bool = True,
         attention: bool = False, attention_isa: str = "") -> tuple[int, int]:
    """Turn each MatMulNBits node of `widths` bits the matmul kernel takes on `isa` (none where `isa` is "") into
    ai.kvexport.QMatMul, and with `attention` each GroupQueryAttention over an int8 cache the attention op takes
    into ai.kvexport.Int8CacheAttention, in place, in every subgraph, and each one over the main graph's float
    caches that the fp32 op takes under an If that runs ai.kvexport.Fp32CacheAttention for one new token
    (_one_token_branch; on `attention_isa` avx512 or avx512-vnni, at a head size in TILED_HEAD_SIZES, also for a
    prompt of one batch row, which its tiled kernel takes; the int8 engine's own Ifs likewise,
    _int8_prompts_to_the_op); the
    numbers swapped (matmuls, attentions of either kind).
    `huge_pages`: whether the matmul kernel asks for huge pages for its packed weights."""
    from onnx import helper

    dtypes = {t.name: t.data_type for g in _graphs(model.graph) for t in g.initializer}
    n = m = 0
    for graph in _graphs(model.graph):
        for node in graph.node:
            if isa and takes(node, dtypes, isa, widths):
                _retype(node, OP, ("K", "N", "bits", "block_size"), [helper.make_attribute("huge_pages", int(huge_pages))])
                n += 1
            elif attention and takes_attention(node):
                _retype(node, ATTENTION_OP, ATTENTION_KEPT, [])
                m += 1
    if attention:
        g, caches = model.graph, float_caches(model.graph)
        made = []
        for node in g.node:
            if takes_fp32_attention(node, caches):
                prompts = attention_isa.startswith("avx512") and _head_size(g, node.input[3]) in TILED_HEAD_SIZES
                made.extend(_one_token_branch(g, node, prompts))
                m += 1
            else:
                made.append(node)
        if len(made) != len(g.node):
            del g.node[:]
            g.node.extend(made)
        if attention_isa.startswith("avx512"):
            _int8_prompts_to_the_op(g)
    if (n or m) and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return n, m


def open_session(model_path: Path, options: Any, kern: Kernel, huge_pages: bool = True,
                 attn: Kernel = ATTENTION_NOT_ASKED) -> tuple[Any, int, int, Kernel]:
    """An ONNX Runtime CPU session of `model_path` with the usable kernels (`kern`: the quantized matmul, `attn`:
    the cache attention) swapped in where they apply (weights read from the graph's own external-data folder),
    the numbers of nodes swapped (matmuls, attentions) and `attn` named for the op it swapped in (int8 or fp32
    cache); where none applies the file is loaded as it is."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(model_path), load_external_data=False) if kern.usable or attn.usable else None
    n, m = (swap(model, kern.isa if kern.usable else "", huge_pages=huge_pages, attention=attn.usable,
                 attention_isa=attn.isa)
            if model is not None else (0, 0))
    if model is not None and float_caches(model.graph):
        attn = attn.for_fp32()
    if not (n or m):
        return ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"]), 0, 0, attn
    options.register_custom_ops_library(str(LIBRARY))
    options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                     str(model_path.parent))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]), n, m, attn
