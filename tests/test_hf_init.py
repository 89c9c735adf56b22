"""Checkpoints exactly as `transformers` initializes them build and verify on every CPU-runnable target.

Its init leaves every bias zero and every norm weight one, so many parameters hold equal tensors,
which the ONNX exporter stores once. The backends that rebuild the owned decoder from the IR
(intel, amd) must still find each parameter (issue 11, item 4).
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvexport.testing import exports_made_once, hf_init_checkpoint_once
from kvexport.zoo import TINY_CONFIGS

FAMILIES = sorted(TINY_CONFIGS)  # every registered family
MAX_SEQ = 80  # verify's 33-token prompt + 32 decode steps; amd compiles the cache static at this size


class _LazyCheckpoints(dict):
    def __init__(self, tmp_path_factory: pytest.TempPathFactory):
        super().__init__()
        self.factory = tmp_path_factory

    def __missing__(self, family: str) -> Path:
        self[family] = hf_init_checkpoint_once(self.factory, family)  # the one backends/nvidia's test builds too
        return self[family]


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _LazyCheckpoints(tmp_path_factory)  # type: ignore[return-value]


def test_hf_init_has_the_equal_tensors_that_the_exporter_merges(hf_checkpoints: dict[str, Path]) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(hf_checkpoints["qwen2"] / "model.safetensors"))
    biases = [t for k, t in tensors.items() if k.endswith(".bias")]
    norms = [t for k, t in tensors.items() if "norm" in k]
    assert len(biases) > 1 and all(float(t.abs().max()) == 0 for t in biases)
    assert len(norms) > 1 and all(bool((t == 1).all()) for t in norms)


def _options(target: str):  # type: ignore[no-untyped-def]
    from kvexport.backends import BuildOptions

    if target == "intel":
        pytest.importorskip("openvino", reason="the intel target needs openvino (pip install 'kvexport[intel]')")
        return BuildOptions(precision="fp32")  # intel's automatic precision is bf16 on AMX/AVX512-BF16 CPUs
    if target == "amd":
        return BuildOptions(precision="fp32", max_batch=4, threads=2, extra={"device": "cpu"})
    return BuildOptions(precision="fp32")


class _LazyBuilds(dict):
    """(family, target) -> artifact, built and verified (fp32) on first use. cpu, amd and nvidia lower the same
    static IR: each family's is exported once per run (exports_made_once) for all three."""

    def __init__(self, root: Path, checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
        super().__init__()
        self.root, self.checkpoints, self.factory = root, checkpoints, tmp_path_factory

    def __missing__(self, key: tuple[str, str]) -> Path:
        from kvexport.build import build

        family, target = key
        options = _options(target)
        t0 = time.perf_counter()
        # verify=True: NumericsMismatchError if the engine differs from transformers beyond the tolerance
        with exports_made_once(self.factory):
            self[key] = build(self.checkpoints[family], self.root / f"{family}-{target}.kvx", target=target,
                              max_seq=MAX_SEQ, options=options, verify=True)
        print(f"{family}/{target}: built and verified in {time.perf_counter() - t0:.1f}s")
        return self[key]


@pytest.fixture(scope="session")
def hf_builds(tmp_path_factory: pytest.TempPathFactory, hf_checkpoints: dict[str, Path]) -> dict[tuple[str, str], Path]:
    return _LazyBuilds(tmp_path_factory.mktemp("hf-init-builds"), hf_checkpoints, tmp_path_factory)  # type: ignore[return-value]


def built_and_verified(hf_builds: dict[tuple[str, str], Path], family: str, target: str) -> None:
    from kvexport import manifest as mf

    m = mf.read(hf_builds[family, target])
    assert m.raw["target"]["backend"] == target and m.raw["target"]["precision"] == "fp32"
    assert m.raw["verification"]["passed"], m.raw["verification"]


# amd (an AOTInductor compile per family, 35-55 s each): tests/test_hf_init_amd.py, so that pytest-xdist
# (--dist loadfile) runs it on one worker while this file runs on the other
@pytest.mark.slow
@pytest.mark.parametrize("target", ["cpu", "intel"])
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_init_checkpoint_builds_and_verifies(family: str, target: str,
                                                 hf_builds: dict[tuple[str, str], Path]) -> None:
    built_and_verified(hf_builds, family, target)


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_read_back_from_the_ir_equals_the_checkpoint(family: str, hf_checkpoints: dict[str, Path],
                                                              hf_builds: dict[tuple[str, str], Path]) -> None:
    from kvexport.artifact import open_artifact
    from kvexport.checkpoint import load_checkpoint
    from kvexport.export import decoder_from_ir

    folder, m = open_artifact(hf_builds[family, "cpu"])
    weights = m.raw["ir"]["weights"]
    dec = decoder_from_ir(folder, m)
    ref = load_checkpoint(hf_checkpoints[family], max_seq=MAX_SEQ).decoder
    assert set(weights) == {n for n, _ in ref.named_parameters()}  # every parameter, a tied one once
    assert len({w["initializer"] for w in weights.values()}) < len(weights)  # the exporter merged some
    a, b = dec.state_dict(), ref.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _without_initializer(src: Path, dst: Path, name: str) -> None:
    import shutil

    import onnx

    shutil.copytree(src, dst)
    model = onnx.load(str(dst / "model.onnx"), load_external_data=True)
    keep = [i for i in model.graph.initializer if i.name != name]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    (dst / "model.onnx.data").unlink()
    onnx.save_model(model, str(dst / "model.onnx"), save_as_external_data=True, location="model.onnx.data")


def test_an_ir_that_truly_lacks_a_weight_is_an_artifact_error(hf_builds: dict[tuple[str, str], Path],
                                                               tmp_path: Path) -> None:
    from kvexport.artifact import open_artifact
    from kvexport.errors import ArtifactError
    from kvexport.export import decoder_from_ir

    src, m = open_artifact(hf_builds["qwen2", "cpu"])
    shared = m.raw["ir"]["weights"]["layers.1.attn.qkv_proj.bias"]["initializer"]  # also layer 0's
    _without_initializer(src, tmp_path / "lacks.kvx", shared)
    with pytest.raises(ArtifactError, match=r"no weight for 2 decoder parameter\(s\) \(layers.0.attn.qkv_proj.bias, "
                                             r"layers.1.attn.qkv_proj.bias\)"):
        decoder_from_ir(tmp_path / "lacks.kvx", m)
    del m.raw["ir"]["weights"]["norm.weight"]  # a manifest that does not say where a parameter is
    with pytest.raises(ArtifactError, match=r"no weight for 1 decoder parameter\(s\) \(norm.weight\)"):
        decoder_from_ir(src, m)
    del m.raw["ir"]["weights"]  # a manifest from before `ir.weights`: names alone cannot find merged tensors
    with pytest.raises(ArtifactError, match="predates `ir.weights`"):
        decoder_from_ir(src, m)
