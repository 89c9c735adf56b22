"""Every registered family lowers for TensorRT, and its packaged fp16 graph verifies (ONNX Runtime)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvexport.artifact import export_artifact, finish, open_artifact
from kvexport.backends import BuildOptions
from kvexport.manifest import read
from kvexport.zoo import TINY_CONFIGS, write_checkpoint
from kvexport_nvidia.backend import ENGINE_DIR, PREPARED, NvidiaBackend

from nvidia_ort_twin import OrtTwinSession


# fp16 routing: the fp16 graph routes in fp16 (every Cast to float becomes fp16), and qwen3_moe's tiny model (top-2
# of 4 experts, no renormalisation) measured text mean KL 4.0e-5 and max KL 0.015 against fp32 transformers
# (limits 2e-5 / 1e-3); the nvidia target builds no fp32 graph. Known and open: an fp32 router is the fix.
FP16_ROUTING_OFF = pytest.mark.xfail(strict=True, reason="qwen3_moe routed in fp16 exceeds the fp16 KL limits")


@pytest.mark.slow
@pytest.mark.parametrize("family", [pytest.param(f, marks=FP16_ROUTING_OFF) if f == "qwen3_moe" else f
                                    for f in sorted(set(TINY_CONFIGS) - {"llama"})])  # llama: test_nvidia_backend
def test_family_lowers_and_verifies(family: str, tmp_path: Path) -> None:
    from kvexport.runtime.engine import Engine
    from kvexport.verify import verify_engine

    ckpt = write_checkpoint(TINY_CONFIGS[family], tmp_path / family, seed=5)
    folder = export_artifact(ckpt, tmp_path / f"{family}.kvx", max_seq=64)
    m = read(folder)
    NvidiaBackend().build(folder, m, BuildOptions(max_batch=2, extra={"defer": True}), lambda _m: None)
    finish(folder, m)
    folder, m = open_artifact(folder)
    report = verify_engine(Engine(folder, m, OrtTwinSession(folder / ENGINE_DIR / PREPARED, m)), ckpt, decode_steps=8)
    assert report.passed, (family, report.failures)
