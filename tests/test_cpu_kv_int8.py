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
def int8_artifact(workdir: Path, checkpoints: dict[str, Path]) -> Path:
    from kvexport.build import build

    return build(checkpoints["llama"], workdir / "llama-kv-int8.kvx", target="cpu", max_seq=MAX_SEQ,
                 options=BuildOptions(kv="int8"), verify=False)


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
        np.testing.assert_array_equal(stored[:, :, :S], np.clip(np.round(x / scale), -128, 127))
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
    nodes = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(nodes) == cfg.num_hidden_layers
    for n in nodes:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["kv_cache_bit_width"] == 8 and attrs["k_quant_type"] == attrs["v_quant_type"] == b"PER_CHANNEL"
        for name in (n.input[K_SCALE_INPUT], n.input[V_SCALE_INPUT]):
            scale = inits[name]
            assert scale.shape == (1, cfg.num_key_value_heads, 1, cfg.head_dim) and (scale > 0).all()
    caches = {i.name: i.type.tensor_type.elem_type for i in model.graph.input if i.name.startswith("past_")}
    assert len(caches) == 2 * cfg.num_hidden_layers and set(caches.values()) == {TensorProto.INT8}
    target = int8_engine.manifest.target
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
