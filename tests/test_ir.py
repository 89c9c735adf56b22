"""The IR contract (docs/design.md), run directly in ONNX Runtime with no kvexport runtime involved."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from kvexport import manifest as mf
from kvexport.artifact import export_artifact
from kvexport.runtime.ring import MASK_INPUT, RING_MASK_DIM, RingSpec, chunks, sliding_mask
from kvexport.tolerances import tolerance
from tests.conftest import FAMILIES, MAX_SEQ, HFReference, random_ids

TOL = tolerance("cpu", "fp32")


class IRRunner:
    """Feeds the static-style IR with explicit caches; returns logits and the present caches."""

    def __init__(self, folder: Path):
        self.m = mf.read(folder)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        self.sess = ort.InferenceSession(str(folder / self.m.raw["ir"]["file"]), so, providers=["CPUExecutionProvider"])
        self.cfg = self.m.config
        self.style = self.m.raw["ir"]["cache_style"]
        self.ring = RingSpec.of(self.m)  # sliding-window layers on rings (their own mask input)
        self.names = {i.name for i in self.sess.get_inputs()}

    def empty(self, batch: int, slots: int) -> list[np.ndarray]:
        ring = self.ring
        return [np.zeros((batch, self.cfg.num_key_value_heads, ring.length(slots) if ring and ring.is_ring(k) else slots,
                          self.cfg.head_dim), np.float32) for k in range(2 * self.cfg.num_hidden_layers)]

    def run(self, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray, caches: list[np.ndarray],
            write_index: np.ndarray | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
        if self.ring is None:
            return self._run(ids, pos, mask, caches, write_index)
        assert write_index is not None  # rows that write at one slot (every test here); rings take W rows a call
        for a, b in chunks(ids.shape[1], self.ring.window):
            out, caches = self._run(ids[:, a:b], pos[:, a:b], mask[:, :, a:b], caches, write_index + a)
        return out, caches

    def _run(self, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray, caches: list[np.ndarray],
             write_index: np.ndarray | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
        feeds = {"input_ids": ids.astype(np.int64), "position_ids": pos.astype(np.int64), "attention_mask": mask}
        if self.ring is not None:
            held = mask[..., : int(write_index[0]) + ids.shape[1]]  # type: ignore[index]
            ring_len = caches[2 * min(self.ring.layers)].shape[2]
            feeds[MASK_INPUT] = sliding_mask(held, ring_len, self.ring.window)
            feeds = {k: v for k, v in feeds.items() if k in self.names}
        if self.style == "static":
            feeds["write_index"] = write_index.astype(np.int64)  # type: ignore[union-attr]
        feeds.update({inp: c for (inp, _), c in zip(self.m.kv_pairs(), caches)})
        out = self.sess.run(None, feeds)
        return out[0], out[1:]


def causal_mask(S: int, past: int, slots: int) -> np.ndarray:
    """Causal only: a sliding-window layer's band is the graph's own."""
    q = past + np.arange(S)[:, None]
    k = np.arange(slots)[None, :]
    return (k <= q)[None, None]


def greedy(r: IRRunner, prompt: list[int], steps: int, slots: int) -> tuple[list[int], np.ndarray]:
    """Prefill the prompt, then decode `steps` tokens greedily; returns all ids and (steps, vocab) logits."""
    caches = r.empty(1, slots if r.style == "static" else 0)
    seq, out = list(prompt), []
    a, b = 0, len(prompt)
    for _ in range(steps):
        S = b - a
        ids, pos = np.array([seq[a:b]]), np.arange(a, b)[None]
        if r.style == "static":
            logits, caches = r.run(ids, pos, causal_mask(S, a, slots), caches, np.array([a]))
        else:
            logits, caches = r.run(ids, pos, causal_mask(S, a, b), caches)
        out.append(logits[0, -1])
        seq.append(int(out[-1].argmax()))
        a, b = b, b + 1
    return seq, np.stack(out)


@pytest.mark.parametrize("family", FAMILIES)
def test_ir_matches_transformers_prefill_and_32_decode_steps(family: str, artifacts: dict[str, Path],
                                                             references: dict[str, HFReference]) -> None:
    r = IRRunner(artifacts[family])
    for prompt_len in (1, 6, 29):
        seq, eng = greedy(r, random_ids(prompt_len, seed=prompt_len), 33, 96)
        want = references[family].logits(seq[:-1])[prompt_len - 1 :]  # teacher-forced on the IR's tokens
        assert np.abs(eng - want).max() < TOL.max_abs_logit, (family, prompt_len)
        assert (eng.argmax(-1) == want.argmax(-1)).all(), (family, prompt_len)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_prefill_n_then_decode_equals_prefill_n_plus_1_across_the_cache(family: str, artifacts: dict[str, Path]) -> None:
    r = IRRunner(artifacts[family])
    slots = 64
    ids = random_ids(slots, seed=11)
    for n in (1, 2, 5, 13, 24, 25, 40, 62):
        caches = r.empty(1, slots)
        _, caches = r.run(np.array([ids[:n]]), np.arange(n)[None], causal_mask(n, 0, slots), caches, np.array([0]))
        stepped, _ = r.run(np.array([[ids[n]]]), np.array([[n]]), causal_mask(1, n, slots), caches, np.array([n]))
        whole, _ = r.run(np.array([ids[: n + 1]]), np.arange(n + 1)[None], causal_mask(n + 1, 0, slots),
                         r.empty(1, slots), np.array([0]))
        assert np.abs(stepped[0, -1] - whole[0, -1]).max() < 1e-5, n


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_batch_rows_of_different_lengths_match_each_row_alone(family: str, artifacts: dict[str, Path]) -> None:
    """Left-padded batch of 3 with explicit positions and masks; pad queries see only themselves."""
    r = IRRunner(artifacts[family])
    slots, steps = 48, 4
    rows = [random_ids(n, seed=n) for n in (4, 11, 30)]
    S = max(map(len, rows))
    pad = np.array([S - len(x) for x in rows])
    ids = np.array([[0] * p + x for p, x in zip(pad, rows)])
    pos = np.maximum(np.arange(S)[None] - pad[:, None], 0)
    valid = np.arange(slots)[None] >= pad[:, None]  # (B, slots)
    mask = causal_mask(S, 0, slots).repeat(3, 0) & valid[:, None, None, :]
    for b in range(3):
        mask[b, 0, np.arange(pad[b]), np.arange(pad[b])] = True
    logits, caches = r.run(ids, pos, mask, r.empty(3, slots), np.zeros(3))
    batched = [logits[:, -1]]
    for t in range(S, S + steps - 1):
        tok = batched[-1].argmax(-1)[:, None]
        m = causal_mask(1, t, slots).repeat(3, 0) & valid[:, None, None, :]
        logits, caches = r.run(tok, (t - pad)[:, None], m, caches, np.full(3, t))
        batched.append(logits[:, -1])
    for b, row in enumerate(rows):
        _, alone = greedy(r, row, steps, slots)
        assert np.abs(alone - np.stack([x[b] for x in batched])).max() < 1e-5, b


def test_a_written_cache_slot_never_changes(artifacts: dict[str, Path]) -> None:
    r = IRRunner(artifacts["llama"])
    slots = 32
    caches = r.empty(2, slots)
    ids = np.array([random_ids(5, 1), random_ids(5, 2)])
    _, caches = r.run(ids, np.arange(5)[None].repeat(2, 0), causal_mask(5, 0, slots).repeat(2, 0),
                      caches, np.zeros(2))
    for t in range(5, 20):
        before = [c[:, :, :t].copy() for c in caches]
        _, caches = r.run(np.array([[7], [9]]), np.array([[t], [t]]), causal_mask(1, t, slots).repeat(2, 0),
                          caches, np.array([t, t]))
        for old, new in zip(before, caches):
            assert np.array_equal(old, new[:, :, :t])  # bitwise: earlier slots untouched
            assert np.abs(new[:, :, t]).sum() > 0  # and this step wrote its own slot
            assert not new[:, :, t + 1 :].any()  # and nothing beyond it


def _graph(folder: Path) -> onnx.GraphProto:
    return onnx.load(str(folder / "model.onnx"), load_external_data=False).graph


@pytest.mark.parametrize("family", FAMILIES)
def test_graph_keeps_kv_heads_grouped_and_writes_with_tensor_scatter(family: str, artifacts: dict[str, Path]) -> None:
    folder = artifacts[family]
    g = _graph(folder)
    m = mf.read(folder)
    cfg = m.config
    opsets = onnx.load(str(folder / "model.onnx"), load_external_data=False).opset_import
    assert any(o.domain in ("", "ai.onnx") and o.version == 24 for o in opsets)
    ops = [n.op_type for n in g.node]
    assert "Expand" not in ops and "Tile" not in ops
    producers = {o: n for n in g.node for o in n.output}
    shapes = {i.name: i.type.tensor_type.shape for i in g.input}
    attn = [n for n in g.node if n.op_type == "Attention"]
    scatter = [n for n in g.node if n.op_type == "TensorScatter"]
    assert len(attn) == cfg.num_hidden_layers and len(scatter) == 2 * cfg.num_hidden_layers
    rings = RingSpec.of(m).layers if RingSpec.of(m) else frozenset()  # sliding layers on ring caches
    for n in scatter:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        ring = int(n.output[0].split(".")[1]) in rings
        assert attrs["axis"] == -2 and attrs["mode"] == (b"circular" if ring else b"linear")
        assert n.input[0].startswith("past_key_values.") and n.output[0].startswith("present.")
        assert shapes[n.input[0]].dim[1].dim_value == cfg.num_key_value_heads
    for n in attn:
        ring = int(n.name.split(".")[1]) in rings
        for kv in n.input[1:3]:  # K/V straight from the cache (a ring: it and the new rows): no repeat to q heads
            assert producers[kv].op_type == ("Concat" if ring else "TensorScatter")
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert (attrs["q_num_heads"], attrs["kv_num_heads"]) == (cfg.num_attention_heads, cfg.num_key_value_heads)
        # the explicit bool mask; a sliding-window layer's is And(mask, its band)
        mask = n.input[3] if n.input[3] in shapes else producers[n.input[3]].input[0]
        assert shapes[mask].dim[3].dim_param == (RING_MASK_DIM if ring else "cache_len")  # a ring's comes banded
    if cfg.position_kind == "rope":
        assert ops.count("RotaryEmbedding") == 2 * cfg.num_hidden_layers
    if cfg.norm_kind == "rms":  # block norms (two per layer, four sandwiching both sublayers) and the final one,
        qk = 2 * cfg.num_hidden_layers if cfg.qk_norm != "none" else 0  # plus q and k norms where the family has them
        per_layer = 4 if cfg.norm_position == "sandwich" else 2
        assert ops.count("RMSNormalization") == per_layer * cfg.num_hidden_layers + 1 + qk


def test_cache_capacity_is_one_symbolic_dim_shared_by_caches_mask_and_outputs(artifacts: dict[str, Path]) -> None:
    g = _graph(artifacts["llama"])
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*g.input, *g.output]}
    for name, d in dims.items():
        if name.startswith(("past_key_values.", "present.")):
            assert d[0] == "batch" and d[2] == "cache_len", name
    assert dims["attention_mask"] == ["batch", 1, "seq", "cache_len"]
    assert dims["logits"] == ["batch", 1, 320]  # last-token-only


def test_same_graph_runs_at_capacity_64_and_max_seq_with_the_same_logits(artifacts: dict[str, Path]) -> None:
    r = IRRunner(artifacts["qwen2"])
    prompt = random_ids(9, seed=5)
    _, small = greedy(r, prompt, 20, 64)
    _, full = greedy(r, prompt, 20, MAX_SEQ)
    assert np.abs(small - full).max() < 1e-5


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_concat_style_matches_transformers(family: str, checkpoints: dict[str, Path], workdir: Path,
                                           references: dict[str, HFReference]) -> None:
    folder = export_artifact(checkpoints[family], workdir / f"{family}-concat.kvx", max_seq=MAX_SEQ, cache_style="concat")
    g = _graph(folder)
    assert "TensorScatter" not in [n.op_type for n in g.node]
    attn = [n for n in g.node if n.op_type == "Attention"]
    assert all(n.input[4].startswith("past_key_values.") and n.output[1].startswith("present.") for n in attn)
    r = IRRunner(folder)
    seq, eng = greedy(r, random_ids(7, seed=2), 20, 0)
    want = references[family].logits(seq[:-1])[6:]
    assert np.abs(eng - want).max() < TOL.max_abs_logit
    assert (eng.argmax(-1) == want.argmax(-1)).all()


def test_export_is_deterministic_and_uses_external_data(checkpoints: dict[str, Path], artifacts: dict[str, Path],
                                                        workdir: Path) -> None:
    again = export_artifact(checkpoints["llama"], workdir / "llama-again.kvx", max_seq=MAX_SEQ)
    a, b = _graph(artifacts["llama"]), _graph(again)
    assert [n.name for n in a.node] == [n.name for n in b.node]
    assert [i.name for i in a.initializer] == [i.name for i in b.initializer]
    assert len({n.name for n in a.node}) == len(a.node)  # unique
    assert any(n.name.startswith("layers.1.attn/TensorScatter") for n in a.node)
    assert (again / "model.onnx.data").stat().st_size > 10 * (again / "model.onnx").stat().st_size
