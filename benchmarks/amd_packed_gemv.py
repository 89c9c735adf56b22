"""Same-run GEMV timings (batch 1, 2 threads) of the packed CPU kernels the amd target's int8/int4 builds call,
against fp32 F.linear, over bench-1b's MLP shapes; prints the best round and the median per-round ratio.

    python benchmarks/amd_packed_gemv.py [--rounds 7] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from timing import seconds_per_call  # benchmarks/timing.py, beside this script

SHAPES = [(8192, 2048), (2048, 8192)]  # (N, K): bench-1b's gate/up and down projections


def kernels(n: int, k: int) -> dict[str, Callable[[], object]]:
    w, x = torch.randn(n, k), torch.randn(1, k)
    xb = x.to(torch.bfloat16)
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s8 = torch.rand(n, dtype=torch.bfloat16)
    q4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
    sz = torch.rand(k // 32, n, 2, dtype=torch.bfloat16)
    return {
        "fp32 F.linear": lambda: F.linear(x, w),
        "int8, bf16 activations": lambda: torch.ops.aten._weight_int8pack_mm(xb, q8, s8),
        "int4 g32, bf16 activations": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, q4, 32, sz),
        "int8, fp32 activations": lambda: torch.ops.aten._weight_int8pack_mm(x, q8, s8.float()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    per_shape = [kernels(n, k) for n, k in SHAPES]
    names = list(per_shape[0])
    rounds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):  # systems interleaved in rounds
        for name in names:
            reps = 3 if "fp32 activations" in name else 20  # that path is a slow loop
            rounds[name].append(sum(seconds_per_call(ks[name], reps) for ks in per_shape))
    base = rounds[names[0]]
    for name in names:
        ratio = statistics.median(b / t for b, t in zip(base, rounds[name]))
        print(f"{name:28s} best {min(rounds[name]) * 1e3:8.2f} ms   median ratio vs fp32 {ratio:.2f}x")


if __name__ == "__main__":
    main()
