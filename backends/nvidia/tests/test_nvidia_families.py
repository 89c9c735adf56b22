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


# The routers run in fp32 (kvexport_nvidia.router); what still fails is a near tie of this random-weight model,
# measured: at one teacher-forced position of the built-in text the fp32 reference's 2nd and 3rd experts differ by
# 5e-5 in probability (0.25225 / 0.25231), the fp16 residual stream entering the router makes them 0.25243 / 0.25229,
# the second expert flips and that position's KL is 0.015 (row: max 1e-3), 3.9e-5 of the text's mean KL 4.0e-5
# (row: 2e-5) by itself. The same numbers as with the router in fp16. Mixtral passes.
ROUTER_NEAR_TIE = pytest.mark.xfail(strict=True, reason="qwen3_moe's tiny random router has a 5e-5 near tie that "
                                                        "the fp16 residual stream flips (fp32 router measured)")


@pytest.mark.slow
@pytest.mark.parametrize("family", [pytest.param(f, marks=ROUTER_NEAR_TIE) if f == "qwen3_moe" else f
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
