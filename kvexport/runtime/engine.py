"""The Engine: tokenizer + sampling + the cache's slot bookkeeping over any backend's Session."""
from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from kvexport.artifact import open_artifact
from kvexport.errors import ArtifactError, ContextOverflowError, InputError
from kvexport.manifest import Manifest
from kvexport.runtime.ring import RingSpec
from kvexport.runtime.sampling import SamplingParams, sample
from kvexport.runtime.session import Session

Prompt = str | Sequence[int] | np.ndarray
FinishReason = Literal["stop", "length"]


@dataclass
class Generation:
    """One row's result: generated ids (prompt excluded) and their text."""

    token_ids: list[int]
    text: str | None
    prompt_ids: list[int]
    finish_reason: FinishReason


@dataclass
class StreamEvent:
    token_id: int
    text: str  # the text this token completed (may be "" while a UTF-8 sequence is incomplete)
    index: int


@dataclass
class Batch:
    """A live request: left-padded rows, one Session state, the slots held so far (lower-level API)."""

    prompts: list[list[int]]
    state: Any
    pad: np.ndarray  # (B,) left padding per row
    valid: np.ndarray  # (B, max_slots) bool: slot holds a real token of that row
    slots: int = 0  # T: slots held by every row
    logits: np.ndarray | None = None  # (B, V) after the last step: the caller's own array unless copy=False

    @property
    def batch_size(self) -> int:
        return len(self.prompts)


@dataclass
class _Tokenizer:
    tok: Any

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=True))


class Engine:
    """Generates text from an artifact's engine. Safe to share between threads: each call owns
    its own cache state; the Session underneath is the only shared object."""

    def __init__(self, folder: Path, manifest: Manifest, session: Session):
        self.folder, self.manifest, self.session = folder, manifest, session
        self.config = manifest.config
        self.max_seq = manifest.max_seq
        ring = RingSpec.of(manifest)
        # how many slots a request may hold: max_seq, or the model's positions where every layer slides on a ring
        self.limit = ring.limit(self.max_seq) if ring is not None else self.max_seq
        self.vocab_size = self.config.vocab_size
        self.eos_ids = tuple(manifest.raw["tokenizer"]["eos_token_ids"])
        self.tokenizer = self._load_tokenizer()

    def _load_tokenizer(self) -> _Tokenizer | None:
        path = self.folder / "tokenizer.json"
        if "tokenizer.json" not in self.manifest.raw["tokenizer"]["files"] or not path.is_file():
            return None
        from tokenizers import Tokenizer

        return _Tokenizer(Tokenizer.from_file(str(path)))

    # --- text <-> ids -------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InputError("this artifact has no tokenizer.json; pass token ids instead of text")
        return self.tokenizer.encode(text)

    def decode_text(self, ids: Sequence[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids)

    def _as_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        else:
            arr = np.asarray(prompt)
            if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
                raise InputError(
                    f"token ids must be a 1-D sequence of integers, got dtype {arr.dtype} and shape {arr.shape}; "
                    "pass text or a list of ints"
                )
            ids = [int(i) for i in arr]
        if not ids:
            raise InputError("the prompt is empty; pass at least one token")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InputError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return ids

    # --- lower level: prefill / decode -------------------------------------------------------
    def check_fits(self, longest_prompt: int, max_new_tokens: int) -> None:
        need = longest_prompt + max_new_tokens
        if need > self.limit:
            raise ContextOverflowError(
                f"the request needs {need} cache slots (prompt {longest_prompt} + max_new_tokens {max_new_tokens}) "
                + (f"but this engine holds at most max_seq={self.max_seq}; shorten the prompt, lower max_new_tokens, "
                   "or rebuild with a larger --max-seq" if self.limit == self.max_seq else
                   f"but every layer of this model slides on a ring and its positions end at {self.limit} "
                   "(max_position_embeddings); shorten the prompt or lower max_new_tokens")
            )

    def prefill(self, prompts: Prompt | Sequence[Prompt], max_new_tokens: int = 0, *, copy: bool = True) -> Batch:
        """Run the prompt(s) through the engine; returns a Batch whose .logits (B, V) are each row's last.

        The logits are the caller's own array. copy=False returns a view of the engine's output
        buffer instead (no copy), which the next step on this batch overwrites: use it only to
        consume the logits before the next call."""
        if max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0 (the cache slots kept for decoding), got {max_new_tokens}")
        rows = self._rows(prompts)
        S = max(len(r) for r in rows)
        self.check_fits(S, max_new_tokens)
        B = len(rows)
        pad = np.array([S - len(r) for r in rows], dtype=np.int64)
        ids = np.zeros((B, S), dtype=np.int64)
        for b, r in enumerate(rows):
            ids[b, pad[b]:] = r
        pos, mask = left_padded(pad, S)
        valid = np.zeros((B, S + max_new_tokens), dtype=bool)
        valid[:, :S] = np.arange(S)[None, :] >= pad[:, None]
        state = self.session.new_state(B, S + max(max_new_tokens, 1))
        batch = Batch(rows, state, pad, valid, 0, None)
        logits = self.session.step(state, ids, pos, mask[:, None])
        batch.logits = logits.copy() if copy else logits
        batch.slots = S
        return batch

    def decode(self, batch: Batch, tokens: np.ndarray, *, copy: bool = True) -> np.ndarray:
        """Append one token per row; returns the (B, V) logits for the next position (also in batch.logits).

        The logits are the caller's own array (a copy of B x V floats). copy=False returns a view
        of the engine's output buffer instead, which the next step overwrites."""
        T = batch.slots
        if T + 1 > self.limit:
            raise ContextOverflowError(f"the cache is full ({self.limit} slots); no slot left for another token")
        if T + 1 > batch.valid.shape[1]:
            grown = np.zeros((batch.batch_size, max(2 * batch.valid.shape[1], T + 1)), dtype=bool)
            grown[:, : batch.valid.shape[1]] = batch.valid
            batch.valid = grown
        batch.valid[:, T] = True
        mask = batch.valid[:, None, None, : T + 1].copy()  # (B, 1, 1, T+1)
        ids = np.asarray(tokens, dtype=np.int64).reshape(batch.batch_size, 1)
        pos = (T - batch.pad).reshape(-1, 1)
        logits = self.session.step(batch.state, ids, pos, mask)
        batch.logits = logits.copy() if copy else logits
        batch.slots = T + 1
        return batch.logits

    def _rows(self, prompts: Prompt | Sequence[Prompt]) -> list[list[int]]:
        if isinstance(prompts, str) or (isinstance(prompts, np.ndarray) and prompts.ndim == 1):
            return [self._as_ids(prompts)]
        if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
            return [self._as_ids(r) for r in prompts]
        seq = list(prompts)  # type: ignore[arg-type]
        if not seq:
            raise InputError("no prompt given")
        if all(isinstance(x, int | np.integer) for x in seq):
            return [self._as_ids(seq)]
        return [self._as_ids(p) for p in seq]

    # --- generation ------------------------------------------------------------------------------
    def _steps(self, prompts: Prompt | Sequence[Prompt], max_new_tokens: int, params: SamplingParams,
               stop: Sequence[int | str]) -> Iterator[tuple[Batch, np.ndarray, np.ndarray]]:
        """Yields (batch, tokens (B,), live-before-this-token (B,)) for every generated position."""
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        stop_ids = {s for s in stop if isinstance(s, int)} | set(self.eos_ids)
        rng = np.random.default_rng(params.seed)
        batch = self.prefill(prompts, max_new_tokens, copy=False)  # sampled at once, before the next step
        try:
            live = np.ones(batch.batch_size, dtype=bool)
            for step in range(max_new_tokens):
                assert batch.logits is not None
                tokens = sample(batch.logits, params, rng)
                yield batch, tokens, live.copy()
                live &= ~np.isin(tokens, list(stop_ids))
                if not live.any() or step == max_new_tokens - 1:
                    break
                self.decode(batch, tokens, copy=False)
        finally:
            self.session.release(batch.state)

    def generate(
        self,
        prompt: Prompt | Sequence[Prompt],
        max_new_tokens: int = 32,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[int | str] = (),
    ) -> Generation | list[Generation]:
        """Generate for one prompt (returns a Generation) or a batch (returns a list).

        A prompt is text or token ids. `stop` holds token ids and/or strings; the model's EOS
        ids always stop. Greedy unless temperature > 0.
        """
        params = SamplingParams(temperature, top_k, top_p, seed)
        single = isinstance(prompt, str) or _is_id_list(prompt)
        stop_strs = [s for s in stop if isinstance(s, str)]
        out: list[list[int]] = []
        reasons: list[FinishReason] = []
        rows: list[list[int]] = []
        for batch, tokens, live in self._steps(prompt, max_new_tokens, params, stop):
            if not out:
                rows = batch.prompts
                out = [[] for _ in rows]
                reasons = ["length"] * len(rows)
            for b, t in enumerate(tokens):
                if live[b] and reasons[b] == "length":
                    out[b].append(int(t))
                    if int(t) in self.eos_ids or int(t) in stop or self._hit_stop_string(out[b], stop_strs):
                        reasons[b] = "stop"
        gens = []
        for b, ids in enumerate(out):
            text = self.decode_text(ids)
            if text is not None:
                for s in stop_strs:
                    if s in text:
                        text = text[: text.index(s)]
            gens.append(Generation(ids, text, rows[b], reasons[b]))
        return gens[0] if single else gens

    def _hit_stop_string(self, ids: list[int], stop_strs: list[str]) -> bool:
        if not stop_strs or self.tokenizer is None:
            return False
        text = self.tokenizer.decode(ids[-64:])
        return any(s in text for s in stop_strs)

    def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int = 32,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[int | str] = (),
    ) -> Iterator[StreamEvent]:
        """Yield tokens and their text as they are generated (one prompt)."""
        if not (isinstance(prompt, str) or _is_id_list(prompt)):
            raise InputError("stream takes one prompt; use generate for batches")
        params = SamplingParams(temperature, top_k, top_p, seed)
        ids: list[int] = []
        emitted, held = "", 0
        stop_strs = [s for s in stop if isinstance(s, str)]
        stop_ids = set(self.eos_ids) | {s for s in stop if isinstance(s, int)}
        for _batch, tokens, _live in self._steps(prompt, max_new_tokens, params, stop):
            t = int(tokens[0])
            ids.append(t)
            text = self.decode_text(ids) or ""
            final = t in stop_ids or len(ids) == max_new_tokens
            hits = [text.index(s) for s in stop_strs if s in text]
            if hits:
                text, final = text[: min(hits)], True
            if not final and text.endswith("\ufffd") and held < 3:
                held += 1  # wait for the rest of a multi-byte UTF-8 character (at most 4 bytes)
                delta = ""
            else:
                delta, held = text[len(emitted):], 0
            emitted += delta
            yield StreamEvent(t, delta, len(ids) - 1)
            if final:
                return


def _is_id_list(p: Any) -> bool:
    if isinstance(p, np.ndarray):
        return p.ndim == 1
    return isinstance(p, Sequence) and len(p) > 0 and all(isinstance(x, int | np.integer) for x in p)


def left_padded(pad: np.ndarray, S: int) -> tuple[np.ndarray, np.ndarray]:
    """How Engine.prefill lays out a batch of prompts left-padded by pad[b] slots to S: position_ids (B, S) and the
    attention mask (B, S, S), causal with no pad keys and a pad query seeing itself only (its row stays finite); a
    sliding-window layer's band is the graph's own (Decoder.decode)."""
    i = np.arange(S)
    pos = np.maximum(i[None, :] - pad[:, None], 0)
    if not pad.any():  # no row padded: every row the same triangle, a view of 2S - 1 bools
        return pos, causal(len(pad), S)
    mask = np.tri(S, dtype=bool)[None].repeat(len(pad), axis=0)  # key j <= query i
    valid = i[None, :] >= pad[:, None]  # a padded row: its pad keys hidden, each pad query seeing itself only
    mask &= valid[:, None, :]
    mask[:, i, i] |= ~valid
    return pos, mask


def causal(B: int, S: int) -> np.ndarray:
    """The causal mask (B, S, S) (query i sees keys 0..i) as a read-only view of 2S - 1 bools: `base` holds S True
    then S-1 False and row i is base[S-1-i : 2S-1-i] (i + 1 True), so a step that takes its rows in pieces, or
    copies them into a buffer of its own, never holds S x S bytes (1 GiB at 32,768 tokens, 2.3 s to fill). Where a
    runtime needs the rows contiguous, np.ascontiguousarray makes them so."""
    base = np.zeros(2 * S - 1, dtype=bool)
    base[:S] = True
    row = np.lib.stride_tricks.as_strided(base[S - 1:], shape=(S, S), strides=(-1, 1), writeable=False)
    return np.broadcast_to(row, (B, S, S))


def load(path: str | Path, *, threads: int | None = None, **options: Any) -> Engine:
    """Open an artifact and load its engine through its backend, whose `load` first checks that the
    folder holds exactly the files the manifest lists, each with its sha256 (Backend.load)."""
    from kvexport import backends

    folder, manifest = open_artifact(path, verify_hashes=False)  # the backend's load checks, once
    target = manifest.target
    if target is None:
        raise ArtifactError(
            f"{folder} holds only the IR (made by `kvexport export`), no engine: build one from the checkpoint "
            f"folder it was exported from ({manifest.raw['model'].get('name') or 'the model'}) with "
            f"`kvexport build CHECKPOINT_DIR --target cpu -o OUT.kvx`"
        )
    verification = manifest.raw.get("verification") or {}
    if verification.get("passed") is False:
        warnings.warn(f"{folder} failed verification against its reference (see {folder / 'verify.json'})",
                      stacklevel=2)
    backend = backends.get(target["backend"])
    session = backend.load(folder, manifest, threads=threads, **options)
    return Engine(folder, manifest, session)
