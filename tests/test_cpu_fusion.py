"""The cpu engine's lowering of TensorScatter + Attention to GroupQueryAttention."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from kvexport import manifest as mf
from kvexport.backends.cpu_fusion import fuse_group_query_attention, lower_for_onnxruntime
from kvexport.runtime.ring import MASK_INPUT, RingSpec, sliding_mask
from tests.conftest import random_ids


def test_engine_graph_has_one_fused_attention_per_layer(artifacts: dict[str, Path]) -> None:
    folder = artifacts["qwen2"]  # full attention in every layer (sliding ones keep rings, unfused: test_ring_cache)
    m = mf.read(folder)
    g = onnx.load(str(folder / "engine" / "model.opt.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in g.node]
    assert ops.count("GroupQueryAttention") == m.config.num_hidden_layers
    assert "TensorScatter" not in ops and "Attention" not in ops
    assert m.target is not None and m.target["options"]["fused_attention_layers"] == m.config.num_hidden_layers
    ir = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    assert "GroupQueryAttention" not in [n.op_type for n in ir.node]  # the IR itself stays standard ONNX


def test_engine_graph_reads_packed_qkv_and_folds_residual_adds(artifacts: dict[str, Path]) -> None:
    gpt2 = onnx.load(str(artifacts["gpt2"] / "engine" / "model.opt.onnx"), load_external_data=False).graph
    n_gpt2 = mf.read(artifacts["gpt2"]).config.num_hidden_layers
    attn = [n for n in gpt2.node if n.op_type == "GroupQueryAttention"]
    assert len(attn) == n_gpt2 and all(n.input[1] == "" and n.input[2] == "" for n in attn)  # packed q|k|v
    llama = onnx.load(str(artifacts["llama"] / "engine" / "model.opt.onnx"), load_external_data=False).graph
    layers = mf.read(artifacts["llama"]).config.num_hidden_layers
    ops = [n.op_type for n in llama.node]
    # every norm but the first layer's (it reads the embedding, no residual yet) absorbs its Add
    assert ops.count("SkipSimplifiedLayerNormalization") == 2 * layers
    assert ops.count("RMSNormalization") == 1
    assert ops.count("RotaryEmbedding") == 2 * layers  # RoPE stays outside: see _packed_qkv


@pytest.mark.parametrize("family", ["qwen2", "gpt2", "gemma2"])  # gemma2: GQA's softcap; its sliding layers' rings stay
def test_fused_graph_matches_the_ir_with_padding_and_in_place_writes(artifacts: dict[str, Path], family: str) -> None:
    folder = artifacts[family]
    man = mf.read(folder)
    cfg = man.config
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    done = lower_for_onnxruntime(model)
    ring = RingSpec.of(man)  # gemma2's sliding layers keep rings: the IR's own Attention, left unfused
    assert done["fused_attention_layers"] == cfg.num_hidden_layers - (len(ring.layers) if ring else 0)
    assert done["fused_skip_norms"] == (0 if family == "gpt2" else 2 * cfg.num_hidden_layers)
    fused = folder / "test-fused.onnx"  # beside the IR: shares its external data
    onnx.save_model(model, str(fused))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    try:
        ref = ort.InferenceSession(str(folder / "model.onnx"), so)
        fus = ort.InferenceSession(str(fused), so)
    finally:
        fused.unlink()
    B, S, L = 2, 6, 32
    pad = np.array([0, 4])
    ids = np.array([random_ids(S, 1), [0] * 4 + random_ids(2, 2)])
    pos = np.maximum(np.arange(S)[None] - pad[:, None], 0)
    valid = np.arange(L)[None] >= pad[:, None]
    i = np.arange(S)
    mask = np.zeros((B, 1, S, L), bool)
    mask[:, 0, :, :S] = (i[None, :] <= i[:, None])[None] & valid[:, None, :S]
    for b in range(B):
        mask[b, 0, np.arange(pad[b]), np.arange(pad[b])] = True

    def run(sess: ort.InferenceSession, ids: np.ndarray, pos: np.ndarray, wi: np.ndarray, mask: np.ndarray,
            caches: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        feeds = {"input_ids": ids, "position_ids": pos, "write_index": wi, "attention_mask": mask}
        if ring is not None:  # over the held slots, through the ring
            feeds[MASK_INPUT] = sliding_mask(mask[..., : int(wi[0]) + ids.shape[1]], ring.length(L), ring.window)
        feeds.update({p: c for (p, _), c in zip(man.kv_pairs(), caches)})
        out = sess.run(None, feeds)
        return out[0], out[1:]

    zeros = [np.zeros((B, cfg.num_key_value_heads, ring.length(L) if ring and ring.is_ring(k) else L, cfg.head_dim),
                      np.float32) for k in range(len(man.kv_pairs()))]
    a, ca = run(ref, ids, pos, np.zeros(B, np.int64), mask, [z.copy() for z in zeros])
    f, cf = run(fus, ids, pos, np.zeros(B, np.int64), mask, [z.copy() for z in zeros])
    assert np.abs(a - f).max() < 1e-4
    for t in range(S, S + 16):  # past gemma2's sliding window of 16
        tok = a[:, -1].argmax(-1)[:, None]
        step_mask = np.zeros((B, 1, 1, L), bool)
        step_mask[:, 0, 0, : t + 1] = valid[:, : t + 1]
        a, ca = run(ref, tok, (t - pad)[:, None], np.full(B, t), step_mask, ca)
        f, cf = run(fus, tok, (t - pad)[:, None], np.full(B, t), step_mask, cf)
        assert np.abs(a - f).max() < 1e-4, t
        assert max(np.abs(x[:, :, : t + 1] - y[:, :, : t + 1]).max() for x, y in zip(ca, cf)) < 1e-4  # rings whole


def test_concat_style_is_left_alone(checkpoints: dict[str, Path], workdir: Path) -> None:
    from kvexport.artifact import export_artifact

    folder = workdir / "llama-concat.kvx"
    if not folder.exists():
        export_artifact(checkpoints["llama"], folder, max_seq=128, cache_style="concat")
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    before = [n.op_type for n in model.graph.node]
    assert fuse_group_query_attention(model) == 0
    assert [n.op_type for n in model.graph.node] == before
