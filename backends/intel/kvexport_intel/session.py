"""The intel target's Session: one compiled OpenVINO model, one InferRequest (its own KV state) per request."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvexport.errors import ContextOverflowError, InputError
from kvexport.runtime.engine import left_padded
from kvexport.runtime.ring import MASK_INPUT, RingSpec, sliding_mask, step_pieces
from kvexport.runtime.session import Session

# Additive mask value for slots a token may not see. Finite, so that a row that sees nothing
# (never a real token's row) stays finite instead of NaN; exp(-1e30 - max) is exactly 0.0 in
# f32 and bf16, so visible rows are unchanged. -1e30 fits bf16's range (finfo(f32).min rounds
# to -inf in bf16).
MASKED = np.float32(-1e30)
# Bytes per cached element by cache precision (the storage layout; OpenVINO does not report it).
KV_ITEM_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "u8": 1, "i8": 1}
# caches that lose nothing: f32, and bf16, which is held only under bf16 activations
LOSSLESS_KV = ("f32", "bf16")
# A fresh batch-1 prompt of at least this many tokens (by default every one) is prefilled through the engine's
# paged-attention form (kvexport_intel.paged), compiled with the engine's own cache precision, and the request keeps
# decoding paged over its blocks. The threshold was 1024 on timings of the prefill alone (bench-125m f32, AMD EPYC Zen 3
# AVX2, load 5-6: paged over one stateful call 1.21x/1.00x at 256 tokens, 1.13x/0.92x at 512, 1.01x/1.00x at 1024,
# 0.46x/0.52x at 4096), taken before the paged form computed logits for the last token only and before a finished
# request's block cache was kept for the next one (_one_row: making one took ~10 ms of a 32-token prompt's time to
# first token on bench-125m). On an AMD EPYC Zen 4 (AVX-512), `kvexport bench --variant paged_prefill_min=1
# --step-pairs`: the paged decode step was 1.04x / 1.10x the stateful one's speed at prompts 32 / 512 (bench-125m int4
# g32, f32 activations) and 1.03x / 1.03x (bench-1b int4 g128, bf16), TTFT at 512 0.74x and 0.94x; at 32, with the block
# cache reused, 14.6 against 15.8 ms (bench-125m). Against OpenVINO GenAI (which runs paged attention itself) on
# bench-1b, bf16, five rounds: int4 g128 decode 1.14x / 1.10x paged against 0.99x / 0.98x stateful, int8 1.10x / 1.08x
# against 0.98x / 1.07x; a second run, paged: int4 0.98x / 1.07x, int8 1.07x / 1.04x (docs/performance.md). So every
# prompt (1). A fresh batch of left-padded prompts is paged too (the load option batch_rows=paged, the default): a row
# each in one block cache, without its padding; with four rows (bench-125m int4 g32, f32 activations, Zen 4) decode
# steps took 0.81-0.85x the stateful call's time and TTFT at 512 0.70-0.95x (docs/backends/intel.md). Rings, models
# without a paged form and batches under batch_rows=state keep the stateful call.
# At a 4096-token context the paged decode step had taken 0.81x the stateful one's time (per-step median of 40
# interleaved steps, bench-125m, Zen 3, load ~7; with u8 caches 0.92x at load ~1.9), and handing the blocks over cost ~0.7 s plus
# a first stateful step of ~1.1 s at load ~7 (0.23-0.29 s and 0.12-0.14 s at load ~1.9; the plugin grows a state sized
# to the prompt).
# A u8 cache's blocks are quantized by paged attention's own kernels, keys and values per token and head with an
# f32 scale and zero point each (KEY_CACHE_QUANT_MODE below), the state's scheme in the plugin's block layout;
# `kvexport verify` judges both paths (kvexport.verify.other_path_text).
PAGED_PREFILL_MIN = 1
STATE_PATH = "one stateful call (the fused attention with state)"
# Paged attention's u8 key quantization, set rather than left to the plugin's AUTO, so that another OpenVINO's
# default cannot change what was verified. AUTO picks BY_CHANNEL in OpenVINO 2026.4 (keys per channel over each block
# of 32 tokens, as OpenVINO GenAI runs it). BY_TOKEN is faster and smaller. At a 4,096-token context with int4 g32
# weights (bench-125m, AMD EPYC Zen 4, AVX-512), interleaved decode steps in one process took 1.06-1.17x as long with
# keys per channel as per token at f32 activations (four runs of 78 steps) and 1.12x under bf16 (alike on an AVX2
# Zen 3). A slot then takes 144 bytes per KV head at head_dim 64 instead of 152 (0.281x f32's 512, not 0.297x),
# and the blocks hold what the state holds, quantized per token and head.
PAGED_KEY_QUANT = "BY_TOKEN"


def step_inputs(input_names: Any, ring: RingSpec | None, T: int, beam_idx: np.ndarray, input_ids: np.ndarray,
                position_ids: np.ndarray, attention_mask: np.ndarray) -> dict[str, np.ndarray]:
    """The stateful IR's inputs for a step of S tokens onto a state holding T slots; attention_mask is the
    boolean (B, 1, S, T+S) of the Session API. Also the rows of NNCF's calibration dataset (kvexport_intel.compress)."""
    B = input_ids.shape[0]
    inputs = {
        "input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
        "position_ids": np.ascontiguousarray(position_ids, dtype=np.int64),
        "beam_idx": beam_idx,
    }
    if "attention_mask" in input_names:  # absent where every layer is a ring
        inputs["attention_mask"] = np.where(attention_mask, np.float32(0.0), MASKED)  # (B, 1, S, T+S) additive
    if ring is not None:  # the rings hold min(W, T) slots: the mask says which token each holds
        held = sliding_mask(attention_mask, ring.length(T), ring.window)  # (B, 1, S, min(W, T)+S)
        inputs[MASK_INPUT] = np.where(held, np.float32(0.0), MASKED)
        inputs["write_index"] = np.full(B, T, dtype=np.int64)
    return inputs


@dataclass
class IntelState:
    """One request: its own InferRequest, whose variables are this request's K/V cache."""

    request: Any
    batch: int
    slots: int = 0
    beam_idx: np.ndarray | None = None  # (B,) int32 identity: rows are never reordered
    run_seconds: float = 0.0
    steps: int = 0
    rows: Any = None  # the request's PagedRows (a row each) while it decodes paged; None: the state holds it
    pads: np.ndarray | None = None  # (B,) each paged row's left padding: the slots of the batch it does not hold
    # the tokens each row of a paged request holds, to re-run them into the state on a hand-over (quantized blocks,
    # or a batch: _hand_over)
    ids: list[list[int]] | None = None


class IntelSession(Session):
    def __init__(self, compiled: Any, *, max_seq: int, vocab_size: int, num_layers: int, kv_heads: int,
                 head_dim: int, facts: dict[str, Any], ring: RingSpec | None = None):
        self.compiled = compiled
        self.max_seq, self.vocab_size = max_seq, vocab_size
        self.ring = ring  # sliding-window layers on a ring of at most `window` slots in the state
        # slots a request may hold: past max_seq where every layer slides on a ring
        self.limit = ring.limit(max_seq) if ring is not None else max_seq
        self.input_names = {name for port in compiled.inputs for name in port.get_names()}
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.facts = facts
        self._pool: list[Any] = []  # reset InferRequests of finished requests: memory does not grow
        self._row_pool: list[Any] = []  # finished paged requests' one-row block caches, their blocks freed (_one_row)
        self._lock = threading.Lock()
        # set by the backend's open_session: how to compile the paged-attention form for batched rows
        self.model_path: str | None = None
        self.compile_config: dict[str, Any] = {}
        self.batch_rows = "paged"  # or "state": one InferRequest per row (the load option batch_rows)
        self.windows: list[int | None] = [None] * num_layers  # each layer's sliding window (None: whole past)
        self._paged: tuple[Any, str | None] | None = None  # (compiled paged model or None, why not)
        self.state_names: list[str] = []  # the K/V variables, layer after layer, key then value (open_session)
        self.paged_prefill_min = PAGED_PREFILL_MIN  # the load option paged_prefill_min: a fresh prompt this long is paged
        # the load option paged_split: which packed projections the paged form cuts into one matmul per piece
        # (kvexport_intel.paged.SPLITS; docs/backends/intel.md)
        self.paged_split = "none"
        # the load option prompt_split: the cut of a second paged form that runs every step of more than one token a
        # row over the same blocks; paged_split's (the load option's "same"): no second form
        self.prompt_split = "none"
        self._prompt_form: tuple[Any, str | None] | None = None  # (compiled prompt form or None, why not)
        # the load option decode_matmul, as open_session resolved it: kvexport's QGemv library where the decode
        # form's compressed matmuls take it (kvexport_intel.gemv; prompts then run a second form unless gemv_rows),
        # else None
        self.decode_gemv: Path | None = None
        # set by open_session: whether that op also takes the steps of more rows (AMX-BF16 over its bf16 copies:
        # kvexport_intel.gemv.choose_rows), so that one paged form runs every step; and the copies its forms share
        self.gemv_rows = False
        self._bf16_copies: dict[tuple[Any, ...], Any] = {}
        # set by open_session: the same engine compiled at f32 activations with a given cache precision
        self.cache_twin: Callable[[str], IntelSession] | None = None

    def describe(self) -> dict[str, Any]:
        return {"cache_policy": "internal", "device": "cpu (OpenVINO)", **self.facts}

    def lossy_cache_cost(self, progress: Callable[[str], None] | None = None) -> dict[str, Any] | None:
        """What this engine's lossy cache (u8, f16) costs against the same engine with an f32 cache: both compiled
        at f32 activations from the engine file, one after the other, and run on one teacher-forced greedy
        prompt (kvcost.kv_precision_cost). None where the cache is lossless (f32, or bf16 under bf16)."""
        kv = self.facts.get("kv_precision")
        if kv in LOSSLESS_KV or self.cache_twin is None:
            return None
        from kvexport_intel.kvcost import kv_precision_cost

        if progress is not None:
            progress(f"verify: what the {kv} cache costs against an f32 one (the engine compiled twice at f32, in turn)")
        twin = self.cache_twin
        return kv_precision_cost(lambda: twin("f32"), lambda: twin(str(kv)))

    def other_prompt_path(self, min_tokens: int) -> AbstractContextManager[dict[str, Any]] | None:
        if self.ring is not None or not self.state_names:
            return None  # every prompt takes the stateful call
        if self.paged_prefill_min <= min_tokens:  # such prompts are paged already: the other path is the state's
            return self._prompts_from(self.limit + 1, STATE_PATH)
        return self._prompts_from(min_tokens, None)

    def batch_row_path(self) -> AbstractContextManager[Any]:
        if self.ring is not None or not self.state_names or self.batch_rows == "paged":
            return nullcontext()  # a batch's prompt takes a lone row's path (both paged, or both the state's)
        return self._prompts_from(self.limit + 1, STATE_PATH)  # batch_rows=state: a batch's prompt takes the state's

    @contextmanager
    def _prompts_from(self, min_tokens: int, path: str | None) -> Iterator[dict[str, Any]]:
        """paged_prefill_min at min_tokens for the context's time (above the engine's limit: no prompt paged); `path`
        names the path such prompts take (None: the paged prefill's own record, facts["long_prefill"])."""
        saved, self.paged_prefill_min = self.paged_prefill_min, min_tokens
        note: dict[str, Any] = {"path": None}
        try:
            yield note
        finally:
            self.paged_prefill_min = saved
            note["path"] = path or self.facts.get("long_prefill")

    # --- batched rows ------------------------------------------------------------------------
    def paged_unavailable(self) -> str | None:
        """Why this engine's rows cannot run through paged attention (None: they can)."""
        if self.batch_rows != "paged":
            return f"batch_rows={self.batch_rows} was asked for"
        if self.model_path is None:
            return "this session was not loaded from an artifact"
        if self.ring is not None:
            return ("its sliding-window layers keep window-sized rings in the state, which OpenVINO's paged attention "
                    "transformation does not page; build with --option ring_cache=false to batch them through paged "
                    "attention (their caches then grow to max_seq)")
        return None

    def paged_model(self) -> tuple[Any, str | None]:
        """The paged-attention form of this engine, compiled once per session: at load where long prompts take it
        (compile_long_prompt_form), else on first use (None and the reason where the transformation does not give
        one PagedAttention per layer)."""
        with self._lock:
            if self._paged is None:
                self._paged = self._compile_paged(self.compile_config, self.paged_split, self.decode_gemv)
            return self._paged

    def prompt_form(self) -> Any:
        """The paged form that prompts run where prompt_split differs from paged_split (compiled once per session,
        after paged_model), else None: prompts run the decode form. Also None where it does not compile (why in
        facts["prompt_form"]): the decode form then takes the prompts."""
        rows_too = self.decode_gemv is not None and self.gemv_rows  # the op takes every step
        if self.prompt_split == self.paged_split and (self.decode_gemv is None or rows_too):
            if rows_too:
                self.facts["prompt_form"] = "the decode form's: kvexport's QGemv takes steps of any rows"
            return None
        with self._lock:
            if self._prompt_form is None:
                self._prompt_form = self._compile_paged(self.compile_config, self.prompt_split,
                                                        self.decode_gemv if rows_too else None)
                why = self._prompt_form[1]
                kind = ("the plugin's matmuls (decode steps take kvexport's)" if self.decode_gemv is not None
                        and not rows_too else f"projections cut: {self.prompt_split}")
                self.facts["prompt_form"] = (f"prompts through a second paged form, {kind}" if why is None
                                             else f"the decode form's: {why}")
            return self._prompt_form[0]

    def _paged_rows(self, compiled: Any, rows: int, max_seq: int) -> Any:
        from kvexport_intel.gemv import GEMV_ROWS
        from kvexport_intel.paged import PagedRows

        return PagedRows(compiled, rows=rows, max_seq=max_seq, num_layers=self.num_layers, vocab_size=self.vocab_size,
                         prompt_compiled=self.prompt_form(),
                         decode_rows_max=GEMV_ROWS if self.decode_gemv is not None and not self.gemv_rows else None)

    def _compile_paged(self, config: dict[str, Any], split: str, gemv: Path | None = None) -> tuple[Any, str | None]:
        """A paged form of the engine (to_paged) with `split`'s projections cut, its attention kvexport's i8 op where
        the cache is i8, its compressed matmuls kvexport's QGemv where `gemv` (that op's library) is given."""
        import openvino as ov

        from kvexport_intel.paged import to_paged

        if self.model_path is None:
            return None, "this session was not loaded from an artifact"
        from kvexport_intel.lowering import read_engine

        core = ov.Core()
        model = read_engine(core, self.model_path)
        if config.get("KEY_CACHE_PRECISION") == "u8":
            config = {**config, "KEY_CACHE_QUANT_MODE": PAGED_KEY_QUANT}
        why, compiled = to_paged(model, self.windows, split), None
        if why is None and self.facts.get("kv_precision") == "i8":
            from kvexport_intel.int8_blocks import kernels, library, to_int8_blocks

            lib = library()  # BackendUnavailableError where it cannot be compiled
            core.add_extension(str(lib))
            swapped = to_int8_blocks(model, kv_heads=self.kv_heads, head_dim=self.head_dim, lib=lib)
            self.facts["paged_attention"] = f"kvexport's Int8PagedAttention over int8 blocks ({swapped} layers)"
            self.facts["i8_kernels"] = kernels(lib, self.head_dim)
        if why is None and gemv is not None:
            from kvexport_intel.gemv import GEMV_ROWS, bf16_copies, kernel, to_qgemv

            core.add_extension(str(gemv))
            # float weights take the op only under bf16 activations (an engine's f32 twin keeps them exact)
            floats = bf16_copies(self.facts.get("weights"), self.facts.get("precision"))
            how = kernel(gemv, floats)
            if floats and self.gemv_rows:
                how += f"; AMX-BF16 for steps of more than {GEMV_ROWS} rows"
            replaced = to_qgemv(model, gemv, floats, self._bf16_copies)
            self.facts["decode_matmuls"] = (f"{replaced} through kvexport's QGemv "
                                            f"({how}{', bf16 copies of the f32 weights' if floats else ''})")
        if why is None:
            try:
                compiled = core.compile_model(model, "CPU", config)
            except RuntimeError as e:  # a graph the plugin compiles statefully but not paged
                why = f"OpenVINO could not compile the paged model: {str(e).strip().splitlines()[-1]}"
        return compiled, why

    def prefill_model(self) -> tuple[Any, str | None]:
        """The paged-attention form for long prompts (paged_prefill_min), its block cache in this engine's cache
        precision: the batched rows' compiled model."""
        if self.ring is not None:
            return None, "sliding-window layers keep rings in the state, which paged attention does not page"
        return self.paged_model()

    def batched_rows(self, rows: int) -> Any:
        why = self.paged_unavailable()
        compiled = None
        if why is None:
            compiled, why = self.paged_model()
        self.facts["batch_rows"] = "paged attention" if why is None else f"one InferRequest per row: {why}"
        if compiled is None:
            return None
        return self._paged_rows(compiled, rows, self.max_seq)

    def compile_long_prompt_form(self) -> str | None:
        """Compile now the paged form a long prompt takes (prefill_model), where this engine can hold one; returns why
        no such form exists (None: compiled). Left to the first long prompt, its compile lands inside that prompt's
        time to first token: ~1.7-2.4 s of bench-125m's 4096-token TTFT (AMD EPYC Zen 3, 2 threads, load 3-5), the
        first round of every benchmark. The compiled paged model maps the IR's weights again: RSS grows by about the
        weight file, but its unique memory by only ~32 MB on bench-125m (the file's pages are shared)."""
        if self.ring is not None or not self.state_names or self.limit < self.paged_prefill_min:
            return "no prompt this engine holds takes the paged form"
        why = self.prefill_model()[1]
        if why is None:
            self.prompt_form()
        return why

    def warm_up(self) -> None:
        """One token through the path a fresh one-row request takes (paged or the state's), so that the plugin
        prepares its weights now rather than inside the first request's time; its request and block cache go back
        to the pools, as a finished request's do."""
        state = self.new_state(1, 1)
        try:
            self.step(state, np.zeros((1, 1), np.int64), np.zeros((1, 1), np.int64), np.ones((1, 1, 1, 1), bool))
        finally:
            self.release(state)
        if self._prompt_form is not None and self._prompt_form[0] is not None:  # prompts run a form of their own:
            rows = self._one_row(self.paged_model()[0])  # two tokens through it, whatever paged_prefill_min is
            try:
                rows.extend(0, np.zeros(2, np.int64))
            finally:
                self._give_back(rows)

    # --- state -----------------------------------------------------------------------------
    def new_state(self, batch: int, capacity: int) -> IntelState:
        if batch < 1:
            raise InputError(f"batch must be at least 1, got {batch}")
        if capacity > self.limit:
            raise ContextOverflowError(f"the request needs {capacity} cache slots but this engine holds at most "
                                       f"{self.limit}" + ("; rebuild with a larger --max-seq" if self.limit == self.max_seq
                                                          else " (the model's positions)"))
        with self._lock:
            request = self._pool.pop() if self._pool else self.compiled.create_infer_request()
        request.reset_state()  # zero-length state: a new request starts with an empty cache
        return IntelState(request, batch, beam_idx=np.arange(batch, dtype=np.int32))

    def release(self, state: IntelState) -> None:
        if state.request is None:
            return
        if state.rows is not None:
            self._give_back(state.rows)
            state.rows, state.ids, state.pads = None, None, None
        state.request.reset_state()  # frees the state buffers' contents before reuse
        with self._lock:
            self._pool.append(state.request)
        state.request = None

    def state_bytes(self, state: IntelState) -> int:
        """Bytes of the KV state as OpenVINO reports it (query_state: each state tensor's byte_size).
        The plugin hands the state back converted to f32 whatever its cache precision, so this is the
        f32 size of the tokens held, not the u8/f16 storage; nor does it include the plugin's spare
        capacity. (Reading it copies the state: call it outside timed loops.)"""
        if state.request is None:
            return 0
        if state.rows is not None:  # a paged request: the f32 bytes of the slots held, as the state would report them
            return 2 * self.num_layers * self.kv_heads * self.head_dim * 4 * int(state.rows.held.sum())
        return sum(int(v.state.byte_size) for v in state.request.query_state())

    def cache_bytes(self, state: IntelState) -> int | None:
        if state.request is not None and state.rows is not None:
            # a paged request's blocks are buffers this session allocated in the cache's own type (a u8 block holds
            # its scales and zero points too): their bytes per slot, for the slots held
            rows = state.rows
            return sum(c.nbytes for c in rows.caches) * int(rows.held.sum()) // (rows.num_blocks * rows.block)
        if self.facts.get("kv_precision", "f32") != "f32":
            return None  # query_state shows the dequantized f32 view, not what is stored
        return self.state_bytes(state)

    def cache_bytes_copied(self, state: IntelState) -> int | None:
        if state.rows is not None:
            return 0  # a paged step writes its token's K/V into the request's blocks in place: nothing is copied
        return None  # the plugin grows its own state buffers: any copy happens inside OpenVINO, uncounted

    def not_measured(self) -> dict[str, str]:
        """Why a figure is None: said of requests the state holds (a paged request measures both)."""
        return {
            "cache_bytes": (f"the state holds this request; OpenVINO returns its {self.facts.get('kv_precision')} "
                            "cache converted to f32 (query_state), not its storage"),
            "cache_bytes_copied": ("the state holds this request; OpenVINO grows its state buffers itself and reports "
                                   "no copy count"),
        }

    # --- step -------------------------------------------------------------------------------
    def step(self, state: IntelState, input_ids: np.ndarray, position_ids: np.ndarray,
             attention_mask: np.ndarray) -> np.ndarray:
        if state.request is None:
            raise InputError("this state was released; start a new request with new_state()")
        B, S = input_ids.shape
        if B != state.batch:
            raise InputError(f"this state holds {state.batch} rows, the step gave {B}")
        T = state.slots
        total = T + S
        if total > self.limit:
            raise ContextOverflowError(f"{total} slots exceed {'max_seq' if self.limit == self.max_seq else 'the model'} "
                                       f"limit of {self.limit}" + ("; rebuild with a larger --max-seq"
                                                                    if self.limit == self.max_seq else ""))
        if attention_mask.shape != (B, 1, S, total):
            raise InputError(f"attention_mask has shape {attention_mask.shape}; this state holds {state.slots} slots, "
                             f"so a step of {S} tokens needs (B, 1, S, T+S) = {(B, 1, S, total)}")
        if state.rows is not None:
            if _padded_causal(position_ids, attention_mask, T, state.pads) is not None:
                return self._paged_step(state, input_ids)
            self._hand_over(state)  # a step paged attention cannot take (a hidden slot): the state takes over
        if (T == 0 and S >= self.paged_prefill_min and self.ring is None and self.state_names
                and (B == 1 or self.batch_rows == "paged")):
            logits = self._paged_prefill(state, input_ids, position_ids, attention_mask)
            if logits is not None:
                return logits
        # a ring takes at most `window` new rows a step (more would overwrite each other): longer ones in pieces.
        # A long prompt is not cut otherwise: OpenVINO's fused attention with state took more time for a 4096-token
        # prompt in PREFILL_PIECE pieces than in one call (docs/performance.md, prompt 4096 on bench-125m)
        for piece in step_pieces(input_ids, position_ids, attention_mask, self.ring.window if self.ring else None):
            logits = self._step(state, *piece)
        return logits

    def _step(self, state: IntelState, input_ids: np.ndarray, position_ids: np.ndarray,
              attention_mask: np.ndarray) -> np.ndarray:
        T = state.slots
        inputs = step_inputs(self.input_names, self.ring, T, state.beam_idx, input_ids, position_ids, attention_mask)
        S = input_ids.shape[1]
        t0 = time.perf_counter()
        state.request.infer(inputs, share_inputs=True, share_outputs=True)
        state.run_seconds += time.perf_counter() - t0
        state.steps += 1
        state.slots = T + S
        return state.request.get_output_tensor(0).data[:, -1, :]  # (B, vocab) float32

    def _paged_prefill(self, state: IntelState, input_ids: np.ndarray, position_ids: np.ndarray,
                       attention_mask: np.ndarray) -> np.ndarray | None:
        """A fresh request's prompt (paged_prefill_min), one row or a batch of left-padded rows, through the
        paged-attention form: the request keeps its blocks, in the engine's cache precision, a row each without its
        padding, and decodes paged (state.rows). None (nothing done) where a row is not a plain causal run from
        position 0 after its padding, or this engine has no paged form (the reason goes to facts["long_prefill"])."""
        B, S = input_ids.shape
        pads = _padded_causal(position_ids, attention_mask, 0, None)
        if pads is None:
            return None
        compiled, why = self.prefill_model()
        self.facts["long_prefill"] = f"one stateful call: {why}" if why is not None else "paged attention, decode paged"
        if compiled is None:
            return None
        t0 = time.perf_counter()
        if B == 1:
            state.rows = self._one_row(compiled)
            logits = state.rows.extend(0, input_ids[0])[None]  # (1, vocab), a view of the request's output as _step's
        else:  # the rows' prompts without their padding, in one infer: (B, vocab), each row's last token
            state.rows = self._paged_rows(compiled, B, self.limit)
            logits = state.rows.prompts([row[pad:] for row, pad in zip(input_ids, pads)])
        state.run_seconds += time.perf_counter() - t0
        state.steps += 1
        state.slots, state.pads = S, pads
        if B > 1 or self._quantized_blocks():
            state.ids = [[int(t) for t in row[pad:]] for row, pad in zip(input_ids, pads)]
        return logits

    def _one_row(self, compiled: Any) -> Any:
        """A block cache of one row for a fresh paged request: a finished request's (its blocks freed; the pages it
        wrote and its InferRequest kept, as the stateful requests' pool keeps theirs) or else a new one, with blocks
        for the engine's whole limit, calloc'd so that only the blocks a row writes become resident."""
        with self._lock:
            if self._row_pool:
                return self._row_pool.pop()
        return self._paged_rows(compiled, 1, self.limit)

    def _give_back(self, rows: Any) -> None:
        if rows.rows != 1:  # a batch's: its block cache is not kept (a batch of another size would not fit it)
            rows.release()
            return
        rows.free(0)
        with self._lock:
            self._row_pool.append(rows)

    def _paged_step(self, state: IntelState, input_ids: np.ndarray) -> np.ndarray:
        """The next tokens of a request that decodes paged, the same number a row: appended to its blocks;
        (B, vocab) logits."""
        t0 = time.perf_counter()
        B, S = input_ids.shape
        if B == 1:
            logits = state.rows.extend(0, input_ids[0])[None]  # a view of the request's output: as _step's
        elif S == 1:
            logits = state.rows.decode(np.arange(B), input_ids[:, 0])
        else:
            logits = state.rows.prompts(list(input_ids))
        state.run_seconds += time.perf_counter() - t0
        if state.ids is not None:
            for held, row in zip(state.ids, input_ids):
                held.extend(int(t) for t in row)
        state.steps += 1
        state.slots += S
        return logits

    def _quantized_blocks(self) -> bool:
        """Whether this engine's paged blocks are quantized: u8 (values, scales and zero points in the plugin's own
        block layout, which OpenVINO does not document and gives no way to read back), or i8, whose state is u8: a
        hand-over re-runs the request's tokens rather than rounding them twice."""
        return self.compile_config.get("KEY_CACHE_PRECISION", "f32") == "u8"  # i8 engines compile their state u8

    def _hand_over(self, state: IntelState) -> None:
        """Move a paged request into its state variables and free its blocks: the state holds the request now.
        One row's f32/f16/bf16 blocks are read back exactly and copied in (the state stores them in the same type).
        u8 and i8 blocks are not read back: u8's layout is the plugin's own and undocumented (the state does not
        expose its own either: query_state hands back f32), and dequantizing either for the state to quantize again
        would round them twice. Nor are a batch's, whose rows hold no padding that the state's rows have. The
        request's tokens are re-run instead, through one stateful call laid out as the batch's prompt was (each
        row's padding first), so the state holds exactly what a request that never went paged would hold (a
        prefill's time, on a step that is rare: one that hides a held slot)."""
        import openvino as ov

        t0 = time.perf_counter()
        rows, S = state.rows, state.slots
        if state.ids is not None:
            assert state.pads is not None
            pads = state.pads
            ids = np.zeros((state.batch, S), dtype=np.int64)
            for b, held in enumerate(state.ids):
                ids[b, pads[b]:] = held
            self._give_back(rows)
            state.rows, state.ids, state.pads, state.slots = None, None, None, 0
            state.request.reset_state()
            pos, mask = left_padded(pads, S)
            self._step(state, ids, pos, mask[:, None])
            return
        blocks = np.asarray(rows.tables[0])
        # a fresh request's blocks come off the free list in order: a view of them, not a gathered copy
        in_order = np.array_equal(np.diff(blocks), np.ones(len(blocks) - 1))
        run = slice(blocks[0], blocks[0] + len(blocks)) if in_order else blocks
        variables = {v.name: v for v in state.request.query_state()}
        for name, cache in zip(self.state_names, rows.caches):  # key_cache.i, value_cache.i: the same order
            held = cache[run]  # (blocks, kv_heads, block, head_dim) -> (1, kv_heads, S, head_dim)
            kv = held.transpose(1, 0, 2, 3).reshape(self.kv_heads, -1, self.head_dim)[None, :, :S]
            kv = np.ascontiguousarray(kv, dtype=np.float32)  # f16 blocks: exact in f32, stored as f16 again
            variables[name].state = ov.Tensor(kv)  # the plugin copies it
        self._give_back(rows)
        state.rows, state.pads = None, None
        state.run_seconds += time.perf_counter() - t0


def _padded_causal(position_ids: np.ndarray, attention_mask: np.ndarray, past: int,
                   pads: np.ndarray | None) -> np.ndarray | None:
    """Each row's left padding where a step is what paged attention computes over the rows' own tokens (None where
    it is not): row b's positions past - pads[b], ... and each of its new tokens seeing the row's held slots after
    its padding and its new tokens up to itself. A fresh prompt (pads None) finds each row's padding: the slots
    before its first position 0, seen by no token after them (Engine.prefill's layout: a pad query sees itself)."""
    B, S = position_ids.shape
    if pads is None:  # a fresh prompt (past 0)
        leading = (np.cumsum(position_ids != 0, axis=1) == 0).sum(axis=1)  # each row's leading position-0 slots
        pads = np.maximum(leading - 1, 0).astype(np.int64)
    for b in range(B):
        pad = int(pads[b])
        rows = slice(max(pad - past, 0), S)  # a fresh prompt's pad queries are not the row's: they are dropped
        n = S - rows.start
        if n < 1 or not np.array_equal(position_ids[b, rows], np.arange(past + rows.start - pad, past + S - pad)):
            return None
        mask = attention_mask[b, 0, rows]
        if mask[:, :pad].any() or not mask[:, pad:past].all() or not _causal(mask[:, past + rows.start:]):
            return None
    return pads


def _causal(mask: np.ndarray, rows: int = 256) -> bool:
    """Whether the (n, n) `mask` is the causal triangle (query i sees keys 0..i), checked `rows` rows at a time: a
    prompt's mask without an n x n temporary (16 MB of fresh pages at 4,096 tokens, 1 GB at 32,768)."""
    n = len(mask)
    if mask.shape != (n, n):
        return False
    keys = np.arange(n)
    if n and mask.strides[0] == -mask.strides[1]:  # element (i, j) at offset (j - i) * stride: constant diagonals
        # (Engine.prefill's causal view), so its first row and first column say it all
        return bool(mask[:, 0].all()) and np.array_equal(mask[0], keys == 0)
    return all(np.array_equal(mask[r:r + rows], keys[None, :] <= np.arange(r, min(r + rows, n))[:, None])
               for r in range(0, n, rows))
