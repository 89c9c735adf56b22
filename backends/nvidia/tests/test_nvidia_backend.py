"""NvidiaBackend without a GPU: error paths, deferred packaging, and the packaged graph's numerics."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvexport import backends
from kvexport.artifact import check_integrity, finish, open_artifact
from kvexport.backends import BuildOptions
from kvexport.errors import ArtifactError, BackendUnavailableError, InputError
from kvexport.manifest import read
from kvexport_nvidia import backend as nb
from kvexport_nvidia import fingerprint as fp
from kvexport_nvidia.backend import ENGINE_DIR, PLAN, PREPARED, NvidiaBackend

from nvidia_ort_twin import OrtTwinSession

FAKE = fp.DeviceInfo(tensorrt="10.15.1", gpu_name="NVIDIA H200", compute_capability="9.0", driver="580.65.06")


def _copy_ir(tiny_ir: Path, dst: Path) -> Path:
    shutil.copytree(tiny_ir, dst)
    return dst


@pytest.fixture(scope="module")
def deferred(tiny_ir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An fp16 artifact packaged with --defer here (no GPU, no TensorRT)."""
    folder = _copy_ir(tiny_ir, tmp_path_factory.mktemp("nvb") / "deferred.kvx")
    m = read(folder)
    NvidiaBackend().build(folder, m, BuildOptions(max_batch=4, extra={"defer": True}), lambda _m: None)
    finish(folder, m)
    return folder


def _pretend_gpu_machine(monkeypatch: pytest.MonkeyPatch, info: fp.DeviceInfo = FAKE) -> None:
    monkeypatch.setattr(NvidiaBackend, "availability", lambda self: [])
    monkeypatch.setattr(nb, "probe_device", lambda device_index=0: info)


def test_registered_and_capabilities() -> None:
    b = backends.get("nvidia")
    caps = b.capabilities()
    assert isinstance(b, NvidiaBackend)
    assert caps.ir_cache_style == "static" and caps.cache_policy == "fixed" and caps.deferred_build
    assert caps.default_precision == "fp16" and set(caps.precisions) == {"fp16", "bf16", "fp32", "int8", "int4"}
    assert caps.kv_modes == ("fp16", "bf16", "fp32")  # the first: the cache under int8/int4 weights
    assert "tensorrt" not in sys.modules  # registering and asking imports no SDK


def test_availability_names_exactly_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    b = NvidiaBackend()
    monkeypatch.setattr(nb, "tensorrt_installed", lambda: False)
    monkeypatch.setattr(fp, "nvidia_smi", lambda: ({"gpu_name": "X", "driver": "1", "compute_capability": "9.0"}, ""))
    monkeypatch.setattr(nb, "torch_cuda_build", lambda: "12.8")
    reasons = b.availability()
    assert len(reasons) == 1 and "TensorRT is not installed" in reasons[0] and "pip install" in reasons[0]
    monkeypatch.setattr(nb, "tensorrt_installed", lambda: True)
    monkeypatch.setattr(fp, "nvidia_smi", lambda: (None, "nvidia-smi is not on PATH: no NVIDIA driver is installed"))
    reasons = b.availability()
    assert len(reasons) == 1 and "no NVIDIA GPU" in reasons[0] and "nvidia-smi" in reasons[0]
    monkeypatch.setattr(fp, "nvidia_smi", lambda: ({"gpu_name": "X", "driver": "1", "compute_capability": "9.0"}, ""))
    monkeypatch.setattr(nb, "torch_cuda_build", lambda: None)
    reasons = b.availability()
    assert len(reasons) == 1 and "CPU-only build" in reasons[0]


def test_build_here_fails_before_work_and_offers_defer(tiny_ir: Path, tmp_path: Path) -> None:
    folder = _copy_ir(tiny_ir, tmp_path / "a.kvx")
    m = read(folder)
    with pytest.raises(BackendUnavailableError) as e:
        NvidiaBackend().build(folder, m, BuildOptions(), lambda _m: None)
    msg = str(e.value)
    assert "TensorRT is not installed" in msg and "no NVIDIA GPU" in msg and "--defer" in msg
    assert not (folder / ENGINE_DIR).exists()  # refused before lowering anything
    assert m.raw["target"] is None


@pytest.mark.parametrize("options, match", [
    (BuildOptions(precision="fp8", extra={"defer": True}), "fp16, bf16 or fp32 engines"),
    (BuildOptions(weights="fp32", kv="fp16", extra={"defer": True}), "--weights fp32 takes --kv fp32"),
    (BuildOptions(weights="fp16", kv="bf16", extra={"defer": True}), "--weights fp16 takes --kv fp16"),
    (BuildOptions(weights="int4", group_size=32, kv="fp32", extra={"defer": True}), "int4 weights dequantize into an fp16"),
    (BuildOptions(extra={"defer": True, "bogus": 1}), "unknown nvidia option"),
    (BuildOptions(extra={"defer": True, "max_prefill": 10_000}), "max_prefill"),
    (BuildOptions(extra={"defer": True, "max_prefill": "many"}), "integer"),
    (BuildOptions(max_batch=0, extra={"defer": True}), "max_batch"),
])
def test_bad_build_options_are_input_errors(tiny_ir: Path, tmp_path: Path, options: BuildOptions, match: str) -> None:
    folder = _copy_ir(tiny_ir, tmp_path / "a.kvx")
    with pytest.raises(InputError, match=match):
        NvidiaBackend().build(folder, read(folder), options, lambda _m: None)
    assert not (folder / ENGINE_DIR).exists()


def test_deferred_packaging(deferred: Path) -> None:
    folder, m = open_artifact(deferred)  # every file hashed and checked
    t = m.target
    assert t["backend"] == "nvidia" and t["precision"] == "fp16" and t["deferred"] is True
    assert t["engine_files"] == [f"{ENGINE_DIR}/{PREPARED}", f"{ENGINE_DIR}/{PREPARED}.data"]
    assert all(f in m.raw["files"] for f in t["engine_files"])
    assert t["fingerprint"] == {} and not (folder / ENGINE_DIR / PLAN).exists()
    opts = t["options"]
    assert opts["max_batch"] == 4 and opts["max_prefill"] == m.max_seq
    assert [p["name"] for p in opts["profiles"]] == ["prefill", "decode"]
    assert opts["lowering"]["rope_rewritten"] == 4 and opts["lowering"]["precision"] == "fp16"
    check_integrity(folder, m)


def test_fp32_engine_is_recorded_cached_apart_and_verifies_strict(tiny_ir: Path, tiny_ckpt: Path, deferred: Path,
                                                                   tmp_path: Path) -> None:
    """--weights fp32: the manifest's target says fp32 everywhere it says fp16 for the default engine, with the
    same profiles; a plan rebuilt for it is cached under another key even for the same IR bytes; and its packaged
    graph passes `kvexport verify` at the strict (nvidia, fp32) row."""
    from kvexport.runtime.engine import Engine
    from kvexport.verify import verify_engine

    folder = _copy_ir(tiny_ir, tmp_path / "fp32.kvx")
    m = read(folder)
    NvidiaBackend().build(folder, m, BuildOptions(weights="fp32", max_batch=4, extra={"defer": True}), lambda _m: None)
    finish(folder, m)
    folder, m = open_artifact(folder)
    t, half = m.target, read(deferred).target
    assert t["precision"] == t["weights"]["dtype"] == t["options"]["model_dtype"] == "fp32"
    assert t["options"]["lowering"]["precision"] == "fp32" and half["options"]["model_dtype"] == "fp16"
    assert t["options"]["profiles"] == half["options"]["profiles"]
    assert t["weights"]["bytes"] > 1.9 * half["weights"]["bytes"]  # fp32 weights: twice fp16's bytes
    keys = {name: fp.cache_key("same IR", FAKE.fingerprint(), nb.rebuild_options(x)) for name, x in
            (("fp32", t), ("fp16", half))}
    assert keys["fp32"] != keys["fp16"]
    report = verify_engine(Engine(folder, m, OrtTwinSession(folder / ENGINE_DIR / PREPARED, m)), tiny_ckpt,
                           decode_steps=12)
    assert (report.backend, report.precision) == ("nvidia", "fp32") and report.passed, report.failures
    assert report.summary["max_abs_logit"] < 1e-4 and report.summary["greedy_agreement"] == 1.0


def test_precision_flags_resolve_before_any_export(tiny_ckpt: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """auto stays fp16 with its fp16 cache (fp32 is asked for by name); an impossible pair is an InputError
    raised before the export starts."""
    import kvexport.artifact
    from kvexport.build import build
    from kvexport.precision import resolve

    auto = resolve(NvidiaBackend(), BuildOptions(weights="auto"), set())
    assert (auto.weights, auto.kv) == ("fp16", "fp16")
    named = resolve(NvidiaBackend(), BuildOptions(weights="fp32"), set())
    assert (named.weights, named.kv) == ("fp32", "fp32")
    quant = resolve(NvidiaBackend(), BuildOptions(weights="int8"), set())
    assert quant.kv == "fp16"  # int8 weights dequantize into the fp16 engine by default
    monkeypatch.setattr(kvexport.artifact, "export_artifact", lambda *a, **k: pytest.fail("exported"))
    for weights, kv in (("fp32", "bf16"), (None, "fp32"), ("int8", "fp32")):
        with pytest.raises(InputError, match="--kv"):
            build(tiny_ckpt, tmp_path / "x.kvx", target="nvidia", verify=False,
                  options=BuildOptions(weights=weights, kv=kv, extra={"defer": True}))


def test_deferred_graph_verifies_against_the_reference(deferred: Path, tiny_ckpt: Path) -> None:
    """The packaged fp16 graph (what TensorRT will parse), run by ONNX Runtime with the TensorRT
    session's slot model, passes kvexport.verify at the (nvidia, fp16) tolerance."""
    from kvexport.runtime.engine import Engine
    from kvexport.verify import verify_engine

    folder, m = open_artifact(deferred)
    engine = Engine(folder, m, OrtTwinSession(folder / ENGINE_DIR / PREPARED, m))
    report = verify_engine(engine, tiny_ckpt, decode_steps=12)
    assert (report.backend, report.precision) == ("nvidia", "fp16")
    assert report.passed, report.failures
    assert report.summary["greedy_agreement"] >= 0.99


def test_loading_deferred_here_says_where_it_runs(deferred: Path) -> None:
    with pytest.raises(BackendUnavailableError, match="built at first load on the GPU machine"):
        NvidiaBackend().load(deferred, read(deferred))


def test_no_rebuild_on_deferred_fails_clearly(deferred: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend_gpu_machine(monkeypatch)
    with pytest.raises(ArtifactError, match="deferred.*no_rebuild"):
        NvidiaBackend().load(deferred, read(deferred), no_rebuild=True)


def _as_built(deferred: Path, dst: Path, plan: bytes, fingerprint: dict) -> Path:
    """A copy of the deferred artifact dressed as one built on `fingerprint` with `plan` bytes."""
    folder = _copy_ir(deferred, dst)
    m = read(folder)
    (folder / ENGINE_DIR / PLAN).write_bytes(plan)
    m.raw["target"].update(deferred=False, fingerprint=fingerprint,
                           engine_files=[*m.raw["target"]["engine_files"], f"{ENGINE_DIR}/{PLAN}"])
    m.raw["target"]["options"]["deferred"] = False
    finish(folder, m)
    return folder


def test_fingerprint_mismatch_with_no_rebuild_fails_clearly(deferred: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _as_built(deferred, tmp_path / "built.kvx", b"not a real plan", {**FAKE.fingerprint(), "tensorrt": "10.16.0"})
    _pretend_gpu_machine(monkeypatch)
    with pytest.raises(ArtifactError, match="10.16.0.*10.15.1.*no_rebuild"):
        NvidiaBackend().load(folder, read(folder), no_rebuild=True)


def test_tampered_plan_is_never_deserialized(deferred: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _as_built(deferred, tmp_path / "built.kvx", b"plan", FAKE.fingerprint())
    (folder / ENGINE_DIR / PLAN).write_bytes(b"plan, edited after the build")
    _pretend_gpu_machine(monkeypatch)
    called = []
    monkeypatch.setattr(NvidiaBackend, "_session", lambda self, *a, **k: called.append(1))
    with pytest.raises(ArtifactError, match="sha256"):
        NvidiaBackend().load(folder, read(folder))
    assert not called


def test_matching_plan_goes_to_the_session(deferred: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _as_built(deferred, tmp_path / "built.kvx", b"plan", FAKE.fingerprint())
    _pretend_gpu_machine(monkeypatch)
    seen = {}
    monkeypatch.setattr(NvidiaBackend, "_session", lambda self, plan, m, **k: seen.update(plan=plan, **k) or "S")
    assert NvidiaBackend().load(folder, read(folder), no_rebuild=True, cuda_graph=False) == "S"
    assert seen["plan"] == folder / ENGINE_DIR / PLAN and seen["cuda_graph"] is False


def test_mismatch_uses_a_verified_cached_rebuild(deferred: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rebuild already in the cache folder for this machine is used, and only if its bytes match."""
    folder = _as_built(deferred, tmp_path / "built.kvx", b"plan", {**FAKE.fingerprint(), "gpu_name": "NVIDIA A10"})
    monkeypatch.setenv("KVEXPORT_CACHE", str(tmp_path / "cache"))
    _pretend_gpu_machine(monkeypatch)
    m = read(folder)
    files = m.raw["files"]
    ir_sha = files[f"{ENGINE_DIR}/{PREPARED}.data"] + files[f"{ENGINE_DIR}/{PREPARED}"]
    entry = fp.cache_root() / fp.cache_key(ir_sha, FAKE.fingerprint(), nb.rebuild_options(m.target))
    entry.mkdir(parents=True)
    (entry / PLAN).write_bytes(b"rebuilt plan")
    from kvexport.checkpoint import sha256_file

    (entry / "entry.json").write_text(json.dumps({"sha256": sha256_file(entry / PLAN),
                                                  "fingerprint": FAKE.fingerprint(), "ir_sha256": ir_sha}))
    seen = {}
    monkeypatch.setattr(NvidiaBackend, "_session", lambda self, plan, m, **k: seen.update(plan=plan) or "S")
    NvidiaBackend().load(folder, m, progress=lambda _m: None)
    assert seen["plan"] == entry / PLAN
    # a cached plan that no longer matches its entry is rebuilt, which needs TensorRT: here that
    # is a BackendUnavailableError naming TensorRT, never a crash on the bad bytes
    (entry / PLAN).write_bytes(b"corrupted")
    with pytest.raises(BackendUnavailableError, match="TensorRT"):
        NvidiaBackend().load(folder, m, progress=lambda _m: None)


def test_load_option_errors(deferred: Path) -> None:
    with pytest.raises(InputError, match="threads"):
        NvidiaBackend().load(deferred, read(deferred), threads=4)
    with pytest.raises(InputError, match="unknown nvidia load option"):
        NvidiaBackend().load(deferred, read(deferred), fast=True)


def test_doctor_reports_what_it_sees() -> None:
    d = NvidiaBackend().doctor()
    assert set(d) >= {"gpu", "tensorrt", "torch_cuda", "ready"}
    assert d["ready"] is (not NvidiaBackend().availability())


@pytest.mark.skipif(not NvidiaBackend().availability(), reason="this machine can build nvidia engines")
def test_cli_build_without_gpu_has_no_traceback(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, "-m", "kvexport.cli", "build", "--target", "nvidia", "-o", str(tmp_path / "x.kvx")],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr
    assert "TensorRT is not installed" in r.stderr and "--defer" in r.stderr
    assert not (tmp_path / "x.kvx").exists()


@pytest.mark.skipif(not NvidiaBackend().availability(), reason="this machine can run the GPU check")
def test_gpu_check_script_says_what_is_missing() -> None:
    script = Path(__file__).resolve().parents[1] / "gpu_check.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3 and "Traceback" not in r.stderr
    assert "cannot run here" in r.stderr and "TensorRT" in r.stderr
