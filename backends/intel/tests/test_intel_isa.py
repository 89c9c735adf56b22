"""ISA detection and precision choice from /proc/cpuinfo flags (no OpenVINO needed)."""
from __future__ import annotations

import pytest

from kvexport.errors import InputError
from kvexport_intel import isa

SAPPHIRE_RAPIDS = "processor : 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8 avx512_fp16\n"
COOPER_LAKE = "processor : 0\nflags : fpu avx2 avx512f avx512_bf16\n"
ICE_LAKE = "processor : 0\nflags : fpu avx2 avx512f avx512_vnni\n"
ZEN3 = "processor : 0\nflags : fpu avx2 fma\n"


@pytest.mark.parametrize(("text", "precision", "amx"), [
    (SAPPHIRE_RAPIDS, "bf16", True), (COOPER_LAKE, "bf16", False), (ICE_LAKE, "fp32", False), (ZEN3, "fp32", False),
])
def test_precision_follows_the_cpu_features(text: str, precision: str, amx: bool) -> None:
    flags = isa.read_cpu_flags(text)
    assert isa.auto_precision(flags) == precision
    assert isa.has_amx(flags) is amx
    report = isa.fingerprint_isa(flags)
    assert set(report["isa"]) >= {"amx_tile", "amx_bf16", "amx_int8", "avx512_bf16"}
    assert report["isa"]["amx_tile"] is amx
    assert precision in isa.why_precision(flags)


def test_bf16_artifact_falls_back_to_fp32_with_a_warning_without_bf16_hardware() -> None:
    run, warning = isa.runtime_precision("bf16", isa.read_cpu_flags(ICE_LAKE))
    assert run == "fp32" and warning is not None and "AVX512-BF16" in warning
    assert isa.runtime_precision("bf16", isa.read_cpu_flags(SAPPHIRE_RAPIDS)) == ("bf16", None)
    assert isa.runtime_precision("fp32", isa.read_cpu_flags(ZEN3)) == ("fp32", None)


def test_precision_names() -> None:
    assert isa.normalize_precision("f32") == "fp32"
    assert isa.normalize_precision("BF16") == "bf16"
    with pytest.raises(InputError, match="fp32.*bf16"):
        isa.normalize_precision("int4")


def test_this_machine_is_read() -> None:
    flags = isa.read_cpu_flags()
    assert flags, "/proc/cpuinfo has no flags line"
    assert isa.auto_precision(flags) == ("bf16" if {"amx_bf16", "avx512_bf16"} & flags else "fp32")


def test_the_cache_held_follows_the_activations() -> None:
    """bf16 activations hold an f32-asked cache in bf16 (bit-identical logits, and paged attention keeps no f32 cache
    under bf16), except in ring engines; f32 activations hold a bf16-asked cache in f32; lossy caches stay as asked."""
    from kvexport.runtime.ring import RingSpec
    from kvexport_intel import held_kv

    ring = RingSpec(window=8, layers=frozenset({0}), num_layers=2, max_positions=64)
    assert held_kv("bf16", "f32") == "bf16" and held_kv("bf16", "bf16") == "bf16"
    assert held_kv("bf16", "f32", ring) == "f32"
    assert held_kv("fp32", "bf16") == "f32" and held_kv("fp32", "f32") == "f32"
    assert [held_kv(a, kv) for a in ("fp32", "bf16") for kv in ("f16", "u8")] == ["f16", "u8", "f16", "u8"]
