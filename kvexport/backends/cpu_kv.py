"""The cpu engine's int8 KV cache: per-channel K and V scales calibrated on a sample text, and the
fused GroupQueryAttention nodes switched to ONNX Runtime's quantized cache (kv_cache_bit_width 8).

The kernel stores round(x / scale) clipped to int8 and reads q * scale back, with one scale per
(kv head, channel) of each layer, shape (1, H_kv, 1, D): calibration puts scale = absmax / 127 over
what the fp32 engine writes into its cache while prefilling the sample. The scales are initializers
of the engine graph, so the manifest hashes them with every other engine file.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kvexport.errors import InputError
from kvexport.manifest import Manifest
from kvexport.precision import kv_elements_per_token

QMAX = 127.0  # symmetric int8: the kernel clips to [-128, 127]; absmax maps to 127
MIN_SCALE = 1e-8  # a channel that only ever held zeros: any positive scale stores it exactly
# Calibration prefills up to CALIBRATION_TOKENS tokens of the sample, CALIBRATION_WINDOW at a time:
# scales from a few hundred tokens clip other text (docs/backends/cpu.md has the measurements).
CALIBRATION_TOKENS = 2048
CALIBRATION_WINDOW = 512
CALIBRATION_TMP = "model.calibrate.tmp.onnx"  # beside the IR, so its external-data path resolves
# GroupQueryAttention's inputs by position (com.microsoft, ONNX Runtime 1.31): k_scale and v_scale
# follow attention_bias (10) and head_sink (11)
K_SCALE_INPUT, V_SCALE_INPUT = 12, 13


def calibration_ids(text: str | None, encode: Callable[[str], list[int]] | None, vocab_size: int,
                    fallback: str) -> tuple[str, list[int]]:
    """(source, ids) to calibrate on: the last CALIBRATION_TOKENS tokens of `text` (verify judges a
    held-out text from its start, so its end keeps the judged positions unseen), else of `fallback`,
    else seeded ids when the artifact has no tokenizer."""
    for source, t in (("calibration text (tail)", text), ("built-in sample text", fallback)):
        if t and encode is not None:
            ids = encode(t)
            if len(ids) >= 2:
                return source, ids[-CALIBRATION_TOKENS:]
    lo = 3 if vocab_size > 3 else 0
    rng = np.random.default_rng(0)
    return "seeded ids", [int(i) for i in rng.integers(lo, min(vocab_size, 259), CALIBRATION_WINDOW)]


def channel_scales(cache: np.ndarray, rotary_dim: int = 0) -> np.ndarray:
    """(1, H_kv, 1, D) float32 scales from a filled cache (B, H_kv, S, D): absmax / 127 per channel.

    rotary_dim > 0 (keys after RoPE, rotate-half layout): channels i and i + rotary_dim/2 are one
    rotating pair, and a pair keeps its length at every position while each channel swings between
    +-length. Both get the pair's largest length, so a key at a position the sample never reached
    still fits in the range."""
    x = np.abs(cache.astype(np.float32))
    if rotary_dim:
        half = rotary_dim // 2
        pair = np.sqrt(x[..., :half] ** 2 + x[..., half:rotary_dim] ** 2)  # (B, H_kv, S, rot/2)
        x = x.copy()
        x[..., :half] = pair
        x[..., half:rotary_dim] = pair
    absmax = x.max(axis=(0, 2), keepdims=True)  # (1, H_kv, 1, D)
    return np.maximum(absmax / QMAX, MIN_SCALE).astype(np.float32)


def calibrate(session: Any, manifest: Manifest, ids: list[int], rotary_dim: int,
              window: int) -> dict[str, np.ndarray]:
    """Prefill `ids` through an fp32 CpuSession, `window` tokens at a time (each from position 0).
    Returns each cache input's scale (keys with their RoPE pairs): the largest over every window."""
    kinds = {p["input"]: p["kind"] for p in manifest.cache["pairs"]}
    scales: dict[str, np.ndarray] = {}
    for start in range(0, len(ids), window):
        chunk = ids[start : start + window]
        S = len(chunk)
        state = session.new_state(1, S)
        i = np.arange(S)
        mask = (i[None, :] <= i[:, None])[None, None]  # (1, 1, S, S) causal
        session.step(state, np.asarray([chunk], dtype=np.int64), i[None], mask)
        for (name, _), cache in zip(session.pairs, state.caches):
            got = channel_scales(cache[:, :, :S], rotary_dim if kinds[name] == "key" else 0)  # (1, H_kv, S, D) in
            scales[name] = np.maximum(scales[name], got) if name in scales else got
        session.release(state)
    return scales


def quantize_cache(model: onnx.ModelProto, scales: dict[str, np.ndarray]) -> int:
    """Switch every fused GroupQueryAttention to the int8 cache, with the scales of its past key and
    value inputs; those inputs and the present outputs become int8. Returns how many were switched."""
    g = model.graph
    nodes = [n for n in g.node if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"]
    if 2 * len(nodes) != len(scales) or any(n.input[i] not in scales for n in nodes for i in (3, 4)):
        raise InputError(f"the cpu engine graph fused {len(nodes)} attention layers of {len(scales) // 2}; an int8 "
                         "KV cache needs every layer fused into GroupQueryAttention: build this model with --kv fp32")
    caches: set[str] = set()
    for n in nodes:
        scope = n.name.rsplit("/", 1)[0]
        names = [f"{scope}/kv_int8/k_scale", f"{scope}/kv_int8/v_scale"]
        g.initializer.extend([numpy_helper.from_array(scales[n.input[3]], names[0]),
                              numpy_helper.from_array(scales[n.input[4]], names[1])])
        inputs = list(n.input) + [""] * max(0, V_SCALE_INPUT + 1 - len(n.input))
        inputs[K_SCALE_INPUT], inputs[V_SCALE_INPUT] = names
        del n.input[:]
        n.input.extend(inputs)
        n.attribute.extend([helper.make_attribute("kv_cache_bit_width", 8),
                            helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                            helper.make_attribute("v_quant_type", "PER_CHANNEL")])
        caches.update([n.input[3], n.input[4], n.output[1], n.output[2]])
    for vi in [*g.input, *g.output]:
        if vi.name in caches:
            vi.type.tensor_type.elem_type = TensorProto.INT8
    return len(nodes)


def build_int8_cache(model: onnx.ModelProto, folder: Path, manifest: Manifest, text: str | None, threads: int,
                     progress: Callable[[str], None]) -> dict[str, Any]:
    """Calibrate on the fp32 engine graph `model` (fused, saved beside the IR so its weights resolve),
    then switch it to the int8 cache in place. Returns the manifest's `target.kv` record."""
    from kvexport.backends.cpu import CpuSession
    from kvexport.verify import BUILTIN_TEXT

    encode = None
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        encode = lambda t: list(tok.encode(t, add_special_tokens=True).ids)  # noqa: E731
    cfg = manifest.config
    source, ids = calibration_ids(text, encode, cfg.vocab_size, BUILTIN_TEXT)
    window = min(CALIBRATION_WINDOW, manifest.max_seq)
    progress(f"calibrating int8 KV scales on {len(ids)} tokens ({source}), {window} at a time")
    staged = folder / CALIBRATION_TMP
    try:
        onnx.save_model(model, str(staged))
        session = CpuSession(staged, manifest, threads)
        rotary = cfg.effective_rotary_dim if cfg.position_kind == "rope" else 0
        scales = calibrate(session, manifest, ids, rotary, window)
        del session
    finally:
        staged.unlink(missing_ok=True)
    quantize_cache(model, scales)
    elements = kv_elements_per_token(manifest)
    # bytes_per_token: one byte per element; the scales (one fp32 per channel, shared by every row and
    # position) are a fixed cost beside it, the size of one fp32 token
    return {"dtype": "int8", "bytes_per_token": elements, "fp32_bytes_per_token": elements * 4,
            "scale_bytes": elements * 4, "scales": "per channel (1, H_kv, 1, D) per layer, absmax / 127",
            "calibration": {"source": source, "tokens": len(ids), "window": window}}
