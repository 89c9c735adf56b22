"""TensorRT optimization profiles computed from the manifest: one for prefill, one for decode.

A profile gives every dynamic input a (min, opt, max) shape. The cache dims are static (max_seq is
pinned by the lowering), so only batch and the new-token count vary: prefill spans batch
1..max_batch x seq 1..max_prefill; decode is seq 1, so TensorRT picks its kernels for one token.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvexport.errors import InputError
from kvexport.manifest import Manifest
from kvexport.runtime.ring import MASK_INPUT, RingSpec

Shape = tuple[int, ...]
PREFILL, DECODE = 0, 1  # profile indices in the engine (the runtime selects by these)


@dataclass(frozen=True)
class Profile:
    name: str
    shapes: dict[str, tuple[Shape, Shape, Shape]]  # input name -> (min, opt, max)

    def to_dict(self) -> dict:
        return {"name": self.name, "shapes": {k: [list(s) for s in v] for k, v in self.shapes.items()}}

    def covers(self, name: str, shape: Shape) -> bool:
        lo, _, hi = self.shapes[name]
        return len(shape) == len(lo) and all(a <= s <= b for a, s, b in zip(lo, shape, hi))


def _input_shapes(m: Manifest, batch: int, seq: int) -> dict[str, Shape]:
    """Concrete shape of every IR input for `batch` rows of `seq` new tokens, cache at max_seq (a sliding
    layer's ring at its R = min(window, max_seq) slots, its mask over the ring and the new rows)."""
    c = m.cache
    max_seq = m.max_seq
    ring = RingSpec.of(m)
    R = ring.length(max_seq) if ring else 0
    shapes: dict[str, Shape] = {}
    for spec in m.inputs:
        name = spec["name"]
        if name in ("input_ids", "position_ids"):
            shapes[name] = (batch, seq)
        elif name == "write_index":
            shapes[name] = (batch,)
        elif name == "attention_mask":
            shapes[name] = (batch, 1, seq, max_seq)  # (B, 1, S, S_max): the explicit bool mask
        elif name == MASK_INPUT and ring:
            shapes[name] = (batch, 1, seq, R + seq)  # (B, 1, S, R+S): the ring, then the new rows
        elif name.startswith("past_key_values."):
            layer = int(name.split(".")[1])
            slots = R if ring and layer in ring.layers else max_seq
            shapes[name] = (batch, c["kv_heads"], slots, c["head_dim"])  # (B, H_kv, S_max or R, D)
        else:
            raise InputError(f"IR input {name!r} is not part of the static-cache contract; rebuild the artifact")
    return shapes


def make_profiles(m: Manifest, *, max_batch: int, max_prefill: int | None = None,
                  opt_prefill: int | None = None) -> list[Profile]:
    """[prefill, decode] profiles; opt is batch 1 (the common single-request case)."""
    if m.raw["ir"]["cache_style"] != "static":
        raise InputError("TensorRT profiles are computed for the static-cache IR only")
    max_seq = m.max_seq
    max_prefill = max_seq if max_prefill is None else max_prefill
    if max_batch < 1:
        raise InputError(f"max_batch must be >= 1 (got {max_batch})")
    if not 1 <= max_prefill <= max_seq:
        raise InputError(f"max_prefill must be within 1..max_seq={max_seq} (got {max_prefill})")
    ring = RingSpec.of(m)
    if ring is not None:  # a ring takes at most its R slots of new rows a step: the runtime cuts longer prefills
        max_prefill = min(max_prefill, ring.length(max_seq))
    opt_prefill = min(max_prefill, 128) if opt_prefill is None else opt_prefill
    if not 1 <= opt_prefill <= max_prefill:
        raise InputError(f"opt_prefill must be within 1..max_prefill={max_prefill} (got {opt_prefill})")

    def profile(name: str, seq: tuple[int, int, int]) -> Profile:
        lo, opt, hi = _input_shapes(m, 1, seq[0]), _input_shapes(m, 1, seq[1]), _input_shapes(m, max_batch, seq[2])
        return Profile(name, {k: (lo[k], opt[k], hi[k]) for k in lo})

    return [profile("prefill", (1, opt_prefill, max_prefill)), profile("decode", (1, 1, 1))]


def pick_profile(profiles: list[Profile], seq: int) -> int:
    """Decode steps (one new token) run on the decode profile, everything else on prefill."""
    return DECODE if seq == 1 and len(profiles) > DECODE else PREFILL


def check_request(profiles: list[Profile], batch: int, seq: int) -> None:
    """A step outside every profile fails here, with the limits, instead of inside TensorRT."""
    p = profiles[pick_profile(profiles, seq)]
    lo, _, hi = p.shapes["input_ids"]
    if not (lo[0] <= batch <= hi[0] and lo[1] <= seq <= hi[1]):
        raise InputError(
            f"a step of batch {batch} x {seq} tokens is outside the engine's {p.name} profile "
            f"(batch {lo[0]}..{hi[0]}, tokens {lo[1]}..{hi[1]}); rebuild with --option max_batch=N "
            "or --option max_prefill=N, or split the prompt"
        )
