"""GPU-only: the package compiled for the GPU, its decode step captured as a HIP (or CUDA) graph and replayed."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import kvexport
from kvexport_amd import device as dv

from conftest import AMD_MAX_BATCH, batch_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not dv.gpu_present(), reason="needs a ROCm (or CUDA) GPU visible to torch; this machine has "
                                                    "none, so the graph-captured decode has not run here"),
]


@pytest.fixture(scope="module")
def gpu_artifact(amd_builds, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvexport.backends import BuildOptions
    from kvexport.build import build

    return build(amd_builds.checkpoint("llama"), tmp_path_factory.mktemp("amdgpu") / "llama-gpu.kvx", target="amd",
                 max_seq=96, options=BuildOptions(max_batch=AMD_MAX_BATCH, extra={"device": "gpu"}), verify=True)


def _greedy(engine, prompt: list[int], steps: int):  # type: ignore[no-untyped-def]
    batch = engine.prefill(prompt, steps)
    logits, tokens = [batch.logits[0].copy()], []
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits.append(engine.decode(batch, np.array([tokens[-1]]))[0].copy())
    return tokens, np.stack(logits), batch.state


def test_gpu_build_verifies_and_fingerprints(gpu_artifact: Path) -> None:
    m = kvexport.load(gpu_artifact).manifest.raw
    assert m["verification"]["passed"] is True  # within the (amd, fp16|bf16) tolerance of transformers fp32
    fp = m["target"]["fingerprint"]
    assert m["target"]["precision"] in ("fp16", "bf16")
    if torch.version.hip:
        assert fp["device_kind"] == "rocm" and fp["hip"] == torch.version.hip
        assert fp["gfx_arch"] == torch.cuda.get_device_properties(0).gcnArchName
    else:
        assert fp["device_kind"] == "cuda"


def test_decode_is_captured_once_and_replayed(gpu_artifact: Path) -> None:
    graphed, direct = kvexport.load(gpu_artifact), kvexport.load(gpu_artifact, graphs=False)
    prompt = [1, 40, 41, 42, 43, 44]
    g_tokens, g_logits, g_state = _greedy(graphed, prompt, 24)
    d_tokens, d_logits, d_state = _greedy(direct, prompt, 24)
    assert g_state.captures == 1 and g_state.replays == 24
    assert d_state.graph is None and d_state.replays == 0
    assert g_tokens == d_tokens
    np.testing.assert_allclose(g_logits, d_logits, atol=1e-2, rtol=0)  # same kernels, replayed


def test_replay_allocates_nothing_and_keeps_cache_addresses(gpu_artifact: Path) -> None:
    engine = kvexport.load(gpu_artifact)
    batch = engine.prefill([1, 7, 8, 9], 40)
    ptrs = [c.data_ptr() for c in batch.state.caches]
    tok = int(batch.logits[0].argmax())
    tok = int(engine.decode(batch, np.array([tok]))[0].argmax())  # the capture
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    for _ in range(16):
        tok = int(engine.decode(batch, np.array([tok]))[0].argmax())
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    assert [c.data_ptr() for c in batch.state.caches] == ptrs


def test_gpu_batch_rows_and_threads(gpu_artifact: Path) -> None:
    engine = kvexport.load(gpu_artifact)
    prompts = [[1, 40, 41, 42, 43, 44, 45], [1, 70, 71]]
    alone = [_greedy(engine, p, 8)[0] for p in prompts]
    assert batch_greedy(engine, prompts, 8) == alone


@pytest.mark.parametrize("weights,group", [("int4", 32), ("int8", None)])
def test_gpu_packed_weights_build_verify_and_replay(tmp_path: Path, weights: str, group: int | None) -> None:
    """int8/int4 weights on the GPU (_weight_int8pack_mm, _weight_int4pack_mm): the trained default model passes
    its teacher-forced row, and the captured decode step gives the direct calls' tokens."""
    from kvexport.backends import BuildOptions
    from kvexport.build import build
    from kvexport.zoo import write_named

    ckpt = write_named("default", tmp_path / "default")
    out = build(ckpt, tmp_path / f"default-{weights}.kvx", target="amd", max_seq=256, verify=True,
                options=BuildOptions(weights=weights, group_size=group, max_batch=2, extra={"device": "gpu"}))
    prompt = [1, 100, 101, 32, 40]
    graphed, _, _ = _greedy(kvexport.load(out, graphs=True), prompt, 16)
    direct, _, _ = _greedy(kvexport.load(out, graphs=False), prompt, 16)
    assert graphed == direct
