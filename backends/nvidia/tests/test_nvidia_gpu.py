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
