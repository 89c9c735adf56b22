"""The nvidia Session: a TensorRT engine run with execute_async_v3 over a fixed max_seq device cache.

Per request state: the KV cache on the GPU (torch tensors, one per past input), bound as both the
`past_*` input and its aliased `present_*` output so IKVCacheUpdateLayer writes in place; one
execution context per profile (prefill, decode) and a CUDA stream of its own, so threads with
distinct states never share a context. The decode step (one token, fixed shapes and addresses) is
run eagerly once, then captured as a CUDA graph and replayed for every later token.
A sliding layer's ring (rings.py) is not aliased: its present goes to a second buffer of R slots and the
two swap after every step, so decode keeps one captured graph per parity of the swap.
torch and TensorRT are imported inside functions: the module imports on CPU-only machines.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvexport.errors import ContextOverflowError, InputError
from kvexport.runtime.ring import MASK_INPUT, RingSpec, sliding_mask, step_pieces
from kvexport.runtime.session import Session

from kvexport_nvidia.profiles import DECODE, PREFILL, Profile, check_request
from kvexport_nvidia.trt_build import EngineBuildError, import_tensorrt

ALIGN = 128  # bytes; torch's caching allocator hands out 512-byte aligned blocks, checked below


def torch_dtype(trt: Any, dt: Any) -> Any:
    import torch

    table = {
        trt.DataType.HALF: torch.float16, trt.DataType.FLOAT: torch.float32, trt.DataType.BF16: torch.bfloat16,
        trt.DataType.INT64: torch.int64, trt.DataType.INT32: torch.int32, trt.DataType.BOOL: torch.bool,
    }
    if dt not in table:
        raise EngineBuildError(f"engine tensor dtype {dt} has no torch equivalent; rebuild the engine")
    return table[dt]


@dataclass
class _State:
    batch: int
    capacity: int
    caches: list[Any]  # torch tensors (B, H_kv, S_max or R, D) on the GPU, in manifest pair order
    stream: Any  # torch.cuda.Stream
    contexts: list[Any]  # [prefill, decode] IExecutionContext
    held: int = 0  # cache slots every row holds (T)
    graph: Any = None  # torch.cuda.CUDAGraph of the decode step, captured on the first decode
    spares: list[Any] = field(default_factory=list)  # per pair: a ring's second buffer (its present), else None
    swaps: int = 0  # steps since the rings' buffers were allocated (their parity picks the decode graph)
    other_graph: Any = None  # the decode graph of the other parity (rings only)
    captures: int = 0  # decode graphs captured for this state (1 once decoding, with cuda_graph)
    replays: int = 0  # decode steps served by replaying the captured graph
    decode_io: dict[str, Any] = field(default_factory=dict)  # static device buffers the graph reads
    host_io: dict[str, Any] = field(default_factory=dict)  # pinned staging for them
    lock: threading.Lock = field(default_factory=threading.Lock)


def graph_step(state: _State, *, eager: Callable[[], None], capture: Callable[[], Any]) -> None:
    """One graph-mode decode step: replay the state's captured graph, or, the first time, run the
    step eagerly (its result is this step's output) and capture the same launch for later steps.
    Counts both on the state, so tests can check that decode really is captured once and replayed."""
    if state.graph is not None:
        state.graph.replay()
        state.replays += 1
        return
    eager()
    state.graph = capture()
    state.captures += 1


def swap_rings(state: _State) -> None:
    """After a step: each ring's second buffer (just written) becomes its cache, and the decode graph
    captured with the buffers the other way round becomes the one to replay."""
    if not any(s is not None for s in state.spares):
        return
    for k, spare in enumerate(state.spares):
        if spare is not None:
            state.caches[k], state.spares[k] = spare, state.caches[k]
    state.graph, state.other_graph = state.other_graph, state.graph
    state.swaps += 1


def step_feeds(held: int, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray, *, max_seq: int,
               ring: RingSpec | None, full_mask: bool) -> dict[str, np.ndarray]:
    """The engine's host inputs for one step of S tokens over `held` slots: the full-length layers' mask
    padded to max_seq (absent where every layer is a ring), a ring's mask over its R = min(window, max_seq)
    slots then the S new rows (kvexport.runtime.ring). Shared by the TensorRT session and its test twin."""
    B, S = ids.shape
    feeds = {"input_ids": ids, "position_ids": pos, "write_index": np.full((B,), held, dtype=np.int64)}
    if full_mask:
        full = np.zeros((B, 1, S, max_seq), dtype=np.bool_)  # slots past T+S stay invisible
        full[..., : mask.shape[-1]] = mask
        feeds["attention_mask"] = full
    if ring is not None:
        feeds[MASK_INPUT] = sliding_mask(mask, ring.length(max_seq), ring.window)
    return feeds


class TrtSession(Session):
    def __init__(self, engine: Any, runtime: Any, *, pairs: list[tuple[str, str]], profiles: list[Profile],
                 max_seq: int, vocab_size: int, device_index: int = 0, cuda_graph: bool = True,
                 info: dict[str, Any] | None = None, ring: RingSpec | None = None):
        import torch

        self._trt = import_tensorrt()
        self._engine, self._runtime = engine, runtime  # the runtime must outlive the engine
        self.pairs, self.profiles = pairs, profiles
        self.max_seq, self.vocab_size = max_seq, vocab_size
        self.device = torch.device("cuda", device_index)
        self.cuda_graph = cuda_graph
        self.info = info or {}
        self._io = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
        self.ring = ring
        self.limit = ring.limit(max_seq) if ring else max_seq  # past max_seq where every layer is a ring
        self._check_aliasing()

    # --- engine facts -------------------------------------------------------------------------
    def _check_aliasing(self) -> None:
        """Each present output must alias its past input: that is the in-place cache update."""
        for k, (past, present) in enumerate(self.pairs):
            if past not in self._io or present not in self._io:
                raise EngineBuildError(f"engine lacks cache tensor {past!r}/{present!r}; rebuild it")
            if self.ring is not None and self.ring.is_ring(k):
                continue  # a ring's present is IScatterLayer's own output, bound to the ring's second buffer
            aliased = self._engine.get_aliased_input_tensor(present)
            if aliased != past:
                raise EngineBuildError(
                    f"engine output {present!r} is not aliased to {past!r} (got {aliased!r}): the KV-cache "
                    "update is not in place. Rebuild with TensorRT >= 10.15 from this kvexport's IR."
                )

    def _dtype(self, name: str) -> Any:
        return torch_dtype(self._trt, self._engine.get_tensor_dtype(name))

    # --- Session API ------------------------------------------------------------------------------
    def new_state(self, batch: int, capacity: int) -> _State:
        import torch

        if capacity > self.limit:
            raise ContextOverflowError(
                f"a request needing {capacity} cache slots exceeds this engine's "
                + (f"max_seq {self.max_seq}" if self.limit == self.max_seq else f"positions ({self.limit})")
                + "; shorten the prompt or max_new_tokens, or rebuild with a larger max_seq"
            )
        check_request(self.profiles, batch, 1)
        caches, spares = [], []
        for k, (past, _) in enumerate(self.pairs):
            shape = self.profiles[PREFILL].shapes[past][0][1:]  # (H_kv, S_max or R, D)
            # fixed policy: the whole max_seq cache (a ring: its R slots), zeroed (masked slots must hold finite values)
            t = torch.zeros((batch, *shape), dtype=self._dtype(past), device=self.device)
            assert t.data_ptr() % ALIGN == 0
            caches.append(t)
            spares.append(torch.zeros_like(t) if self.ring is not None and self.ring.is_ring(k) else None)
        stream = torch.cuda.Stream(device=self.device)
        contexts = []
        for index in (PREFILL, DECODE):
            ctx = self._engine.create_execution_context()
            if ctx is None:
                raise EngineBuildError("TensorRT could not create an execution context (out of GPU memory?)")
            if not ctx.set_optimization_profile_async(index, stream.cuda_stream):
                raise EngineBuildError(f"TensorRT refused optimization profile {index} for a new context; "
                                       "rebuild the engine with this kvexport")
            contexts.append(ctx)
        return _State(batch=batch, capacity=capacity, caches=caches, stream=stream, contexts=contexts, spares=spares)

    def release(self, state: _State) -> None:
        state.graph = None
        state.other_graph = None
        state.caches.clear()
        state.spares.clear()
        state.decode_io.clear()
        state.contexts.clear()

    def cache_bytes(self, state: _State) -> int:
        return sum(t.numel() * t.element_size() for t in [*state.caches, *(s for s in state.spares if s is not None)])

    def describe(self) -> dict[str, Any]:
        return {"device": str(self.device), "cache_policy": "fixed", "cuda_graph_decode": self.cuda_graph,
                "profiles": [p.name for p in self.profiles], **self.info,
                "ring": None if self.ring is None else {"window": self.ring.window, "layers": sorted(self.ring.layers)}}

    def step(self, state: _State, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        B, _ = self._validate(state, input_ids, position_ids, attention_mask)
        # a ring takes at most its R slots of new rows a step (more would overwrite each other): longer in pieces
        logits = np.empty((B, self.vocab_size), np.float32)
        limit = self.ring.length(self.max_seq) if self.ring else None
        for piece in step_pieces(input_ids, position_ids, attention_mask, limit):
            logits = self._piece(state, *piece)
        return logits

    def _piece(self, state: _State, input_ids: np.ndarray, position_ids: np.ndarray,
               attention_mask: np.ndarray) -> np.ndarray:
        B, S = input_ids.shape
        T = state.held
        check_request(self.profiles, B, S)
        with state.lock:
            if S == 1 and self.cuda_graph:
                logits = self._decode(state, input_ids, position_ids, attention_mask)
            else:
                logits = self._run(state, PREFILL if S > 1 else DECODE, input_ids, position_ids, attention_mask)
            state.held = T + S
            swap_rings(state)
        return logits

    # --- internals --------------------------------------------------------------------------------
    def _validate(self, state: _State, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray) -> tuple[int, int]:
        if ids.dtype != np.int64 or pos.dtype != np.int64 or mask.dtype != np.bool_:
            raise InputError("input_ids and position_ids must be int64 and attention_mask bool")
        if ids.ndim != 2 or pos.shape != ids.shape:
            raise InputError(f"input_ids {ids.shape} and position_ids {pos.shape} must both be (batch, seq)")
        B, S = ids.shape
        if B != state.batch:
            raise InputError(f"this state holds {state.batch} rows; the step has {B}")
        if mask.shape != (B, 1, S, state.held + S):
            raise InputError(f"attention_mask must be (B, 1, S, T+S) = {(B, 1, S, state.held + S)}, got {mask.shape}")
        if state.held + S > self.limit:  # the cache is max_seq long whatever capacity was asked
            raise ContextOverflowError(
                f"the step needs {state.held + S} cache slots; " + (
                    f"this engine's cache holds max_seq={self.max_seq}" if self.limit == self.max_seq else
                    f"every layer slides on a ring and the model's positions end at {self.limit}"))
        return B, S

    def _host_inputs(self, state: _State, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        return step_feeds(state.held, ids, pos, mask, max_seq=self.max_seq, ring=self.ring,
                          full_mask="attention_mask" in self._io)

    def _bind(self, state: _State, ctx: Any, inputs: dict[str, Any], logits: Any) -> None:
        for name, t in inputs.items():
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        for (past, present), cache, spare in zip(self.pairs, state.caches, state.spares or [None] * len(state.caches)):
            ctx.set_input_shape(past, tuple(cache.shape))
            ctx.set_tensor_address(past, cache.data_ptr())
            # aliased: updated in place; a ring writes its second buffer (swapped after the step)
            ctx.set_tensor_address(present, (cache if spare is None else spare).data_ptr())
        ctx.set_tensor_address("logits", logits.data_ptr())

    def _logits_buffer(self, B: int) -> Any:
        import torch

        return torch.empty((B, 1, self.vocab_size), dtype=self._dtype("logits"), device=self.device)

    def _run(self, state: _State, profile: int, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """One eager execute_async_v3 (prefill, or decode without graphs)."""
        import torch

        host = self._host_inputs(state, ids, pos, mask)
        with torch.cuda.stream(state.stream):
            dev = {k: torch.from_numpy(v).to(self.device, non_blocking=False) for k, v in host.items()}
            logits = self._logits_buffer(ids.shape[0])
            ctx = state.contexts[profile]
            self._bind(state, ctx, dev, logits)
            if not ctx.execute_async_v3(state.stream.cuda_stream):
                raise EngineBuildError("TensorRT execute_async_v3 failed; see the TensorRT log above")
            return logits[:, -1, :].float().cpu().numpy()  # .cpu() waits for the stream

    def _decode(self, state: _State, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """One-token step on static buffers; captured as a CUDA graph after its first eager run."""
        import torch

        host = self._host_inputs(state, ids, pos, mask)
        if not state.decode_io:
            for k, v in host.items():
                state.host_io[k] = torch.from_numpy(np.zeros_like(v)).pin_memory()
                state.decode_io[k] = torch.empty(v.shape, dtype=state.host_io[k].dtype, device=self.device)
            state.decode_io["logits"] = self._logits_buffer(ids.shape[0])
        for k, v in host.items():
            state.host_io[k].numpy()[...] = v
        ctx = state.contexts[DECODE]
        logits = state.decode_io["logits"]
        with torch.cuda.stream(state.stream):
            for k in host:
                state.decode_io[k].copy_(state.host_io[k], non_blocking=True)

            def eager() -> None:
                self._bind(state, ctx, {k: state.decode_io[k] for k in host}, logits)
                # the eager run is this step's result and flushes TensorRT's deferred setup, which
                # must not happen inside a capture; the graph then records the same launch
                if not ctx.execute_async_v3(state.stream.cuda_stream):
                    raise EngineBuildError("TensorRT execute_async_v3 failed; see the TensorRT log above")
                state.stream.synchronize()

            def capture() -> Any:
                graph = torch.cuda.CUDAGraph()
                # thread_local: other threads' CUDA calls (their own states) may go on during capture
                with torch.cuda.graph(graph, stream=state.stream, capture_error_mode="thread_local"):
                    ctx.execute_async_v3(state.stream.cuda_stream)
                return graph

            graph_step(state, eager=eager, capture=capture)
            return logits[:, -1, :].float().cpu().numpy()
