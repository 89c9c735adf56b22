"""CPU features that decide the intel target's precision: AMX and AVX512-BF16, read from /proc/cpuinfo."""
from __future__ import annotations

from typing import Any

from kvexport.doctor import read_cpu_flags  # noqa: F401 - the one reader of /proc/cpuinfo flags, kept here by name

# The flags recorded in every artifact's fingerprint (Linux /proc/cpuinfo names).
ISA_FLAGS = ("amx_tile", "amx_bf16", "amx_int8", "avx512_bf16", "avx512f", "avx2")
# bf16 compute exists in hardware when either of these is present (OpenVINO's CPU plugin
# then runs bf16 matmuls natively; without them a bf16 request is emulated or refused).
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
PRECISIONS = ("fp32", "bf16")
ALIASES = {"f32": "fp32", "float32": "fp32", "fp32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}


def isa_report(flags: set[str]) -> dict[str, bool]:
    """{flag: present} for every flag in ISA_FLAGS: what the fingerprint records."""
    return {f: f in flags for f in ISA_FLAGS}


def has_bf16(flags: set[str]) -> bool:
    return any(f in flags for f in BF16_FLAGS)


def has_amx(flags: set[str]) -> bool:
    return "amx_tile" in flags and ("amx_bf16" in flags or "amx_int8" in flags)


def auto_precision(flags: set[str]) -> str:
    """bf16 where the CPU computes it natively (AMX-BF16 or AVX512-BF16), fp32 otherwise."""
    return "bf16" if has_bf16(flags) else "fp32"


def why_precision(flags: set[str]) -> str:
    if "amx_bf16" in flags:
        return "bf16: the CPU has AMX-BF16 tiles"
    if "avx512_bf16" in flags:
        return "bf16: the CPU has AVX512-BF16"
    return "fp32: the CPU has neither AMX-BF16 nor AVX512-BF16"


def normalize_precision(p: str) -> str:
    from kvexport.errors import InputError

    if p.lower() not in ALIASES:
        raise InputError(f"the intel target supports precisions fp32 (alias f32) and bf16, not {p!r}")
    return ALIASES[p.lower()]


def runtime_precision(chosen: str, flags: set[str]) -> tuple[str, str | None]:
    """(precision to run, warning or None): an artifact built for bf16 on a CPU without bf16
    hardware runs in fp32 rather than in slow emulation or not at all."""
    if chosen == "bf16" and not has_bf16(flags):
        return "fp32", ("this artifact was built for bf16, but this CPU has neither AMX-BF16 nor AVX512-BF16; "
                        "running in fp32 (exact, slower per byte). Rebuild with --precision fp32 to silence this.")
    return chosen, None


def fingerprint_isa(flags: set[str]) -> dict[str, Any]:
    return {"isa": isa_report(flags), "amx": has_amx(flags), "bf16_hardware": has_bf16(flags)}
