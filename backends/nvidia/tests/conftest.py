"""Shared fixtures: one tiny seeded checkpoint and its static IR, exported once per session."""
from __future__ import annotations

from pathlib import Path

import pytest

from nvidia_ort_twin import MAX_SEQ  # noqa: F401  (one definition, importable by a unique name)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvexport.zoo import TINY_CONFIGS, write_checkpoint

    return write_checkpoint(TINY_CONFIGS["llama"], tmp_path_factory.mktemp("nv") / "tiny-llama", seed=3)


@pytest.fixture(scope="session")
def tiny_ir(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fp32 static-cache IR artifact (no target) that `kvexport build` hands the backend."""
    from kvexport.artifact import export_artifact

    return export_artifact(tiny_ckpt, tmp_path_factory.mktemp("nv") / "tiny.kvx", max_seq=MAX_SEQ)
