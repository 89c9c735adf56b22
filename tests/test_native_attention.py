"""kvexport's attention over the KV cache (kvexport/native/attention.c): the int8 op against ONNX Runtime's quantized
GroupQueryAttention, and the fp32 op (under the swap's one-token If) against its fp32 kernel, on the same inputs and
the same bound cache; which nodes the load-time swap takes; a `--kv int8` engine and an fp32-cache engine loaded with
and without them.

The op runs where the library was built at install and the CPU has AVX-512 or AVX2+FMA: each ISA's tests run where
the CPU has it (both on an AVX-512 CPU, the AVX2 kernel through KVEXPORT_ATTENTION_ISA=avx2) and are skipped
elsewhere. CI (.ci/run) builds the library and sets KVEXPORT_REQUIRE_NATIVE, so there a missing library fails these
tests instead of skipping them."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvexport import native
from kvexport.doctor import read_cpu_flags
from tests.conftest import native_isa

FLAGS = read_cpu_flags()
BEST = native.attention_isa_of(FLAGS)
HAVE = {"avx512-vnni": BEST == "avx512-vnni", "avx512": BEST.startswith("avx512"), "avx2": bool(BEST)}
ISAS = ["avx512-vnni", "avx512", "avx2"]


def _runs_here(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    native_isa(isa, HAVE[isa], native.ATTENTION_ISA_ENV, monkeypatch)
    if isa == "avx512" and BEST == "avx512-vnni":  # the AVX-512 kernel without VNNI on a CPU that has it
        monkeypatch.setenv(native.ATTENTION_ISA_ENV, "avx512")


def _int16_prompt(isa: str, D: int, S: int) -> bool:
    """Whether an int8 cache's step of S new tokens takes the VNNI prompt kernel (int16 queries and weights)."""
    return isa == "avx512-vnni" and D in native.INT8_TILED_HEAD_SIZES and S > 1


def _model(B: int, H: int, KV: int, D: int, C: int, *, packed: bool, rotary: bool, bias: bool, per_channel: bool,
           ours: bool, f32: bool = False, isa: str = "") -> onnx.ModelProto:
    """One quantized GroupQueryAttention (ONNX Runtime's, or the same node as kvexport's op) over a (B, KV, C, D)
    int8 cache, scales as initializers; rotary tables of C + 8 positions. `f32`: the same over a float cache (no
    scales), kvexport's op under its one-token If (on `isa` avx512 for prompts of one batch row too)."""
    rng = np.random.default_rng(1)
    cache = TensorProto.FLOAT if f32 else TensorProto.INT8
    inputs = [helper.make_tensor_value_info("q", TensorProto.FLOAT, [B, None, ((H + 2 * KV) if packed else H) * D])]
    if not packed:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [B, None, KV * D]) for n in ("k", "v")]
    inputs += [helper.make_tensor_value_info(n, cache, [B, KV, C, D]) for n in ("past_k", "past_v")]
    inputs += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [B]),
               helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    names = ["q", "", "", "past_k", "past_v", "seqlens_k", "total", "", "", "", "", "", "k_scale", "v_scale"]
    if not packed:
        names[1:3] = ["k", "v"]
    shape = [1, KV, 1, D] if per_channel else [1]
    inits = [numpy_helper.from_array(rng.uniform(0.01, 0.05, shape).astype(np.float32), n) for n in ("k_scale", "v_scale")]
    if f32:
        names, inits = names[:12], []
    attrs: dict = {"num_heads": H, "kv_num_heads": KV, "scale": float(1 / np.sqrt(D))}
    if rotary:
        angles = np.arange(C + 8)[:, None] / 10000.0 ** (np.arange(D // 2) / (D // 2))
        inits += [numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
                  numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin")]
        names[7:10] = ["cos", "sin", "position_ids"]
        inputs.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, [B, None]))
        attrs["do_rotary"] = 1
    if bias:
        names[10] = "bias"
        inputs.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, [B, 1, None, None]))
    quant = "PER_CHANNEL" if per_channel else "PER_TENSOR"
    if not f32:
        attrs.update(kv_cache_bit_width=8, k_quant_type=quant, v_quant_type=quant)
    while names[-1] == "":
        names.pop()
    node = helper.make_node("GroupQueryAttention", names, ["out", "present_k", "present_v"], domain="com.microsoft",
                            **attrs)
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, None),
               *(helper.make_tensor_value_info(n, cache, None) for n in ("present_k", "present_v"))]
    model = helper.make_model(helper.make_graph([node], "gqa", inputs, outputs, inits), ir_version=10,
                              opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid("com.microsoft", 1)])
    if ours:
        assert native.swap(model, "", attention=True, attention_isa=isa) == (0, 1)
    return model


def _session(model: onnx.ModelProto):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    if any(o.domain == native.DOMAIN for o in model.opset_import):
        so.register_custom_ops_library(str(native.LIBRARY))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _run(sess, feeds: dict[str, np.ndarray], caches: tuple[np.ndarray, np.ndarray], in_place: bool) -> tuple:
    """One step with the caches bound as past (and as present where `in_place`): the output and the presents."""
    b = sess.io_binding()
    for name, arr in feeds.items():
        b.bind_cpu_input(name, arr)
    for name, buf in zip(("past_k", "past_v"), caches):
        b.bind_input(name, "cpu", 0, buf.dtype, buf.shape, buf.ctypes.data)
    b.bind_output("out")
    for name, buf in zip(("present_k", "present_v"), caches):
        if in_place:
            b.bind_output(name, "cpu", 0, buf.dtype, buf.shape, buf.ctypes.data)
        else:
            b.bind_output(name)
    sess.run_with_iobinding(b)
    out = b.get_outputs()
    return out[0].numpy(), (caches if in_place else (out[1].numpy(), out[2].numpy()))


def _feeds(x: np.ndarray, held: np.ndarray, H: int, KV: int, D: int, *, packed: bool, rotary: bool,
           bias: bool) -> dict[str, np.ndarray]:
    """One step's inputs for new rows `x` (B, S, (H + 2 KV) D) after `held` rows per batch row: positions 5 past the
    rows, and a bias that masks batch row 0's first three slots."""
    B, S = x.shape[:2]
    feeds = {"seqlens_k": (held + S - 1).astype(np.int32), "total": np.array(held.max() + S, np.int32)}
    feeds.update({"q": x} if packed else {"q": x[..., :H * D].copy(), "k": x[..., H * D:(H + KV) * D].copy(),
                                         "v": x[..., (H + KV) * D:].copy()})
    if rotary:
        feeds["position_ids"] = (held[:, None] + np.arange(S) + 5).astype(np.int64)
    if bias:
        mask = np.zeros((B, 1, S, held.max() + S), np.float32)
        mask[0, 0, :, :min(3, held[0])] = np.finfo(np.float32).min
        feeds["bias"] = mask
    return feeds


CASES = {  # (B, H, KV, D, C, packed, rotary, bias, per_channel, row lengths, new tokens per step)
    "bench-125m-shape": (1, 12, 4, 64, 1100, True, True, True, True, [1030], 1),
    "rows-apart": (2, 8, 2, 64, 700, False, False, False, True, [10, 600], 1),
    "head-128-group-1": (2, 8, 8, 128, 300, True, True, True, True, [0, 250], 1),
    "head-32-per-tensor": (3, 6, 2, 32, 1100, True, False, True, False, [513, 1023, 5], 1),
    "group-8-head-80": (1, 16, 2, 80, 200, True, True, False, True, [77], 1),
    "several-new-tokens": (1, 4, 2, 64, 600, True, True, True, True, [530], 3),  # ONNX Runtime: batch 1 then
    "prompt-after-rows": (1, 12, 4, 64, 700, True, True, True, True, [300], 100),
    "prompt-group-5": (1, 10, 2, 64, 300, False, True, True, True, [40], 37),
    "prompt-head-128": (1, 8, 2, 128, 400, True, True, True, True, [150], 60),  # the tiled kernel at head size 128
    "prompt-head-32": (1, 8, 2, 32, 300, True, True, True, True, [100], 45),  # int8 caches' tiled kernel only
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "copied"])
@pytest.mark.parametrize("isa", ISAS)
def test_the_op_stores_onnxruntimes_bytes_and_attends_as_it_does(case: str, in_place: bool, isa: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Three steps through ONNX Runtime's quantized kernel and through the op, each on its own copy of one random
    int8 cache: the stored bytes equal exactly (the new key rotated and both rows rounded as the kernel does, value
    rows on rounding ties included), the
    rest of the cache untouched, the outputs equal to float order (runs of rows summed apart and merged; a prompt
    through the VNNI kernel to its int16 rounding). Rows of
    a batch at different lengths, a masked prefix through attention_bias, packed and separate q|k|v, per-tensor
    and per-channel scales, head sizes 32 to 128, groups of 1 to 8 query heads; each ISA's kernel."""
    _runs_here(isa, monkeypatch)
    B, H, KV, D, C, packed, rotary, bias, per_channel, lengths, S = CASES[case]
    flags = {"packed": packed, "rotary": rotary, "bias": bias, "per_channel": per_channel}
    models = [_model(B, H, KV, D, C, ours=o, **flags) for o in (False, True)]
    theirs, ours = (_session(m) for m in models)
    scales = {t.name: np.broadcast_to(numpy_helper.to_array(t).reshape(-1, 1) if t.dims == [1] else
                                      numpy_helper.to_array(t).reshape(KV, D), (KV, D)).reshape(KV * D)
              for t in models[0].graph.initializer if t.name in ("k_scale", "v_scale")}
    rng = np.random.default_rng(2)
    ties = 0
    start = rng.integers(-127, 128, (2, B, KV, C, D)).astype(np.int8)
    caches = [(start[0].copy(), start[1].copy()), (start[0].copy(), start[1].copy())]
    held = np.array(lengths)  # rows each batch row holds before the step
    for _ in range(3):
        x = (rng.standard_normal((B, S, (H + 2 * KV) * D)) * 2).astype(np.float32)
        # the first token's value row at (k + 1/2) * scale: ties, which x / scale and x * (1 / scale) round apart
        v = ((rng.integers(-100, 100, (B, KV * D)) + 0.5) * scales["v_scale"]).astype(np.float32)
        x[:, 0, (H + KV) * D:] = v
        ties += int((np.round(v / scales["v_scale"]) != np.round(v * (np.float32(1) / scales["v_scale"]))).sum())
        feeds = _feeds(x, held, H, KV, D, packed=packed, rotary=rotary, bias=bias)
        (want, (wk, wv)), (got, (gk, gv)) = (_run(s, feeds, c, in_place) for s, c in zip((theirs, ours), caches))
        for w, g in ((wk, gk), (wv, gv)):
            np.testing.assert_array_equal(g, w)
        for b in range(B):  # the new rows written where seqlens_k says; the held rows kept; the rest untouched in
            end = held[b] + S  # place, zero in a present of its own (as ONNX Runtime leaves it)
            assert (gk[b, :, held[b]:end] != start[0][b, :, held[b]:end]).any()
            np.testing.assert_array_equal(gk[b, :, :held[b]], start[0][b, :, :held[b]])
            np.testing.assert_array_equal(gk[b, :, end:], start[0][b, :, end:] if in_place else 0)
        # float order, or where the VNNI prompt kernel runs, its int16 queries (15 bits a row) and weights (1/32767):
        # about 2e-4 of the largest output on these peaked scores (std ~4), 1e-3 allowed
        tol = 1e-3 if _int16_prompt(isa, D, S) else 5e-5
        np.testing.assert_allclose(got, want, atol=tol * float(np.abs(want).max()))
        if not in_place:
            caches = [(wk, wv), (gk, gv)]
        start = (caches[1][0].copy(), caches[1][1].copy())
        held = held + S
    assert ties > 0  # the data held ties that only the kernel's own rounding stores alike


@pytest.mark.parametrize("D", native.INT8_TILED_HEAD_SIZES)
def test_the_vnni_prompt_kernels_rounding_is_small_beside_the_int8_caches_own(D: int,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """What the VNNI prompt kernel's int16 queries and weights cost, against what storing the cache in int8 costs:
    float keys and values (each channel about 40 steps of its scale wide), held as int8 for 300 rows and a
    150-token prompt of one row after them, attended (a) in float64 over the float keys and values, (b) by ONNX
    Runtime's quantized kernel, (c) by the op's VNNI kernel. The op's distance from ONNX Runtime's is under 5% of
    ONNX Runtime's own from the float attention, and the op is no further from the float attention than it."""
    _runs_here("avx512-vnni", monkeypatch)
    B, H, KV, C, held, S = 1, 8, 2, 512, 300, 150
    G = H // KV
    models = [_model(B, H, KV, D, C, ours=o, packed=True, rotary=False, bias=False, per_channel=True)
              for o in (False, True)]
    theirs, ours = (_session(m) for m in models)
    sc = {t.name: numpy_helper.to_array(t).reshape(KV, 1, D) for t in models[0].graph.initializer}
    rng = np.random.default_rng(8)
    keys, values = (np.clip(rng.standard_normal((KV, held + S, D)) * 40, -127, 127) * sc[n] for n in ("k_scale", "v_scale"))
    q = rng.standard_normal((S, H, D)) * 2
    x = np.concatenate([q.reshape(S, H * D), keys[:, held:].transpose(1, 0, 2).reshape(S, KV * D),
                        values[:, held:].transpose(1, 0, 2).reshape(S, KV * D)], 1)[None].astype(np.float32)
    x = x.astype(np.float64)  # the float attention reads what the op was fed
    k64, v64 = keys.copy(), values.copy()
    k64[:, held:] = x[0, :, H * D:(H + KV) * D].reshape(S, KV, D).transpose(1, 0, 2)
    v64[:, held:] = x[0, :, (H + KV) * D:].reshape(S, KV, D).transpose(1, 0, 2)
    scores = np.einsum("shd,hjd->hsj", q.astype(np.float32).astype(np.float64), np.repeat(k64, G, 0)) / np.sqrt(D)
    scores[:, np.arange(held + S)[None, :] > (held + np.arange(S))[:, None]] = -np.inf
    w = np.exp(scores - scores.max(-1, keepdims=True))
    exact = np.einsum("hsj,hjd->shd", w / w.sum(-1, keepdims=True), np.repeat(v64, G, 0)).reshape(S, H * D)
    outs = []
    for sess in (theirs, ours):
        caches = tuple(np.zeros((B, KV, C, D), np.int8) for _ in range(2))
        for c, f, n in zip(caches, (keys, values), ("k_scale", "v_scale")):
            c[0, :, :held] = np.clip(np.round(f[:, :held] / sc[n]), -128, 127)
        feeds = _feeds(x.astype(np.float32), np.array([held]), H, KV, D, packed=True, rotary=False, bias=False)
        outs.append(_run(sess, feeds, caches, True)[0][0].astype(np.float64))
    rms = lambda a: float(np.sqrt(np.mean(a ** 2)))  # noqa: E731
    int8_cost, vnni_cost = rms(outs[0] - exact), rms(outs[1] - outs[0])
    # about 0.8% measured; above 0.1% shows the int16 path ran (float order alone is ~1e-6 of the int8 cost)
    assert 1e-3 * int8_cost < vnni_cost < 0.05 * int8_cost, (vnni_cost, int8_cost)
    assert rms(outs[1] - exact) <= 1.01 * int8_cost


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "copied"])
@pytest.mark.parametrize("isa", ["avx512", "avx2"])  # a float cache's kernels (no VNNI form)
def test_the_fp32_cache_op_stores_and_attends_as_onnxruntime_does(case: str, in_place: bool, isa: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The same cases over a float cache: ONNX Runtime's GroupQueryAttention against the node under the swap's If
    (kvexport's Fp32CacheAttention for one new token, and with AVX-512 at head size 64 for several new tokens of one
    batch row, its tiled prompt kernel; ONNX Runtime's node otherwise), three steps each on its own copy of one
    random cache: the rows stored equal exactly (the key rotated as MLAS rotates it), the rest of the cache
    untouched, the outputs equal to float order, and exactly equal where several tokens take ONNX Runtime's
    branch."""
    _runs_here(isa, monkeypatch)
    B, H, KV, D, C, packed, rotary, bias, per_channel, lengths, S = CASES[case]
    flags = {"packed": packed, "rotary": rotary, "bias": bias, "per_channel": per_channel}
    models = [_model(B, H, KV, D, C, ours=o, f32=True, isa=isa, **flags) for o in (False, True)]
    prompts = isa.startswith("avx512") and D in native.TILED_HEAD_SIZES  # the tiled kernel: one row's prompts
    assert [n.op_type for n in models[1].graph.node] == (["Shape", "Shape", "ReduceMin", "Equal", "If"] if prompts
                                                         else ["Shape", "Equal", "If"])
    theirs, ours = (_session(m) for m in models)
    rng = np.random.default_rng(2)
    start = rng.standard_normal((2, B, KV, C, D)).astype(np.float32)
    caches = [(start[0].copy(), start[1].copy()), (start[0].copy(), start[1].copy())]
    held = np.array(lengths)
    for _ in range(3):
        x = (rng.standard_normal((B, S, (H + 2 * KV) * D)) * 2).astype(np.float32)
        feeds = _feeds(x, held, H, KV, D, packed=packed, rotary=rotary, bias=bias)
        (want, (wk, wv)), (got, (gk, gv)) = (_run(s, feeds, c, in_place) for s, c in zip((theirs, ours), caches))
        for b in range(B):
            end = held[b] + S
            for w, g, st in ((wk, gk, start[0]), (wv, gv, start[1])):
                np.testing.assert_array_equal(g[b, :, :end], w[b, :, :end])
                assert (g[b, :, held[b]:end] != st[b, :, held[b]:end]).any()
                np.testing.assert_array_equal(g[b, :, :held[b]], st[b, :, :held[b]])
                np.testing.assert_array_equal(g[b, :, end:], st[b, :, end:] if in_place else 0)
        if S == 1 or (prompts and B == 1):
            np.testing.assert_allclose(got, want, atol=5e-5 * float(np.abs(want).max()))
        else:
            np.testing.assert_array_equal(got, want)
        if not in_place:
            caches = [(wk, wv), (gk, gv)]
        start = np.stack([caches[1][0], caches[1][1]]).copy()
        held = held + S


def test_the_op_refuses_what_it_cannot_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """Errors at run time, typed by ONNX Runtime, for a cache past its end and a position past the tables."""
    _runs_here("avx2", monkeypatch)
    monkeypatch.delenv(native.ATTENTION_ISA_ENV, raising=False)  # the kernel this CPU takes by default
    sess = _session(_model(1, 4, 2, 64, 64, packed=True, rotary=True, bias=False, per_channel=True, ours=True))
    caches = (np.zeros((1, 2, 64, 64), np.int8), np.zeros((1, 2, 64, 64), np.int8))
    x = np.ones((1, 1, 8 * 64), np.float32)
    feeds = {"q": x, "seqlens_k": np.array([64], np.int32), "total": np.array(65, np.int32),
             "position_ids": np.array([[3]], np.int64)}
    with pytest.raises(Exception, match="seqlens_k is outside the cache"):
        _run(sess, feeds, caches, True)
    feeds.update(seqlens_k=np.array([10], np.int32), total=np.array(11, np.int32), position_ids=np.array([[500]], np.int64))
    with pytest.raises(Exception, match="outside the cos/sin tables"):
        _run(sess, feeds, caches, True)


def test_the_swap_takes_only_the_attention_it_computes() -> None:
    """Only causal GroupQueryAttention over an 8-bit cache without softcap, local window, smooth softmax, head
    sink, qk output or interleaved rotation, found inside If branches too; fp32-cache nodes stay ONNX Runtime's."""
    base = _model(1, 4, 2, 64, 64, packed=True, rotary=True, bias=False, per_channel=True, ours=False)
    node = base.graph.node[0]

    def variant(**change: object) -> onnx.NodeProto:
        n = onnx.NodeProto()
        n.CopyFrom(node)
        for key, value in change.items():
            if key == "head_sink":
                n.input[11] = "sink"
                continue
            kept = [a for a in n.attribute if a.name != key]
            del n.attribute[:]
            n.attribute.extend(kept)
            if value is not None:
                n.attribute.append(helper.make_attribute(key, value))
        return n

    assert native.takes_attention(variant())
    assert native.takes_attention(variant(smooth_softmax=-1))  # ONNX Runtime's off, as the cpu engine writes it
    for refused in ({"kv_cache_bit_width": None}, {"kv_cache_bit_width": 4}, {"softcap": 30.0},
                    {"local_window_size": 16}, {"smooth_softmax": 1}, {"qk_output": 1}, {"rotary_interleaved": 1},
                    {"k_quant_type": "NONE"}, {"head_sink": True}, {"causal": 0}):
        assert not native.takes_attention(variant(**refused)), refused
    # inside an If's branch, as the cpu engine holds it (kvexport.backends.cpu_kv.branch_attention)
    g = base.graph
    branch = helper.make_graph([variant()], "one", [], list(g.output))
    other = helper.make_graph([variant(kv_cache_bit_width=None)], "many", [], list(g.output))
    cond = helper.make_tensor_value_info("many", TensorProto.BOOL, [])
    wrapped = helper.make_model(helper.make_graph(
        [helper.make_node("If", ["many"], ["out", "present_k", "present_v"], then_branch=other, else_branch=branch)],
        "g", [*g.input, cond], list(g.output), list(g.initializer)), opset_imports=list(base.opset_import))
    assert native.swap(wrapped, "", attention=True) == (0, 1)
    branches = {a.name: a.g.node[0] for a in wrapped.graph.node[0].attribute}
    assert (branches["else_branch"].domain, branches["else_branch"].op_type) == (native.DOMAIN, native.ATTENTION_OP)
    assert {a.name for a in branches["else_branch"].attribute} == {"num_heads", "kv_num_heads", "scale", "do_rotary"}
    assert branches["then_branch"].op_type == "GroupQueryAttention"
    assert native.swap(wrapped, "", attention=False) == (0, 0)


def test_the_swap_puts_fp32_cache_attention_under_a_one_token_branch() -> None:
    """Over a float cache the swap takes the main graph's GroupQueryAttention nodes that read the graph's cache
    inputs, with the same attribute limits, and puts each under an If on "one new token": then kvexport's op, else
    the node as it was; the If writes the node's own outputs."""
    base = _model(1, 4, 2, 64, 64, packed=True, rotary=True, bias=False, per_channel=True, ours=False, f32=True)
    node = base.graph.node[0]
    caches = native.float_caches(base.graph)
    assert caches == {"past_k", "past_v"}
    assert native.takes_fp32_attention(node, caches) and not native.takes_attention(node)
    for change in ({"softcap": 30.0}, {"local_window_size": 16}, {"causal": 0}, {"kv_cache_bit_width": 8}):
        n = onnx.NodeProto()
        n.CopyFrom(node)
        key, value = next(iter(change.items()))
        n.attribute.append(helper.make_attribute(key, value))
        assert not native.takes_fp32_attention(n, caches), change
    n = onnx.NodeProto()
    n.CopyFrom(node)
    n.input[3] = "sliced"  # a past that is not the bound cache (the int8 engine's prompt branch reads such)
    assert not native.takes_fp32_attention(n, caches)
    assert native.swap(base, "", attention=True) == (0, 1)
    shape, equal, branch = base.graph.node
    assert (shape.op_type, list(shape.input), equal.op_type) == ("Shape", ["q"], "Equal")
    assert branch.op_type == "If" and list(branch.output) == ["out", "present_k", "present_v"]
    then, other = (next(a.g for a in branch.attribute if a.name == x) for x in ("then_branch", "else_branch"))
    assert (then.node[0].domain, then.node[0].op_type) == (native.DOMAIN, native.FP32_ATTENTION_OP)
    assert (other.node[0].domain, other.node[0].op_type) == ("com.microsoft", "GroupQueryAttention")
    assert list(then.node[0].input) == list(other.node[0].input) == list(node.input)
    assert native.swap(base, "", attention=True) == (0, 0)  # the If's nodes no longer read the main graph's caches


def test_which_kernel_each_cpu_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(native.ATTENTION_ISA_ENV, raising=False)
    k = native.attention_kernel({"sse4_2"})
    assert not k.usable and ("neither AVX-512 nor AVX2" in k.why or "not built" in k.why)
    assert k.record(0)["kernel"] == "onnxruntime GroupQueryAttention"
    if native.LIBRARY.is_file():
        on = native.attention_kernel({"avx512f", "avx2", "fma"})
        assert on.usable and on.record(3) == {"kernel": "kvexport Int8CacheAttention (avx512)", "nodes": 3,
                                              "why": "this CPU has avx512"}
        assert on.for_fp32().record(2)["kernel"] == "kvexport Fp32CacheAttention (avx512)"
        assert native.attention_kernel({"avx2", "fma"}).isa == "avx2"
        vnni = native.attention_kernel({"avx512f", "avx512bw", "avx512_vnni", "avx2", "fma"})
        assert vnni.record(3)["kernel"] == "kvexport Int8CacheAttention (avx512-vnni)"
        assert vnni.for_fp32().record(2)["kernel"] == "kvexport Fp32CacheAttention (avx512)"  # float keys: no VNNI
        assert native.attention_kernel({"avx512f", "avx512_vnni", "fma"}).isa == "avx512"  # VNNI needs BW too
        monkeypatch.setenv(native.ATTENTION_ISA_ENV, "avx512")
        assert native.attention_kernel({"avx512f", "avx512bw", "avx512_vnni", "avx2", "fma"}).isa == "avx512"
        monkeypatch.setenv(native.ATTENTION_ISA_ENV, "avx2")
        assert native.attention_kernel({"avx512f", "avx2", "fma"}).isa == "avx2"
        assert native.attention_kernel({"avx512f", "avx512bw", "avx512_vnni", "avx2", "fma"}).isa == "avx2"


def _int8_artifact(tmp_path_factory: pytest.TempPathFactory, head: int) -> Path:
    """A `--kv int8` cpu artifact of a tiny llama with two query heads of `head` channels and one KV head."""
    from kvexport.backends import BuildOptions
    from kvexport.build import build
    from kvexport.zoo import TINY_CONFIGS, write_checkpoint

    root = tmp_path_factory.mktemp(f"head{head}")
    cfg = {**TINY_CONFIGS["llama"], "hidden_size": 2 * head, "num_attention_heads": 2, "num_key_value_heads": 1}
    ckpt = write_checkpoint(cfg, root / "ckpt", seed=5)
    build(ckpt, root / "kv8.kvx", target="cpu", max_seq=128, options=BuildOptions(kv="int8"), verify=False)
    return root / "kv8.kvx"


@pytest.fixture(scope="module")
def int8_head64_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Head size 64, one the op's tiled prompt kernel takes over either cache (the tiny families' heads are 16 or
    32 wide)."""
    return _int8_artifact(tmp_path_factory, 64)


@pytest.fixture(scope="module")
def int8_head32_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Head size 32, which the tiled prompt kernel takes over an int8 cache only."""
    return _int8_artifact(tmp_path_factory, 32)


def _swapped(artifact: Path, isa: str) -> onnx.ModelProto:
    model = onnx.load(str(artifact / "engine" / "model.opt.onnx"), load_external_data=False)
    assert native.swap(model, "", attention=True, attention_isa=isa)[1] > 0
    return model


def test_the_swap_sends_one_rows_prompt_of_an_int8_engine_to_the_op_where_its_tiled_kernel_runs(
        int8_head64_artifact: Path, int8_head32_artifact: Path, int8_cache_artifact: Path) -> None:
    """The int8 engine's Ifs (kvexport.backends.cpu_kv: the fp32 form for several new tokens, the quantized node for
    one) read "several new tokens in several batch rows" once the op is swapped in on AVX-512 at head size 32, 64 or
    128, so one row's prompt runs the op's tiled kernel; on AVX2 (no tiled kernel), or at another head size, they
    keep "several new tokens"."""
    from kvexport.backends.cpu_kv import PREFIX

    for art, isa, cond in ((int8_head64_artifact, "avx512", f"{PREFIX}/many_rows"),
                           (int8_head64_artifact, "avx512-vnni", f"{PREFIX}/many_rows"),
                           (int8_head32_artifact, "avx512-vnni", f"{PREFIX}/many_rows"),
                           (int8_head64_artifact, "avx2", f"{PREFIX}/many"),
                           (int8_cache_artifact, "avx512", f"{PREFIX}/many")):  # heads 16 wide
        g = _swapped(art, isa).graph
        ifs = [n for n in g.node if n.op_type == "If" and n.input[0].startswith(f"{PREFIX}/many")]
        assert ifs and {n.input[0] for n in ifs} == {cond}, isa
        # each condition is computed before the first If that reads it
        made = [i for i, n in enumerate(g.node) if cond in n.output]
        assert made and made[0] < list(g.node).index(ifs[0])
    rows = [n for n in _swapped(int8_head64_artifact, "avx512").graph.node if n.output[0] == f"{PREFIX}/rows"]
    assert rows and rows[0].input[0] == "input_ids"


@pytest.mark.parametrize("isa", ["avx512-vnni", "avx512"])
@pytest.mark.parametrize("head", [64, 32])
def test_one_rows_prompt_through_the_tiled_kernel_matches_the_fp32_form(isa: str, head: int,
                                                                         request: pytest.FixtureRequest,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """At head size 64 or 32 on AVX-512 an int8 engine's one-row prompt runs the op's tiled kernel, ONNX Runtime's fp32
    form without the op: the same bytes stored (but for a rounding tie of the key, rotated in another float order),
    the logits to float order (with VNNI, to its int16 rounding) and the same greedy tokens after; whole, and in
    pieces that continue held rows."""
    import kvexport
    from kvexport.runtime import session

    _runs_here(isa, monkeypatch)
    art = request.getfixturevalue(f"int8_head{head}_artifact")
    ours = kvexport.load(str(art), threads=2)
    theirs = kvexport.load(str(art), threads=2, native_attention="false")
    prompt = [int(t) for t in np.random.default_rng(6).integers(3, 200, 70)]
    tol = 1e-3 if isa == "avx512-vnni" else 1e-4  # its int16 queries and weights: ~2.5e-4 of the largest logit
    for piece in (session.PREFILL_PIECE, 32):  # one call, then 32 + 32 + 6 new tokens over the rows held
        monkeypatch.setattr(session, "PREFILL_PIECE", piece)
        a, b = ours.prefill(prompt, 30), theirs.prefill(prompt, 30)
        la, lb = a.logits, b.logits
        for _ in range(8):
            np.testing.assert_allclose(la, lb, atol=tol * float(np.abs(lb).max()))
            for x, y in zip(a.state.caches, b.state.caches):
                diff = np.abs(x.astype(np.int16) - y.astype(np.int16))
                assert diff.max() <= 1 and (diff > 0).mean() < (5e-3 if isa == "avx512-vnni" else 1e-3)
            assert (la.argmax(-1) == lb.argmax(-1)).all()
            tok = lb.argmax(-1)
            la, lb = ours.decode(a, tok), theirs.decode(b, tok)
        assert (a.state.caches[0][0, :, :70] != 0).any()
        ours.session.release(a.state), theirs.session.release(b.state)


@pytest.mark.parametrize("isa", ISAS)
def test_an_int8_cache_engine_decodes_the_same_with_the_op(isa: str, int8_cache_artifact: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The same `--kv int8` artifact loaded with the op and with ONNX Runtime's kernel, fed the same tokens for 30
    steps: the cache bytes equal after every step and the logits agree to float order (the op is swapped into
    the one-token branch of every layer, and on AVX-512 one row's prompt runs its tiled kernel; ONNX Runtime's
    fp32 form takes prompts otherwise). A prompt of two rows takes the fp32 form under either load."""
    import kvexport
    from kvexport.errors import InputError

    _runs_here(isa, monkeypatch)
    ours = kvexport.load(str(int8_cache_artifact), threads=2)
    theirs = kvexport.load(str(int8_cache_artifact), threads=2, native_attention="false")
    layers = ours.manifest.config.num_hidden_layers
    assert ours.session.describe()["cache_attention"] == {
        "kernel": f"kvexport Int8CacheAttention ({isa})", "nodes": layers, "why": f"this CPU has {isa}"}
    assert theirs.session.describe()["cache_attention"] == {
        "kernel": "onnxruntime GroupQueryAttention", "nodes": 0, "why": "off (load option native_attention=false)"}
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 200, 40)]
    a, b = ours.prefill(prompt, 31), theirs.prefill(prompt, 31)
    la, lb = a.logits, b.logits
    for _ in range(30):
        np.testing.assert_allclose(la, lb, atol=1e-4 * float(np.abs(lb).max()))
        assert all(np.array_equal(x, y) for x, y in zip(a.state.caches, b.state.caches))
        tok = lb.argmax(-1)
        la, lb = ours.decode(a, tok), theirs.decode(b, tok)
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(3, 200, k)] for k in (23, 9)]
    a, b = ours.prefill(prompts, 3), theirs.prefill(prompts, 3)
    np.testing.assert_array_equal(a.logits, b.logits)  # the same graph ran for both
    assert all(np.array_equal(x, y) for x, y in zip(a.state.caches, b.state.caches))
    with pytest.raises(InputError, match="native_attention"):
        kvexport.load(str(int8_cache_artifact), native_attention="maybe")


@pytest.mark.parametrize("isa", ["avx512", "avx2"])  # a float cache's kernels (no VNNI form)
def test_an_fp32_cache_engine_decodes_the_same_with_the_op(isa: str, artifacts: dict[str, Path],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The default fp32-cache artifact loaded with the op (one-token steps, and one row's prompts with AVX-512) and
    without: a batch of two rows at different lengths fed the same tokens for 30 steps keeps the caches equal to
    float order and picks the same greedy tokens, the two-row prompt's rows (ONNX Runtime's branch) are equal
    exactly, every step writes the bound cache buffers in place (the If's outputs are the bound caches), and a
    one-row prompt gives the same logits to float order."""
    import kvexport

    _runs_here(isa, monkeypatch)
    art = artifacts["llama"]
    ours = kvexport.load(str(art), threads=2)
    theirs = kvexport.load(str(art), threads=2, native_attention="false")
    layers = ours.manifest.config.num_hidden_layers
    assert ours.session.describe()["cache_attention"] == {
        "kernel": f"kvexport Fp32CacheAttention ({isa})", "nodes": layers, "why": f"this CPU has {isa}"}
    assert theirs.session.describe()["cache_attention"]["nodes"] == 0
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(3, 200, n)] for n in (37, 12)]
    a, b = ours.prefill(prompts, 31), theirs.prefill(prompts, 31)
    assert all(np.array_equal(x, y) for x, y in zip(a.state.caches, b.state.caches))
    buffers = [c.ctypes.data for c in a.state.caches]
    la, lb = a.logits, b.logits
    for _ in range(30):
        np.testing.assert_allclose(la, lb, atol=1e-4 * float(np.abs(lb).max()))
        assert np.array_equal(la.argmax(-1), lb.argmax(-1))
        for x, y in zip(a.state.caches, b.state.caches):
            np.testing.assert_allclose(x, y, atol=1e-4 * float(np.abs(y).max()))
        tok = lb.argmax(-1)
        la, lb = ours.decode(a, tok), theirs.decode(b, tok)
    assert [c.ctypes.data for c in a.state.caches] == buffers
    # one row's prompt: with AVX-512 the op's tiled prompt kernel takes it (ONNX Runtime's node otherwise)
    a, b = ours.prefill([prompts[0]], 4), theirs.prefill([prompts[0]], 4)
    np.testing.assert_allclose(a.logits, b.logits, atol=1e-4 * float(np.abs(b.logits).max()))
    assert np.array_equal(a.logits.argmax(-1), b.logits.argmax(-1))
    for x, y in zip(a.state.caches, b.state.caches):
        np.testing.assert_allclose(x, y, atol=1e-4 * float(np.abs(y).max()))


def test_doctor_says_which_cache_attention_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kvexport.backends.cpu import CpuBackend

    monkeypatch.delenv(native.REQUIRE_ENV, raising=False)
    k = native.attention_kernel()
    said = CpuBackend().doctor()["cache_attention"]
    both = ("kvexport Int8CacheAttention (avx512-vnni), Fp32CacheAttention (avx512)" if k.isa == "avx512-vnni"
            else f"kvexport Int8CacheAttention, Fp32CacheAttention ({k.isa})")
    assert said == (both if k.usable else f"ONNX Runtime's: {k.why}")
    monkeypatch.setattr(native, "LIBRARY", tmp_path / "absent.so")
    assert CpuBackend().doctor()["cache_attention"].startswith("ONNX Runtime's: not built")
