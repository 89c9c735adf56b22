"""Huge pages for what a load allocates (kvexport.runtime.hugepages): new, resident memory moves to 2 MiB pages
with its bytes unchanged, an untouched region is left alone, and the cpu engine reports what it did (or that it
was told not to). What the system allows is read from it: a kernel or THP mode that cannot is asserted to say so."""
from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

import kvexport
from kvexport.errors import InputError
from kvexport.runtime import hugepages
from kvexport.runtime.hugepages import anonymous_regions, collapse_new, thp_mode


def _span(array: np.ndarray) -> dict[str, int]:
    """Rss and AnonHugePages (bytes) of the mappings over `array`'s bytes (madvise splits a mapping at the span's
    2 MiB edges, so there may be several)."""
    start, end = array.ctypes.data, array.ctypes.data + array.nbytes
    inside, out = False, {"Rss": 0, "AnonHugePages": 0}
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            inside = lo < end and start < hi
        elif inside and fields[0][:-1] in out:
            out[fields[0][:-1]] += int(fields[1]) * 1024
    return out


def _collapse_works() -> bool:
    return thp_mode() in ("always", "madvise")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc (Linux)")
def test_new_resident_memory_moves_to_huge_pages_with_its_bytes_and_untouched_memory_stays() -> None:
    before = anonymous_regions()
    # plain anonymous mappings, as a runtime's allocator makes them (numpy's own large arrays ask for huge pages
    # themselves, so they would prove nothing): 32 MiB with every page written, as a repacked weight is, and
    # 64 MiB never written, as an arena's spare room
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # (a shared one is /dev/zero, a file)
    written, spare = mmap.mmap(-1, 32 << 20, flags=private), mmap.mmap(-1, 64 << 20, flags=private)
    touched = np.frombuffer(written, dtype=np.int32)
    touched[:] = np.arange(touched.size, dtype=np.int32)
    untouched = np.frombuffer(spare, dtype=np.uint8)
    assert _span(touched)["AnonHugePages"] == 0 or thp_mode() == "always"
    rss_untouched = _span(untouched)["Rss"]
    placed = collapse_new(before)
    assert placed.asked and placed.seconds >= 0
    if not _collapse_works():
        assert placed.huge_bytes == 0 and placed.detail.startswith("not available"), placed
        return
    if "no MADV_COLLAPSE" in placed.detail:  # a kernel older than 6.1: marked only, khugepaged's to move
        pytest.skip(f"this kernel has no MADV_COLLAPSE: {placed.detail}")
    region = _span(touched)
    if region["AnonHugePages"] < 16 << 20 and "kept small pages" in placed.detail:
        pytest.skip(f"the kernel found no free 2 MiB pages for this test's memory: {placed.detail}")
    assert region["AnonHugePages"] >= 16 << 20, (placed, region)  # at least the whole 2 MiB pages inside 32 MiB
    if thp_mode() == "madvise":  # 'always' may have given huge pages at the first write already
        assert placed.huge_bytes >= 16 << 20, placed
    assert np.array_equal(touched, np.arange(touched.size, dtype=np.int32))
    after = _span(untouched)
    assert after["Rss"] <= rss_untouched + (4 << 20), after  # not populated by the collapse
    assert collapse_new(anonymous_regions()).huge_bytes == 0  # nothing new since: nothing moved


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc (Linux)")
def test_memory_the_runtime_placed_itself_counts_as_placed() -> None:
    """kvexport's own kernels ask for huge pages for their packed weights as they allocate them (qmatmul.c): those
    are huge before collapse_new runs, and a count of what it moved alone would call them small pages."""
    if not _collapse_works():
        pytest.skip(f"transparent huge pages are {thp_mode()!r} here")
    before = anonymous_regions()
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    region = mmap.mmap(-1, 32 << 20, flags=private)
    region.madvise(mmap.MADV_HUGEPAGE)  # asked before the first write, as qmatmul.c does
    weights = np.frombuffer(region, dtype=np.int32)
    weights[:] = 7
    already = _span(weights)["AnonHugePages"]
    if already < 16 << 20:
        pytest.skip(f"the kernel gave no huge pages at the first write ({already} bytes)")
    placed = collapse_new(before)
    assert placed.huge_bytes >= already, placed
    assert "with what the runtime placed itself" in placed.detail or thp_mode() == "always", placed


def test_no_proc_or_no_thp_is_said_not_done(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert collapse_new(None).detail.startswith("not available")
    never = tmp_path / "enabled"
    never.write_text("always madvise [never]\n")
    monkeypatch.setattr(hugepages, "THP_ENABLED", never)
    assert thp_mode() == "never"
    placed = collapse_new(set())
    assert placed.huge_bytes == 0 and "'never'" in placed.detail


def test_the_cpu_engine_reports_its_placement_and_takes_the_load_option(default_artifact: Path) -> None:
    """fp32 weights stay in small pages unless asked (quantized ones are placed by default:
    tests/test_cpu_weights.py); the load option turns it on and off; a value that is no boolean is refused."""
    default = kvexport.load(str(default_artifact)).session.describe()["huge_pages"]
    assert default["asked"] is False and default["detail"].startswith("off: the default for fp32 weights")
    on = kvexport.load(str(default_artifact), huge_pages=True).session.describe()["huge_pages"]
    assert on["asked"] is True and on["huge_bytes"] >= 0 and on["detail"]
    if not _collapse_works():
        assert on["detail"].startswith("not available")
    off = kvexport.load(str(default_artifact), huge_pages="false").session.describe()["huge_pages"]
    assert off == {"asked": False, "huge_bytes": 0, "seconds": 0.0, "detail": "off (load option huge_pages=false)"}
    with pytest.raises(InputError, match="huge_pages"):
        kvexport.load(str(default_artifact), huge_pages="sometimes")
