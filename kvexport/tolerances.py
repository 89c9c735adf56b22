"""The one tolerance table, keyed by (backend, precision). Tests and `kvexport verify` read it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    max_abs_logit: float  # max |engine - reference| over every compared logit
    min_greedy_agreement: float  # fraction of greedy steps whose token matches the reference
    max_mean_kl: float  # mean KL(reference || engine) per step


EXACT = Tolerance(max_abs_logit=1e-4, min_greedy_agreement=1.0, max_mean_kl=1e-6)

TOLERANCES: dict[tuple[str, str], Tolerance] = {
    ("reference", "fp32"): EXACT,  # the owned decoder in eager torch
    ("cpu", "fp32"): EXACT,
    ("intel", "fp32"): Tolerance(1e-3, 1.0, 1e-5),
    ("intel", "bf16"): Tolerance(float("inf"), 0.99, 1e-3),
    # a lossy KV cache (target.options.kv_precision) costs agreement on top of the weights' precision
    ("intel", "fp32+kv-f16"): Tolerance(float("inf"), 0.99, 1e-5),
    ("intel", "fp32+kv-u8"): Tolerance(float("inf"), 0.95, 5e-4),
    ("intel", "bf16+kv-f16"): Tolerance(float("inf"), 0.99, 1e-3),
    ("intel", "bf16+kv-u8"): Tolerance(float("inf"), 0.95, 2e-3),
    ("amd", "fp32"): Tolerance(1e-3, 1.0, 1e-5),
    ("amd", "fp16"): Tolerance(float("inf"), 0.99, 1e-3),
    ("amd", "bf16"): Tolerance(float("inf"), 0.99, 2e-3),
    ("nvidia", "fp16"): Tolerance(float("inf"), 0.99, 1e-3),
    ("nvidia", "bf16"): Tolerance(float("inf"), 0.99, 2e-3),
    ("nvidia", "fp32"): Tolerance(1e-3, 1.0, 1e-5),
}


def precision_key(target: dict) -> str:
    """`fp32`, or `fp32+kv-u8` when the engine keeps its KV cache in a lossier type than its weights."""
    precision = str(target.get("precision", "fp32"))
    kv = (target.get("options") or {}).get("kv_precision")
    return precision if kv in (None, "f32", "fp32") else f"{precision}+kv-{kv}"


def tolerance(backend: str, precision: str) -> Tolerance:
    try:
        return TOLERANCES[(backend, precision)]
    except KeyError:
        raise KeyError(f"no tolerance for ({backend!r}, {precision!r}); add one to kvexport/tolerances.py") from None
