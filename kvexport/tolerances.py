"""The one tolerance table, keyed by (backend, precision). Tests and `kvexport verify` read it.

A row judges one of two ways (kvexport.verify):
- strict (fp32): the engine's logits over greedy decoding of seeded prompts against the fp32
  reference: max |logit diff|, identical greedy tokens, mean KL.
- teacher-forced (any precision below fp32: bf16, fp16, a lossy KV cache): the engine fed a fixed
  text (the reference's held-out text when it ships one), its next-token distribution at every
  position against the fp32 reference's: top-1 agreement, mean and max KL, perplexity change.
  Greedy agreement on random weights is no measure there (their logits are nearly flat), so these
  rows are set from what a correct engine measures on the trained default model, with margin, and
  the mutation tests (tests/test_verify.py) show that a broken engine fails them.
"""
from __future__ import annotations

from dataclasses import dataclass

INF = float("inf")


@dataclass(frozen=True)
class Tolerance:
    max_abs_logit: float = INF  # strict: max |engine - reference| over every compared logit
    min_greedy_agreement: float = 0.0  # strict: fraction of greedy steps whose token matches the reference
    max_mean_kl: float = INF  # mean KL(reference || engine): per greedy step (strict), per text position (teacher-forced)
    min_top1_agreement: float | None = None  # teacher-forced: argmax agreement per text position; None = strict row
    max_max_kl: float = INF  # teacher-forced: the worst position's KL
    max_ppl_change: float = INF  # teacher-forced: |ppl_engine / ppl_reference - 1| on a held-out text

    @property
    def teacher_forced(self) -> bool:
        return self.min_top1_agreement is not None


def _lossy(top1: float, mean_kl: float, max_kl: float, ppl_change: float) -> Tolerance:
    return Tolerance(min_top1_agreement=top1, max_mean_kl=mean_kl, max_max_kl=max_kl, max_ppl_change=ppl_change)


EXACT = Tolerance(max_abs_logit=1e-4, min_greedy_agreement=1.0, max_mean_kl=1e-6)
FP32 = Tolerance(max_abs_logit=1e-3, min_greedy_agreement=1.0, max_mean_kl=1e-5)

# Teacher-forced rows: what a correct engine measures on the trained default model's held-out text
# (384 positions, as `kvexport verify` runs; docs/design.md "Verification" has the table), about
# 10x on the KLs and several flips on top-1 for margin. The KLs are what catch subtle cache bugs on
# this model: RoPE off by one in decode, or a stale cache slot, keep top-1 at 0.98-0.99 but measure
# mean KL 3.7e-3 and max KL 0.3-0.8 (100x a correct bf16 engine, 7x the bf16 row); a wrong GQA head
# mapping measures top-1 0.33, mean KL 0.84 (tests/test_verify.py).
FP16 = _lossy(top1=0.99, mean_kl=2e-5, max_kl=1e-3, ppl_change=0.005)  # amd fp16: 1.0, 6.0e-7, 7.6e-6, +0.002%
BF16 = _lossy(top1=0.98, mean_kl=5e-4, max_kl=0.03, ppl_change=0.01)  # amd bf16: 0.992, 3.8e-5, 3.6e-4, -0.05%
KV_F16 = _lossy(top1=0.99, mean_kl=1e-5, max_kl=1e-3, ppl_change=0.005)  # intel kv f16: 1.0, 7.2e-8, 1.9e-6, -0.000%
KV_U8 = _lossy(top1=0.985, mean_kl=3e-4, max_kl=0.05, ppl_change=0.01)  # intel kv u8: 0.997, 1.8e-5, 6.2e-4, -0.03%
# bf16 weights with a lossy cache: the errors add; and OpenVINO bf16 itself, which cannot run on
# the AVX2 machine the rows were measured on: amd bf16 (full bf16 torch, a harsher rounding than
# OpenVINO's bf16 matmuls) plus margin, to be replaced by a measurement on an AMX/AVX512-BF16 CPU
BF16_DERIVED = _lossy(top1=0.97, mean_kl=1e-3, max_kl=0.05, ppl_change=0.02)

TOLERANCES: dict[tuple[str, str], Tolerance] = {
    ("reference", "fp32"): EXACT,  # the owned decoder in eager torch
    ("cpu", "fp32"): EXACT,
    ("intel", "fp32"): FP32,
    ("intel", "bf16"): BF16_DERIVED,  # derived, see above
    # a lossy KV cache (target.options.kv_precision) costs agreement on top of the weights' precision
    ("intel", "fp32+kv-f16"): KV_F16,
    ("intel", "fp32+kv-u8"): KV_U8,
    ("intel", "bf16+kv-f16"): BF16_DERIVED,
    ("intel", "bf16+kv-u8"): BF16_DERIVED,
    ("amd", "fp32"): FP32,
    ("amd", "fp16"): FP16,
    ("amd", "bf16"): BF16,
    ("nvidia", "fp16"): FP16,
    ("nvidia", "bf16"): BF16,
    ("nvidia", "fp32"): FP32,
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
