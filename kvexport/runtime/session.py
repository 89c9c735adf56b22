"""What a backend hands the runtime: one compiled decoder step over a cache it knows how to hold."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np

# Prompt tokens one engine call takes where a session cuts a long prefill into pieces (the cpu target at
# batch 1): each piece attends over the slots held so far plus its own, so the attention scores of a
# prompt of N tokens stop at about N^2/2 + N*PREFILL_PIECE/2 where one call under an explicit mask may
# compute the N x N square, and a piece's scratch holds heads x PREFILL_PIECE x N scores.
# docs/performance.md has the measurements at prompt 4096 (a gain under load, within noise on a quiet machine).
PREFILL_PIECE = 256


def piece_limit(window: int | None) -> int:
    """Most new tokens one call may take: PREFILL_PIECE, or a ring's window where that is smaller."""
    return min(window, PREFILL_PIECE) if window else PREFILL_PIECE


class Session(ABC):
    """A loaded engine. The runtime's Engine drives it; a Session never tokenizes or samples.

    Slot model shared by every backend: a request of `batch` rows is left-padded, so every row
    holds the same number T of cache slots. Each `step` appends S new tokens to every row
    (slots T .. T+S-1, the caller says which slots each new token may see) and returns the
    last token's logits. Sessions must be safe to call from several threads with distinct states.
    """

    max_seq: int
    vocab_size: int

    @abstractmethod
    def new_state(self, batch: int, capacity: int) -> Any:
        """Per-request cache state for `batch` rows; `capacity` is the slots the request will need."""

    @abstractmethod
    def step(self, state: Any, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """input_ids, position_ids: int64 (B, S); attention_mask: bool (B, 1, S, T+S) over the slots
        held after this step. Returns float32 logits (B, vocab) of each row's last new token.
        The returned array may be a view into a buffer the next step overwrites."""

    def release(self, state: Any) -> None:  # noqa: B027 - optional hook
        """Free the state's buffers early (they are also freed when the state is dropped)."""

    def describe(self) -> dict[str, Any]:
        """Facts for `inspect` and `bench` (threads, cache policy, device)."""
        return {}

    def batched_rows(self, rows: int) -> Any:
        """This backend's own cache rows for continuous batching (a kvexport.runtime.rows.Rows that
        decodes every row in one call), or None where it has none for this engine: the scheduler
        then steps one Session state per row."""
        return None

    def lossy_cache_cost(self, progress: Callable[[str], None] | None = None) -> dict[str, Any] | None:
        """What a lossy KV cache costs against the same engine with a lossless one (logit agreement), where the
        backend can compile that twin (the intel target); None otherwise. verify reports it; `progress` hears
        of the work before it starts."""
        return None

    def other_prompt_path(self, min_tokens: int) -> AbstractContextManager[dict[str, Any]] | None:
        """Where a fresh prompt can take one of two paths (the intel target: paged attention from its
        paged_prefill_min, every prompt by default, or the fused attention with state): a context manager under
        which fresh prompts of `min_tokens` take the path they do not take by default, so that verification
        reaches both on a short model. It yields a dict whose "path" says, on exit, which path they took. None
        where every prompt takes the same path."""
        return None

    def batch_row_path(self) -> AbstractContextManager[Any]:
        """A context under which one row's fresh prompt takes the path a batch of rows takes, so that a check
        comparing a row alone with the same row in a batch compares one computation (the intel target pages a lone
        row's prompt and runs a batch's through the fused attention with state; other_prompt_path reaches the two
        apart). A no-op where rows alone and batches share one path."""
        return nullcontext()

    def cache_bytes(self, state: Any) -> int | None:
        """Bytes the state's KV cache occupies now, as read from the buffers or the runtime;
        None where the backend cannot measure it (`not_measured` says why)."""
        return None

    def cache_bytes_copied(self, state: Any) -> int | None:
        """Cache bytes copied so far for this state, counted where the copies happen;
        None where the backend cannot count them (`not_measured` says why)."""
        return None

    def not_measured(self) -> dict[str, str]:
        """Why `cache_bytes` / `cache_bytes_copied` return None here, by method name."""
        return {"cache_bytes": "this backend does not report its cache size",
                "cache_bytes_copied": "this backend does not count cache copies"}
