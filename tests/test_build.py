"""`build` end to end in-process: a failed verification keeps the artifact, marked as failed."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import kvexport
from kvexport import tolerances
from kvexport.build import build
from kvexport.errors import NumericsMismatchError


def test_failed_verification_keeps_the_artifact_marked_failed(checkpoints: dict[str, Path], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    impossible = tolerances.Tolerance(max_abs_logit=0.0, min_greedy_agreement=1.0, max_mean_kl=0.0)
    monkeypatch.setitem(tolerances.TOLERANCES, ("cpu", "fp32"), impossible)
    out = tmp_path / "x.kvx"
    with pytest.raises(NumericsMismatchError, match="verify.json"):
        build(checkpoints["gpt2"], out, max_seq=64)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["verification"]["passed"] is False
    assert not (tmp_path / "x.kvx.building").exists()
    with pytest.warns(UserWarning, match="failed verification"):
        kvexport.load(out)


def test_interrupted_build_leaves_the_previous_artifact(checkpoints: dict[str, Path], artifacts: dict[str, Path],
                                                        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = Path(shutil.copytree(artifacts["llama"], tmp_path / "y.kvx"))  # the previous artifact: the session's build
    before = (out / "manifest.json").read_text()

    def boom(*_a: object, **_k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("kvexport.backends.cpu.CpuBackend.build", boom)
    with pytest.raises(KeyboardInterrupt):
        build(checkpoints["llama"], out, max_seq=64, verify=False)
    assert (out / "manifest.json").read_text() == before  # the old artifact is whole
    assert not (tmp_path / "y.kvx.building").exists()
    kvexport.load(out)
