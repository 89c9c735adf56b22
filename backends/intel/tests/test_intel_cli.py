"""`kvexport build --target intel` on the embedded default, `kvexport doctor`, and refusals before long work."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvexport.backends import BuildOptions
from kvexport.build import build
from kvexport.errors import BackendUnavailableError, InputError

pytest.importorskip("openvino", reason="the intel target needs openvino (pip install 'kvexport[intel]')")


def kvx(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvexport", *args], capture_output=True, text=True, timeout=timeout)


def no_raw_warnings(r: subprocess.CompletedProcess[str]) -> bool:
    """The CLI turns library warnings into `notice:` lines; no `path:line: SomeWarning:` or source line."""
    return not re.search(r"^\S+:\d+: \w*Warning: |warnings\.warn\(", r.stdout + r.stderr, re.M)


def test_build_intel_on_the_embedded_default_then_run(tmp_path: Path) -> None:
    out = tmp_path / "default-intel.kvx"
    r = kvx("build", "--target", "intel", "-o", str(out), "--max-seq", "256")
    assert r.returncode == 0, r.stderr
    assert "fused ScaledDotProductAttention" in r.stdout + r.stderr
    assert no_raw_warnings(r), r.stderr
    from kvexport_intel import isa

    flags = isa.read_cpu_flags()
    chosen = isa.auto_precision(flags)  # bf16 on AMX / AVX512-BF16 CPUs, fp32 elsewhere
    assert f"precision {isa.why_precision(flags)}" in r.stderr  # the pick and its reason are printed
    m = json.loads((out / "manifest.json").read_text())
    t = m["target"]
    assert t["backend"] == "intel" and t["precision"] == chosen
    assert t["fingerprint"]["precision_reason"] == isa.why_precision(flags)
    assert sorted(t["engine_files"]) == ["engine/openvino_model.bin", "engine/openvino_model.xml"]
    assert set(t["fingerprint"]["isa"]) >= {"amx_tile", "amx_bf16", "amx_int8", "avx512_bf16"}
    assert m["verification"]["passed"] is True
    run = kvx("run", str(out), "--prompt", "hello", "--max-new-tokens", "5")
    assert run.returncode == 0, run.stderr
    assert no_raw_warnings(run), run.stderr
    # OpenVINO compiles the engine file at every load and nothing is rebuilt: --no-rebuild holds as it is
    again = kvx("run", str(out), "--prompt", "hello", "--max-new-tokens", "5", "--no-rebuild")
    assert again.returncode == 0 and again.stdout == run.stdout, again.stderr


def test_doctor_shows_amx_numa_and_the_precision_it_would_pick() -> None:
    r = json.loads(kvx("doctor", "--json").stdout)
    intel = r["targets"]["intel"]
    assert intel["ready"] is True
    assert intel["amx"] in ("present", "absent")
    assert intel["numa_nodes"] and all(isinstance(c, list) for c in intel["numa_nodes"].values())
    assert intel["would_pick_precision"].split(":")[0] in ("fp32", "bf16")
    from kvexport.doctor import read_cpu_flags

    flags = read_cpu_flags()  # the format --kv int8 holds on this CPU, and why (the compiler looked for, not run)
    vector = "avx512f" in flags or {"avx2", "fma"} <= flags
    u8_on_tiles = {"amx_bf16", "amx_int8"} & flags and {"amx_bf16", "avx512_bf16"} & flags  # AMX under bf16
    i8_on_tiles = {"amx_tile", "amx_int8", "amx_bf16"} <= flags  # doctor assumes the tiles granted
    pays = vector and (not u8_on_tiles or i8_on_tiles)
    assert intel["kv_int8"].startswith(f"{'i8' if pays else 'u8'}: "), intel["kv_int8"]
    vnni = {"avx512f", "avx512bw", "avx512_vnni"} <= flags  # int8/int4 decode steps: kvexport's QGemv where it has it
    assert intel["decode_matmul"] == ("kvexport: kvexport's QGemv (AVX512-VNNI)" if vnni else
                                      "openvino: this CPU lacks AVX512-VNNI, which kvexport's decode matmul is written "
                                      "for: the plugin's matmuls (decode_matmul=kvexport runs its portable loops)")
    bf16 = {"avx512f", "avx512bw", "avx512_bf16"} <= flags  # and bf16 weights' decode steps
    assert intel["decode_matmul_bf16"] == ("kvexport: kvexport's QGemv (AVX512-BF16)" if bf16 else
                                           "openvino: this CPU lacks AVX512-BF16, which kvexport's decode matmul is "
                                           "written for: the plugin's matmuls (decode_matmul=kvexport runs its "
                                           "portable loops)")
    amx = bf16 and {"amx_tile", "amx_bf16"} <= flags  # and their prompts: the same op's AMX-BF16 tiles
    assert intel["prompt_matmul_bf16"].startswith("kvexport: kvexport's QGemv (AMX-BF16)" if amx else
                                                  "openvino: the plugin's matmuls"), intel["prompt_matmul_bf16"]


@pytest.mark.parametrize(("extra", "match"), [
    ({"kv_precision": "q4"}, "kv_precision"),
    ({"numa_node": "63"}, "NUMA node 63 does not exist"),
    ({"streams": "2"}, "unknown intel options"),
])
def test_bad_options_fail_before_any_export(extra: dict, match: str, tmp_path: Path) -> None:
    from kvexport_intel import IntelBackend
    from kvexport.manifest import Manifest

    t0 = time.perf_counter()
    with pytest.raises(InputError, match=match):
        IntelBackend().build(tmp_path, Manifest({}), BuildOptions(extra=extra), lambda _m: None)
    assert time.perf_counter() - t0 < 5


def test_bad_precision_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="builds weight precisions fp32, bf16, int8, int4"):  # no fp16
        build(None, tmp_path / "x.kvx", target="intel", options=BuildOptions(precision="fp16"))


@pytest.mark.parametrize("cpu", ["this", "zen3"])
def test_bf16_cache_under_f32_activations_is_refused_before_the_export(cpu: str, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """--kv bf16 rides on bf16 activations (an f32 request is held in bf16 there anyway); under f32 activations
    fp16 is the 2-byte cache: asked for with --weights fp32 on any CPU, or with the default on one without bf16."""
    from kvexport_intel import isa

    if cpu == "zen3":
        monkeypatch.setattr(isa, "read_cpu_flags", lambda *_a: {"avx2", "fma"})
    asked = BuildOptions(weights="fp32", kv="bf16") if cpu == "this" else BuildOptions(kv="bf16")
    t0 = time.perf_counter()
    with pytest.raises(InputError, match="--kv bf16 goes with bf16 activations.*--kv fp16"):
        build(None, tmp_path / "x.kvx", target="intel", options=asked)
    assert time.perf_counter() - t0 < 5 and not (tmp_path / "x.kvx").exists()


def test_ipex_path_says_plainly_why_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from kvexport_intel.ipex import require_ipex

    monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch", None)  # not installed
    with pytest.raises(BackendUnavailableError, match="end-of-life"):
        require_ipex()
    monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch", types.SimpleNamespace(__version__="2.8.0+cpu"))
    import torch

    if torch.__version__.startswith("2.8"):
        pytest.skip("torch 2.8 matches IPEX's pin here")
    with pytest.raises(BackendUnavailableError, match="built for torch 2.8"):
        require_ipex()


def test_bench_labels_the_cache_an_engine_holds_as_loaded(intel_artifacts: dict) -> None:
    """`kvexport bench --variant kv_precision=u8` times a u8 cache: its label says so, not the artifact's record."""
    from kvexport import load
    from kvexport.bench import mode_of

    _, art = intel_artifacts["llama"]
    built = mode_of(load(art))
    assert "kv-int8" not in built
    assert mode_of(load(art, kv_precision="u8")) == built.split("+kv-")[0] + "+kv-int8"
