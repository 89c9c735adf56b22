"""cpu int8/int4 weights: ONNX Runtime's own MatMulNBits quantizer over the optimized engine graph."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import onnx

BITS = {"int8": 8, "int4": 4}  # the weight modes this module makes
# The block along K each weight mode takes when --group-size is not given. int4: 32, as onnxruntime-genai's model
# builder. int8: MLAS's 8-bit kernel pays per block (a scale and a block sum read, a float multiply-add) beside its
# bytes, and blocks of 128 ran bench-1b's step faster than 32 on every CPU kind timed: without int8 dot products
# (AMD EPYC Zen 3, AVX2 only), with AVX512-VNNI (AMD EPYC Zen 4) and with AMX-INT8 (an Intel Xeon: 1.15x / 1.13x
# at prompts 32 / 512) (docs/backends/cpu.md)
DEFAULT_GROUP_SIZE = {"int4": 32, "int8": 128}
LM_HEAD_BITS_UNDER_INT4 = 8  # the logits' projection is the most sensitive matmul; 8 bits as genai's builder
LM_HEAD_MODES = {"int8": 8, "int4": 4}  # --option lm_head= under --weights int4
QUANTIZERS = ("rtn", "gptq")  # --option quantizer=: round to nearest, or GPTQ (kvexport.backends.cpu_gptq)
# what GPTQ calibrates on: given the MatMul inputs' tensor names, the (tokens, K) values each took on the
# calibration text, and the manifest's record of that text
Calibration = Callable[[list[str]], "tuple[dict[str, np.ndarray], dict[str, Any]]"]
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


def head_block(group: int, bits: int) -> int:
    """The block along K of the lm_head under int4 weights: at 8 bits (the default) the int8 default block where
    that is wider than the int4 group (MLAS's 8-bit kernel pays per block: bench-1b's 8-bit head at 128 decoded
    1.07x / 1.10x its head at 32 on AMD EPYC Zen 4, docs/backends/cpu.md), else the group; at 4 bits the group."""
    return max(group, DEFAULT_GROUP_SIZE["int8"]) if bits == 8 else group


def fitted_block(k: int, group: int) -> int:
    """The block along K for a matrix of K rows under the default group size: the group where it divides K, else the
    widest power of two from group/2 down to 16 (MatMulNBits' least) that does, so no block is padded (a padded
    block is read every token, and a tied table whose rows are no whole number of blocks stays fp32), else the
    group (padded). A --group-size the user gives is taken as given."""
    block = group
    while k % block and block > 16:
        block //= 2
    return block if k % block == 0 else group


def lm_head(model: onnx.ModelProto, output: str = "logits", op_type: str = "MatMul") -> onnx.NodeProto | None:
    """The `op_type` node that makes `output` (the first one met walking back from it), or None."""
    producer = {o: n for n in model.graph.node for o in n.output}
    todo, seen = [output], set()
    while todo:
        name = todo.pop(0)
        node = producer.get(name)
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        if node.op_type == op_type:
            return node
        todo.extend(node.input)
    return None


def tied_embedding(model: onnx.ModelProto, head: onnx.NodeProto) -> onnx.NodeProto | None:
    """The Gather that reads the token embeddings when its (V, H) table holds the lm_head's (H, V) weight
    transposed (tied embeddings, compared value by value), else None."""
    inits = {t.name: t for t in model.graph.initializer}
    weight = inits.get(head.input[1])
    if weight is None or len(weight.dims) != 2:
        return None
    for node in model.graph.node:
        table = inits.get(node.input[0]) if node.op_type == "Gather" and node.input else None
        if table is not None and list(table.dims) == list(weight.dims)[::-1] and _same_transposed(table, weight):
            return node
    return None


def _same_transposed(table: onnx.TensorProto, weight: onnx.TensorProto, rows: int = 4096) -> bool:
    """table == weight.T, compared in slices of rows over zero-copy views (a 1B model's table is 1 GB)."""
    from onnx import numpy_helper

    def view(t: onnx.TensorProto) -> np.ndarray:
        if t.data_type == 1 and t.raw_data:  # FLOAT
            return np.frombuffer(t.raw_data, np.float32).reshape(tuple(t.dims))
        return numpy_helper.to_array(t)

    a, b = view(table), view(weight)
    return all(np.array_equal(a[i:i + rows], b[:, i:i + rows].T) for i in range(0, a.shape[0], rows))


def share_with_head(model: onnx.ModelProto, gather: onnx.NodeProto, head: onnx.NodeProto) -> str:
    """Replace the embedding `gather` by GatherBlockQuantized over the lm_head MatMulNBits' own blocks and
    scales (one quantized table for both, as onnxruntime-genai's builder ties them; exact against the
    head's dequantized rows) and drop the fp32 table. Returns what the manifest records."""
    from onnx import helper, numpy_helper

    attrs = {a.name: a.i for a in head.attribute}
    vocab, hidden, bits, block = attrs["N"], attrs["K"], attrs["bits"], attrs["block_size"]
    table = gather.input[0]
    shape = numpy_helper.from_array(np.array([vocab, hidden * bits // 8], np.int64), f"{head.input[1]}_rows")
    rows = f"{head.input[1]}_as_rows"
    nodes = [helper.make_node("Reshape", [head.input[1], shape.name], [rows], name=f"{gather.name}/rows"),
             helper.make_node("GatherBlockQuantized", [rows, gather.input[1], head.input[2]], list(gather.output),
                              name=f"{gather.name}/GatherBlockQuantized", domain="com.microsoft", bits=bits,
                              block_size=block, gather_axis=0, quantize_axis=1)]
    at = list(model.graph.node).index(gather)
    model.graph.node.remove(gather)
    for i, node in enumerate(nodes):
        model.graph.node.insert(at + i, node)
    model.graph.initializer.append(shape)
    if not any(table in n.input for n in model.graph.node):
        model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == table))
    return f"GatherBlockQuantized over the lm_head's {bits}-bit blocks (tied)"


def _quantize(model: onnx.ModelProto, bits: int, group_size: int, level: int, *,
              exclude: list[str] | None = None) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    config = DefaultWeightOnlyQuantConfig(block_size=group_size, is_symmetric=True, accuracy_level=level, bits=bits,
                                          op_types_to_quantize=("MatMul",))
    q = MatMulNBitsQuantizer(model, bits=bits, block_size=group_size, is_symmetric=True, accuracy_level=level,
                             nodes_to_exclude=exclude, algo_config=config)
    q.process()
    return q.model.model


def _weight_rows(model: onnx.ModelProto) -> dict[str, int]:
    """K (the weight's rows) of every MatMul by a constant 2-D weight, by node name: what the quantizer takes."""
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    return {n.name: dims[n.input[1]][0] for n in model.graph.node
            if n.op_type == "MatMul" and len(dims.get(n.input[1], ())) == 2}


def unpack_split_matmuls(model: onnx.ModelProto) -> int:
    """Cut every MatMulNBits whose one reader is a Split along its output's last axis (the IR's packed gate|up) into
    one MatMulNBits per piece, each over its own rows of N (blocks, scales, zero points and bias sliced; the same
    bytes, the same kernel), and drop the Split: onnxruntime-genai's graph keeps gate and up apart, and on bench-1b
    int4 the Split and the strided reads after it cost ~1.5% of a decode step (docs/backends/cpu.md). Returns
    how many were cut."""
    from onnx import helper, numpy_helper

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    cut, dead, replaced = {}, set(), set()
    for node in g.node:
        if node.op_type != "MatMulNBits" or len(readers.get(node.output[0], [])) != 1:
            continue
        split = readers[node.output[0]][0]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        n_rows = int(attrs["N"])
        ins = list(node.input) + [""] * (6 - len(node.input))  # A, B, scales, zero_points, g_idx, bias
        if split.op_type != "Split" or ins[4] or any(x and x not in inits for x in ins[1:4] + ins[5:6]):
            continue
        if {a.name: helper.get_attribute_value(a) for a in split.attribute}.get("axis", 0) not in (-1, 2):
            continue  # MatMulNBits' output is (B, S, N): only a split of N is a split of the weight's rows
        if len(split.input) > 1 and split.input[1]:
            if split.input[1] not in inits:
                continue
            sizes = [int(x) for x in numpy_helper.to_array(inits[split.input[1]])]
        elif n_rows % len(split.output) == 0:
            sizes = [n_rows // len(split.output)] * len(split.output)
        else:
            continue
        if sum(sizes) != n_rows:
            continue
        start = 0
        pieces = []
        arrays = {name: numpy_helper.to_array(inits[name]) for name in ins[1:] if name}
        for out, size in zip(split.output, sizes):
            piece_ins = [ins[0]]
            for name in ins[1:]:
                if not name:
                    piece_ins.append("")
                    continue
                whole = arrays[name]
                rows = whole.reshape(n_rows, -1)[start:start + size]
                part = rows.reshape((size, *whole.shape[1:]) if whole.ndim > 1 else (-1,))
                new = f"{name}_rows{start}"
                g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(part), new))
                piece_ins.append(new)
            while piece_ins and not piece_ins[-1]:
                piece_ins.pop()
            piece = helper.make_node("MatMulNBits", piece_ins, [out], name=f"{node.name}_rows{start}",
                                     domain=node.domain)
            piece.attribute.extend(a for a in node.attribute if a.name != "N")
            piece.attribute.append(helper.make_attribute("N", size))
            pieces.append(piece)
            start += size
        cut[id(node)] = pieces
        dead.add(id(split))
        replaced.update(x for x in ins[1:] if x)
    if not cut:
        return 0
    nodes = []
    for n in g.node:
        if id(n) not in dead:
            nodes += cut.get(id(n), [n])
    del g.node[:]
    g.node.extend(nodes)
    used = {i for n in g.node for i in n.input}
    for i in reversed(range(len(g.initializer))):  # in place: a copy of the repeated field is every weight again
        if g.initializer[i].name in replaced and g.initializer[i].name not in used:
            del g.initializer[i]
    return len(cut)


class WeightsOnDisk(Mapping[str, np.ndarray]):
    """The fp32 weight (input 1) of each MatMul node in `nodes` of the graph stored at model_path, read from
    its external data file each time one is asked for (one matrix in RAM at a time beside the loaded model,
    where a copy of all of them would be a 1B model's 4 GB more), or from the graph where it is stored inline."""

    def __init__(self, model_path: Path, skeleton: onnx.ModelProto, nodes: list[str]):
        from onnx import numpy_helper
        from onnx.external_data_helper import uses_external_data

        stored = {t.name: t for t in skeleton.graph.initializer}
        weight = {n.name: n.input[1] for n in skeleton.graph.node if n.name in set(nodes)}
        self.places: dict[str, tuple[Path, int, tuple[int, ...]] | np.ndarray] = {}
        for name in nodes:
            t = stored[weight[name]]
            if uses_external_data(t) and t.data_type == 1:  # FLOAT
                info = {e.key: e.value for e in t.external_data}
                self.places[name] = (model_path.parent / info["location"], int(info.get("offset", 0)), tuple(t.dims))
            else:
                self.places[name] = numpy_helper.to_array(t)

    def __getitem__(self, name: str) -> np.ndarray:
        place = self.places[name]
        if isinstance(place, np.ndarray):
            return place
        path, offset, shape = place
        return np.fromfile(path, dtype=np.float32, count=int(np.prod(shape)), offset=offset).reshape(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.places)

    def __len__(self) -> int:
        return len(self.places)


def quantize_engine(model_path: Path, data_name: str, weights: str, group_size: int, flags: set[str],
                    progress: Callable[[str], None], head_mode: str | None = None, fit: bool = False,
                    calibration: Calibration | None = None) -> dict[str, Any]:
    """Rewrite the optimized graph at model_path (external data in data_name beside it) with every MatMul on a
    constant weight as MatMulNBits: `weights` bits (int4: the lm_head at 8, or at `head_mode`), RTN,
    symmetric, blocks of group_size along K (with `fit`, the default group size: fitted_block per matrix).
    With `calibration`, every matrix but the lm_head is then rounded again by GPTQ against the values its
    input took (the lm_head stays RTN: under int4 it keeps 8 bits, and a tied table reads its blocks as
    embeddings, which no calibration input describes). Tied embeddings then read the lm_head's blocks through
    GatherBlockQuantized. Returns the record for the manifest's target.weights."""
    import onnx

    level, why = accuracy_level(flags)
    t0 = time.perf_counter()
    skeleton = onnx.load(str(model_path), load_external_data=False)  # the graph, and where its weights lie
    head_node = lm_head(skeleton)
    head = head_node.name if head_node is not None else None
    bits = BITS[weights]
    head_bits = LM_HEAD_MODES[head_mode or "int8"] if bits == 4 else bits
    # (bits, block) per matrix; one quantizer pass per distinct pair, every other matrix left out of it
    rows = _weight_rows(skeleton)
    plan = {name: (bits, fitted_block(k, group_size) if fit else group_size) for name, k in rows.items()}
    if head in plan and bits == 4:  # a head block this code picked is fitted to K; one the user gave is kept
        block = head_block(group_size, head_bits)
        plan[head] = (head_bits, fitted_block(rows[head], block) if fit or block != group_size else block)
    method: dict[str, Any] = {"method": "rtn"}
    if calibration is not None:  # before the weights are loaded here: its prefill holds them in a session
        from kvexport.backends import cpu_gptq

        originals = WeightsOnDisk(model_path, skeleton, [name for name in plan if name != head])
        inputs = cpu_gptq.input_names(skeleton, list(originals))
        seen, method = calibration(sorted(set(inputs.values())))
    model = onnx.load(str(model_path))  # the weights too: the quantizer reads them
    tied = tied_embedding(model, head_node) if head_node is not None else None  # reads the head's input names
    quiet = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    before, quiet.level = quiet.level, logging.WARNING  # one INFO line per node otherwise
    try:
        for key in sorted(set(plan.values()), reverse=True):
            model = _quantize(model, key[0], key[1], level, exclude=[n for n, v in plan.items() if v != key])
        if calibration is not None:
            method["matrices"] = cpu_gptq.apply(model, originals, inputs, seen, progress)
            del originals, seen
    finally:
        quiet.setLevel(before)
    unpacked = unpack_split_matmuls(model)
    embeddings = ("fp32 Gather (untied: it reads one row a token, no speed to gain)" if tied is None else
                  "fp32 Gather (tied, but the lm_head is no MatMulNBits of the table's shape)")
    quantized_head = lm_head(model, op_type="MatMulNBits")
    table = next((t for t in model.graph.initializer if tied is not None and t.name == tied.input[0]), None)
    shape = {a.name: a.i for a in quantized_head.attribute} if quantized_head is not None else {}
    if table is not None and [shape.get("N"), shape.get("K")] == list(table.dims):  # the head, quantized
        if shape["K"] % shape["block_size"]:
            embeddings = "fp32 Gather (tied, but the hidden size is no multiple of the block: padded blocks)"
        else:
            embeddings = share_with_head(model, tied, quantized_head)
    matmuls = sum(n.op_type == "MatMul" for n in model.graph.node)
    nbits = sum(n.op_type == "MatMulNBits" for n in model.graph.node)
    blocks: dict[str, int] = {}  # matrices per block size, as the graph has them
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            size = str(next(a.i for a in node.attribute if a.name == "block_size"))
            blocks[size] = blocks.get(size, 0) + 1
    (model_path.parent / data_name).unlink(missing_ok=True)  # onnx appends to an existing data file
    onnx.save_model(model, str(model_path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data_name, size_threshold=1024)
    fitted = "".join(f", {n} at block {b}" for b, n in blocks.items() if int(b) != group_size)
    head_at = f" at block {plan[head][1]}" if head in plan else ""
    apart = f", {unpacked} packed matmuls (gate|up) cut at their Split" if unpacked else ""
    progress(f"cpu: {nbits} matmuls to MatMulNBits {weights} (group {group_size}{fitted}, lm_head {head_bits}-bit{head_at}, "
             f"{method['method']}, {why}{apart}) in {time.perf_counter() - t0:.1f}s")
    return {**method, "symmetric": True, "accuracy_level": level, "accuracy_level_reason": why,
            "lm_head_bits": head_bits if head is not None else None,
            "lm_head_block": plan[head][1] if head in plan else None, "matmulnbits_nodes": nbits,
            "float_matmuls_left": matmuls, "embeddings": embeddings, "blocks": blocks, "split_matmuls_unpacked": unpacked}
