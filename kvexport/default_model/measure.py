"""Measure the embedded default model: held-out perplexity through transformers and a built engine.

    python -m kvexport.default_model.measure [--window 512] [--target cpu] [--bytes N]

Per-byte perplexity over heldout.txt, in non-overlapping windows of `--window` tokens: each
window's first byte is context only, every later byte is predicted (teacher-forced). The engine
side runs prefill(1 token) then one decode step per byte, the way generation uses the cache.
"""
from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvexport.zoo import DEFAULT_MODEL_DIR, HELDOUT_FILE


def heldout_ids(folder: str | Path = DEFAULT_MODEL_DIR, n_bytes: int | None = None) -> np.ndarray:
    data = (Path(folder) / HELDOUT_FILE).read_bytes()[:n_bytes]
    return np.frombuffer(data, dtype=np.uint8).astype(np.int64) + 3


def _nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """Summed negative log-likelihood of targets under logits (T, V), in float64."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return float(-logp[np.arange(len(targets)), targets].sum())


def perplexity(window_logits: Callable[[np.ndarray], np.ndarray], ids: np.ndarray, window: int) -> float:
    """exp(mean NLL per predicted byte); window_logits(ids (n,)) -> logits (n, V) for one window."""
    nll, n = 0.0, 0
    for s in range(0, len(ids), window):
        chunk = ids[s: s + window]
        if len(chunk) < 2:
            break
        nll += _nll(window_logits(chunk)[:-1], chunk[1:])
        n += len(chunk) - 1
    return math.exp(nll / n)


def hf_window_logits(model_dir: str | Path = DEFAULT_MODEL_DIR) -> Callable[[np.ndarray], np.ndarray]:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                          attn_implementation="eager").eval()

    def run(chunk: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return model(torch.from_numpy(chunk)[None]).logits[0].numpy()

    return run


def engine_window_logits(engine) -> Callable[[np.ndarray], np.ndarray]:  # noqa: ANN001 - kvexport.Engine
    def run(chunk: np.ndarray) -> np.ndarray:
        batch = engine.prefill([int(chunk[0])], max_new_tokens=len(chunk) - 1)
        out = [np.array(batch.logits[0], copy=True)]
        for t in chunk[1:-1]:
            out.append(np.array(engine.decode(batch, np.array([t], dtype=np.int64))[0], copy=True))
        out.append(out[-1])  # the last position's prediction is not scored
        return np.stack(out)

    return run


def main(argv: list[str] | None = None) -> int:
    import kvexport
    from kvexport.build import build

    ap = argparse.ArgumentParser(prog="python -m kvexport.default_model.measure", description=__doc__.split("\n")[0])
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--target", default="cpu")
    ap.add_argument("--bytes", type=int, default=None, help="measure on the first N bytes only")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    ids = heldout_ids(n_bytes=a.bytes)
    t0 = time.perf_counter()
    ppl_hf = perplexity(hf_window_logits(), ids, a.window)
    print(f"transformers: per-byte perplexity {ppl_hf:.4f} over {len(ids)} bytes ({time.perf_counter() - t0:.0f}s)")
    with tempfile.TemporaryDirectory() as tmp:
        art = build(None, Path(tmp) / "default.kvx", target=a.target, max_seq=max(a.window, 256), verify=False)
        engine = kvexport.load(art, threads=a.threads)
        t0 = time.perf_counter()
        ppl_e = perplexity(engine_window_logits(engine), ids, a.window)
        print(f"{a.target} engine: per-byte perplexity {ppl_e:.4f} ({time.perf_counter() - t0:.0f}s)")
        g = engine.generate("def ", max_new_tokens=64)
        print(f"generate('def ', 64 greedy): {g.text!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
