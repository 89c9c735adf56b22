"""Fixtures for the intel target: tiny seeded checkpoints and their intel artifacts, built once per session."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvexport.testing import made_once, run_folder
from kvexport.zoo import TINY_CONFIGS, write_checkpoint

INTEL_MAX_SEQ = 128


def _openvino_or_skip() -> None:
    pytest.importorskip("openvino", reason="the intel target needs openvino (pip install 'kvexport[intel]')")


@pytest.fixture(scope="session")
def intel_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shared by pytest-xdist's workers: each artifact below is built once per run."""
    return run_folder(tmp_path_factory, "kvx-intel")


class _LazyIntelArtifacts(dict):
    """family -> (checkpoint folder, intel artifact folder), exported and lowered on first use in the run."""

    def __init__(self, workdir: Path):
        super().__init__()
        self.workdir = workdir

    def __missing__(self, family: str) -> tuple[Path, Path]:
        from kvexport.build import build

        _openvino_or_skip()
        ckpt = made_once(self.workdir / f"ckpt-{family}",
                         lambda out: write_checkpoint(TINY_CONFIGS[family], out, seed=11))
        # verify=False: the tests below hold the engine to the reference themselves (64 steps)
        art = made_once(self.workdir / f"{family}-intel.kvx",
                        lambda out: build(ckpt, out, target="intel", max_seq=INTEL_MAX_SEQ, verify=False))
        self[family] = (ckpt, art)
        return ckpt, art


@pytest.fixture(scope="session")
def intel_artifacts(intel_workdir: Path) -> dict[str, tuple[Path, Path]]:
    return _LazyIntelArtifacts(intel_workdir)
