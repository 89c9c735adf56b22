"""The cpu engine's int8 KV cache: per-channel K and V scales calibrated on a sample text, and the
fused GroupQueryAttention nodes switched to ONNX Runtime's quantized cache (kv_cache_bit_width 8).

ONNX Runtime 1.31's quantized kernel is fast on one new token and slow on many (docs/backends/cpu.md
measures it), so each quantized node sits under an If: a step of several tokens runs the same
computation as ops that are fast on many rows (branch_attention), one token runs the kernel.

The kernel stores round(x * (1 / scale)) clipped to int8 and reads q * scale back, with one scale per
(kv head, channel) of each layer, shape (1, H_kv, 1, D): calibration puts scale = absmax / 127 over
what the fp32 engine writes into its cache while prefilling the sample. The scales are initializers
of the engine graph, so the manifest hashes them with every other engine file.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kvexport.errors import InputError
from kvexport.manifest import Manifest
from kvexport.precision import kv_elements_per_token

QMAX = 127.0  # symmetric int8: the kernel clips to [-128, 127]; absmax maps to 127
MIN_SCALE = 1e-8  # a channel that only ever held zeros: any positive scale stores it exactly
# Calibration prefills up to CALIBRATION_TOKENS tokens of the sample, CALIBRATION_WINDOW at a time:
# scales from a few hundred tokens clip other text (docs/backends/cpu.md has the measurements).
CALIBRATION_TOKENS = 2048
CALIBRATION_WINDOW = 512
CALIBRATION_TMP = "model.calibrate.tmp.onnx"  # beside the IR, so its external-data path resolves
# GroupQueryAttention's inputs by position (com.microsoft, ONNX Runtime 1.31): k_scale and v_scale
# follow attention_bias (10) and head_sink (11)
K_SCALE_INPUT, V_SCALE_INPUT = 12, 13
QUANT_ATTRS = ("kv_cache_bit_width", "k_quant_type", "v_quant_type")
PREFIX = "kvx_prefill"  # names of the nodes and constants branch_attention adds
HELD = f"{PREFIX}/held"  # (1,) the most slots a row held before this step
PREFILL_RECORD = ("a step of several new tokens: the new rows quantized into the cache as the kernel stores them, fp32 "
                  "attention over the dequantized rows; one token: the quantized kernel")


def calibration_ids(text: str | None, encode: Callable[[str], list[int]] | None, vocab_size: int,
                    fallback: str) -> tuple[str, list[int]]:
    """(source, ids) to calibrate on: the last CALIBRATION_TOKENS tokens of `text` (verify judges a
    held-out text from its start, so its end keeps the judged positions unseen), else of `fallback`,
    else seeded ids when the artifact has no tokenizer."""
    for source, t in (("calibration text (tail)", text), ("built-in sample text", fallback)):
        if t and encode is not None:
            ids = encode(t)
            if len(ids) >= 2:
                return source, ids[-CALIBRATION_TOKENS:]
    lo = 3 if vocab_size > 3 else 0
    rng = np.random.default_rng(0)
    return "seeded ids", [int(i) for i in rng.integers(lo, min(vocab_size, 259), CALIBRATION_WINDOW)]


def build_calibration_ids(text: str | None, folder: Path, manifest: Manifest) -> tuple[str, list[int]]:
    """calibration_ids() for a build: `text` (else the built-in sample) through the artifact's own tokenizer."""
    from kvexport.verify import BUILTIN_TEXT

    return calibration_ids(text, text_encoder(folder), manifest.config.vocab_size, BUILTIN_TEXT)


def text_encoder(folder: Path) -> Callable[[str], list[int]] | None:
    """The artifact's tokenizer as text -> ids (special tokens added), or None when it ships none."""
    if not (folder / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return lambda t: list(tok.encode(t, add_special_tokens=True).ids)


def channel_scales(cache: np.ndarray, rotary_dim: int = 0) -> np.ndarray:
    """(1, H_kv, 1, D) float32 scales from a filled cache (B, H_kv, S, D): absmax / 127 per channel.

    rotary_dim > 0 (keys after RoPE, rotate-half layout): channels i and i + rotary_dim/2 are one
    rotating pair, and a pair keeps its length at every position while each channel swings between
    +-length. Both get the pair's largest length, so a key at a position the sample never reached
    still fits in the range."""
    x = np.abs(cache.astype(np.float32))
    if rotary_dim:
        half = rotary_dim // 2
        pair = np.sqrt(x[..., :half] ** 2 + x[..., half:rotary_dim] ** 2)  # (B, H_kv, S, rot/2)
        x = x.copy()
        x[..., :half] = pair
        x[..., half:rotary_dim] = pair
    absmax = x.max(axis=(0, 2), keepdims=True)  # (1, H_kv, 1, D)
    return np.maximum(absmax / QMAX, MIN_SCALE).astype(np.float32)


def prefill_windows(session: Any, ids: Sequence[int], window: int,
                    before: Callable[[Any], None] | None = None) -> Iterator[tuple[Any, int]]:
    """Prefill `ids` through a CpuSession `window` tokens at a time, each window from position 0 in a state of
    its own; yields (state, tokens in it) after each step, then releases the state. `before(state)` runs
    before the step."""
    for start in range(0, len(ids), window):
        chunk = list(ids[start : start + window])
        S = len(chunk)
        state = session.new_state(1, S)
        if before is not None:
            before(state)
        i = np.arange(S)
        mask = (i[None, :] <= i[:, None])[None, None]  # (1, 1, S, S) causal
        session.step(state, np.asarray([chunk], dtype=np.int64), i[None], mask)
        yield state, S
        session.release(state)


def calibrate(session: Any, manifest: Manifest, ids: list[int], rotary_dim: int,
              window: int) -> dict[str, np.ndarray]:
    """Prefill `ids` through an fp32 CpuSession, `window` tokens at a time (each from position 0).
    Returns each cache input's scale (keys with their RoPE pairs): the largest over every window."""
    kinds = {p["input"]: p["kind"] for p in manifest.cache["pairs"]}
    scales: dict[str, np.ndarray] = {}
    for state, S in prefill_windows(session, ids, window):
        for (name, _), cache in zip(session.pairs, state.caches):
            got = channel_scales(cache[:, :, :S], rotary_dim if kinds[name] == "key" else 0)  # (1, H_kv, S, D) in
            scales[name] = np.maximum(scales[name], got) if name in scales else got
    return scales


def quantize_cache(model: onnx.ModelProto, scales: dict[str, np.ndarray]) -> int:
    """Switch every fused GroupQueryAttention to the int8 cache, with the scales of its past key and
    value inputs; those inputs and the present outputs become int8. Returns how many were switched."""
    g = model.graph
    nodes = [n for n in g.node if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"]
    if 2 * len(nodes) != len(scales) or any(n.input[i] not in scales for n in nodes for i in (3, 4)):
        raise InputError(f"the cpu engine graph fused {len(nodes)} attention layers of {len(scales) // 2}; an int8 "
                         "KV cache needs every layer fused into GroupQueryAttention: build this model with --kv fp32")
    caches: set[str] = set()
    for n in nodes:
        scope = n.name.rsplit("/", 1)[0]
        names = [f"{scope}/kv_int8/k_scale", f"{scope}/kv_int8/v_scale"]
        g.initializer.extend([numpy_helper.from_array(scales[n.input[3]], names[0]),
                              numpy_helper.from_array(scales[n.input[4]], names[1])])
        inputs = list(n.input) + [""] * max(0, V_SCALE_INPUT + 1 - len(n.input))
        inputs[K_SCALE_INPUT], inputs[V_SCALE_INPUT] = names
        del n.input[:]
        n.input.extend(inputs)
        n.attribute.extend([helper.make_attribute("kv_cache_bit_width", 8),
                            helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                            helper.make_attribute("v_quant_type", "PER_CHANNEL")])
        caches.update([n.input[3], n.input[4], n.output[1], n.output[2]])
    for vi in [*g.input, *g.output]:
        if vi.name in caches:
            vi.type.tensor_type.elem_type = TensorProto.INT8
    return len(nodes)


def build_int8_cache(model: onnx.ModelProto, folder: Path, manifest: Manifest, text: str | None, threads: int,
                     progress: Callable[[str], None]) -> dict[str, Any]:
    """Calibrate on the fp32 engine graph `model` (fused, saved beside the IR so its weights resolve),
    then switch it to the int8 cache in place. Returns the manifest's `target.kv` record."""
    from kvexport.backends.cpu import CpuSession

    cfg = manifest.config
    source, ids = build_calibration_ids(text, folder, manifest)
    window = min(CALIBRATION_WINDOW, manifest.max_seq)
    progress(f"calibrating int8 KV scales on {len(ids)} tokens ({source}), {window} at a time")
    staged = folder / CALIBRATION_TMP
    try:
        onnx.save_model(model, str(staged))
        session = CpuSession(staged, manifest, threads)
        rotary = cfg.effective_rotary_dim if cfg.position_kind == "rope" else 0
        scales = calibrate(session, manifest, ids, rotary, window)
        del session
    finally:
        staged.unlink(missing_ok=True)
    quantize_cache(model, scales)
    elements = kv_elements_per_token(manifest)
    # bytes_per_token: one byte per element; the scales (one fp32 per channel, shared by every row and
    # position) are a fixed cost beside it, the size of one fp32 token
    return {"dtype": "int8", "bytes_per_token": elements, "fp32_bytes_per_token": elements * 4,
            "scale_bytes": elements * 4, "scales": "per channel (1, H_kv, 1, D) per layer, absmax / 127",
            "calibration": {"source": source, "tokens": len(ids), "window": window}}


def _quantized_attention(g: onnx.GraphProto) -> list[onnx.NodeProto]:
    """g's GroupQueryAttention nodes over the int8 cache; adds the constants their fp32 forms share."""
    nodes = [n for n in g.node if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"
             and any(a.name == "kv_cache_bit_width" for a in n.attribute)]
    if not nodes:
        raise InputError("this cpu engine graph has no GroupQueryAttention over an int8 cache to branch: "
                         "build it with --kv int8")
    g.initializer.extend([helper.make_tensor(f"{PREFIX}/zero", TensorProto.INT64, [1], [0]),
                          helper.make_tensor(f"{PREFIX}/axis", TensorProto.INT64, [1], [2]),
                          helper.make_tensor(f"{PREFIX}/lo", TensorProto.FLOAT, [], [-QMAX - 1]),
                          helper.make_tensor(f"{PREFIX}/hi", TensorProto.FLOAT, [], [QMAX])])
    return nodes


def _fp32_attention(n: onnx.NodeProto, g: onnx.GraphProto, outputs: list[str]) -> list[onnx.NodeProto]:
    """What the quantized GroupQueryAttention `n` computes, in ops fast on many rows; its three results
    named `outputs` (attention, present key, present value). Adds its constants to g's initializers.

    The new K/V rows are stored as the kernel stores them (checked against ONNX Runtime 1.31:
    round(x * (1 / scale)), half to even, clipped to [-128, 127]) by TensorScatter at write_index, in
    place where the cache is bound as input and output; the attention is ONNX Runtime's fp32 kernel over
    the past rows and the new ones, both read back as q * scale, the values the quantized kernel attends
    over. Only the float sums' order differs from the kernel."""
    dims = {t.name: list(t.dims) for t in g.initializer}
    scope = n.name.rsplit("/", 1)[0] + "/kv_prefill"
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    _, kv_heads, _, head_dim = dims[n.input[K_SCALE_INPUT]]  # (1, H_kv, 1, D)
    width = kv_heads * head_dim
    g.initializer.extend([helper.make_tensor(f"{scope}/heads", TensorProto.INT64, [4], [0, 0, kv_heads, head_dim]),
                          helper.make_tensor(f"{scope}/merged", TensorProto.INT64, [3], [0, 0, width])])
    made: list[onnx.NodeProto] = []
    q, k, v = n.input[:3]
    if not k:  # packed (B, S, (H + 2 H_kv) D): the kernel splits it, so does the form
        q, k, v = (f"{scope}/{x}_in" for x in "qkv")
        g.initializer.append(helper.make_tensor(f"{scope}/sizes", TensorProto.INT64, [3],
                                                [int(attrs["num_heads"]) * head_dim, width, width]))
        made.append(helper.make_node("Split", [n.input[0], f"{scope}/sizes"], [q, k, v], axis=2))
    rotary = int(attrs.get("do_rotary", 0))
    if rotary:  # the kernel rotates q and k itself (cpu_fusion.fold_rotary): the form rotates them first, per
        # token (the kernel's tables and positions), so the rows it stores and attends over are the rotated ones
        for x, heads in ((q, "num_heads"), (k, "kv_num_heads")):
            made.append(helper.make_node("RotaryEmbedding", [x, *n.input[7:10]], [f"{x}/rotated"],
                                         num_heads=int(attrs[heads]), interleaved=int(attrs.get("rotary_interleaved", 0))))
        q, k = f"{q}/rotated", f"{k}/rotated"
    for x_in, past, present, scale, x in ((k, n.input[3], outputs[1], n.input[K_SCALE_INPUT], f"{scope}/key"),
                                          (v, n.input[4], outputs[2], n.input[V_SCALE_INPUT], f"{scope}/value")):
        made += [  # the new rows (B, S, H_kv D) -> (B, H_kv, S, D) -> int8, stored as the kernel stores them
            helper.make_node("Reshape", [x_in, f"{scope}/heads"], [f"{x}/bshd"]),
            helper.make_node("Transpose", [f"{x}/bshd"], [f"{x}/bhsd"], perm=[0, 2, 1, 3]),
            # the kernel multiplies by 1 / scale (fp32), which rounds differently from x / scale at ties
            helper.make_node("Reciprocal", [scale], [f"{x}/inverse"]),
            helper.make_node("Mul", [f"{x}/bhsd", f"{x}/inverse"], [f"{x}/scaled"]),
            helper.make_node("Round", [f"{x}/scaled"], [f"{x}/rounded"]),
            helper.make_node("Clip", [f"{x}/rounded", f"{PREFIX}/lo", f"{PREFIX}/hi"], [f"{x}/clipped"]),
            helper.make_node("Cast", [f"{x}/clipped"], [f"{x}/q"], to=TensorProto.INT8),
            helper.make_node("TensorScatter", [past, f"{x}/q", "write_index"], [present], axis=-2, mode="linear"),
            # ... and read back as the kernel reads them: q * scale, in its (B, S, H_kv D) layout
            helper.make_node("Mul", [f"{x}/clipped", scale], [f"{x}/deq"]),
            helper.make_node("Transpose", [f"{x}/deq"], [f"{x}/deq_bshd"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", [f"{x}/deq_bshd", f"{scope}/merged"], [f"{x}/new"]),
            # the past rows 0 .. T-1 (B, H_kv, T, D), none in a fresh prompt
            helper.make_node("Slice", [past, f"{PREFIX}/zero", HELD, f"{PREFIX}/axis"], [f"{x}/past8"]),
            helper.make_node("Cast", [f"{x}/past8"], [f"{x}/past_i"], to=TensorProto.FLOAT),
            helper.make_node("Mul", [f"{x}/past_i", scale], [f"{x}/past"])]
    inputs = [q, f"{scope}/key/new", f"{scope}/value/new", f"{scope}/key/past", f"{scope}/value/past",
              *n.input[5:V_SCALE_INPUT - 1]]
    if rotary:
        inputs[7:10] = ["", "", ""]  # rotated above
    while inputs[-1] == "":
        inputs.pop()
    gqa = helper.make_node("GroupQueryAttention", inputs, [outputs[0], f"{scope}/key/unused", f"{scope}/value/unused"],
                           name=f"{scope}/GroupQueryAttention_fp32", domain="com.microsoft")
    gqa.attribute.extend(a for a in n.attribute if a.name not in (*QUANT_ATTRS, "do_rotary", "rotary_interleaved"))
    return [*made, gqa]


def _rebuilt(g: onnx.GraphProto, replace: dict[int, list[onnx.NodeProto]], first: list[onnx.NodeProto]) -> None:
    made = list(first)
    for n in g.node:
        made.extend(replace.get(id(n), [n]))
    del g.node[:]
    g.node.extend(made)


def branch_attention(engine: onnx.ModelProto) -> onnx.ModelProto:
    """The int8-cache engine graph with each quantized GroupQueryAttention under an If on "more than one
    new token": then _fp32_attention, else the node itself. One graph, so the weights are loaded and
    prepacked once, and the caches stay bound in place (TensorScatter and the kernel write the If's
    outputs, which are the bound cache buffers). Returns a new model."""
    model = onnx.ModelProto()
    model.CopyFrom(engine)
    g = model.graph
    nodes = _quantized_attention(g)
    g.initializer.append(helper.make_tensor(f"{PREFIX}/one", TensorProto.INT64, [1], [1]))
    first = [helper.make_node("ReduceMax", ["write_index"], [HELD], keepdims=1),
             helper.make_node("Shape", ["input_ids"], [f"{PREFIX}/seq"], start=1, end=2),
             helper.make_node("Greater", [f"{PREFIX}/seq", f"{PREFIX}/one"], [f"{PREFIX}/many"])]
    types = [TensorProto.FLOAT, TensorProto.INT8, TensorProto.INT8]  # attention, present key, present value
    replace = {}
    for n in nodes:
        scope = n.name.rsplit("/", 1)[0] + "/kv_branch"
        many, one = ([f"{scope}/{form}/{o}" for o in n.output] for form in ("many", "one"))
        kernel = onnx.NodeProto()
        kernel.CopyFrom(n)
        del kernel.output[:]
        kernel.output.extend(one)
        branches = [helper.make_graph(body, f"{scope}/{form}", [],
                                      [helper.make_tensor_value_info(o, t, None) for o, t in zip(outs, types)])
                    for body, outs, form in ((_fp32_attention(n, g, many), many, "many"), ([kernel], one, "one"))]
        replace[id(n)] = [helper.make_node("If", [f"{PREFIX}/many"], list(n.output), name=f"{scope}/If",
                                           then_branch=branches[0], else_branch=branches[1])]
    _rebuilt(g, replace, first)
    return model


def branch_engine(model_path: Path) -> str:
    """Put every quantized GroupQueryAttention of the saved engine graph under its If (branch_attention),
    in place: the graph keeps reading its external data file. Returns what the manifest records."""
    model = onnx.load(str(model_path), load_external_data=False)
    onnx.save_model(branch_attention(model), str(model_path))
    return PREFILL_RECORD
