"""Huge pages for the memory a runtime allocates while it loads an engine.

A decode step at batch 1 streams every weight once. ONNX Runtime repacks each MatMulNBits (and fp32 MatMul)
weight into buffers of its own when a session is made, and Linux maps anonymous memory in 4 KiB pages unless
the process asks for more (transparent huge pages in `madvise` mode, the common default): streaming 0.8 GB of
int4 weights a token then walks ~200,000 page-table entries, and inside a virtual machine each walk is a
two-level one. `collapse_new` asks the kernel to back the loaded engine's new anonymous memory with 2 MiB pages
(`madvise` MADV_HUGEPAGE, then MADV_COLLAPSE, Linux 6.1 and newer, which does it at once instead of leaving it
to khugepaged's slow scan). It touches only memory mapped during the load, and of that only the 2 MiB stretches
whose small pages are almost all present (so no sparse arena is inflated); it changes no byte and reports what it
did. Where the system cannot (no /proc, THP `never`, an older kernel) it says why, and the engine runs as before.
Measured on bench-1b int4, AMD EPYC Zen 4 under KVM: docs/backends/cpu.md ("Huge pages")."""
from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25  # Linux 6.1
HUGE = 1 << 21  # x86-64 and arm64 (4 KiB base pages): a PMD maps 2 MiB
MIN_RESIDENT = 0.9  # a 2 MiB page whose small pages are mostly untouched stays as it is: collapsing would populate it

Regions = set[tuple[int, int]]  # (start, end) of each anonymous mapping


@dataclass(frozen=True)
class Placement:
    """What collapse_new did: bytes of the new memory now in huge pages (moved by it, or asked for by the runtime
    itself), the time it took, and in words."""

    huge_bytes: int
    seconds: float
    detail: str
    asked: bool = True  # False: the load option huge_pages=false

    def record(self) -> dict[str, object]:
        return {"asked": self.asked, "huge_bytes": self.huge_bytes, "seconds": round(self.seconds, 3),
                "detail": self.detail}


def thp_mode() -> str | None:
    """The system's transparent-huge-page mode (always, madvise, never), None where it has none."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def anonymous_regions() -> Regions | None:
    """This process's anonymous mappings (no file behind them, or the brk heap) as (start, end); None where
    /proc/self/maps cannot be read (not Linux)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    out: Regions = set()
    for line in lines:
        fields = line.split()
        anonymous = len(fields) == 5 or (len(fields) == 6 and fields[5] == "[heap]")
        if anonymous and fields[1].startswith("rw"):  # not a PROT_NONE reservation, not code
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.add((lo, hi))
    return out


def anon_huge_bytes() -> int:
    """AnonHugePages of this process (/proc/self/smaps_rollup), 0 where it cannot be read."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _huge_in(spans: list[tuple[int, int]]) -> int | None:
    """AnonHugePages of the mappings that hold `spans` ((start, length)), from /proc/self/smaps; None where it cannot
    be read. Memory a runtime asked huge pages for itself (kvexport's own kernels' packed weights) is huge before
    collapse_new runs, so the growth of AnonHugePages alone undercounts what the load holds in huge pages."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    total, inside = 0, False
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = any(start < hi and lo < start + length for start, length in spans)
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


def _minus(lo: int, hi: int, before: Regions) -> list[tuple[int, int]]:
    """The parts of [lo, hi) that no region in `before` covered."""
    parts = [(lo, hi)]
    for b_lo, b_hi in before:
        if b_lo >= hi or b_hi <= lo:
            continue
        parts = [piece for p_lo, p_hi in parts
                 for piece in ((p_lo, min(p_hi, b_lo)), (max(p_lo, b_hi), p_hi)) if piece[1] > piece[0]]
    return parts


def _resident_spans(pagemap: BinaryIO, start: int, end: int) -> list[tuple[int, int]]:
    """(start, length) runs of the 2 MiB pages in [start, end) whose small pages are at least MIN_RESIDENT present
    (pagemap's bit 63): mappings next to one another merge, so a region's own resident share says too little.
    Read 1 GiB of address space at a time (2 MiB of pagemap), however large the mapping."""
    per = HUGE // 4096
    full: list[bool] = []
    for chunk in range(start, end, 1 << 30):
        stop = min(chunk + (1 << 30), end)
        pagemap.seek(chunk // 4096 * 8)
        raw = pagemap.read((stop - chunk) // 4096 * 8)
        present = (np.frombuffer(raw, dtype=np.uint64) >> np.uint64(63)).astype(bool).reshape(-1, per)
        full += list(present.mean(axis=1) >= MIN_RESIDENT)
    runs, at = [], None
    for i, ok in enumerate([*full, False]):
        if ok and at is None:
            at = i
        elif not ok and at is not None:
            runs.append((start + at * HUGE, (i - at) * HUGE))
            at = None
    return runs


def _madvise() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def collapse_new(before: Regions | None) -> Placement:
    """Back the anonymous memory mapped since `before` (anonymous_regions() taken before the load) with huge pages:
    every 2 MiB-aligned stretch of it whose small pages are at least MIN_RESIDENT present."""
    t0 = time.perf_counter()
    mode = thp_mode()
    if before is None or mode is None:
        return Placement(0, 0.0, "not available: this system has no transparent huge pages (/proc or sysfs)")
    if mode == "never":
        return Placement(0, 0.0, f"not available: transparent huge pages are 'never' ({THP_ENABLED})")
    if os.sysconf("SC_PAGE_SIZE") != 4096:
        return Placement(0, 0.0, "not available: huge pages here are placed for 4 KiB base pages only")
    after = anonymous_regions() or set()
    spans: list[tuple[int, int]] = []
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
            for lo, hi in after:
                if (lo, hi) in before:
                    continue
                for new_lo, new_hi in _minus(lo, hi, before):  # a region that grew (the heap, a merge): its new part
                    spans += _resident_spans(pagemap, -(-new_lo // HUGE) * HUGE, new_hi // HUGE * HUGE)
    except OSError as e:
        return Placement(0, time.perf_counter() - t0, f"not available: /proc/self/pagemap could not be read ({e})")
    if not spans:
        return Placement(0, time.perf_counter() - t0, "nothing to place: no new region spans a whole huge page")
    madvise = _madvise()
    had = anon_huge_bytes()
    failed, errors, collapse = 0, set(), True
    for start, length in spans:
        madvise(start, length, MADV_HUGEPAGE)
        if collapse and madvise(start, length, MADV_COLLAPSE) != 0:
            err = ctypes.get_errno()
            if err == 22:  # EINVAL: a kernel older than 6.1 has no MADV_COLLAPSE
                collapse = False
            else:  # EAGAIN / ENOMEM: no free 2 MiB page for part of the span; it stays in small pages
                failed += 1
                errors.add(os.strerror(err))
    moved = max(anon_huge_bytes() - had, 0)
    total = sum(length for _, length in spans)
    held = _huge_in(spans)
    huge = moved if held is None else min(max(held, moved), total)
    if not collapse:
        detail = (f"{total / 2**20:.0f} MiB marked MADV_HUGEPAGE; this kernel has no MADV_COLLAPSE (Linux 6.1), so "
                  "khugepaged moves them in its own time")
    else:
        detail = f"{moved / 2**20:.0f} MiB of {total / 2**20:.0f} MiB moved to huge pages (MADV_COLLAPSE)"
        if huge > moved:
            detail += f", {huge / 2**20:.0f} MiB in huge pages with what the runtime placed itself"
        if mode == "always" and held is None:
            detail += "; THP is 'always' here, so pages already huge at the load are not counted"
        if failed:
            detail += f"; {failed} of {len(spans)} spans kept small pages ({', '.join(sorted(errors))})"
    return Placement(huge, time.perf_counter() - t0, detail)
