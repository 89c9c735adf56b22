"""Hardware tests: TensorRT engine build, aliased in-place cache, CUDA-graph decode, rebuilds.

They need an NVIDIA GPU, TensorRT >= 10.15 and a CUDA build of torch; elsewhere they skip and
say which of those is missing. (They have not run on hardware yet: see docs/backends/nvidia.md.)
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from kvexport.artifact import finish
from kvexport.backends import BuildOptions
from kvexport.manifest import read
from kvexport_nvidia.backend import ENGINE_DIR, PLAN, NvidiaBackend

from nvidia_ort_twin import MAX_SEQ

_MISSING = NvidiaBackend().availability()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(_MISSING), reason="needs an NVIDIA GPU with TensorRT: "
                                                   + "; ".join(_MISSING))]
PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 90, 91]]


@pytest.fixture(scope="module")
def built(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kvexport build --target nvidia, verification included (it raises if the engine disagrees)."""
    from kvexport.build import build

    out = tmp_path_factory.mktemp("gpu") / "tiny-nv.kvx"
    return build(tiny_ckpt, out, target="nvidia", max_seq=MAX_SEQ, options=BuildOptions(max_batch=2), verify=True)


def _greedy(path: Path, **load_options: object) -> list[list[int]]:
    import kvexport

    engine = kvexport.load(str(path), **load_options)
    return [g.token_ids for g in engine.generate(PROMPTS, max_new_tokens=16)]  # type: ignore[union-attr]


def test_build_records_engine_fingerprint_and_verification(built: Path) -> None:
    m = read(built)
    t = m.target
    assert f"{ENGINE_DIR}/{PLAN}" in t["engine_files"] and not t["deferred"]
    assert set(t["fingerprint"]) == {"tensorrt", "gpu_name", "compute_capability", "driver"}
    assert m.raw["verification"]["passed"] and m.raw["verification"]["greedy_agreement"] >= 0.99


def test_present_is_aliased_and_the_cache_is_written_in_place(built: Path) -> None:
    import kvexport

    engine = kvexport.load(str(built))
    s = engine.session
    for past, present in s.pairs:
        assert s._engine.get_aliased_input_tensor(present) == past
    state = s.new_state(1, 16)
    ptrs = [c.data_ptr() for c in state.caches]
    ids = np.array([[1, 5, 6, 7]], np.int64)
    mask = np.tril(np.ones((4, 4), bool))[None, None]
    s.step(state, ids, np.arange(4, dtype=np.int64)[None], mask)
    k0 = state.caches[0].float().cpu().numpy()
    assert [c.data_ptr() for c in state.caches] == ptrs
    assert np.abs(k0[:, :, :4]).sum() > 0 and not k0[:, :, 4:].any()  # slots 0..3 written, the rest untouched


def test_cuda_graph_decode_equals_eager_decode(built: Path) -> None:
    assert _greedy(built, cuda_graph=True) == _greedy(built, cuda_graph=False)


def test_decode_is_captured_once_and_replayed(built: Path) -> None:
    """Graph mode: the first decode runs eagerly and is captured, every later one is a replay;
    cuda_graph=False never captures. Same tokens and close logits either way."""
    import kvexport

    def run(**load_options: object) -> tuple[list[int], np.ndarray, object]:
        engine = kvexport.load(str(built), **load_options)
        batch = engine.prefill(PROMPTS[0], 24)
        tokens, logits = [int(batch.logits[0].argmax())], [batch.logits[0]]
        for _ in range(23):
            logits.append(engine.decode(batch, np.array([tokens[-1]]))[0])
            tokens.append(int(logits[-1].argmax()))
        return tokens, np.stack(logits), batch.state

    g_tokens, g_logits, g_state = run(cuda_graph=True)
    e_tokens, e_logits, e_state = run(cuda_graph=False)
    assert (g_state.captures, g_state.replays) == (1, 22) and g_state.graph is not None
    assert (e_state.captures, e_state.replays) == (0, 0) and e_state.graph is None
    assert g_tokens == e_tokens
    np.testing.assert_allclose(g_logits, e_logits, atol=1e-2, rtol=0)  # the same kernels, replayed


def test_two_states_use_the_same_profiles_at_once(built: Path) -> None:
    """Each request state creates its own prefill and decode execution contexts, so two live states
    are two contexts on each optimization profile (set_optimization_profile_async with the same
    index). Interleaved step by step, and then in two threads, each must equal its run alone."""
    from concurrent.futures import ThreadPoolExecutor

    import kvexport

    engine = kvexport.load(str(built))
    alone = [engine.generate(p, max_new_tokens=16).token_ids for p in PROMPTS]  # type: ignore[union-attr]
    batches = [engine.prefill(p, 16) for p in PROMPTS]  # both states alive: 2 contexts per profile
    assert all(len(b.state.contexts) == 2 for b in batches)
    together: list[list[int]] = [[int(b.logits[0].argmax())] for b in batches]
    for _ in range(15):
        for b, toks in zip(batches, together):  # A, B, A, B, ...: each context used while the other lives
            toks.append(int(engine.decode(b, np.array([toks[-1]]))[0].argmax()))
    assert together == alone
    assert all((b.state.captures, b.state.replays) == (1, 14) for b in batches)
    with ThreadPoolExecutor(2) as pool:
        threaded = list(pool.map(lambda p: engine.generate(p, max_new_tokens=16).token_ids, PROMPTS * 2))
    assert threaded == alone * 2


def test_fingerprint_mismatch_rebuilds_into_the_cache(built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVEXPORT_CACHE", str(tmp_path / "cache"))
    moved = tmp_path / "other-gpu.kvx"
    shutil.copytree(built, moved)
    m = read(moved)
    m.raw["target"]["fingerprint"]["driver"] = "0.0 (another machine)"
    finish(moved, m)
    want = _greedy(built)
    assert _greedy(moved) == want
    plans = list((tmp_path / "cache" / "nvidia").glob(f"*/{PLAN}"))
    assert len(plans) == 1
    from kvexport.errors import ArtifactError

    with pytest.raises(ArtifactError, match="no_rebuild"):
        _greedy(moved, no_rebuild=True)
    assert _greedy(moved) == want  # second load: the cached rebuild, no new plan
    assert len(list((tmp_path / "cache" / "nvidia").glob(f"*/{PLAN}"))) == 1


def test_deferred_artifact_builds_at_first_load(tiny_ckpt: Path, built: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from kvexport.build import build

    monkeypatch.setenv("KVEXPORT_CACHE", str(tmp_path / "cache"))
    out = build(tiny_ckpt, tmp_path / "deferred.kvx", target="nvidia", max_seq=MAX_SEQ,
                options=BuildOptions(max_batch=2, extra={"defer": True}))
    assert read(out).target["deferred"]
    assert _greedy(out) == _greedy(built)


@pytest.mark.parametrize("weights,group", [("int4", 32), ("int8", None)])
def test_int4_engine_builds_and_verifies(tmp_path: Path, weights: str, group: int | None) -> None:
    """The trained default model with weight-only int4 (blocked INT4 DequantizeLinear) and int8 (per channel):
    TensorRT parses and builds the plan, and kvexport.build's verify passes the teacher-forced row."""
    from kvexport.build import build
    from kvexport.zoo import write_named

    ckpt = write_named("default", tmp_path / "default")
    out = build(ckpt, tmp_path / f"default-{weights}.kvx", target="nvidia", max_seq=256, verify=True,
                options=BuildOptions(weights=weights, group_size=group, max_batch=2))
    m = read(out)
    assert m.raw["verification"]["passed"] and m.target["weights"]["dtype"] == weights
    assert m.raw["verification"]["mode"] == "teacher-forced" and (out / ENGINE_DIR / PLAN).is_file()


def test_mistral_on_rings_generates_past_max_seq_like_its_packaged_graph(tmp_path: Path) -> None:
    """Every layer of the tiny mistral slides (window 24): its engine holds 24-slot rings written by
    IScatterLayer into a second buffer swapped after each step, decodes past max_seq with two captured decode
    graphs (one per order of the buffers), and picks the tokens its packaged graph picks on ONNX Runtime."""
    import kvexport
    from kvexport.build import build
    from kvexport.zoo import TINY_CONFIGS, write_checkpoint

    from nvidia_ort_twin import OrtTwinSession

    ckpt = write_checkpoint(TINY_CONFIGS["mistral"], tmp_path / "mistral", seed=5)
    path = build(ckpt, tmp_path / "mistral-nv.kvx", target="nvidia", max_seq=MAX_SEQ,
                 options=BuildOptions(max_batch=2), verify=True)
    engine = kvexport.load(str(path))
    prompt = list(range(3, 43))  # 40 tokens: two ring-sized prefill pieces
    got = engine.generate(prompt, max_new_tokens=100, stop=()).token_ids  # 140 slots > max_seq 64
    from kvexport.runtime.engine import Engine

    m = read(path)
    twin = Engine(path, m, OrtTwinSession(path / ENGINE_DIR / "prepared.onnx", m))
    assert got == twin.generate(prompt, max_new_tokens=100, stop=()).token_ids
    b = engine.prefill(prompt, 4)
    for t in range(3):
        engine.decode(b, np.array([t + 5]))
    assert b.state.captures == 2 and b.state.replays == 1
    assert [c.shape[2] for c in b.state.caches] == [TINY_CONFIGS["mistral"]["sliding_window"]] * 4


def test_fp32_engine_builds_and_verifies_strict(tiny_ckpt: Path, tmp_path: Path) -> None:
    """--weights fp32 on TensorRT: the engine is built without TF32 and its build-time verify holds it to the
    strict (nvidia, fp32) row: identical greedy tokens and max |dlogit| within 1e-4 of transformers fp32."""
    from kvexport.build import build
    from kvexport.tolerances import tolerance

    out = build(tiny_ckpt, tmp_path / "tiny-nv-fp32.kvx", target="nvidia", max_seq=MAX_SEQ,
                options=BuildOptions(weights="fp32", max_batch=2), verify=True)
    m = read(out)
    assert m.target["precision"] == m.target["options"]["model_dtype"] == "fp32"
    v = m.raw["verification"]
    assert v["passed"] and v["greedy_agreement"] == 1.0
    assert v["max_abs_logit"] <= tolerance("nvidia", "fp32").max_abs_logit
