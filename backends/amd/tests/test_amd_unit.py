"""amd backend parts that need no compile: device probing, fingerprints, refusals, the in-place trace."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvexport.artifact import export_artifact
from kvexport.backends import BuildOptions, get
from kvexport.checkpoint import load_checkpoint
from kvexport.decoder import IN_PLACE
from kvexport.errors import ArtifactError, BackendUnavailableError, InputError
from kvexport.manifest import read
from kvexport_amd import AmdBackend, lowering
from kvexport_amd import device as dv
from kvexport_amd.session import AotiSession

from conftest import AMD_FAMILIES

HAS_GPU = dv.gpu_present()
ROCM_PROPS = SimpleNamespace(name="AMD Instinct MI300X", gcnArchName="gfx942:sramecc+:xnack-", major=9, minor=4)


@pytest.fixture(scope="module")
def tiny_ir(amd_builds, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An IR-only artifact (no target), as kvexport build hands it to the backend."""
    return export_artifact(amd_builds.checkpoint("llama"), tmp_path_factory.mktemp("amdu") / "ir.kvx", max_seq=32)


def test_registered_and_capabilities() -> None:
    b = get("amd")
    assert isinstance(b, AmdBackend)
    caps = b.capabilities()
    assert caps.cache_policy == "fixed" and caps.ir_cache_style == "static"
    assert set(caps.precisions) == {"fp16", "bf16", "fp32", "int8", "int4"}
    if not HAS_GPU:
        assert caps.default_precision == "fp32"
    assert b.availability() == []  # torch with AOTInductor is all it needs here


def test_doctor_reports_rocm_and_arch() -> None:
    facts = AmdBackend().doctor()
    assert facts["torch"] == torch.__version__
    assert facts["rocm"] is (torch.version.hip is not None)
    assert "gfx_arch" in facts and "gpu" in facts
    if not HAS_GPU:
        assert facts["gpu"] is None and facts["gfx_arch"] is None and facts["builds_for"] == "cpu"
        assert "ROCm" in facts["note"]


def test_probe_rocm_gpu_reads_gfx_arch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: ROCM_PROPS)
    info = dv.probe_gpu()
    assert info.kind == "rocm" and info.gfx_arch == "gfx942:sramecc+:xnack-" and info.torch_device == "cuda"
    fp = info.fingerprint()
    assert fp["hip"] == "6.4.43482" and fp["gfx_arch"] == "gfx942:sramecc+:xnack-" and "cuda" not in fp
    assert dv.mismatches(fp, info) == []
    other = dv.DeviceInfo(kind="rocm", name="MI250X", torch=torch.__version__, hip="6.4.43482", gfx_arch="gfx90a")
    assert any("gfx942" in p and "gfx90a" in p for p in dv.mismatches(fp, other))
    newer = dv.DeviceInfo(kind="rocm", name=ROCM_PROPS.name, torch=torch.__version__, hip="7.0",
                          gfx_arch=ROCM_PROPS.gcnArchName)
    assert any("HIP" in p for p in dv.mismatches(fp, newer))


def test_probe_cuda_gpu_has_no_gfx_arch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(name="NVIDIA H200", major=9, minor=0))
    info = dv.probe_gpu()
    assert info.kind == "cuda" and info.gfx_arch is None and info.fingerprint()["compute_capability"] == "9.0"


def test_cpu_fingerprint_mismatches() -> None:
    here = dv.probe_cpu()
    fp = here.fingerprint()
    assert dv.mismatches(fp, here) == []
    assert any("torch" in p for p in dv.mismatches({**fp, "torch": "1.0"}, here))
    assert any("avx10_9" in p for p in dv.mismatches({**fp, "cpu_flags": [*fp["cpu_flags"], "avx10_9"]}, here))
    assert any("rocm" in p for p in dv.mismatches({**fp, "device_kind": "rocm"}, here))


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU messages; this machine has a GPU")
def test_no_gpu_is_a_clear_error() -> None:
    with pytest.raises(BackendUnavailableError, match="ROCm"):
        dv.select("gpu")
    assert dv.select("auto").kind == "cpu"
    with pytest.raises(BackendUnavailableError, match="auto\\|gpu\\|cpu"):
        dv.select("tpu")  # type: ignore[arg-type]


def _no_export(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a: object, **k: object) -> None:
        raise AssertionError("refusals must come before export/compile")

    monkeypatch.setattr(lowering, "export_program", boom)
    monkeypatch.setattr("kvexport.export.decoder_from_ir", boom)


@pytest.mark.skipif(HAS_GPU, reason="checks the CPU-only refusals")
@pytest.mark.parametrize(("options", "error", "match"), [
    (BuildOptions(precision="fp8"), InputError, "fp16, bf16 or fp32"),
    (BuildOptions(extra={"device": "gpu"}), BackendUnavailableError, "ROCm"),
    (BuildOptions(extra={"nope": 1}), InputError, "unknown amd option"),
    (BuildOptions(max_batch=0), InputError, "max_batch"),
])
def test_build_refusals_come_first(tiny_ir: Path, monkeypatch: pytest.MonkeyPatch, options: BuildOptions,
                                   error: type, match: str) -> None:
    _no_export(monkeypatch)
    with pytest.raises(error, match=match):
        AmdBackend().build(tiny_ir, read(tiny_ir), options, lambda _m: None)


def test_missing_compiler_is_a_clear_error(tiny_ir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_export(monkeypatch)
    monkeypatch.setattr(dv, "cxx_compiler", lambda: None)
    with pytest.raises(BackendUnavailableError, match="C\\+\\+ compiler"):
        AmdBackend().build(tiny_ir, read(tiny_ir), BuildOptions(extra={"device": "cpu"}), lambda _m: None)


def test_check_refuses_concat_ir_and_quantized_cache(tiny_ir: Path) -> None:
    m = read(tiny_ir)
    assert AmdBackend().check(m) == []
    m.raw["ir"]["cache_style"] = "concat"
    m.raw["cache"]["quantization"] = "u8"
    problems = AmdBackend().check(m)
    assert any("static" in p for p in problems) and any("u8" in p for p in problems)


@pytest.mark.skipif(HAS_GPU, reason="checks the CPU-only CLI message")
def test_cli_gpu_device_without_gpu_has_no_traceback(amd_builds, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "kvexport", "build", str(amd_builds.checkpoint("llama")),
                        "--target", "amd", "--option", "device=gpu", "--max-seq", "16", "-o", str(tmp_path / "x.kvx")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 3
    assert "Traceback" not in r.stderr + r.stdout
    assert "ROCm" in r.stderr + r.stdout


@pytest.mark.parametrize("family", AMD_FAMILIES)
def test_inplace_write_matches_functional_decoder(amd_builds, family: str) -> None:
    """The IN_PLACE strategy gives the functional decoder's logits and writes the same presents in place."""
    dec = load_checkpoint(amd_builds.checkpoint(family), 24, torch.float32).decoder
    g = torch.Generator().manual_seed(0)
    B, S, C = 2, 4, 24
    ids = torch.randint(3, 259, (B, S), generator=g)
    wi = torch.tensor([3, 3])
    pos = (wi[:, None] + torch.arange(S)).contiguous()
    mask = torch.zeros(B, 1, S, C, dtype=torch.bool)
    mask[..., : 3 + S] = True
    caches = [torch.randn(dec.cache_shape(B, C), generator=g) for _ in range(2 * dec.cfg.num_hidden_layers)]
    ref = dec(ids, pos, wi, mask, *[c.clone() for c in caches])
    mine = [c.clone() for c in caches]
    with dec.configured(kv=IN_PLACE):
        out = lowering.LogitsOnly(dec)(ids, pos, wi, mask, *mine)
    torch.testing.assert_close(out, ref[0], rtol=0, atol=1e-6)
    for got, want in zip(mine, ref[1:]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_exported_graph_mutates_caches_and_returns_logits_only(amd_builds) -> None:
    dec = load_checkpoint(amd_builds.checkpoint("llama"), 16, torch.float32, last_token_only=True).decoder
    ep = lowering.export_program(dec, max_batch=4, dtype=torch.float32, device="cpu")
    assert len(ep.graph_signature.user_outputs) == 1
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert not any("scatter" in t for t in targets)  # no whole-cache functional copy
    assert "aten.index_put_.default" in targets
    # functionalized (what Inductor lowers), the writes are mutations of every past cache input
    specs = ep.run_decompositions().graph_signature.output_specs
    mutated = [s.target for s in specs if s.kind.name == "USER_INPUT_MUTATION"]
    assert mutated == [f"past_{i}" for i in range(2 * dec.cfg.num_hidden_layers)]
    # the same program runs batch 1 decode and batch 3 prefill (dynamic batch and seq)
    for B, S in ((1, 1), (3, 5)):
        args = lowering.example_inputs(dec, B, S, 16, torch.float32, "cpu")
        assert ep.module()(*args).shape == (B, 1, dec.cfg.vocab_size)


def test_inspect_package_rules(tmp_path: Path) -> None:
    def pkg(*names: str) -> Path:
        p = tmp_path / f"p{len(list(tmp_path.iterdir()))}.pt2"
        with zipfile.ZipFile(p, "w") as z:
            for n in names:
                z.writestr(n, b"x")
        return p

    good = pkg("m/data/aotinductor/model/abc.wrapper.so", "m/data/aotinductor/model/abc.wrapper.cpp", "m/version")
    assert len(lowering.inspect_package(good)) == 3
    with pytest.raises(ArtifactError, match="unpickled"):
        lowering.inspect_package(pkg("m/data/aotinductor/model/a.so", "m/data/weights/w0"))
    with pytest.raises(ArtifactError, match="unpickled"):
        lowering.inspect_package(pkg("m/data/aotinductor/model/a.so", "m/models/model.json"))
    with pytest.raises(ArtifactError, match="no compiled library"):
        lowering.inspect_package(pkg("m/data/aotinductor/model/a.cpp"))
    bad = tmp_path / "junk.pt2"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ArtifactError, match="not an AOTInductor package"):
        lowering.inspect_package(bad)


def test_graph_capture_refused_on_cpu() -> None:
    with pytest.raises(InputError, match="GPU"):
        AotiSession(None, device="cpu", dtype=torch.float32, num_layers=1, kv_heads=1, head_dim=8, max_seq=8,
                    vocab_size=8, max_batch=1, use_graph=True, facts={})


def test_decode_buffers_fill_only_held_slots() -> None:
    ids, pos, wi = torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    mask = torch.zeros(2, 1, 1, 8, dtype=torch.bool)
    m = np.array([[True, False, True]] * 2)[:, None, None, :]
    session = SimpleNamespace(full_mask=True, ring=None)  # what _fill reads of a session without ring layers
    AotiSession._fill(session, [ids, pos, wi, mask], np.array([[4], [5]]), np.array([[2], [1]]), m, 2)
    assert ids.tolist() == [[4], [5]] and pos.tolist() == [[2], [1]] and wi.tolist() == [2, 2]
    assert mask[0, 0, 0].tolist() == [True, False, True, False, False, False, False, False]
