"""Same-run decode speed of a target with sliding-window layers on rings against the same checkpoint built with
`--option ring_cache=false` (every layer full length, on the target's fused attention: OpenVINO's
attention-with-state node on `intel`, GroupQueryAttention on `cpu`): bench-125m's shape as a mistral with
window 512, seeded random, fp32, 2 threads. Interleaved rounds of greedy decode steps per prompt length;
prints each round, the cache bytes the session holds and the median per-round speed ratio ring / full.
On intel the engine loaded second measured faster in the same process (ring / full 0.82x loaded full first,
0.67x ring first), so run both `--load-order`s and report both.

    python benchmarks/ring_speed.py [--target intel|cpu] [--workdir DIR] [--rounds 3] [--steps 64] [--prompts 32,1536]
                                    [--load-order ring,full|full,ring]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

import kvexport
from kvexport.backends import BuildOptions
from kvexport.build import build
from kvexport.zoo import BENCH_125M, write_checkpoint

CONFIG = {**BENCH_125M, "model_type": "mistral", "sliding_window": 512, "max_position_embeddings": 4096}


def decode_seconds(engine: kvexport.runtime.engine.Engine, prompt: list[int], steps: int) -> tuple[float, int]:
    """Mean seconds of one greedy decode step after prefilling `prompt`, and the cache bytes at the end."""
    b = engine.prefill(prompt, steps)
    tok = b.logits.argmax(-1)
    t0 = time.perf_counter()
    for _ in range(steps - 1):
        tok = engine.decode(b, tok).argmax(-1)
    dt = (time.perf_counter() - t0) / (steps - 1)
    held = engine.session.cache_bytes(b.state)
    engine.session.release(b.state)
    return dt, held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=("intel", "cpu"), default="intel")
    ap.add_argument("--workdir", type=Path, default=Path("out/ring-speed"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompts", default="32,1536")
    ap.add_argument("--load-order", default="ring,full", choices=("ring,full", "full,ring"))
    a = ap.parse_args()
    ckpt = write_checkpoint(CONFIG, a.workdir / "bench-mistral", seed=0)
    engines = {}
    for name in a.load_order.split(","):
        ring = "true" if name == "ring" else "false"
        out = a.workdir / f"bench-mistral-{a.target}-{name}.kvx"
        if not out.exists():
            build(ckpt, out, target=a.target, max_seq=2048, verify=False,
                  options=BuildOptions(weights="fp32", extra={"ring_cache": ring}))
        engines[name] = kvexport.load(str(out), threads=2, **({"precision": "fp32"} if a.target == "intel" else {}))
    rng = np.random.default_rng(0)
    for n in (int(p) for p in a.prompts.split(",")):
        prompt = [int(x) for x in rng.integers(3, CONFIG["vocab_size"] - 1, n)]
        for e in engines.values():
            decode_seconds(e, prompt, 8)  # warm-up
        ratios = []
        for r in range(a.rounds):
            t = {}
            for name, e in engines.items():
                t[name], held = decode_seconds(e, prompt, a.steps)
                print(f"prompt {n} round {r} {name}: {1 / t[name]:.1f} tok/s, cache {held} bytes", flush=True)
            ratios.append(t["full"] / t["ring"])
        print(f"prompt {n}: ring speed / full speed, median of rounds {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f}); load average {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
