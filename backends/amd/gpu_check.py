"""On a machine with a GPU (ROCm, or any CUDA GPU: same torch.cuda API): build, verify and time the amd target.

    python backends/amd/gpu_check.py [--out amd_gpu_check.json] [--models default,bench-125m]

For each model it runs `kvexport build --target amd` for the GPU (bf16 where supported, else fp16;
verification against the transformers fp32 reference included), then, batch 1, 64 greedy tokens,
prompts of 32 and 512 tokens (docs/benchmarks.md), decodes through the Engine twice on the same GPU:
with the decode step captured once as a HIP/CUDA graph and replayed per token, and with direct
calls of the AOTInductor runner. It records decode tok/s of both (their ratio is the launch
overhead the graph removes), time to first token, whether the two token streams agree, and that
one capture served every decode step. Built to finish well under 10 minutes on one datacenter GPU
(bench-125m is skipped once 6 minutes have gone); without a GPU it exits with code 3 and says why.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NEW_TOKENS = 64
PROMPTS = (32, 512)
BUDGET_S = 360  # start no new model after this: the whole check must fit a 10-minute slot


def _prompt(n: int, seed: int) -> list[int]:
    import numpy as np

    return [1, *np.random.default_rng(seed).integers(3, 259, n - 1).tolist()]


def decode_run(engine: Any, ids: list[int]) -> dict[str, Any]:
    """TTFT and decode tok/s through the Engine (its Python overhead included), best of two runs."""
    import numpy as np
    import torch

    best: dict[str, Any] = {}
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        batch = engine.prefill(ids, NEW_TOKENS)
        tok = int(batch.logits[0].argmax())
        t1 = time.perf_counter()
        tokens = [tok]
        for _ in range(NEW_TOKENS - 1):
            tok = int(engine.decode(batch, np.array([tok]))[0].argmax())
            tokens.append(tok)
        t2 = time.perf_counter()
        state = batch.state
        run = {"ttft_s": t1 - t0, "decode_tok_s": (NEW_TOKENS - 1) / (t2 - t1), "tokens": tokens,
               "captures": state.captures, "replays": state.replays}
        engine.session.release(state)
        if not best or run["decode_tok_s"] > best["decode_tok_s"]:
            best = run
    return best


def check_model(name: str, work: Path, say: Any, weights: str | None = None) -> dict[str, Any]:
    import kvexport
    from kvexport.backends import BuildOptions
    from kvexport.build import build
    from kvexport.zoo import write_named

    ckpt = work / name
    if not ckpt.exists():
        write_named(name, ckpt, seed=0)
    max_seq = 1024 if name == "bench-125m" else None
    t0 = time.perf_counter()
    art = build(ckpt, work / f"{name}-{weights or 'default'}-amd.kvx", target="amd", max_seq=max_seq,
                options=BuildOptions(weights=weights, max_batch=4, extra={"device": "gpu"}), verify=True,
                progress=say)
    result: dict[str, Any] = {"build_and_verify_s": round(time.perf_counter() - t0, 1)}
    m = json.loads((art / "manifest.json").read_text())
    result.update(target=m["target"], verification=m["verification"])
    graphed = kvexport.load(art)  # graphs on by default on a GPU
    direct = kvexport.load(art, graphs=False)
    for n in PROMPTS:
        if n + NEW_TOKENS > graphed.max_seq:
            continue
        ids = _prompt(n, seed=n)
        g, d = decode_run(graphed, ids), decode_run(direct, ids)
        result[f"prompt_{n}"] = {
            "graph": {k: v for k, v in g.items() if k != "tokens"},
            "direct": {k: v for k, v in d.items() if k != "tokens"},
            "graph_over_direct_decode": g["decode_tok_s"] / d["decode_tok_s"],
            "tokens_agree": g["tokens"] == d["tokens"],
            "one_capture_per_request": g["captures"] == 1 and g["replays"] == NEW_TOKENS - 1,
        }
        say(f"{name} prompt {n}: graph {g['decode_tok_s']:.0f} tok/s, direct {d['decode_tok_s']:.0f} tok/s, "
            f"agree={g['tokens'] == d['tokens']}")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("amd_gpu_check.json"))
    p.add_argument("--models", default="default,bench-125m")
    p.add_argument("--weights", default="default,int8,int4",
                   help="weight modes to build each model in (default: the target's own; int4 at group 32)")
    args = p.parse_args(argv)
    start = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)

    from kvexport_amd import AmdBackend
    from kvexport_amd import device as dv

    doctor = AmdBackend().doctor()
    say(f"doctor: {doctor}")
    if not dv.gpu_present():
        print(f"amd gpu_check needs a GPU: {dv.no_gpu_reason()}", file=sys.stderr)
        return 3
    report: dict[str, Any] = {"doctor": doctor, "models": {}}
    with tempfile.TemporaryDirectory(prefix="kvx-amd-gpu-") as tmp:
        runs = [(m, w) for m in args.models.split(",") if m for w in args.weights.split(",") if w]
        for name, weights in runs:
            key = name if weights == "default" else f"{name}:{weights}"
            if time.perf_counter() - start > BUDGET_S:
                report["models"][key] = {"skipped": f"time budget ({BUDGET_S}s) spent before it started"}
                continue
            try:
                report["models"][key] = check_model(name, Path(tmp), say, None if weights == "default" else weights)
            except Exception as e:  # noqa: BLE001 - one model's failure is recorded, the others still run
                report["models"][key] = {"error": f"{type(e).__name__}: {e}"}
                say(f"{key} failed: {type(e).__name__}: {e}")
    report["total_s"] = round(time.perf_counter() - start, 1)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    say(f"wrote {args.out}")
    ok = all("error" not in r for r in report["models"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
