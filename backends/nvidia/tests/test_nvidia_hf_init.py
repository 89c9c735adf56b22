"""tests/test_hf_init.py's check on the nvidia target: a checkpoint exactly as `transformers` initializes it (zero
biases, unit norms: equal tensors the ONNX exporter stores once) lowers for TensorRT, and its packaged fp32 graph,
run by ONNX Runtime (the ORT twin of the TensorRT session), passes `kvexport verify` at the strict fp32 row.
Its checkpoints and their static IR are those tests/test_hf_init.py builds for cpu and amd, made once per run.
Nothing here ran on TensorRT or a GPU."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvexport.artifact import open_artifact
from kvexport.backends import BuildOptions
from kvexport.testing import exports_made_once, hf_init_checkpoint_once
from kvexport.zoo import TINY_CONFIGS
from kvexport_nvidia.backend import ENGINE_DIR, PREPARED

from nvidia_ort_twin import OrtTwinSession

MAX_SEQ = 80  # verify's 33-token prompt + 32 decode steps


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_hf_init_checkpoint_lowers_and_its_fp32_graph_verifies(family: str, tmp_path: Path,
                                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    from kvexport.build import build
    from kvexport.runtime.engine import Engine
    from kvexport.verify import verify_engine

    ckpt = hf_init_checkpoint_once(tmp_path_factory, family)
    with exports_made_once(tmp_path_factory):
        folder = build(ckpt, tmp_path / f"{family}.kvx", target="nvidia", max_seq=MAX_SEQ, verify=False,
                       options=BuildOptions(weights="fp32", max_batch=4, extra={"defer": True}))
    folder, m = open_artifact(folder)
    assert m.target["options"]["lowering"]["precision"] == "fp32"  # type: ignore[index]
    report = verify_engine(Engine(folder, m, OrtTwinSession(folder / ENGINE_DIR / PREPARED, m)), ckpt)
    assert (report.backend, report.precision) == ("nvidia", "fp32")
    assert report.passed, (family, report.failures)
