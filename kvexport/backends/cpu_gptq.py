"""GPTQ for the cpu engine's MatMulNBits weights: each (K, N) matrix rounded one row of K at a time, the
rounding error of every row spread over the rows not yet rounded through the inverse of the matrix's
input statistics H = X^T X / n (Frantar et al., "GPTQ", 2022; their "columns" are these rows), so the
layer's output on the calibration text moves less than round-to-nearest moves it. `--option quantizer=gptq`.

The blocks are ONNX Runtime's MatMulNBits format as its own symmetric quantizer (MLAS) writes them:
per block of `block_size` rows of K, scale = (the block's value of largest magnitude) / -2^(bits-1),
stored q = clip(round(w / scale) + 2^(bits-1), 0, 2^bits - 1), no zero points (the kernel's default,
2^(bits-1)); int4 packs two q per byte, the lower K row in the low nibble. With H the identity the
rounding is exactly that quantizer's round-to-nearest (tests/test_cpu_gptq.py holds both to it).

The statistics are taken from the fp32 engine graph itself: every quantized MatMul's input is made a
graph output and the calibration text prefilled through the cpu session, PREFILL_PIECE tokens a
window, each window from position 0; the inputs are kept (tokens x K float32 each: 2048 tokens of a
1B model's 16 layers are ~1.9 GB) and H formed from them one input at a time. Every matrix's H comes
from the fp32 model's activations (not from the layers before it already quantized, as the paper's
sequential variant does): one prefill, and the build's verification judges the result against the
tolerance table either way.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvexport.errors import UnsupportedFeatureError

if TYPE_CHECKING:
    import onnx

    from kvexport.manifest import Manifest

DAMP = 0.01  # added to H's diagonal, times its mean: keeps the Cholesky factor defined (the paper's default)
LAZY_ROWS = 128  # rows rounded before their error reaches the rest of the matrix (one matmul a batch)
COLLECT_TMP = "model.gptq.tmp.onnx"  # beside the optimized graph, so its external-data path resolves


def factor(x: np.ndarray, damp: float = DAMP) -> tuple[Any, Any]:
    """From the (T, K) inputs a matrix saw: (the upper Cholesky factor of the inverse of H = X^T X / T
    plus damp * mean(diag H) on its diagonal, float32 (K, K); the inputs that were always zero, bool (K,))."""
    import torch

    xs = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    h = xs.T @ xs / max(len(x), 1)
    dead = torch.diagonal(h) == 0  # an input that was always zero: its rows of the weight cannot matter
    h[dead, dead] = 1.0
    h += damp * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    # H^-1 = U^T U with U upper: with J the reversal, J H J = L L^T gives H = A A^T for A = J L J (upper), so
    # U = A^-1: one Cholesky and one triangular solve (half the work of inverting H and factoring the inverse)
    a = torch.flip(torch.linalg.cholesky(torch.flip(h, (0, 1))), (0, 1))
    return _upper_inverse(a), dead


def _upper_inverse(a: Any) -> Any:
    """The inverse of the upper triangular `a` by halves: [[A, B], [0, D]]^-1 = [[A^-1, -A^-1 B D^-1], [0, D^-1]],
    so the work is matrix products (a triangular solve against the identity costs 4x as much at K 8192)."""
    import torch

    n = a.shape[0]
    if n <= 512:
        return torch.linalg.solve_triangular(a, torch.eye(n, dtype=a.dtype), upper=True)
    m = n // 2
    top, bottom = _upper_inverse(a[:m, :m]), _upper_inverse(a[m:, m:])
    out = torch.zeros_like(a)
    out[:m, :m], out[m:, m:] = top, bottom
    out[:m, m:] = -(top @ a[:m, m:]) @ bottom
    return out


def blocks(w: np.ndarray, bits: int, block: int, fac: tuple[Any, Any] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits blocks of the (K, N) weight `w` (ONNX MatMul layout: y = x @ w): (packed uint8
    (N, K_blocks, block * bits / 8), scales float32 (N, K_blocks)). `fac`: factor() of the inputs the
    matrix saw; None rounds to nearest. Works on w's rows of K (each one contiguous N outputs)."""
    import torch

    k, n = w.shape
    nblocks = -(-k // block)
    half, top = 2 ** (bits - 1), 2**bits - 1
    wk = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))  # (K, N), updated in place
    q = torch.zeros((nblocks * block, n), dtype=torch.uint8)  # a padded block's tail: 0 bytes, as the quantizer's
    scales = torch.zeros((nblocks, n), dtype=torch.float32)
    u = None
    if fac is not None:
        u, dead = fac
        wk[dead] = 0.0
    lazy = block * max(1, LAZY_ROWS // block)  # a multiple of the block: no block straddles two batches
    s = safe = scales[0]
    for a in range(0, k, lazy):
        b = min(a + lazy, k)
        part = wk[a:b]  # rows a..b, rounded in turn; what is left of them after is not read again
        err = torch.empty((b - a, n), dtype=torch.float32)
        for j in range(b - a):
            row = a + j
            if row % block == 0:  # a new block: its scale from its rows as they stand now
                span = part[j : j + block]
                s = span.gather(0, span.abs().argmax(dim=0, keepdim=True))[0] / -half
                scales[row // block] = s
                safe = torch.where(s == 0, torch.ones_like(s), s)
            qr = torch.where(s == 0, half, torch.clamp(torch.round(part[j] / safe) + half, 0, top))
            q[row] = qr.to(torch.uint8)
            if u is None:
                continue
            e = (part[j] - (qr - half) * s) / u[row, row]
            if j + 1 < b - a:
                part[j + 1 :].addr_(u[row, row + 1 : b], e, alpha=-1.0)
            err[j] = e
        if u is not None and b < k:
            wk[b:].addmm_(u[a:b, b:].T, err, alpha=-1.0)
    qb = q.T.contiguous().numpy().reshape(n, nblocks, block)
    if bits == 4:
        qb = (qb[..., 0::2] | (qb[..., 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(qb), np.ascontiguousarray(scales.T.numpy())


def input_names(model: onnx.ModelProto, weights: Sequence[str]) -> dict[str, str]:
    """The activation input of each MatMul node in `weights` (node name -> tensor name)."""
    wanted = set(weights)
    return {n.name: n.input[0] for n in model.graph.node if n.name in wanted}


def collect(model_path: Path, manifest: Manifest, ids: Sequence[int], threads: int, names: Sequence[str],
            progress: Callable[[str], None]) -> dict[str, np.ndarray]:
    """The values of each tensor in `names` (MatMul inputs of the fp32 graph at model_path, its external
    data beside it) over a prefill of `ids`, PREFILL_PIECE tokens a window: (tokens, K) float32 each."""
    import onnx
    from onnx import TensorProto, helper

    from kvexport.backends.cpu import CpuSession
    from kvexport.backends.cpu_kv import prefill_windows
    from kvexport.runtime.session import PREFILL_PIECE

    graph = onnx.load(str(model_path), load_external_data=False)
    have = {o.name for o in graph.graph.output}
    wanted = list(dict.fromkeys(names))
    graph.graph.output.extend(helper.make_tensor_value_info(t, TensorProto.FLOAT, None) for t in wanted if t not in have)
    staged = model_path.parent / COLLECT_TMP
    seen: dict[str, list[np.ndarray]] = {t: [] for t in wanted}
    t0 = time.perf_counter()

    def bind(state: Any) -> None:  # after logits and the caches: these are the binding's last outputs
        for t in wanted:
            state.binding.bind_output(t, "cpu")

    try:
        onnx.save_model(graph, str(staged))
        session = CpuSession(staged, manifest, threads)
        for state, _ in prefill_windows(session, ids, max(1, min(PREFILL_PIECE, manifest.max_seq)), bind):
            for t, value in zip(wanted, state.binding.get_outputs()[-len(wanted):]):
                seen[t].append(value.numpy().reshape(-1, value.shape()[-1]))
        del session
    finally:
        staged.unlink(missing_ok=True)
    got = {t: np.concatenate(v) for t, v in seen.items()}
    progress(f"gptq: {len(wanted)} matmul inputs over {len(ids)} tokens in {time.perf_counter() - t0:.1f}s")
    return got


def apply(model: onnx.ModelProto, originals: Mapping[str, np.ndarray], inputs: dict[str, str],
          seen: dict[str, np.ndarray], progress: Callable[[str], None]) -> int:
    """Rewrite the blocks and scales of every MatMulNBits node whose source MatMul is in `originals`
    (node name of the MatMul -> its (K, N) fp32 weight) with GPTQ against what its input saw,
    seen[inputs[name]]. The quantizer names a MatMulNBits node after its MatMul plus a suffix; its
    inputs 1 and 2 are the blocks and the scales. Returns how many matrices were rewritten."""
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    factors: dict[str, tuple[Any, Any]] = {}  # one per input tensor: matrices that share an input share it
    left = {t: list(inputs.values()).count(t) for t in set(inputs.values())}  # a (K, K) factor is freed after
    done = 0
    t0 = time.perf_counter()
    named = {f"{m}_Q{b}": m for m in originals for b in (4, 8)}
    for node in model.graph.node:
        source = named.get(node.name) if node.op_type == "MatMulNBits" else None
        if source is None or node.input[0] != inputs[source]:
            continue
        attrs = {a.name: a.i for a in node.attribute}
        tensor = inputs[source]
        if tensor not in factors:
            factors[tensor] = factor(seen[tensor])
        packed, scales = blocks(originals[source], attrs["bits"], attrs["block_size"], factors[tensor])
        left[tensor] -= 1
        if not left[tensor]:  # its last matrix: 256 MB at K 8192
            del factors[tensor], seen[tensor]
        for index, value in ((1, packed), (2, scales)):
            old = inits[node.input[index]]
            old.CopyFrom(numpy_helper.from_array(value.reshape(tuple(old.dims)), old.name))
        done += 1
    if done != len(originals):  # the quantizer's naming is what ties a MatMulNBits node to its source matrix
        raise UnsupportedFeatureError(
            f"gptq found {done} of the {len(originals)} MatMulNBits nodes ONNX Runtime's quantizer made (it names "
            "them after their MatMul with a _Q4/_Q8 suffix): this onnxruntime names them otherwise; build with "
            "--option quantizer=rtn")
    progress(f"gptq: {done} matrices rounded against their inputs in {time.perf_counter() - t0:.1f}s")
    return done


def record(source: str, tokens: int) -> dict[str, Any]:
    """The manifest's words for the method."""
    return {"method": "gptq", "damp": DAMP, "calibration": {"source": source, "tokens": tokens},
            "inputs": "each matmul's input in the fp32 graph's prefill of the calibration text"}
