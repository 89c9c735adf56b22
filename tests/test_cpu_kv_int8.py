"""cpu --kv int8: ONNX Runtime's GroupQueryAttention keeps the cache in int8 with per-channel scales,
in place, a quarter of the fp32 bytes, and the engine still verifies against its tolerance row."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kvexport
from kvexport.artifact import open_artifact
from kvexport.backends import BuildOptions
from kvexport.backends.cpu import ENGINE_DIR, OPT_MODEL
from kvexport.backends.cpu_kv import K_SCALE_INPUT, V_SCALE_INPUT, channel_scales
from kvexport.runtime.engine import Engine
from kvexport.testing import prefill_pieces_gap
from kvexport.tolerances import precision_key

from tests.conftest import MAX_SEQ, random_ids


@pytest.fixture(scope="module")
def int8_artifact(int8_cache_artifact: Path) -> Path:
    return int8_cache_artifact


@pytest.fixture(scope="module")
def int8_engine(int8_artifact: Path) -> Engine:
    return kvexport.load(str(int8_artifact))


def _gqa_model(cache_type: int, B: int, H: int, Hk: int, D: int, C: int) -> onnx.ModelProto:
    """One GroupQueryAttention over a (B, Hk, C, D) cache; int8 takes per-channel k/v scales."""
    inputs = [helper.make_tensor_value_info("q", TensorProto.FLOAT, [B, None, H * D]),
              helper.make_tensor_value_info("k", TensorProto.FLOAT, [B, None, Hk * D]),
              helper.make_tensor_value_info("v", TensorProto.FLOAT, [B, None, Hk * D]),
              helper.make_tensor_value_info("past_k", cache_type, [B, Hk, C, D]),
              helper.make_tensor_value_info("past_v", cache_type, [B, Hk, C, D]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [B]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    names, attrs = ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total"], {}
    if cache_type == TensorProto.INT8:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, Hk, 1, D]) for n in ("k_scale", "v_scale")]
        names += [""] * (K_SCALE_INPUT - len(names)) + ["k_scale", "v_scale"]
        attrs = {"kv_cache_bit_width": 8, "k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL"}
    node = helper.make_node("GroupQueryAttention", names, ["out", "present_k", "present_v"], domain="com.microsoft",
                            num_heads=H, kv_num_heads=Hk, **attrs)
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, None),
               helper.make_tensor_value_info("present_k", cache_type, None),
               helper.make_tensor_value_info("present_v", cache_type, None)]
    return helper.make_model(helper.make_graph([node], "gqa", inputs, outputs), ir_version=10,
                             opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid("com.microsoft", 1)])


def _branch(node: onnx.NodeProto, name: str) -> onnx.GraphProto:
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)


def test_onnxruntime_stores_round_x_over_scale_per_channel_and_attends_over_it() -> None:
    """The kernel contract the int8 engine is built on (ONNX Runtime 1.31's CPU GroupQueryAttention)."""
    import onnxruntime as ort

    B, S, H, Hk, D, C = 1, 5, 4, 2, 16, 32
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, S, n * D)).astype(np.float32) for n in (H, Hk, Hk))
    feeds = {"q": q, "k": k, "v": v, "seqlens_k": np.array([S - 1], np.int32), "total": np.array(S, np.int32)}
    heads = [x.reshape(B, S, Hk, D).transpose(0, 2, 1, 3) for x in (k, v)]  # (B, Hk, S, D)
    k_scale, v_scale = (channel_scales(x) for x in heads)
    assert k_scale.shape == (1, Hk, 1, D)

    def run(cache_type: int, dtype: type, **extra: np.ndarray) -> list[np.ndarray]:
        sess = ort.InferenceSession(_gqa_model(cache_type, B, H, Hk, D, C).SerializeToString(),
                                    providers=["CPUExecutionProvider"])
        zeros = np.zeros((B, Hk, C, D), dtype)
        return sess.run(None, {**feeds, "past_k": zeros, "past_v": zeros.copy(), **extra})

    out32, _, _ = run(TensorProto.FLOAT, np.float32)
    out8, k8, v8 = run(TensorProto.INT8, np.int8, k_scale=k_scale, v_scale=v_scale)
    assert k8.dtype == np.int8
    for stored, x, scale in ((k8, heads[0], k_scale), (v8, heads[1], v_scale)):
        # x times the fp32 reciprocal, rounded half to even (x / scale rounds some ties apart: see below)
        np.testing.assert_array_equal(stored[:, :, :S], np.clip(np.round(x * (np.float32(1) / scale)), -128, 127))
        assert np.abs(stored[:, :, :S]).max() == 127  # absmax / 127 uses the whole range
    assert 0 < np.abs(out8 - out32).max() < 0.02  # attention over the int8 cache, not the fp32 inputs


def test_rotating_key_pairs_share_the_scale_of_their_length() -> None:
    """A RoPE pair (i, i + rot/2) keeps its length at every position: both channels get it, so a key at
    a position the calibration never reached fits the range."""
    x = np.zeros((1, 1, 2, 8), np.float32)  # (B, H_kv, S, D), rotary over the first 4 channels
    x[0, 0, 0, :4] = [3.0, 0.0, 4.0, 0.0]  # pair (0, 2) has length 5
    x[0, 0, 1, 4:] = [1.0, -2.0, 0.0, 0.0]
    s = channel_scales(x, rotary_dim=4)[0, 0, 0] * 127
    np.testing.assert_allclose(s, [5, 0, 5, 0, 1, 2, 0, 0], atol=1e-5)


def test_engine_graph_keeps_every_layer_in_int8_with_calibrated_scales(int8_artifact: Path,
                                                                        int8_engine: Engine) -> None:
    model = onnx.load(str(int8_artifact / ENGINE_DIR / OPT_MODEL))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    cfg = int8_engine.config
    branches = [n for n in model.graph.node if n.op_type == "If"]
    assert len(branches) == cfg.num_hidden_layers  # several new tokens: fp32 attention; one: the kernel
    nodes = [n for b in branches for n in _branch(b, "else_branch").node]
    assert len(nodes) == cfg.num_hidden_layers and {n.op_type for n in nodes} == {"GroupQueryAttention"}
    for n in nodes:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["kv_cache_bit_width"] == 8 and attrs["k_quant_type"] == attrs["v_quant_type"] == b"PER_CHANNEL"
        assert attrs["do_rotary"] == 1 and n.input[1] == ""  # RoPE inside the kernel, q|k|v packed (fold_rotary)
        for name in (n.input[K_SCALE_INPUT], n.input[V_SCALE_INPUT]):
            scale = inits[name]
            assert scale.shape == (1, cfg.num_key_value_heads, 1, cfg.head_dim) and (scale > 0).all()
    caches = {i.name: i.type.tensor_type.elem_type for i in model.graph.input if i.name.startswith("past_")}
    assert len(caches) == 2 * cfg.num_hidden_layers and set(caches.values()) == {TensorProto.INT8}
    target = int8_engine.manifest.target
    assert target["options"]["rotary_in_attention"] == cfg.num_hidden_layers
    # ... and the many-token branch rotates q and k itself before it stores and attends
    assert all([n.op_type for n in _branch(b, "then_branch").node].count("RotaryEmbedding") == 2 for b in branches)
    assert precision_key(target) == "fp32+kv-int8"
    kv = target["kv"]
    assert kv["dtype"] == "int8" and kv["bytes_per_token"] * 4 == kv["fp32_bytes_per_token"]
    assert kv["calibration"]["tokens"] > 0


def test_the_int8_cache_holds_at_most_027x_the_fp32_bytes(int8_engine: Engine, artifacts: dict[str, Path]) -> None:
    fp32 = kvexport.load(str(artifacts["llama"]))
    prompt = random_ids(40)
    a, b = int8_engine.prefill(prompt, 8), fp32.prefill(prompt, 8)
    assert all(c.dtype == np.int8 for c in a.state.caches) and a.state.capacity == b.state.capacity
    ratio = int8_engine.session.cache_bytes(a.state) / fp32.session.cache_bytes(b.state)
    assert ratio <= 0.27, ratio  # scales included: 0.25 + one fp32 token's worth over the capacity
    assert int8_engine.session.cache_bytes(a.state) > sum(c.nbytes for c in a.state.caches)  # the scales count


def test_decode_writes_in_place_and_growth_copies_once_per_step(int8_engine: Engine) -> None:
    """Decode steps copy no cache bytes; crossing capacity steps copies the held int8 rows once, exactly:
    the logits match a state that started at full capacity."""
    s = int8_engine.session
    prompt = random_ids(20, seed=3)
    grown, fixed = int8_engine.prefill(prompt, 1), int8_engine.prefill(prompt, MAX_SEQ - len(prompt))
    start_capacity = grown.state.capacity
    toks = random_ids(90, seed=4)
    copied = []
    for t in toks:
        before = s.cache_bytes_copied(grown.state)
        got = int8_engine.decode(grown, np.array([t]))
        want = int8_engine.decode(fixed, np.array([t]))
        np.testing.assert_allclose(got, want, atol=1e-4)
        copied.append(s.cache_bytes_copied(grown.state) - before)
    events = grown.state.grow_events
    assert len(events) >= 2 and grown.state.capacity > start_capacity
    assert sum(1 for c in copied if c) == len(events)  # copies only on the steps that grew
    assert s.cache_bytes_copied(fixed.state) == 0


def test_a_prompt_prefilled_in_pieces_matches_one_call(int8_engine: Engine) -> None:
    """The quantized cache takes a long prompt's pieces (PREFILL_PIECE) over the int8 past it already holds."""
    gap, calls = prefill_pieces_gap(int8_engine, random_ids(50, seed=3), 16)
    assert calls == [1, 4]
    assert gap < 1e-3, gap  # the same int8 rows either way; only the float sums' order differs


def test_tiny_family_at_kv_int8_verifies_against_its_row(int8_engine: Engine, checkpoints: dict[str, Path]) -> None:
    """Teacher-forced row, prefill(N)+decode(1) against prefill(N+1), and batch rows of different lengths."""
    from kvexport.verify import self_consistency_limit, tolerance, verify_engine

    r = verify_engine(int8_engine, checkpoints["llama"], decode_steps=16, prompt_lengths=(7,), text_positions=96)
    assert r.precision == "fp32+kv-int8" and r.mode == "teacher-forced"
    assert r.passed, r.failures
    limit = self_consistency_limit(tolerance("cpu", "fp32+kv-int8"))
    assert set(r.checks) == {"prefill_decode_max_abs", "batch_independence_max_abs"}
    assert max(r.checks.values()) <= limit


def test_continuous_batching_rows_hold_int8_and_match_alone(int8_engine: Engine) -> None:
    """The scheduler's shared row pool allocates the session's int8 cache; requests of different lengths,
    prefilled in chunks while others decode, get the tokens they get alone."""
    from kvexport.runtime.rows import BoundRows
    from kvexport.runtime.scheduler import Scheduler

    prompts = ["hello world", "def main(", "a" * 40, "x"]
    alone = [int8_engine.generate(p, 20).token_ids for p in prompts]
    rows = BoundRows(int8_engine.session, 2)
    with Scheduler(int8_engine, rows=rows, prefill_chunk=16) as s:
        got = [h.result(timeout=60).token_ids for h in [s.submit(p, 20) for p in prompts]]
        assert rows.caches and all(c.dtype == np.int8 for c in rows.caches)
    assert got == alone



def test_int4_weights_with_an_int8_cache_verify_against_their_row(workdir: Path,
                                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    """Both lossy modes at once, MatMulNBits weights and the int8 cache, judged where lossy rows are: the
    trained default model's held-out text (random weights' flat logits flip under int4 noise alone)."""
    from kvexport.build import build
    from kvexport.testing import default_checkpoint_once, exports_made_once
    from kvexport.verify import HELDOUT_FILE, verify_engine

    trained = default_checkpoint_once(tmp_path_factory)
    with exports_made_once(tmp_path_factory):  # the default model's export at 256 other targets' tests share
        art = build(trained, workdir / "default-int4-kv-int8.kvx", target="cpu", max_seq=256,
                    options=BuildOptions(weights="int4", group_size=32, kv="int8"), verify=False)
    engine = kvexport.load(str(art))
    assert engine.session.cache_dtype == np.int8
    r = verify_engine(engine, trained, decode_steps=16, prompt_lengths=(7,))
    print(r.text)
    assert r.precision == "int4-g32+kv-int8" and r.mode == "teacher-forced" and r.text["source"] == HELDOUT_FILE
    assert r.passed, r.failures


def test_inspect_counts_the_scales_once_per_engine_not_per_token(int8_artifact: Path) -> None:
    kv = open_artifact(int8_artifact)[1].target["kv"]
    out = subprocess.run([sys.executable, "-m", "kvexport", "inspect", str(int8_artifact), "--no-hash-check"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert kv["scale_bytes"] > 0
    assert (f"KV cache: int8, {kv['bytes_per_token']} bytes per token per row "
            f"(+ {kv['scale_bytes']} bytes of per-channel scales, once per engine)") in out
    # the input list is the IR's float32 contract: inspect says the engine's buffers are int8
    assert "inputs (the IR's; the engine keeps the cache buffers as int8):" in out


def _attention_step_model(packed: bool, B: int, H: int, Hk: int, D: int, C: int, scales: np.ndarray,
                          rotary: bool = False) -> onnx.ModelProto:
    """One quantized GroupQueryAttention as the engine graph holds it (the IR's step inputs, scales as
    initializers, seqlens_k / total from write_index and the new tokens), for branch_attention; `rotary`:
    the kernel rotates q and k itself over cos/sin tables of C positions (cpu_fusion.fold_rotary)."""
    m = _gqa_model(TensorProto.INT8, B, H, Hk, D, C)
    g = m.graph
    n = g.node[0]
    n.name = "layers.0.attn/GroupQueryAttention_0"
    keep = {"past_k", "past_v"} | ({"q"} if packed else {"q", "k", "v"})
    ins = [i for i in g.input if i.name in keep]
    if packed:
        ins[0] = helper.make_tensor_value_info("q", TensorProto.FLOAT, [B, None, (H + 2 * Hk) * D])
        n.input[1], n.input[2] = "", ""
    if rotary:
        angles = np.arange(C)[:, None] / 10000.0 ** (np.arange(D // 2) / (D // 2))
        g.initializer.extend([numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
                              numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin")])
        n.input[7], n.input[8], n.input[9] = "cos", "sin", "position_ids"
        n.attribute.append(helper.make_attribute("do_rotary", 1))
        ins.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, [B, None]))
    del g.input[:]
    g.input.extend([*ins, helper.make_tensor_value_info("input_ids", TensorProto.INT64, [B, None]),
                    helper.make_tensor_value_info("write_index", TensorProto.INT64, [B])])
    g.initializer.extend([numpy_helper.from_array(scales[0], "k_scale"), numpy_helper.from_array(scales[1], "v_scale"),
                          numpy_helper.from_array(np.array(1, np.int32), "one")])
    g.node.insert(0, helper.make_node("Shape", ["input_ids"], ["seq64"], start=1, end=2))
    g.node.insert(1, helper.make_node("Cast", ["seq64"], ["seq"], to=TensorProto.INT32))
    g.node.insert(2, helper.make_node("Cast", ["write_index"], ["wi"], to=TensorProto.INT32))
    g.node.insert(3, helper.make_node("Add", ["wi", "seq"], ["held"]))
    g.node.insert(4, helper.make_node("Sub", ["held", "one"], ["seqlens_k"]))
    g.node.insert(5, helper.make_node("ReduceMax", ["held"], ["total"], keepdims=0))
    return m


@pytest.mark.parametrize(("packed", "rotary"), [(False, False), (True, False), (True, True)],
                         ids=["separate-qkv", "packed-qkv", "packed-qkv-rotary"])
def test_the_many_token_branch_stores_the_kernels_bytes_and_attends_over_them(packed: bool, rotary: bool) -> None:
    """branch_attention's fp32 form of a quantized GroupQueryAttention against the kernel itself, in
    place on one int8 cache: a fresh prompt, a piece over that past, then one token (the kernel's own
    branch). The stored bytes are the kernel's exactly, ties included (the kernel multiplies by 1 / scale,
    which rounds a tie differently from x / scale), and the attention differs by float order only. Where
    the kernel rotates q and k itself, the form rotates them before it stores and attends."""
    import onnxruntime as ort

    from kvexport.backends.cpu_kv import branch_attention

    B, H, Hk, D, C = 1, 4, 2, 64, 2048
    rng = np.random.default_rng(5)
    scales = rng.uniform(0.01, 0.05, (2, 1, Hk, 1, D)).astype(np.float32)
    kernel_model = _attention_step_model(packed, B, H, Hk, D, C, scales, rotary)
    sessions = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
                for m in (kernel_model, branch_attention(kernel_model))]
    assert any(n.op_type == "If" for n in branch_attention(kernel_model).graph.node)
    caches = [[np.zeros((B, Hk, C, D), np.int8) for _ in range(2)] for _ in sessions]
    T, ties = 0, 0
    for S in (1024, 512, 1):
        q = rng.standard_normal((B, S, H * D)).astype(np.float32)
        # half the rows sit at (k + 1/2) * scale: ties, where x / scale and x * (1 / scale) round apart
        kv = [np.concatenate([rng.standard_normal((B, S // 2 + S % 2, Hk, D)) * 3 * sc.reshape(1, 1, Hk, D) / 0.03,
                              (rng.integers(-100, 100, (B, S // 2, Hk, D)) + 0.5) * sc.reshape(1, 1, Hk, D)], axis=1)
              .astype(np.float32).reshape(B, S, Hk * D) for sc in scales]
        x = kv[0].reshape(B, S, Hk, D).transpose(0, 2, 1, 3)
        ties += int((np.round(x / scales[0]) != np.round(x * (np.float32(1) / scales[0]))).sum())
        feeds = {"input_ids": np.zeros((B, S), np.int64), "write_index": np.full(B, T, np.int64)}
        if rotary:
            feeds["position_ids"] = np.arange(T, T + S, dtype=np.int64)[None]
        feeds.update({"q": np.concatenate([q, *kv], axis=-1)} if packed else {"q": q, "k": kv[0], "v": kv[1]})
        outs = []
        for sess, (ck, cv) in zip(sessions, caches):
            b = sess.io_binding()
            for name, arr in feeds.items():
                b.bind_cpu_input(name, arr)
            for inp, out, buf in (("past_k", "present_k", ck), ("past_v", "present_v", cv)):
                b.bind_input(inp, "cpu", 0, np.int8, buf.shape, buf.ctypes.data)
                b.bind_output(out, "cpu", 0, np.int8, buf.shape, buf.ctypes.data)
            b.bind_output("out")
            sess.run_with_iobinding(b)
            outs.append(b.get_outputs()[0].numpy())
        T += S
        for a, b_ in zip(*caches):
            np.testing.assert_array_equal(a[:, :, :T], b_[:, :, :T])
        assert np.abs(caches[0][0][:, :, T - S:T]).max() > 100  # the rows were written into the bound buffers
        np.testing.assert_allclose(outs[0], outs[1], atol=2e-5)
    assert ties > 0  # the data holds ties that only the kernel's own rounding stores alike


def test_a_prompt_through_the_many_token_branch_matches_the_kernel_token_by_token(int8_engine: Engine) -> None:
    """A prompt in one engine call (the fp32 form) against the same prompt fed one token a step (the
    quantized kernel): the same cache bytes up to a rare one-step flip where float order moves a value
    across a rounding edge (none in the first layer, whose K/V no attention precedes), logits within the
    float-order noise, and the same greedy tokens after."""
    s = int8_engine.session
    prompt = random_ids(60, seed=6)
    N = len(prompt)
    whole, stepped = s.new_state(1, N + 8), s.new_state(1, N + 8)
    i = np.arange(N)
    mask = (i[None, :] <= i[:, None])[None, None]
    a = s.step(whole, np.array([prompt]), i[None], mask).copy()
    assert whole.steps == 1
    for t in range(N):
        b = s.step(stepped, np.array([[prompt[t]]]), np.array([[t]]), mask[:, :, t:t + 1, :t + 1]).copy()
    assert np.abs(a - b).max() < 1e-3, np.abs(a - b).max()
    diffs = [np.abs(x[:, :, :N].astype(np.int16) - y[:, :, :N]) for x, y in zip(whole.caches, stepped.caches)]
    assert diffs[0].max() == 0 and diffs[1].max() == 0
    assert max(d.max() for d in diffs) <= 1 and sum(int((d > 0).sum()) for d in diffs) <= 1e-3 * sum(d.size for d in diffs)
    toks = [[], []]
    for state, got in zip((whole, stepped), toks):
        logits = a if state is whole else b
        for t in range(N, N + 8):
            got.append(int(logits.argmax()))
            logits = s.step(state, np.array([[got[-1]]]), np.array([[t]]), np.ones((1, 1, 1, t + 1), bool))
    assert toks[0] == toks[1]


def test_the_many_token_branch_writes_the_bound_cache_in_place(int8_artifact: Path) -> None:
    """ONNX Runtime's TensorScatter warns when its output is not its input's buffer and it must copy the
    cache (checked here on a bare TensorScatter); a prefill and a decode step through the engine's If
    branches give no such warning, keep the state's buffers and count no copied bytes."""
    script = f"""
import numpy as np, onnxruntime as ort, kvexport, kvexport.backends.cpu as cpu
from onnx import TensorProto, helper
plain = cpu.session_options
def loud(threads, optimized_path=None):
    so = plain(threads, optimized_path)
    so.log_severity_level = 1
    return so
cpu.session_options = loud
n = helper.make_node("TensorScatter", ["c", "u", "w"], ["o"], axis=-2, mode="linear")
t = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.INT8, shape)
g = helper.make_graph([n], "g", [t("c", [1, 1, 8, 8]), t("u", [1, 1, 2, 8]),
                      helper.make_tensor_value_info("w", TensorProto.INT64, [1])], [t("o", [1, 1, 8, 8])])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 24)], ir_version=10)
sess = ort.InferenceSession(m.SerializeToString(), loud(1), providers=["CPUExecutionProvider"])
c, other = np.zeros((1, 1, 8, 8), np.int8), np.zeros((1, 1, 8, 8), np.int8)
b = sess.io_binding()
b.bind_cpu_input("c", c); b.bind_cpu_input("u", np.ones((1, 1, 2, 8), np.int8)); b.bind_cpu_input("w", np.array([3]))
b.bind_output("o", "cpu", 0, np.int8, c.shape, other.ctypes.data)
print("== copying TensorScatter", flush=True)
sess.run_with_iobinding(b)
print("== engine", flush=True)
s = kvexport.load({str(int8_artifact)!r}).session
state = s.new_state(1, 48)
ptrs = [c.ctypes.data for c in state.caches]
i = np.arange(40)
s.step(state, (i[None] + 3) % 200, i[None], (i[None, :] <= i[:, None])[None, None])
s.step(state, np.array([[7]]), np.array([[40]]), np.ones((1, 1, 1, 41), bool))
assert [c.ctypes.data for c in state.caches] == ptrs and s.cache_bytes_copied(state) == 0
assert all(np.abs(c[:, :, :41]).max() > 0 for c in state.caches)
print("== done", flush=True)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    log = r.stdout + r.stderr
    warning = "in-place optimization not activated"
    assert "== done" in r.stdout
    # stderr and stdout interleave unordered: the bare TensorScatter warns, so the warning is visible here
    assert log.count(warning) == 1, [line for line in log.splitlines() if warning in line]


def test_an_edited_engine_graph_is_refused_at_load(int8_artifact: Path, tmp_path: Path) -> None:
    """The If branches live in the engine graph the manifest hashes: changing one is refused before loading."""
    import shutil

    from kvexport.errors import ArtifactError

    copy = tmp_path / "edited.kvx"
    shutil.copytree(int8_artifact, copy)
    path = copy / ENGINE_DIR / OPT_MODEL
    model = onnx.load(str(path), load_external_data=False)
    branch = next(n for n in model.graph.node if n.op_type == "If")
    for a in branch.attribute:  # swap the branches: one token would take the fp32 form and many the kernel
        a.name = {"then_branch": "else_branch", "else_branch": "then_branch"}[a.name]
    onnx.save_model(model, str(path))
    with pytest.raises(ArtifactError, match="does not match the sha256"):
        kvexport.load(str(copy))
    path.unlink()
    with pytest.raises(ArtifactError, match="missing"):
        kvexport.load(str(copy))
