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


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(set(TINY_CONFIGS) - {"llama"}))  # llama: test_nvidia_backend
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
