"""Shared fixtures: tiny seeded checkpoints of every family, their IR and cpu artifacts (built once)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvexport.testing import made_once, run_folder
from kvexport.zoo import TINY_CONFIGS, write_checkpoint

FAMILIES = sorted(TINY_CONFIGS)
MAX_SEQ = 128


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvx")


@pytest.fixture(scope="session")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the session fixtures below build, once per run: pytest-xdist's workers share it."""
    return run_folder(tmp_path_factory, "kvx-shared")


@pytest.fixture(scope="session")
def checkpoints(shared: Path) -> dict[str, Path]:
    return {f: made_once(shared / f"ckpt-{f}", lambda p, f=f: write_checkpoint(TINY_CONFIGS[f], p, seed=7))
            for f in FAMILIES}


@pytest.fixture(scope="session")
def default_artifact(shared: Path) -> Path:
    """The embedded default model's cpu artifact (max_seq 256), built once by `kvexport build` as a user runs
    it, verify on; the CLI tests and every test that only loads the default engine share it."""

    def make(out: Path) -> None:
        p = subprocess.run([sys.executable, "-m", "kvexport", "build", "-o", str(out), "--max-seq", "256"],
                           capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        assert p.returncode == 0, p.stderr
        assert "verify:" in p.stderr and "passed" in p.stderr  # build verifies unless told not to

    return made_once(shared / "default.kvx", make)


@pytest.fixture(scope="session")
def int8_cache_artifact(shared: Path, checkpoints: dict[str, Path]) -> Path:
    """The llama family's cpu artifact with an int8 KV cache (`--kv int8`), built once per run."""
    from kvexport.backends import BuildOptions
    from kvexport.build import build

    return made_once(shared / "llama-kv-int8.kvx", lambda out: build(
        checkpoints["llama"], out, target="cpu", max_seq=MAX_SEQ, options=BuildOptions(kv="int8"), verify=False))


@pytest.fixture(scope="session")
def artifacts(shared: Path, checkpoints: dict[str, Path]) -> dict[str, Path]:
    """cpu artifacts (static IR + optimized ORT graph), built lazily per family, once per run."""
    return _LazyArtifacts(shared, checkpoints)  # type: ignore[return-value]


class _LazyArtifacts(dict):
    def __init__(self, workdir: Path, checkpoints: dict[str, Path]):
        super().__init__()
        self.workdir, self.checkpoints = workdir, checkpoints

    def __missing__(self, family: str) -> Path:
        from kvexport.build import build

        self[family] = made_once(self.workdir / f"{family}.kvx", lambda out: build(
            self.checkpoints[family], out, target="cpu", max_seq=MAX_SEQ, verify=False))
        return self[family]


class HFReference:
    """transformers' own model class on the same folder: the numerical reference."""

    def __init__(self, model_dir: Path):
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()

    def logits(self, ids: list[int]) -> np.ndarray:
        with torch.inference_mode():
            return self.model(torch.tensor([ids])).logits[0].numpy()


@pytest.fixture(scope="session")
def references(checkpoints: dict[str, Path]) -> dict[str, HFReference]:
    class _Lazy(dict):
        def __missing__(self, f: str) -> HFReference:
            self[f] = HFReference(checkpoints[f])
            return self[f]

    return _Lazy()  # type: ignore[return-value]


def native_built() -> None:
    """Skip where kvexport's native library was not built at install; fail instead under KVEXPORT_REQUIRE_NATIVE
    (CI builds it and sets that)."""
    from kvexport import native

    if not native.LIBRARY.is_file():
        if os.environ.get(native.REQUIRE_ENV):
            pytest.fail(f"{native.LIBRARY} was not built and {native.REQUIRE_ENV} is set")
        pytest.skip("the native library was not built at install (no ONNX Runtime headers): see setup.py")


def native_isa(isa: str, have: bool, env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run a native op's `isa` kernel: skip where the library is absent (native_built) or the CPU lacks `isa`
    (`have`); `env` (the op's ISA variable) set to avx2 takes the AVX2 kernel on a CPU that has the wider one too."""
    native_built()
    if not have:
        pytest.skip(f"this CPU lacks {isa}")
    if isa == "avx2":
        monkeypatch.setenv(env, "avx2")
    else:
        monkeypatch.delenv(env, raising=False)


def random_ids(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 259, n)]


@pytest.fixture(scope="session")
def intel_builds(shared: Path, checkpoints: dict[str, Path]) -> dict[str, Path]:
    """intel artifacts (OpenVINO stateful IR) of the same checkpoints, built lazily per family, once per run;
    tests that use one skip where openvino is not installed."""

    class _Lazy(dict):
        def __missing__(self, family: str) -> Path:
            pytest.importorskip("openvino", reason="the intel target needs openvino (pip install 'kvexport[intel]')")
            from kvexport.build import build

            self[family] = made_once(shared / f"{family}-intel.kvx", lambda out: build(
                checkpoints[family], out, target="intel", max_seq=MAX_SEQ, verify=False))
            return self[family]

    return _Lazy()  # type: ignore[return-value]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Name the CPU the suite ran on and the ISA it has, at the end where a CI log's tail shows it: ISA-dependent
    tests choose their expectation from this CPU."""
    from kvexport.doctor import cpu_info

    info = cpu_info()
    isa = ", ".join(name for name, present in info["isa"].items() if present) or "none detected"
    terminalreporter.write_line(f"cpu: {info['model']} ({info['logical_cpus']} logical); ISA: {isa}")
