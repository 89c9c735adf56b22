"""Shared by the scripts under benchmarks/: the mean seconds of one call, after one warm-up call."""
from __future__ import annotations

import time
from collections.abc import Callable


def seconds_per_call(fn: Callable[[], object], n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n
