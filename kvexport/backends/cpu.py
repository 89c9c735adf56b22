"""The embedded default target: ONNX Runtime's CPU execution provider, cache bound in place."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvexport.backends import AutoMode, BuildOptions, Capabilities, Option, Progress
from kvexport.backends import Backend as _Backend
from kvexport.backends.cpu_quant import BITS as CPU_BITS
from kvexport.backends.cpu_quant import DEFAULT_GROUP_SIZE as CPU_DEFAULT_GROUP_SIZE
from kvexport.backends.cpu_quant import LM_HEAD_MODES, QUANTIZERS, Calibration
from kvexport.doctor import read_cpu_flags
from kvexport.errors import ArtifactError, InputError
from kvexport.manifest import Manifest
from kvexport.native import ATTENTION_NOT_ASKED, NOT_ASKED, Kernel
from kvexport.runtime.buffers import aligned_zeros, capacity_for, regrow
from kvexport.runtime.hugepages import Placement, anonymous_regions, collapse_new
from kvexport.runtime.ring import MASK_INPUT, RingSpec, chunks, sliding_mask
from kvexport.runtime.rows import run_step
from kvexport.runtime.session import Session, piece_limit

ENGINE_DIR = "engine"
FUSED_TMP = "model.fused.tmp.onnx"
OPT_MODEL = "model.opt.onnx"
OPT_DATA = "model.opt.onnx.data"
HUGE_PAGES_OFF = "off (load option huge_pages=false)"  # a session's placement record where it was told not to place
ORT_CACHE_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int8)": np.int8}
OPTIONS = (
    Option("lm_head", "str", None, "the lm_head's bits under --weights int4: int8 (the default: the logits' "
           "projection is the most sensitive matmul) or int4 (fewer bytes a token, as onnxruntime-genai's "
           "int4 builds)", choices=tuple(LM_HEAD_MODES)),
    Option("quantizer", "str", "rtn", "how --weights int8/int4 round each matrix: rtn (round to nearest, no data) "
           "or gptq (each row of K's rounding error spread over the rows not yet rounded, against what the matrix's "
           "input takes on the calibration text: --calibration-text, else the checkpoint's heldout.txt, else a "
           "built-in sample)",
           choices=QUANTIZERS),
    Option("ring_cache", "bool", True, "sliding-window layers keep a ring of window slots (past max_seq where every "
           "layer slides); false keeps them full length, on the fused GroupQueryAttention"),
    Option("huge_pages", "bool", None, "place the engine's weights in huge pages (default: true for int8/int4 "
           "weights)", phase="load"),
    Option("native_matmul", "bool", None, "kvexport's quantized matmul where it is built and the CPU runs it "
           "(default: true)", phase="load"),
    Option("native_attention", "bool", None, "kvexport's attention over the cache in one-token steps where it is "
           "built and the CPU runs it (default: true)", phase="load"),
)


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def fingerprint() -> dict[str, Any]:
    import onnxruntime as ort

    flags = read_cpu_flags()
    return {
        "onnxruntime": ort.__version__,
        "isa": sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "sse4"))),
        "machine": os.uname().machine,
    }


def session_options(threads: int, optimized_path: Path | None = None) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3  # warnings about in-place TensorScatter are ours to prevent, not to print
    if optimized_path is not None:
        so.optimized_model_filepath = str(optimized_path)
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", OPT_DATA)
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    return so


def open_ort_session(model: Path, threads: int, huge_pages: bool = True, off: str = HUGE_PAGES_OFF,
                     qmm: Kernel | None = None, attn: Kernel | None = None) -> tuple[Any, Placement, int, int, Kernel]:
    """An ONNX Runtime CPU session of `model` (session_options(threads)) whose weights, repacked while the session
    is made, are then moved to huge pages where the system allows (kvexport.runtime.hugepages; `huge_pages=False`
    leaves them in small pages and records `off` as why). With a usable `qmm`, its MatMulNBits nodes that
    kvexport's native kernel takes run it, with a usable `attn` its GroupQueryAttention nodes over an int8 cache, or
    over an fp32 cache in one-token steps (kvexport.native); then how many of each were swapped, and `attn` named
    for the op that was."""
    from kvexport.native import open_session

    before = anonymous_regions() if huge_pages else None
    sess, swapped, attended, attn = open_session(model, session_options(threads), qmm or NOT_ASKED, huge_pages,
                                                 attn or ATTENTION_NOT_ASKED)
    placement = collapse_new(before) if huge_pages else Placement(0, 0.0, off, asked=False)
    return sess, placement, swapped, attended, attn


class CpuBackend(_Backend):
    name = "cpu"

    def capabilities(self) -> Capabilities:
        return Capabilities(
            name="cpu",
            description="ONNX Runtime CPU execution provider (embedded default: no GPU, no vendor SDK)",
            ir_cache_style="static",
            cache_policy="grow",
            precisions=("fp32", *CPU_BITS),  # int8/int4: MatMulNBits (kvexport.backends.cpu_quant)
            default_precision="fp32",
            default_group_size=dict(CPU_DEFAULT_GROUP_SIZE),  # int8: 128 (kvexport.backends.cpu_quant)
            kv_modes=("fp32", "int8"),
            ring_cache=True,  # ring layers stay unfused Attention-24 + TensorScatter circular (GroupQueryAttention has no ring)
            rebuilds_at_load=True,  # the engine file is rebuilt from the IR where ONNX Runtime differs
            devices=("cpu",),
            sdk=("onnxruntime",),
            options=OPTIONS,
        )

    def build_options(self, options: BuildOptions) -> dict[str, Any]:
        """--option lm_head= applies to int4 weights, at the group sizes whose int4 lm_head has a tolerance row."""
        from kvexport.tolerances import TOLERANCES, mode_key

        typed = super().build_options(options)
        head = typed["lm_head"]
        weights = options.weights or options.precision or "fp32"
        if typed["quantizer"] != "rtn" and weights not in (*CPU_BITS, "auto"):
            raise InputError(f"--option quantizer={typed['quantizer']} rounds int8/int4 weights; --weights {weights} "
                             "has nothing to round: use --weights int8 or int4, or drop the option")
        if head is not None and weights != "auto":
            if weights != "int4":
                raise InputError(f"--option lm_head={head} sets the lm_head's bits under --weights int4; with "
                                 f"--weights {weights} the lm_head takes the weights' own precision: drop the option")
            group = options.group_size or CPU_DEFAULT_GROUP_SIZE["int4"]
            key = mode_key("int4", group, options.kv or "fp32", lm_head=head)
            if ("cpu", key) not in TOLERANCES:
                rows = ", ".join(sorted(k for t, k in TOLERANCES if t == "cpu" and "head" in k))
                raise InputError(f"the cpu target has no tolerance row for {key}, so nothing could verify it "
                                 f"(rows with an lm_head option: {rows}); use --group-size 32 or drop the option")
        return typed

    def availability(self) -> list[str]:
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            return ["onnxruntime is not installed (pip install onnxruntime)"]
        return []

    def rings_off(self, options: BuildOptions) -> str | None:
        if options.kv == "int8":
            return "the int8 cache is GroupQueryAttention's quantized cache, which has no ring"
        if not self.build_options(options)["ring_cache"]:
            return "--option ring_cache=false"
        return None

    def check(self, manifest: Manifest) -> list[str]:
        problems = super().check(manifest)
        if manifest.raw["ir"]["dtype"] != "float32":
            problems.append(f"the cpu target runs fp32 graphs; this IR is {manifest.raw['ir']['dtype']}")
        return problems

    def build(self, folder: Path, manifest: Manifest, options: BuildOptions, progress: Progress) -> None:
        """Run ONNX Runtime's graph optimizer once and store its result, so loading is fast."""
        import onnx
        import onnxruntime as ort

        from kvexport.backends.cpu_fusion import fold_rotary, lower_for_onnxruntime
        from kvexport.backends.cpu_kv import build_int8_cache

        self.require_available()
        precision = options.weights or options.precision or "fp32"
        caps = self.capabilities()  # reads the CPU's flags (the int8 default block size depends on them)
        if precision not in caps.precisions:
            raise InputError(f"the cpu target builds weights {', '.join(caps.precisions)}, "
                             f"not {precision!r}")
        group_size = options.group_size or caps.default_group_size.get(precision)
        kv_mode = options.kv or "fp32"
        if kv_mode not in caps.kv_modes:
            raise InputError(f"the cpu target keeps its KV cache in {' or '.join(caps.kv_modes)}, "
                             f"not {kv_mode!r}")
        if kv_mode == "int8" and manifest.cache.get("ring"):
            raise InputError("the cpu target's int8 cache is GroupQueryAttention's, which has no ring, and this IR keeps "
                             "its sliding-window layers on ring caches: build it with `kvexport build --kv int8`, which "
                             "exports the model without rings, or keep --kv fp32 for the rings")
        engine = folder / ENGINE_DIR
        engine.mkdir(exist_ok=True)
        progress("lowering attention to ONNX Runtime's GroupQueryAttention and optimizing the graph")
        t0 = time.perf_counter()
        ir = folder / manifest.raw["ir"]["file"]
        model = onnx.load(str(ir), load_external_data=False)  # weights stay in model.onnx.data
        fused = lower_for_onnxruntime(model, manifest.config)
        fused["rotary_in_attention"] = fold_rotary(model)
        kv = None
        if kv_mode == "int8":
            kv = build_int8_cache(model, folder, manifest, options.calibration_text,
                                  options.threads or default_threads(), progress)
        staged = folder / FUSED_TMP  # beside the IR so its external-data path still resolves
        try:
            onnx.save_model(model, str(staged))
            ort.InferenceSession(str(staged), session_options(1, engine / OPT_MODEL),
                                 providers=["CPUExecutionProvider"])
        finally:
            staged.unlink(missing_ok=True)
        moe = f", {fused['fused_moe_layers']} routed layers in ONNX Runtime's MoE kernel" if "fused_moe_layers" in fused else ""
        rope = f", RoPE inside {fused['rotary_in_attention']} of them" if fused.get("rotary_in_attention") else ""
        progress(f"optimized in {time.perf_counter() - t0:.1f}s ({fused['fused_attention_layers']} attention "
                 f"layers fused{rope}, {fused['fused_skip_norms']} residual adds folded into their RMS norms{moe})")
        quant = None
        if precision in CPU_BITS:
            from kvexport.backends.cpu_quant import quantize_engine

            assert group_size is not None
            typed = self.build_options(options)
            calibration = None
            if typed["quantizer"] == "gptq":
                calibration = _gptq_calibration(engine / OPT_MODEL, folder, manifest, options, progress)
            quant = quantize_engine(engine / OPT_MODEL, OPT_DATA, precision, group_size, read_cpu_flags(), progress,
                                    head_mode=typed["lm_head"], fit=options.fit_blocks, calibration=calibration)
        if kv is not None:
            from kvexport.backends.cpu_kv import branch_engine

            kv["prefill"] = branch_engine(engine / OPT_MODEL)
        manifest.raw["target"] = {
            "backend": "cpu",
            "precision": precision,
            "engine_files": [f"{ENGINE_DIR}/{OPT_MODEL}", f"{ENGINE_DIR}/{OPT_DATA}"],
            "fingerprint": fingerprint(),
            "options": {"threads": options.threads, **fused},
        }
        if kv is not None:  # the int8 record with its scales; core records an fp32 cache itself
            manifest.raw["target"]["kv"] = kv
        if quant is not None:
            manifest.raw["target"]["weights"] = {
                "dtype": precision, "group_size": group_size,
                "bytes": self.weight_bytes(folder, manifest, precision, group_size), **quant}

    def auto_modes(self, flags: set[str]) -> list[AutoMode]:
        """Fewest weight bytes first: decode at batch 1 reads every weight once per token, and MatMulNBits
        at accuracy_level 4 ran an int4 matmul 4-5x, an int8 one 3-4x, as fast as fp32 even on AVX2
        (docs/backends/cpu.md). The cache stays fp32 unless asked: int8 KV helps only long contexts
        and slows prefill on this ONNX Runtime."""
        from kvexport.backends.cpu_quant import accuracy_level

        level = accuracy_level(flags)[1]
        g = CPU_DEFAULT_GROUP_SIZE["int4"]
        modes = [AutoMode("int4", "fp32", f"int4 weights (MatMulNBits, group {g}, {level}): the fewest bytes a "
                          "token", g),
                 AutoMode("int8", "fp32", f"int8 weights (MatMulNBits, {level})"),
                 AutoMode("fp32", "fp32", "fp32: exact")]
        return modes + [AutoMode(m.weights, "int8", m.reason + "; the cache in int8", m.group_size) for m in modes]

    def weight_bytes(self, folder: Path, manifest: Manifest, weights: str, group_size: int | None) -> int:
        """Counted: every initializer of the optimized graph (packed int4/int8 blocks and their scales included)."""
        import onnx
        from onnx.helper import tensor_dtype_to_np_dtype

        model = onnx.load(str(folder / ENGINE_DIR / OPT_MODEL), load_external_data=False)
        return sum(int(np.prod(t.dims)) * np.dtype(tensor_dtype_to_np_dtype(t.data_type)).itemsize
                   for t in model.graph.initializer)

    def open_session(self, folder: Path, manifest: Manifest, *, threads: int | None = None, no_rebuild: bool = False,
                     huge_pages: bool | None = None, native_matmul: bool | None = None,
                     native_attention: bool | None = None) -> CpuSession:
        self.require_available()  # the options are checked and typed by Backend.load (load_options)
        from kvexport import native

        qmm = (native.kernel() if native_matmul in (None, True)
               else Kernel(False, "", "off (load option native_matmul=false)"))
        attn = (native.attention_kernel() if native_attention in (None, True)
                else Kernel(False, "", "off (load option native_attention=false)", **native.ATTENTION_NAMES))
        target = manifest.target or {}
        quantized = (target.get("weights") or {}).get("dtype", "fp32") != "fp32"
        # default: quantized weights only. bench-1b int4 decoded 1.06-1.08x with them in huge pages; fp32's step
        # moved within noise (bench-1b here, bench-125m on Zen 3), so its load is not made longer for it
        huge = huge_pages if huge_pages is not None else quantized
        off = (HUGE_PAGES_OFF if huge_pages is not None else
               "off: the default for fp32 weights (load option huge_pages=true places them)")
        model = folder / ENGINE_DIR / OPT_MODEL
        warning = None
        built_with = target.get("fingerprint", {}).get("onnxruntime")
        if built_with != fingerprint()["onnxruntime"]:
            # an optimized graph from another ONNX Runtime may hold kernels this one lacks: the IR is portable
            if no_rebuild:
                raise ArtifactError(f"{folder} was optimized by onnxruntime {built_with}, this is "
                                    f"{fingerprint()['onnxruntime']}; drop --no-rebuild to load the IR instead")
            lossy = {k: (target.get(k) or {}).get("dtype", "fp32") for k in ("weights", "kv")}
            lossy = {k: v for k, v in lossy.items() if v != "fp32"}
            if lossy:
                # the IR holds fp32 weights and an fp32 cache: running it would not be the engine the
                # manifest describes (nor the tolerance row verify would judge it by)
                raise ArtifactError(
                    f"{folder} keeps {', '.join(f'{k} {v}' for k, v in lossy.items())} in the engine graph made by "
                    f"onnxruntime {built_with}; this is onnxruntime {fingerprint()['onnxruntime']}, and the portable "
                    "IR holds fp32 only. Rebuild the artifact here (kvexport build ... --target cpu) or install "
                    f"onnxruntime=={built_with}")
            model = folder / manifest.raw["ir"]["file"]
            warning = f"optimized graph made by onnxruntime {built_with}; loaded the portable IR instead"
        threads = threads or target.get("options", {}).get("threads") or default_threads()
        return CpuSession(model, manifest, threads, warning, huge_pages=huge, huge_pages_off=off, qmm=qmm, attn=attn)

    def kv_bytes_per_token(self, manifest: Manifest, kv: str) -> int:
        """int8: one byte per element; its per-channel scales are a fixed cost (target.kv.scale_bytes),
        not one per token."""
        if kv != "int8":
            return super().kv_bytes_per_token(manifest, kv)
        from kvexport.precision import kv_elements_per_token

        return kv_elements_per_token(manifest)

    def doctor(self) -> dict[str, Any]:
        try:
            import onnxruntime as ort
        except ImportError:
            return {}
        from kvexport import native
        from kvexport.errors import BackendUnavailableError

        try:
            k = native.kernel()
            qmm = f"{k.ours} ({k.isa}) for 4-bit weights" if k.usable else f"ONNX Runtime's: {k.why}"
            a = native.attention_kernel()
            f = a.for_fp32()  # the fp32 op has no VNNI form: one ISA named where both have the same
            fp32 = f.ours.split()[-1]
            if not a.usable:
                attn = f"ONNX Runtime's: {a.why}"
            elif f.isa == a.isa:
                attn = f"{a.ours}, {fp32} ({a.isa})"
            else:
                attn = f"{a.ours} ({a.isa}), {fp32} ({f.isa})"
        except BackendUnavailableError as e:
            qmm = attn = str(e)
        return {"onnxruntime": ort.__version__, "providers": ort.get_available_providers(), "quantized_matmul": qmm,
                "cache_attention": attn}


@dataclass
class CpuState:
    """One request's cache: 2 * layers aligned buffers (B, H_kv, capacity, D), bound in place."""

    batch: int
    capacity: int
    caches: list[np.ndarray]
    binding: Any
    logits: np.ndarray  # (B, 1, V)
    mask: np.ndarray | None = None  # (B, 1, 1, capacity) decode mask, reused every step
    bytes_copied: int = 0
    run_seconds: float = 0.0
    steps: int = 0
    grow_events: list[int] = field(default_factory=list)


def _gptq_calibration(model: Path, folder: Path, manifest: Manifest, options: BuildOptions,
                      progress: Progress) -> Calibration:
    """What quantize_engine asks GPTQ's inputs of: a prefill of the calibration text (its tail, as the int8
    cache's scales take it) through the fp32 graph at `model`, and the record of that text."""
    from kvexport.backends import cpu_gptq
    from kvexport.backends.cpu_kv import build_calibration_ids

    source, ids = build_calibration_ids(options.calibration_text, folder, manifest)
    threads = options.threads or default_threads()

    def calibration(names: list[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        progress(f"gptq: prefilling {len(ids)} calibration tokens ({source}) for what the matmuls' inputs take")
        return cpu_gptq.collect(model, manifest, ids, threads, names, progress), cpu_gptq.record(source, len(ids))

    return calibration


class CpuSession(Session):
    def __init__(self, model: Path, manifest: Manifest, threads: int, warning: str | None = None,
                 huge_pages: bool = False, huge_pages_off: str = HUGE_PAGES_OFF, qmm: Kernel | None = None,
                 attn: Kernel | None = None):
        self.manifest, self.threads, self.warning = manifest, threads, warning
        cfg = manifest.config
        self.max_seq, self.vocab_size = manifest.max_seq, cfg.vocab_size
        self.kv_heads, self.head_dim = cfg.num_key_value_heads, cfg.head_dim
        self.pairs = manifest.kv_pairs()
        self.ring = RingSpec.of(manifest)  # sliding-window layers on a ring of at most `window` slots
        # positions a request may reach: past max_seq where every layer slides on a ring
        self.limit = self.ring.limit(self.max_seq) if self.ring else self.max_seq
        try:
            self.sess, self.huge_pages, swapped, attended, attn = open_ort_session(model, threads, huge_pages,
                                                                                   huge_pages_off, qmm, attn)
        except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph types
            raise ArtifactError(f"ONNX Runtime could not load {model}: {e}; rebuild the artifact") from e
        self.qmm = (qmm or NOT_ASKED).record(swapped)
        self.attn = attn.record(attended)
        # the cache dtype is the loaded graph's: int8 in an engine built with --kv int8, the IR's
        # float type in the IR (the fallback above) and in every other engine
        past = {i.name: i.type for i in self.sess.get_inputs()}[self.pairs[0][0]]
        self.input_names = {i.name for i in self.sess.get_inputs()}
        self.cache_dtype = ORT_CACHE_DTYPES[past]
        kv = (manifest.target or {}).get("kv") or {}
        self.scale_bytes = int(kv.get("scale_bytes", 0)) if self.cache_dtype == np.int8 else 0
        if not manifest.raw["ir"]["last_token_only"]:
            raise ArtifactError("the cpu runtime expects an IR exported with last-token-only logits")
        # GroupQueryAttention rotates q and k itself (cpu_fusion.fold_rotary): a first prompt whose rows start
        # at different positions (left padding) goes one row at a time. Not under the int8 cache, whose prompts
        # take its many-token branch, which rotates each token at its own position (cpu_kv._fp32_attention)
        self.rows_apart = model.name.endswith(OPT_MODEL) and self.cache_dtype != np.int8 and bool(
            ((manifest.target or {}).get("options") or {}).get("rotary_in_attention"))

    def describe(self) -> dict[str, Any]:
        return {"threads": self.threads, "cache_policy": "grow", "device": "cpu",
                "kv_dtype": np.dtype(self.cache_dtype).name, "warning": self.warning,
                "huge_pages": self.huge_pages.record(), "quantized_matmul": self.qmm,
                "cache_attention": self.attn,
                "ring": None if self.ring is None else {"window": self.ring.window, "layers": sorted(self.ring.layers)}}

    # --- state -----------------------------------------------------------------------------
    def new_state(self, batch: int, capacity: int) -> CpuState:
        cap = capacity_for(min(capacity, self.max_seq), self.max_seq)  # a ring-only request may pass max_seq
        state = CpuState(batch, 0, [], self.sess.io_binding(),
                         aligned_zeros((batch, 1, self.vocab_size), np.float32))
        state.binding.bind_output("logits", "cpu", 0, np.float32, state.logits.shape, state.logits.ctypes.data)
        self._resize(state, cap)
        return state

    def cache_lengths(self, capacity: int) -> list[int]:
        """Slots of each cache pair when the full-length ones hold `capacity`: a ring holds at most its window."""
        ring = self.ring
        return [ring.length(capacity) if ring is not None and ring.is_ring(k) else capacity
                for k in range(len(self.pairs))]

    def _resize(self, state: CpuState, capacity: int) -> None:
        """Allocate caches of `capacity` slots (a ring: at most its window), copy the held rows once, rebind
        past=present. A ring already at its window keeps its buffer: nothing of it is copied."""
        shapes = [(state.batch, self.kv_heads, n, self.head_dim) for n in self.cache_lengths(capacity)]
        new, copied = regrow(state.caches, shapes, self.cache_dtype)
        state.bytes_copied += copied
        for (inp, out), buf in zip(self.pairs, new):
            # same address for input and output: TensorScatter then writes in place
            state.binding.bind_input(inp, "cpu", 0, self.cache_dtype, buf.shape, buf.ctypes.data)
            state.binding.bind_output(out, "cpu", 0, self.cache_dtype, buf.shape, buf.ctypes.data)
        if state.caches:
            state.grow_events.append(capacity)
        state.caches, state.capacity = new, capacity
        state.mask = aligned_zeros((state.batch, 1, 1, capacity), np.bool_)

    def release(self, state: CpuState) -> None:
        state.caches = []
        state.binding.clear_binding_inputs()
        state.binding.clear_binding_outputs()

    def cache_bytes(self, state: CpuState) -> int:
        """The state's cache buffers, plus an int8 cache's per-channel scales (engine constants)."""
        return sum(c.nbytes for c in state.caches) + self.scale_bytes

    def cache_bytes_copied(self, state: CpuState) -> int:
        return state.bytes_copied

    # --- step -------------------------------------------------------------------------------
    def step(self, state: CpuState, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        B, S = input_ids.shape
        total = attention_mask.shape[-1]  # slots held after this step
        if B != state.batch:
            raise InputError(f"this state holds {state.batch} rows, the step gave {B}")
        if total > self.limit:
            raise InputError(f"{total} slots exceed {'the model' if self.limit > self.max_seq else 'max_seq'} "
                             f"limit of {self.limit}")
        T = total - S
        logits = state.logits[:, 0, :]
        # a ring takes at most `window` new rows a step (more would overwrite each other): longer ones in pieces;
        # at batch 1 a long prompt also goes in pieces of PREFILL_PIECE (GroupQueryAttention scores each new row
        # against every slot held after the step, the causal mask applied after: one call of N rows pays N x N)
        window = self.ring.window if self.ring else None
        pieces = chunks(S, piece_limit(window) if B == 1 else window)
        if B > 1 and len(pieces) > 1 and not self.ring.every_layer:  # type: ignore[union-attr]
            # the full-length layers' GroupQueryAttention takes several new rows over a past at batch 1 only
            # (ONNX Runtime 1.31): after the first piece a batch goes on one token a step
            pieces = [pieces[0], *((t, t + 1) for t in range(pieces[0][1], S))]
        for a, b in pieces:
            if self.rows_apart and b - a > 1 and T + a == 0 and len(set(position_ids[:, b - 1] - (b - 1))) > 1:
                logits = self._rows_apart(state, input_ids[:, a:b], position_ids[:, a:b], attention_mask[:, :, a:b, :b])
            else:
                logits = self._step(state, input_ids[:, a:b], position_ids[:, a:b], attention_mask[:, :, a:b, : T + b])
        return logits

    def _rows_apart(self, state: CpuState, input_ids: np.ndarray, position_ids: np.ndarray,
                    attention_mask: np.ndarray) -> np.ndarray:
        """A first prompt whose rows start at different positions, one row a call: each call binds that row's
        slice of the state's cache buffers and logits (rows are contiguous in C order), as BoundRows does."""
        B, S = input_ids.shape
        self._fit(state, S)
        for r in range(B):
            b = self.sess.io_binding()
            for (inp, out), buf in zip(self.pairs, state.caches):
                shape, ptr = (1, *buf.shape[1:]), buf[r].ctypes.data
                b.bind_input(inp, "cpu", 0, self.cache_dtype, shape, ptr)
                b.bind_output(out, "cpu", 0, self.cache_dtype, shape, ptr)
            b.bind_output("logits", "cpu", 0, np.float32, (1, *state.logits.shape[1:]), state.logits[r].ctypes.data)
            self._run(b, state, input_ids[r:r + 1], position_ids[r:r + 1], attention_mask[r:r + 1])
        state.steps += 1
        return state.logits[:, 0, :]

    def _step(self, state: CpuState, input_ids: np.ndarray, position_ids: np.ndarray,
              attention_mask: np.ndarray) -> np.ndarray:
        self._fit(state, attention_mask.shape[-1])
        one = input_ids.shape[1] == 1  # a decode step fills the state's own mask buffer, reused every step
        self._run(state.binding, state, input_ids, position_ids, attention_mask, state.mask if one else None)
        state.steps += 1
        return state.logits[:, 0, :]

    def _fit(self, state: CpuState, total: int) -> None:
        """Grow the state's caches along the ladder where a call reaching `total` slots would not fit."""
        if min(total, self.max_seq) > state.capacity:
            self._resize(state, capacity_for(min(total, self.max_seq), self.max_seq))

    def _run(self, b: Any, state: CpuState, input_ids: np.ndarray, position_ids: np.ndarray,
             attention_mask: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Bind one call's inputs on `b` (its caches and logits already bound) and run it: the mask padded to the
        state's capacity (into `mask` where given), the rings' band, ids, positions, write_index."""
        B, S = input_ids.shape
        total = attention_mask.shape[-1]
        if "attention_mask" in self.input_names:  # absent where every layer is a ring
            if mask is None:
                mask = np.zeros((B, 1, S, state.capacity), dtype=np.bool_)
            mask[..., :total] = attention_mask
            b.bind_cpu_input("attention_mask", mask)
        if self.ring is not None:
            b.bind_cpu_input(MASK_INPUT, sliding_mask(attention_mask, self.ring.length(state.capacity), self.ring.window))
        b.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        b.bind_cpu_input("position_ids", np.ascontiguousarray(position_ids, dtype=np.int64))
        b.bind_cpu_input("write_index", np.full(B, total - S, dtype=np.int64))
        t0 = time.perf_counter()
        run_step(self.sess, b)
        state.run_seconds += time.perf_counter() - t0
