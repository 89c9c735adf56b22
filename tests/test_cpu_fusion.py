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
    # RoPE goes into the kernel (fold_rotary): no Split, no RotaryEmbedding, the packed q|k|v read directly
    assert ops.count("RotaryEmbedding") == 0
    attn = [n for n in llama.node if n.op_type == "GroupQueryAttention"]
    assert len(attn) == layers and all(n.input[1] == "" and n.input[9] for n in attn)
    assert all({a.name: a.i for a in n.attribute}["do_rotary"] == 1 for n in attn)
    assert mf.read(artifacts["llama"]).target["options"]["rotary_in_attention"] == layers


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt_neox"])  # gpt_neox: partial rotary, kept apart
def test_rotation_in_the_kernel_keeps_the_irs_cache_under_left_padding(artifacts: dict[str, Path], family: str) -> None:
    """The engine whose GroupQueryAttention rotates q and k itself, against the IR, on a left-padded batch: a
    first prompt whose rows start at different positions (run one row at a time), then decode steps; logits
    and every held cache slot agree, so the keys are held rotated by their positions, as the IR holds them."""
    import kvexport

    folder = artifacts[family]
    man = mf.read(folder)
    assert man.target is not None
    folded = man.target["options"]["rotary_in_attention"]
    assert folded == (0 if family == "gpt_neox" else man.config.num_hidden_layers)
    engine = kvexport.load(str(folder))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    ir = ort.InferenceSession(str(folder / "model.onnx"), so)
    rows = [random_ids(7, 1), random_ids(3, 2)]
    B, S, L, steps = 2, 7, 32, 10
    pad = np.array([0, 4])
    ids = np.zeros((B, S), np.int64)
    for b, r in enumerate(rows):
        ids[b, pad[b]:] = r
    i = np.arange(S)
    valid = np.arange(L)[None] >= pad[:, None]
    mask = np.zeros((B, 1, S, L), bool)
    mask[:, 0, :, :S] = (i[None, :] <= i[:, None])[None] & valid[:, None, :S]
    for b in range(B):
        mask[b, 0, np.arange(pad[b]), np.arange(pad[b])] = True
    caches = [np.zeros((B, man.config.num_key_value_heads, L, man.config.head_dim), np.float32) for _ in man.kv_pairs()]

    def run(ids: np.ndarray, pos: np.ndarray, wi: int, mask: np.ndarray) -> np.ndarray:
        feeds = {"input_ids": ids, "position_ids": pos, "write_index": np.full(B, wi, np.int64), "attention_mask": mask}
        feeds.update({p: c for (p, _), c in zip(man.kv_pairs(), caches)})
        out = ir.run(None, feeds)
        caches[:] = out[1:]
        return out[0][:, -1]

    want = run(ids, np.maximum(i[None] - pad[:, None], 0), 0, mask)
    batch = engine.prefill(rows, steps)
    assert np.abs(batch.logits - want).max() < 1e-4
    for t in range(S, S + steps):
        tok = want.argmax(-1)
        step_mask = np.zeros((B, 1, 1, L), bool)
        step_mask[:, 0, 0, : t + 1] = valid[:, : t + 1]
        want = run(tok[:, None], (t - pad)[:, None], t, step_mask)
        got = engine.decode(batch, tok)
        assert np.abs(got - want).max() < 1e-4, t
        held = batch.state.caches  # (B, H_kv, capacity, D) per pair, in the manifest's order
        for b in range(B):
            slots = np.flatnonzero(valid[b, : t + 1])
            assert max(np.abs(x[b][:, slots] - y[b][:, slots]).max() for x, y in zip(caches, held)) < 1e-4, (t, b)


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


def test_left_padded_batch_with_rings_and_rotation_in_the_kernel_equals_its_rows_alone(artifacts: dict[str, Path]) -> None:
    """gemma2: full layers rotate in GroupQueryAttention, sliding ones keep their rings; a batch of prompts of
    different lengths (its first piece run one row at a time, the window's pieces after it) against each alone."""
    import kvexport

    e = kvexport.load(str(artifacts["gemma2"]))
    assert e.manifest.target is not None and e.manifest.target["options"]["rotary_in_attention"] > 0
    assert RingSpec.of(e.manifest) is not None
    prompts = [random_ids(n, seed=n) for n in (5, 30, 57)]
    together = e.generate(prompts, 24, stop=())
    alone = [e.generate(p, 24, stop=()) for p in prompts]
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
