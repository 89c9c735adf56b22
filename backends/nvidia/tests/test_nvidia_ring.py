"""Sliding-window layers on rings in the nvidia target's packaged graph, run on ONNX Runtime (the TensorRT twin):
the tiny mistral (window 24, every layer slides) generates 4x its window and past max_seq on 24-slot rings, and
gemma2 keeps only its global layers at max_seq. Nothing here ran on TensorRT or a GPU."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from kvexport.artifact import open_artifact
from kvexport.backends import BuildOptions
from kvexport.manifest import read
from kvexport.runtime.ring import MASK_INPUT, RingSpec
from kvexport.zoo import TINY_CONFIGS, write_checkpoint
from kvexport_nvidia.backend import ENGINE_DIR, PREPARED, NvidiaBackend, profiles_from_target

from nvidia_ort_twin import MAX_SEQ, OrtTwinSession

W = TINY_CONFIGS["mistral"]["sliding_window"]  # 24


def _built(tmp: Path, family: str) -> tuple[Path, Path]:
    """(checkpoint, artifact): the ring IR lowered and packaged by `kvexport build --target nvidia --defer`."""
    from kvexport.build import build

    ckpt = write_checkpoint(TINY_CONFIGS[family], tmp / family, seed=5)
    assert NvidiaBackend().capabilities().ring_cache
    folder = build(ckpt, tmp / f"{family}.kvx", target="nvidia", max_seq=MAX_SEQ, verify=False,
                   options=BuildOptions(max_batch=2, extra={"defer": True}))
    return ckpt, folder


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _built(tmp_path_factory.mktemp("nv-ring"), "mistral")


def _engine(folder: Path):  # type: ignore[no-untyped-def]
    from kvexport.runtime.engine import Engine

    folder, m = open_artifact(folder)
    return Engine(folder, m, OrtTwinSession(folder / ENGINE_DIR / PREPARED, m))


def test_packaged_graph_writes_rings_with_scatter_and_keeps_no_circular_update(mistral: tuple[Path, Path]) -> None:
    folder = mistral[1]
    m = read(folder)
    lowering = m.target["options"]["lowering"]  # type: ignore[index]
    assert lowering["ring_len"] == W and lowering["ring_scatters"] == 4  # K and V of both layers
    g = onnx.load(str(folder / ENGINE_DIR / PREPARED), load_external_data=False).graph
    assert not [n for n in g.node if n.op_type == "TensorScatter"]  # TensorRT's update layer is linear only
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in [*g.input, *g.output]}
    assert dims["past_key_values.0.key"][2] == dims["present.1.value"][2] == W  # pinned: the ring's slots
    producers = {o: n for n in g.node for o in n.output}
    for k in range(2):
        for kind in ("key", "value"):
            node = producers[f"present.{k}.{kind}"]
            assert node.op_type == "ScatterElements" and node.input[0] == f"past_key_values.{k}.{kind}"
    prefill, decode = profiles_from_target(m.target or {})
    assert prefill.shapes["past_key_values.0.key"][2] == (2, 2, W, 16)
    # a step writes at most W rows: the prefill profile stops there, and the ring's mask is (B, 1, S, W + S)
    assert prefill.shapes["input_ids"][2] == (2, W) and prefill.shapes[MASK_INPUT][2] == (2, 1, W, 2 * W)
    assert decode.shapes[MASK_INPUT] == ((1, 1, 1, W + 1),) * 2 + ((2, 1, 1, W + 1),)


def test_generates_4x_the_window_past_max_seq_token_identical(mistral: tuple[Path, Path]) -> None:
    """A 40-token prompt (two ring-sized pieces) and 150 new tokens: 190 slots > max_seq 64 on 24-slot rings,
    the tokens transformers picks at every step (fp32 reference fed the same sequence)."""
    from kvexport.verify import Reference

    ckpt, folder = mistral
    e = _engine(folder)
    assert e.limit == TINY_CONFIGS["mistral"]["max_position_embeddings"] > MAX_SEQ
    rng = np.random.default_rng(4)
    prompt = [int(t) for t in rng.integers(3, 259, 40)]
    n = 150
    assert n >= 4 * W and len(prompt) + n > MAX_SEQ
    b = e.prefill(prompt, n)
    ring_bytes = 2 * 2 * 2 * W * 16 * 2  # layers x (K, V) x kv heads x W x head_dim x fp16
    assert e.session.cache_bytes(b.state) == 2 * ring_bytes  # the rings and their second buffers
    toks = [int(b.logits[0].argmax())]
    for _ in range(n - 1):
        toks.append(int(e.decode(b, np.array([toks[-1]]))[0].argmax()))
    assert [c.shape[2] for c in b.state.caches] == [W] * 4 and b.slots == len(prompt) + n - 1
    ref = Reference(ckpt, MAX_SEQ).logits(prompt + toks[:-1])[len(prompt) - 1:]
    assert toks == ref.argmax(-1).tolist()


def test_inspect_counts_each_rings_swap_buffer_as_the_session_holds_it(mistral: tuple[Path, Path],
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A ring's present is a second buffer swapped with it every step: `kvexport inspect` counts it, labelled, and
    its bytes at max_seq are the ones the session holds for one row."""
    from kvexport.cli import main
    from kvexport.errors import ManifestError
    from kvexport.manifest import validate

    folder = mistral[1]
    assert read(folder).target["ring_buffers"] == 2  # type: ignore[index]
    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    ring = 2 * 2 * 2 * W * 16 * 2  # layers x (K, V) x kv heads x W x head_dim x fp16
    e = _engine(folder)
    assert e.session.cache_bytes(e.session.new_state(1, MAX_SEQ)) == 2 * ring
    assert (f"keep {W} slots; {2 * ring} bytes ({2 * ring / 2**20:.2f} MiB) per row at max_seq ({ring} bytes of them "
            "the rings' swap buffers") in out, out
    assert f"beside {ring * MAX_SEQ // W} bytes" in out, out  # every layer full length: max_seq slots, one buffer
    raw = read(folder).raw
    raw["target"]["ring_buffers"] = 3
    with pytest.raises(ManifestError, match="ring_buffers` is 1 or 2, not 3"):
        validate(raw)


def test_gemma2_keeps_global_layers_full_length_and_verifies(tmp_path: Path) -> None:
    """Mixed model: its sliding layers on W-slot rings, its global layers at max_seq; the fp16 graph passes the
    nvidia fp16 row through kvexport verify (greedy steps, cache checks, the teacher-forced text)."""
    from kvexport.verify import verify_engine

    ckpt, folder = _built(tmp_path, "gemma2")
    e = _engine(folder)
    spec = RingSpec.of(e.manifest)
    assert spec is not None and not spec.every_layer and e.limit == MAX_SEQ
    st = e.session.new_state(1, MAX_SEQ)
    assert [c.shape[2] for c in st.caches] == [spec.window if spec.is_ring(k) else MAX_SEQ for k in range(len(st.caches))]
    report = verify_engine(e, ckpt, decode_steps=24)  # its 33-token prompt + 24 = 57 slots: rings of 16 wrap 3x
    assert report.passed, report.failures


def test_a_ring_ir_lowered_without_its_ring_length_is_refused_before_any_build(mistral: tuple[Path, Path]) -> None:
    """The circular write has no TensorRT update layer: lowering a ring IR as if it had none names the ring."""
    from kvexport.errors import UnsupportedFeatureError
    from kvexport_nvidia.lowering import lower

    folder = mistral[1]
    model = onnx.load(str(folder / "model.onnx"))
    with pytest.raises(UnsupportedFeatureError, match="mode=linear only .*ring"):
        lower(model, max_seq=MAX_SEQ, precision="fp16", pairs=read(folder).kv_pairs())
