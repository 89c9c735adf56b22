"""The `intel` target: OpenVINO stateful IR (KV cache as ReadValue/Assign state) on the CPU plugin."""
from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

from kvexport.backends import (AutoMode, Backend, BuildOptions, Capabilities, Option, Progress, parse_bool,
                               parse_option)
from kvexport.doctor import cpu_info
from kvexport.errors import ArtifactError, BackendUnavailableError, InputError, KvexportError
from kvexport.manifest import Manifest
from kvexport.runtime.hugepages import Placement, Regions, anonymous_regions, collapse_new
from kvexport.runtime.ring import RingSpec
from kvexport_intel import compress, isa, numa
from kvexport_intel.session import KV_ITEM_BYTES, LOSSLESS_KV, IntelSession

ENGINE_DIR = "engine"
OV_PRECISION = {"fp32": "f32", "bf16": "bf16"}
# i8: kvexport's own int8 blocks under its own paged-attention op (kvexport_intel.int8_blocks); --kv int8 is i8 or
# u8 by the CPU (int8_blocks.int8_format) where --option kv_precision does not say which
KV_PRECISIONS = ("f32", "f16", "bf16", "u8", "i8")
KV_MODES = {"fp32": "f32", "fp16": "f16", "bf16": "bf16", "int8": "u8"}  # --kv -> OpenVINO's KV_CACHE_PRECISION
# --weights: fp32/bf16 are OpenVINO's INFERENCE_PRECISION_HINT over f32 weights; int8/int4 are NNCF-compressed
# weights (kvexport_intel.compress), their activations in the CPU's own precision
WEIGHT_MODES = ("fp32", "bf16", *compress.BLOCK_MODES)
OPTIONS = (
    Option("numa_node", "str", None, "pin threads and memory to this NUMA node (a number, or auto)", phase="both"),
    Option("numa_bind", "bool", True, "bind memory to the NUMA node the threads are pinned to", phase="both"),
    Option("engine", "str", "openvino", "the engine to build (IPEX is end-of-life)", choices=("openvino", "ipex")),
    Option("kv_precision", "str", None, "the cache's precision in OpenVINO's words (f32, f16, bf16, u8), or i8: "
           "kvexport's own int8 blocks, one f32 scale per token and head (0.266x f32 at head_dim 64, u8 0.281x), "
           "for paged requests; at build another name for --kv (u8 and i8 are --kv int8, which alone holds i8 on "
           "AVX-512 or AVX2 CPUs where a C++ compiler is on PATH (on AMX ones under bf16 for head sizes 32, 64, "
           "96, 128, whose prompts it runs on AMX tiles), else u8), "
           "at load another precision than built", choices=KV_PRECISIONS, phase="load"),
    Option("precision", "str", None, "run in another precision than built", choices=("fp32", "bf16", "f32", "bfloat16"),
           phase="load"),
    Option("batch_rows", "str", "paged", "how batches run, the serving scheduler's rows and a batch of prompts given "
           "to generate: paged (OpenVINO paged attention, every row in one infer per decode step, a row's padding not "
           "held) or state (the scheduler's rows one InferRequest each, stepped in turn; a batch of prompts one "
           "stateful call, left-padded)",
           choices=("paged", "state"), phase="load"),
    Option("paged_compile", "str", "load", "when the paged-attention form that long prompts and batched rows run is "
           "compiled: at load (where the engine holds a prompt of paged_prefill_min tokens; the load takes longer) "
           "or on first use (first_use: the compile then lands in the first long prompt's or batch's time)",
           choices=("load", "first_use"), phase="load"),
    Option("paged_prefill_min", "int", None, "a fresh one-row prompt of at least this many tokens is prefilled and "
           "decoded through OpenVINO paged attention (default 1: every one; shorter ones take the fused attention "
           "with state)", phase="load"),
    Option("paged_split", "str", "none", "which packed projections the paged-attention form runs as one matmul per "
           "piece: none, qkv (q|k|v) or all (gate|up too: prompts of thousands of tokens ~2% faster, decode steps "
           "~7% slower); the pieces share the packed weights' memory", choices=("none", "qkv", "all"), phase="load"),
    Option("prompt_split", "str", "same", "a second paged-attention form for the steps of prompts (more than one "
           "token a row), its packed projections cut: none, qkv or all (decode steps keep paged_split's form over the "
           "same blocks; all ran prompts of f32 weights at f32 activations 2-7% faster, but the plugin prepares its "
           "weights again: ~0.9x the weight bytes more memory and a longer load on bench-125m), or same (default: "
           "no second form)", choices=("same", "none", "qkv", "all"), phase="load"),
    Option("dynamic_quant_group", "int", None, "int8/int4 weights: the matmuls' activations quantized to int8 in "
           "groups of this many (OpenVINO's DYNAMIC_QUANTIZATION_GROUP_SIZE; default the plugin's own, 32, as "
           "OpenVINO GenAI runs); 0 turns it off (the activations' own precision into the decompressed weights)",
           phase="load"),
    Option("decode_matmul", "str", "auto", "int8/int4 weights, and bf16 ones (or f32 ones run at bf16): what "
           "computes a decode step's matmuls in the paged form: kvexport (kvexport's QGemv over the IR's own "
           "compressed weights, AVX512-VNNI, or over a bf16 copy of its f32 weights, AVX512-BF16; prompts then run a "
           "second paged form with the plugin's matmuls), openvino (the plugin's), or auto (kvexport where the CPU has "
           "that instruction set and a C++ compiler is on PATH)", choices=("auto", "kvexport", "openvino"),
           phase="load"),
    Option("prompt_matmul", "str", "auto", "float weights whose decode steps read kvexport's bf16 copies "
           "(decode_matmul): what computes the steps of more than two rows (prompts, batches): kvexport (the same "
           "op over the same copies through AMX-BF16 tiles: one paged form, one copy of the weights), openvino (a "
           "second paged form with the plugin's matmuls, which prepares a second copy), or auto (kvexport where the "
           "CPU has AMX-BF16)", choices=("auto", "kvexport", "openvino"), phase="load"),
    Option("huge_pages", "bool", True, "place the weights the plugin prepares (its repacked or converted copies, made "
           "at load by one warm-up token) in huge pages", phase="load"),
    Option("ring_cache", "bool", True, "sliding-window layers keep a ring of window slots in the state (past max_seq "
           "where every layer slides); false keeps them full length, on the fused attention and paged attention"),
    Option("int4_sym", "bool", False, "int4 weights symmetric (NNCF INT4_SYM, no zero points) instead of "
           "INT4_ASYM, optimum-intel's default"),
    Option("quantizer", "str", "rtn", "how --weights int4 rounds: rtn (NNCF's data-free rounding) or gptq (NNCF's "
           "GPTQ, against what each matmul's input takes on the calibration text: --calibration-text, else the "
           "checkpoint's heldout.txt, else a built-in sample)",
           choices=tuple(compress.QUANTIZERS)),
)


class IntelBackendWarning(UserWarning):
    """The artifact runs, but not as built (e.g. bf16 artifact on a CPU without bf16 hardware)."""


def _openvino_version() -> str | None:
    try:
        import openvino as ov
    except ImportError:
        return None
    return str(ov.get_version())


def _kv_precision(value: Any) -> str:
    kv = str(value).lower()
    if kv not in KV_PRECISIONS:
        raise InputError(f"kv_precision must be one of {', '.join(KV_PRECISIONS)}, not {value!r} "
                         "(--option kv_precision=u8 quantizes the cache per token and head)")
    return kv


def _numa_node(value: Any) -> int | None:
    if value is None or str(value).lower() in ("auto", ""):
        return None
    try:
        node = int(value)
    except ValueError as e:
        raise InputError(f"numa_node must be a node number or 'auto', not {value!r}") from e
    if node < 0:
        raise InputError(f"numa_node must be >= 0, not {node}")
    return node


class IntelBackend(Backend):
    name = "intel"

    def capabilities(self) -> Capabilities:
        return Capabilities(
            name="intel",
            description="OpenVINO CPU plugin, stateful KV cache with fused SDPA, AMX/AVX512-BF16-aware precision, NUMA pinning",
            ir_cache_style="concat",
            cache_policy="internal",
            precisions=WEIGHT_MODES,
            default_precision=isa.auto_precision(isa.read_cpu_flags()),
            default_group_size=dict(compress.DEFAULT_GROUP_SIZE),  # int8: per output channel, NNCF's only way
            devices=("cpu",),
            sdk=("openvino",),
            kv_modes=tuple(KV_MODES),
            options=OPTIONS,
            option_aliases={"kv_precision": ("kv", {**{v: k for k, v in KV_MODES.items()}, "i8": "int8"})},
        )

    def availability(self) -> list[str]:
        if _openvino_version() is None:
            return ["openvino is not installed (pip install 'kvexport[intel]' or pip install openvino==2026.4.1)"]
        return []

    def check(self, manifest: Manifest) -> list[str]:
        problems = super().check(manifest)
        if manifest.raw["ir"]["dtype"] != "float32":
            problems.append(f"the intel target lowers fp32 IRs (it picks bf16 at compile time); "
                            f"this IR is {manifest.raw['ir']['dtype']}")
        if not manifest.raw["ir"]["last_token_only"]:
            problems.append("the intel target expects an IR exported with last-token-only logits")
        return problems

    def build_options(self, options: BuildOptions) -> dict[str, Any]:
        """The declared options, and the weight-mode combinations NNCF does not make, refused before the export."""
        extra = super().build_options(options)
        weights = _weights_mode(options)
        if weights == "int8" and options.group_size is not None:
            raise InputError("the intel target compresses int8 weights per output channel (NNCF's INT8 modes take no "
                             "group size); --group-size applies to --weights int4 here")
        if extra["int4_sym"] and weights != "int4":
            raise InputError(f"--option int4_sym applies to --weights int4, not {weights or 'the default'}")
        flags = isa.read_cpu_flags()
        compress.check_quantizer(weights or isa.auto_precision(flags), extra["quantizer"])
        if weights in compress.BLOCK_MODES:
            compress.require_nncf()
        activations = _activations(weights or isa.auto_precision(flags), flags)
        kv, _ = _build_kv(options, flags, activations)
        if kv == "bf16" and activations != "bf16":
            raise InputError(f"--kv bf16 goes with bf16 activations, and this build runs f32 ("
                             + ("this CPU has neither AMX-BF16 nor AVX512-BF16" if not isa.has_bf16(flags)
                                else f"--weights {weights}") + "); for a 2-byte cache under f32 activations pass "
                             "--kv fp16 (the same bytes, 3 more mantissa bits), or --kv fp32")
        if kv != "f32" and "ring_cache" in options.extra and extra["ring_cache"]:
            raise InputError(f"--option ring_cache=true with the {kv} cache: {RINGS_F32}; build with --kv fp32 to keep "
                             "the rings, or leave ring_cache unset for a quantized cache on full-length sliding layers")
        return extra

    def auto_modes(self, flags: set[str]) -> list[AutoMode]:
        """Fewest weight bytes first (decode reads every weight once per token); bf16 only where the CPU
        computes it; the cache in f32 first (an int8 cache pays off at long contexts, so only when asked)."""
        g = compress.DEFAULT_GROUP_SIZE["int4"]
        modes = [AutoMode("int4", "fp32", f"int4 weights (NNCF INT4_ASYM, group {g}): the fewest bytes a token", g),
                 AutoMode("int8", "fp32", "int8 weights (NNCF INT8_ASYM per channel): a quarter of fp32's bytes")]
        if isa.has_bf16(flags):
            modes.append(AutoMode("bf16", "fp32", isa.why_precision(flags)))
        modes.append(AutoMode("fp32", "fp32", "fp32: exact"))
        return modes + [AutoMode(m.weights, "int8", m.reason + "; the cache in int8", m.group_size) for m in modes]

    # --- build ------------------------------------------------------------------------------
    def build(self, folder: Path, manifest: Manifest, options: BuildOptions, progress: Progress) -> None:
        """Trace the owned decoder (weights from the IR) into a stateful OpenVINO IR under engine/."""
        self.require_available()
        extra = self.build_options(options)
        if extra["engine"] != "openvino":
            from kvexport_intel.ipex import require_ipex

            require_ipex()  # raises with the reason: IPEX is end-of-life and pinned to torch 2.8
            raise InputError("the intel target builds OpenVINO engines only; IPEX is end-of-life (see docs/backends/intel.md)")
        flags = isa.read_cpu_flags()
        weights = _weights_mode(options) or isa.auto_precision(flags)
        precision = _activations(weights, flags)
        plan = compress.plan(weights, options.group_size, extra["int4_sym"], extra["quantizer"]) \
            if weights in compress.BLOCK_MODES else None
        kv, kv_why = _build_kv(options, flags, precision, manifest)
        numa_node = _numa_node(extra.get("numa_node"))
        if numa_node is not None:
            numa.read_topology().node(numa_node)  # fail now, not at first load, for a node that does not exist
        problems = self.check(manifest)
        if problems:
            raise InputError("; ".join(problems))

        import openvino as ov

        from kvexport.export import decoder_from_ir
        from kvexport_intel import lowering

        t0 = time.perf_counter()
        progress("intel: reading weights back from the IR into the owned decoder")
        dec = decoder_from_ir(folder, manifest, cache_style="concat", last_token_only=True)
        progress("intel: tracing the stateful step through OpenVINO's PyTorch frontend")
        rings = extra["ring_cache"] and kv == "f32"
        if extra["ring_cache"] and not rings and any(manifest.config.window_of(i) is not None
                                                     for i in range(manifest.config.num_hidden_layers)):
            progress(f"intel: sliding-window layers keep full-length caches: {RINGS_F32}")
        model, ring = lowering.convert(dec, manifest, ring=rings)
        if plan is not None:
            dataset = _calibration(model, folder, manifest, options, ring, plan, progress) \
                if plan.get("data_aware") else None
            progress(f"intel: compressing weights with NNCF {plan['mode']}, group size {plan['group_size']}")
            model = compress.compress(model, plan, dataset)
            progress(f"intel: compressed weight tensors {plan['compressed_weights']}")
        engine = folder / ENGINE_DIR
        engine.mkdir(exist_ok=True)
        lowering.static_split_lengths(model)
        ov.save_model(model, str(engine / lowering.XML), compress_to_fp16=False)
        progress(f"intel: wrote {ENGINE_DIR}/{lowering.XML} in {time.perf_counter() - t0:.1f}s; checking the fused path")
        held = held_kv(precision, kv, ring)
        # the weights as inputs: the plugin's transformations without its packed copy of every weight
        compiled = ov.Core().compile_model(lowering.weights_as_inputs(engine / lowering.XML), "CPU",
                                           _compile_config(precision, held, 0, True, plan is not None))
        fused = lowering.fused_attention_layers(compiled)
        ops = lowering.runtime_op_counts(compiled)
        del compiled
        layers = manifest.config.num_hidden_layers
        full = layers - (len(ring.layers) if ring else 0)  # a ring's Assign is its scatter, not the fused Concat
        if kv != "f32" and fused == 0:
            warnings.warn(f"no attention layer of this model is on OpenVINO's fused attention-with-state node, so the "
                          f"{kv} cache precision applies to none: its cache stays f32", IntelBackendWarning, stacklevel=2)
        if fused != full:
            warnings.warn(f"only {fused} of {full} full-length attention layers compiled to OpenVINO's fused "
                          "attention-with-KV-cache node; decode will be slower", IntelBackendWarning, stacklevel=2)
        asked = options.weights or options.precision
        reason = isa.why_precision(flags) if not asked else f"{weights}: asked for with --weights"
        if plan is not None:
            reason = f"{weights} weights ({plan['mode']}, NNCF); activations {isa.why_precision(flags)}"
        progress(f"intel: {fused}/{layers} layers on the fused ScaledDotProductAttention+state path"
                 + (f"; {len(ring.layers)} sliding layers on {ring.window}-slot rings in the state" if ring else ""))
        progress(f"intel: precision {reason}" + ("" if asked or precision == "fp32"
                                                  else " (pass --precision fp32 for exact f32 numerics)"))
        if held != kv:
            progress(f"intel: the cache holds bf16: {BF16_HELD}")
        if kv_why is not None:
            progress(f"intel: --kv int8 holds {kv}: {kv_why}")
        if kv not in LOSSLESS_KV:
            progress(f"intel: what the {kv} cache costs against an f32 one is measured by verify (it compiles the "
                     "engine twice at f32, which a build beside the decoder's weights would not fit in twice their bytes)")
        manifest.raw["target"] = {
            "backend": "intel",
            "precision": weights,
            "activations": precision,  # OpenVINO's INFERENCE_PRECISION_HINT at load
            # bytes: the engine's .bin, every constant (weights, scales, zero points) as the CPU plugin reads it,
            # except bf16, which the file holds in f32 and the plugin converts when it compiles
            "weights": {"dtype": weights, "group_size": plan["group_size"] if weights == "int4" else None,
                        "bytes": (engine / lowering.BIN).stat().st_size // (2 if weights == "bf16" else 1),
                        **(plan or {})},
            "engine_files": [f"{ENGINE_DIR}/{lowering.XML}", f"{ENGINE_DIR}/{lowering.BIN}"],
            "fingerprint": {
                "openvino": _openvino_version(),
                **isa.fingerprint_isa(flags),
                "precision_reason": reason,
                "cpu": cpu_info()["model"],
                "numa_nodes": len(numa.read_topology().nodes),
                "fused_attention_layers": fused,
                "runtime_ops": {k: ops[k] for k in ("ScaledDotProductAttention", "MemoryInput", "MemoryOutput")},
            },
            "options": {"threads": options.threads, "kv_precision": kv, "numa_node": numa_node,
                        "numa_bind": extra["numa_bind"]},
            # the engine's rings, which its concat IR does not keep (kvexport.runtime.ring.RingSpec.of reads them)
            "ring": {"window": ring.window, "layers": sorted(ring.layers), "max_positions": ring.max_positions}
            if ring else None,
        }
        if held == "bf16":  # core's record would say the --kv asked for; this is the cache held
            manifest.raw["target"]["kv"] = {"dtype": "bf16", "bytes_per_token": self.kv_bytes_per_token(manifest, "bf16"),
                                            "why": BF16_HELD}
        if held == "i8":  # core's record counts u8's f32 scale and zero point; i8 holds one f32 scale
            from kvexport_intel.int8_blocks import slot_bytes

            cfg = manifest.config
            manifest.raw["target"]["kv"] = {"dtype": "int8", "format": "i8: kvexport's int8 blocks, one f32 scale per "
                                            "token and KV head (kvexport_intel.int8_blocks)",
                                            "bytes_per_token": cfg.num_hidden_layers * slot_bytes(cfg.num_key_value_heads,
                                                                                                  cfg.head_dim)}
        elif held == "u8":
            manifest.raw["target"]["kv"] = {"dtype": "int8", "format": "u8: OpenVINO's, an f32 scale and zero point "
                                            "per token and KV head",
                                            "bytes_per_token": self.kv_bytes_per_token(manifest, "int8")}
        if kv_why is not None:
            manifest.raw["target"]["kv"]["why"] = f"--kv int8 holds {kv}: {kv_why}"

    # --- load -------------------------------------------------------------------------------
    def open_session(self, folder: Path, manifest: Manifest, *, threads: int | None = None,
                     **options: Any) -> IntelSession:
        self.require_available()
        import openvino as ov

        from kvexport_intel import lowering

        paged_split = _given(options, "paged_split") or "none"
        prompt_split = _given(options, "prompt_split")
        paged_min = _given(options, "paged_prefill_min")
        if paged_min is not None and paged_min < 1:
            raise InputError(f"paged_prefill_min is a prompt length of at least 1 token, not {paged_min}")
        target = manifest.target or {}
        if target.get("backend") != "intel":
            raise ArtifactError(f"{folder} was built for {target.get('backend')!r}, not intel")
        built = target.get("options", {})
        xml = folder / ENGINE_DIR / lowering.XML  # present and intact: Backend.load checked every file

        flags = isa.read_cpu_flags()
        wanted = isa.normalize_precision(options.get("precision") or target.get("activations") or target["precision"])
        precision, warning = isa.runtime_precision(wanted, flags)
        if warning:
            warnings.warn(warning, IntelBackendWarning, stacklevel=3)
        ring = RingSpec.of(manifest)
        kv = held_kv(precision, _kv_precision(options.get("kv_precision", built.get("kv_precision", "f32"))), ring)
        if kv == "i8" and "kv_precision" not in options:  # built i8, and no compiler here: u8, saying so
            from kvexport_intel.int8_blocks import library

            try:
                library()
            except BackendUnavailableError as e:
                kv = "u8"
                said = f"this artifact's cache is kvexport's i8, whose op cannot be compiled here, so it holds u8: {e}"
                warnings.warn(said, IntelBackendWarning, stacklevel=3)
                warning = f"{warning}; {said}" if warning else said

        placement = place(options.get("numa_node", built.get("numa_node")),
                          parse_bool("numa_bind", options.get("numa_bind", built.get("numa_bind", True))))
        threads = threads or built.get("threads") or placement["threads"]
        compressed = (target.get("weights") or {}).get("dtype") in compress.BLOCK_MODES
        dq_group = _given(options, "dynamic_quant_group")
        if dq_group is not None and (dq_group < 0 or not compressed):
            raise InputError(f"dynamic_quant_group applies to int8/int4 weights, as a group size of 0 (off) or more, "
                             f"not {dq_group} for {(target.get('weights') or {}).get('dtype', target['precision'])} "
                             "weights")
        config = _compile_config(precision, kv, int(threads), pinned=True, compressed=compressed, dq_group=dq_group)
        huge = parse_bool("huge_pages", options.get("huge_pages", True))
        before = anonymous_regions() if huge else None  # what the plugin maps from here on is the engine's
        core = ov.Core()  # made after pinning, so the plugin's CPU map sees the node's cores
        try:
            compiled = core.compile_model(lowering.read_engine(core, xml), "CPU", config)
        except RuntimeError as e:
            raise ArtifactError(f"OpenVINO could not compile {xml}: {e}; rebuild the artifact with this OpenVINO") from e
        facts = {"threads": int(threads), "precision": precision, "kv_precision": kv, "warning": warning,
                 "weights": (target.get("weights") or {}).get("dtype", target["precision"]),
                 "openvino": _openvino_version(), "numa": placement,
                 "fused_attention_layers": lowering.fused_attention_layers(compiled),
                 "dynamic_quant_group": compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")}
        if ring is not None:
            facts["ring"] = {"window": ring.window, "layers": sorted(ring.layers)}
        session = self._session(compiled, manifest, facts, ring)
        session.model_path, session.compile_config = str(xml), config
        from kvexport_intel import gemv

        def cache_twin(cache: str) -> IntelSession:  # the same engine at f32 activations with `cache`
            twin_config = _compile_config("fp32", cache, int(threads), pinned=True, compressed=compressed)
            twin = self._session(core.compile_model(lowering.read_engine(core, xml), "CPU", twin_config), manifest,
                                 {**facts, "precision": "fp32", "kv_precision": cache}, ring)
            # its prompts paged as the engine's are, so that an i8 twin holds i8 blocks (its state would be u8)
            twin.model_path, twin.compile_config = str(xml), twin_config
            twin.paged_prefill_min, twin.paged_split = session.paged_prefill_min, session.paged_split
            twin.prompt_split = session.prompt_split  # float weights at f32: the plugin's matmuls (gemv.choose)
            twin.decode_gemv = None if facts["weights"] in gemv.FLOAT_WEIGHTS else session.decode_gemv
            twin.state_names, twin.windows = session.state_names, session.windows
            return twin

        session.cache_twin = cache_twin
        asked = _given(options, "decode_matmul")
        use, facts["decode_matmul"] = gemv.choose(asked, flags, facts["weights"], activations=precision)
        asked_rows = _given(options, "prompt_matmul")
        if use and gemv.bf16_copies(facts["weights"], precision):
            session.gemv_rows, facts["prompt_matmul"] = gemv.choose_rows(asked_rows, gemv.library())
            if not session.gemv_rows:  # the plugin's second form prepares a copy too: will both fit?
                use, why = gemv.copy_fits(asked, (folder / ENGINE_DIR / lowering.BIN).stat().st_size // 2,
                                          gemv.available_memory())  # the f32 IR's bf16 copy: half its file's bytes
                facts["decode_matmul"] = why or facts["decode_matmul"]
        elif asked_rows == "kvexport":
            raise InputError("prompt_matmul=kvexport reads the bf16 copies that float weights' decode steps take at "
                             f"bf16 activations, and this engine's decode steps have none ({facts['decode_matmul']}): "
                             "load without prompt_matmul")
        session.decode_gemv = gemv.library() if use else None
        session.batch_rows = str(options.get("batch_rows") or "paged")
        if paged_min is not None:
            session.paged_prefill_min = paged_min
        session.paged_split = facts["paged_split"] = paged_split
        session.prompt_split = facts["prompt_split"] = paged_split if prompt_split in (None, "same") else prompt_split
        session.state_names = [past for past, _ in manifest.kv_pairs()]  # layer by layer, key then value
        session.windows = [manifest.config.window_of(i) for i in range(manifest.config.num_hidden_layers)]
        eager = (options.get("paged_compile") or "load") == "load"
        why = session.compile_long_prompt_form() if eager else "paged_compile=first_use"
        facts["paged_compile"] = "at load" if why is None else f"on first use ({why})"
        if eager:  # OpenVINO's CPU plugin repacks (under bf16 converts) a dynamic model's weights on its first infer
            t0 = time.perf_counter()
            session.warm_up()
            facts["warm_up_s"] = round(time.perf_counter() - t0, 3)
        facts["huge_pages"] = place_weights(before, None if eager else "paged_compile=first_use").record()
        return session

    @staticmethod
    def _session(compiled: Any, manifest: Manifest, facts: dict[str, Any], ring: RingSpec | None) -> IntelSession:
        cfg = manifest.config
        return IntelSession(compiled, max_seq=manifest.max_seq, vocab_size=cfg.vocab_size,
                            num_layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                            head_dim=cfg.head_dim, facts=facts, ring=ring)

    def doctor(self) -> dict[str, Any]:
        from kvexport_intel.gemv import choose
        from kvexport_intel.int8_blocks import int8_format

        flags = isa.read_cpu_flags()
        topo = numa.read_topology()
        kv_int8, why = int8_format(flags, compile=False)
        ours, matmul_why = choose(None, flags, "int4", compile=False)
        ours16, matmul16_why = choose(None, flags, "bf16", compile=False, activations="bf16")
        amx16 = ours16 and {"amx_tile", "amx_bf16"} <= flags
        return {"openvino": _openvino_version(), "amx": "present" if isa.has_amx(flags) else "absent",
                "isa": isa.isa_report(flags), "would_pick_precision": isa.why_precision(flags),
                "kv_int8": f"{kv_int8}: {why}",  # the format --kv int8 would hold here
                # what runs int8/int4 weights' decode steps here (the load option decode_matmul's auto)
                "decode_matmul": f"{'kvexport' if ours else 'openvino'}: {matmul_why}",
                # and bf16 weights' (or f32 ones run at bf16), where the CPU runs bf16
                "decode_matmul_bf16": f"{'kvexport' if ours16 else 'openvino'}: {matmul16_why}",
                # and what their prompts run (the load option prompt_matmul's auto)
                "prompt_matmul_bf16": ("kvexport: kvexport's QGemv (AMX-BF16) over the decode steps' bf16 copies"
                                       if amx16 else "openvino: the plugin's matmuls (kvexport's need AMX-BF16 and "
                                       "its decode matmul)"),
                "numa_nodes": {n.id: list(n.cpus) for n in topo.nodes},
                "offline_cpus": list(topo.offline)}


def _calibration(model: Any, folder: Path, manifest: Manifest, options: BuildOptions, ring: RingSpec | None,
                 plan: dict[str, Any], progress: Progress) -> list[dict[str, Any]]:
    """NNCF's calibration items for a data-aware quantizer: the calibration text's tail (as the cpu target's GPTQ
    and int8 cache take it), in windows that fit the engine's cache and its rings; its record goes into `plan`."""
    from kvexport.backends.cpu_kv import build_calibration_ids

    source, ids = build_calibration_ids(options.calibration_text, folder, manifest)
    window = min(compress.CALIBRATION_WINDOW, manifest.max_seq, ring.window if ring else manifest.max_seq)
    items = compress.calibration_dataset(model, ring, ids, window)
    plan["calibration"] = {"source": source, "tokens": len(ids), "window": window, "items": len(items)}
    progress(f"intel: {plan['quantizer']} calibrates on {len(ids)} tokens ({source}) in {len(items)} windows "
             f"of up to {window}")
    return items


# why a lossy cache turns the rings off (measured: a ring engine's logits are bit-identical at f32, f16 and u8)
RINGS_F32 = ("OpenVINO's CPU plugin applies the cache precision only to its fused attention's state, so a ring's "
             "state would stay f32")


# why an engine with bf16 activations keeps its cache in bf16 when f32 was asked for (held_kv)
BF16_HELD = ("with bf16 activations K and V are computed in bf16, which a bf16 cache holds exactly (an f32 cache "
             "gave bit-identical logits), and OpenVINO's paged attention, which long prompts and batched rows run, "
             "keeps no f32 cache under bf16")


def held_kv(activations: str, kv: str, ring: RingSpec | None = None) -> str:
    """The cache precision an engine compiles with (OpenVINO's words) for the asked-for `kv`: under bf16 activations
    an f32 request holds bf16 (BF16_HELD), except where sliding layers keep rings in the state, which the cache
    precision does not reach and which never take the paged form (RINGS_F32); under f32 activations (a bf16 artifact
    on a CPU without bf16 hardware) a bf16 request holds f32, as exact as the activations it then runs."""
    if activations == "bf16" and kv == "f32" and ring is None:
        return "bf16"
    if activations != "bf16" and kv == "bf16":
        return "f32"
    return kv


def _activations(weights: str, flags: set[str]) -> str:
    """OpenVINO's inference precision for a weights mode: fp32/bf16 the mode itself; int8/int4 weights as this CPU
    computes fastest (bf16 where it has bf16 hardware)."""
    return weights if weights in OV_PRECISION else isa.auto_precision(flags)


def _build_kv(options: BuildOptions, flags: set[str], activations: str,
              manifest: Manifest | None = None) -> tuple[str, str | None]:
    """The cache precision a build holds, in OpenVINO's words (or i8), and why where the build chose it: core hands
    --kv in options.kv and keeps --option kv_precision (its alias, which names the int8 format) in options.extra.
    --kv int8 alone is i8 or u8 as kvexport_intel.int8_blocks.int8_format picks for this CPU and the build's
    `activations` (its inference precision: "fp32" or "bf16") and the model's head size (from `manifest`, read only
    there; None: the option checks before the export, to which i8 and u8 are alike). Where the build holds
    i8, its op has been compiled (BackendUnavailableError where it cannot be)."""
    named = options.extra.get("kv_precision")
    if named:
        if _kv_precision(named) == "i8":  # its op is compiled here: a missing compiler stops the build before the export
            from kvexport_intel.int8_blocks import library

            library()
        return _kv_precision(named), None
    if (options.kv or "fp32") == "int8":
        from kvexport_intel.int8_blocks import int8_format

        head_dim = manifest.config.head_dim if manifest is not None else None
        return int8_format(flags, activations=activations, head_dim=head_dim)  # compiles the op where it picks i8
    return _kv_precision(KV_MODES[options.kv or "fp32"]), None


def _weights_mode(options: BuildOptions) -> str | None:
    """--weights (or --precision, its other name) in the shared vocabulary; None: not given."""
    from kvexport.precision import canonical

    asked = options.weights or options.precision
    if asked is None:
        return None
    weights = canonical(asked)
    if weights not in WEIGHT_MODES:
        raise InputError(f"the intel target builds --weights {', '.join(WEIGHT_MODES)}, not {asked!r}")
    return weights


def _given(options: dict[str, Any], name: str) -> Any:
    """The load option `name` as given, typed and checked against its declaration in OPTIONS; None: not given."""
    return parse_option(next(o for o in OPTIONS if o.name == name), options.get(name))


def _compile_config(precision: str, kv: str, threads: int, pinned: bool, compressed: bool = False,
                    dq_group: int | None = None) -> dict[str, Any]:
    kv = "u8" if kv == "i8" else kv  # the state has no i8: an i8 engine's stateful calls hold OpenVINO's u8
    config: dict[str, Any] = {
        "INFERENCE_PRECISION_HINT": OV_PRECISION[precision],
        "KV_CACHE_PRECISION": kv,  # OpenVINO's default is u8 on x86: set it, or f32 is not exact
        "KEY_CACHE_PRECISION": kv,
        "VALUE_CACHE_PRECISION": kv,
        "NUM_STREAMS": 1,
        "PERFORMANCE_HINT": "LATENCY",
        "ENABLE_CPU_PINNING": pinned,
    }
    if threads:
        config["INFERENCE_NUM_THREADS"] = threads
    if precision == "fp32" and not compressed:
        config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 0  # no int8 activations anywhere in an exact run
    # int8/int4 weights keep the plugin's default, activations quantized per group of 32 into the compressed
    # matmuls: what OpenVINO GenAI runs, and faster here (docs/backends/intel.md); their rows include its error.
    # dq_group: the load option dynamic_quant_group (compressed weights only, checked where it is read), which sets it
    if dq_group is not None:
        config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = dq_group
    return config


def place_weights(before: Regions | None, why_not: str | None) -> Placement:
    """The weights the plugin prepared for itself, in huge pages (kvexport.runtime.hugepages): what was mapped since
    `before` (taken before the compile), after the load's warm-up token (IntelSession.warm_up) had the plugin make
    its copies. It streams them every decode step, and in 4 KiB pages a step walks a page-table entry every 4 KiB.
    `before` None: the load option huge_pages=false; `why_not`: no warm-up ran, so there is nothing to place yet."""
    if before is None:
        return Placement(0, 0.0, "off (load option huge_pages=false)", asked=False)
    if why_not is not None:
        return Placement(0, 0.0, f"not placed: {why_not} leaves the plugin's weights to the first request")
    return collapse_new(before)


def place(numa_node: Any, bind: bool) -> dict[str, Any]:
    """Pin this process's threads to one NUMA node and bind its memory there (an explicit node,
    or automatically when the machine has more than one node); returns what was done."""
    topo = numa.read_topology()
    requested = _numa_node(numa_node)
    if requested is None and len(topo.nodes) < 2:
        cpus = sorted(os.sched_getaffinity(0))
        return {"node": None, "cpus": cpus, "threads": len(cpus), "process_pinned": False, "memory_bound": False,
                "nodes": len(topo.nodes)}
    node = numa.choose_node(topo, requested)
    cpus = numa.node_cpus_for_process(node)
    numa.pin_process(cpus)
    bound = False
    if bind:
        try:
            numa.bind_memory(node.id)
            bound = True
        except KvexportError as e:
            if requested is not None:
                raise  # asked for by name: say why it cannot be done
            # automatic placement: containers often forbid set_mempolicy (no CAP_SYS_NICE); run unbound
            warnings.warn(f"{e}; threads are pinned to node {node.id} but memory is not bound",
                          IntelBackendWarning, stacklevel=3)
    return {"node": node.id, "cpus": cpus, "threads": len(cpus), "process_pinned": True, "memory_bound": bound,
            "nodes": len(topo.nodes)}


__all__ = ["IntelBackend", "IntelBackendWarning", "KV_ITEM_BYTES", "place"]
