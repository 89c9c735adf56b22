"""bench-125m on the intel target, BENCHMARKS.md protocol: every figure a ratio against HF eager in the same run.

usage: python backends/intel/benchmarks/bench_intel.py WORKDIR [--threads 2] [--precision fp32] [--kv f32,u8]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import kvexport
from kvexport.backends import BuildOptions
from kvexport.bench import format_report, run_bench
from kvexport.build import build
from kvexport.zoo import write_named


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", default=None)
    ap.add_argument("--kv", default="f32", help="comma-separated KV cache precisions to compare (first is the main engine)")
    ap.add_argument("--no-baselines", action="store_true")
    a = ap.parse_args()
    model = a.workdir / "bench-125m"
    if not (model / "config.json").is_file():
        write_named("bench-125m", model)
    art = a.workdir / "bench-125m-intel.kvx"
    if not (art / "manifest.json").is_file():
        build(model, art, target="intel", max_seq=2048,
              options=BuildOptions(precision=a.precision, threads=a.threads), verify=False, progress=print)
    kvs = a.kv.split(",")
    main_engine = kvexport.load(str(art), threads=a.threads, kv_precision=kvs[0],
                                **({"precision": a.precision} if a.precision else {}))
    others = [kvexport.load(str(art), threads=a.threads, kv_precision=k) for k in kvs[1:]]
    print(json.dumps(main_engine.session.describe(), default=str))
    r = run_bench(main_engine, reference=None if a.no_baselines else model, threads=a.threads, others=others,
                  progress=print)
    print(format_report(r))
    (a.workdir / f"bench-intel-{main_engine.session.describe()['precision']}.json").write_text(json.dumps(r, indent=2, default=str))


if __name__ == "__main__":
    main()
