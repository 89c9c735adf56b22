"""What a lossy KV cache (u8, f16) saves and costs: the engine against itself with an f32 cache."""
from __future__ import annotations

from typing import Any

import numpy as np

from kvexport_intel.session import IntelSession


def _greedy_logits(session: IntelSession, prompt: np.ndarray, forced: list[int] | None, steps: int) -> tuple[list[int], np.ndarray, int]:
    """Prefill + steps-1 decodes; greedy, or teacher-forced on `forced` so two caches see the same tokens."""
    S = prompt.shape[0]
    state = session.new_state(1, S + steps)
    i = np.arange(S)
    mask = (i[None, :] <= i[:, None])[None, None]  # (1, 1, S, S) causal
    logits = [session.step(state, prompt[None], i[None], mask)[0].copy()]
    tokens: list[int] = []
    for k in range(steps - 1):
        tok = forced[k] if forced is not None else int(logits[-1].argmax())
        tokens.append(tok)
        T = state.slots
        logits.append(session.step(state, np.array([[tok]]), np.array([[T]]), np.ones((1, 1, 1, T + 1), bool))[0].copy())
    nbytes = session.cache_bytes(state)
    session.release(state)
    return tokens, np.stack(logits), nbytes


def kv_precision_cost(reference: IntelSession, lossy: IntelSession, *, prompt_len: int = 24, steps: int = 32,
                      seed: int = 0) -> dict[str, Any]:
    """Cache bytes saved and logit agreement lost by `lossy`'s cache precision, on one greedy run."""
    from kvexport.verify import compare

    steps = max(2, min(steps, reference.max_seq - prompt_len))
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, min(reference.vocab_size, 259), prompt_len).astype(np.int64)
    tokens, ref, ref_bytes = _greedy_logits(reference, prompt, None, steps)
    _, got, lossy_bytes = _greedy_logits(lossy, prompt, tokens, steps)
    return {"kv_precision": lossy.facts["kv_precision"], "cache_bytes_f32": ref_bytes, "cache_bytes": lossy_bytes,
            "memory_saving": ref_bytes / lossy_bytes, "prompt_len": prompt_len, "steps": steps,
            **compare(ref, got)}
