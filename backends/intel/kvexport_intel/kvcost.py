"""What a lossy KV cache (u8, f16) costs, the engine against itself with an f32 cache, and what its
state occupies, measured as process memory (OpenVINO reports its state in f32 whatever it stores)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvexport.errors import InputError
from kvexport_intel.session import IntelSession


def _greedy_logits(session: IntelSession, prompt: np.ndarray, forced: list[int] | None,
                   steps: int) -> tuple[list[int], np.ndarray]:
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
    session.release(state)
    return tokens, np.stack(logits)


def kv_precision_cost(reference: Callable[[], IntelSession], lossy: Callable[[], IntelSession], *,
                      prompt_len: int = 24, steps: int = 32, seed: int = 0) -> dict[str, Any]:
    """Logit agreement lost by the cache precision of the session `lossy()` makes, on one teacher-forced greedy
    run against `reference()`'s. Each session is made when its run starts and dropped after it, so the two
    compiled models (each with its packed weights) are never held at once. The memory the cache saves is not
    in here: OpenVINO does not report its state storage, and a one-row run is too small to see in process
    memory (state_rss_growth measures it on a batch)."""
    from kvexport.verify import compare

    session = reference()
    steps = max(2, min(steps, session.max_seq - prompt_len))
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, min(session.vocab_size, 259), prompt_len).astype(np.int64)
    tokens, ref = _greedy_logits(session, prompt, None, steps)
    del session
    session = lossy()
    _, got = _greedy_logits(session, prompt, tokens, steps)
    return {"kv_precision": session.facts["kv_precision"], "prompt_len": prompt_len, "steps": steps,
            "memory": "not measured here (OpenVINO reports its state in f32 whatever it stores)",
            **compare(ref, got)}


def state_rss_growth(session: IntelSession, *, batch: int = 128, tokens: int = 120) -> dict[str, Any]:
    """Process RSS growth while `batch` rows fill the state one token at a time: what the plugin's
    state buffers occupy (spare capacity included), measured. Run it in a fresh process with one
    session loaded with batch_rows=state (else a batch is paged and the state holds nothing): each
    step's activations are tiny, so the growth is the state's."""
    import psutil

    proc = psutil.Process()
    tokens = min(tokens, session.max_seq)
    ones = np.ones((batch, 1), np.int64)
    warm = session.new_state(batch, 4)  # the first request allocates the kernels' own scratch
    for t in range(4):
        session.step(warm, 5 * ones, t * ones, np.ones((batch, 1, 1, t + 1), bool))
    session.release(warm)
    state = session.new_state(batch, tokens)
    session.step(state, 5 * ones, 0 * ones, np.ones((batch, 1, 1, 1), bool))
    if state.rows is not None:
        session.release(state)
        raise InputError("this session pages a batch's rows, so its state holds nothing to measure: load the "
                         "artifact with batch_rows=state")
    rss0 = proc.memory_info().rss
    for t in range(1, tokens):
        session.step(state, 7 * ones, t * ones, np.ones((batch, 1, 1, t + 1), bool))
    grown = proc.memory_info().rss - rss0
    reported = session.state_bytes(state)
    session.release(state)
    return {"kv_precision": session.facts["kv_precision"], "batch": batch, "tokens": tokens,
            "rss_growth_bytes": grown, "rss_growth_per_token_row": grown / (batch * (tokens - 1)),
            "state_bytes_reported": reported}
