"""AmdBackend: the owned decoder through torch.export and AOTInductor for ROCm (the CPU elsewhere), HIP-graph decode."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvexport.backends import Backend, BuildOptions, Capabilities, Option, Progress, parse_bool
from kvexport.errors import ArtifactError, BackendUnavailableError, InputError, UnsupportedFeatureError
from kvexport.manifest import Manifest

from kvexport_amd import device as dv

ENGINE_DIR = "engine"
PACKAGE = "model.pt2"
OPTIONS = (
    Option("device", "str", "auto", "compile for the GPU (gpu), the CPU (cpu), or the GPU when there is one",
           choices=("auto", "gpu", "cpu")),
    Option("model_dir", "str", None, "read the weights from this checkpoint folder instead of the IR"),
    Option("graphs", "bool", None, "replay the decode step as a HIP/CUDA graph (default: on a GPU)", phase="load"),
)


class AmdBackend(Backend):
    name = "amd"

    def capabilities(self) -> Capabilities:
        return Capabilities(
            name="amd",
            description="torch.export + AOTInductor package compiled for the ROCm GPU (the CPU where there is "
                        "none), cache updated in place, decode step captured as a HIP graph",
            ir_cache_style="static",
            cache_policy="fixed",  # cache_len is compiled static at max_seq: graph capture needs fixed addresses
            # int8/int4: weight-only, torch's packed matmuls (kvexport_amd.quant); int8 is per output channel
            precisions=("fp16", "bf16", "fp32", "int8", "int4"),
            default_precision=self._default_precision(dv.gpu_present()),
            devices=("rocm", "cuda", "cpu"),
            sdk=("torch",),
            deferred_build=False,
            threads_option=True,
            kv_modes=("fp32", "fp16", "bf16"),
            kv_follows_weights=True,  # the cache is in the compiled graph's dtype
            # sliding-window layers on W-slot rings, written in place (decoder.write_rows_inplace, circular)
            ring_cache=True,
            options=OPTIONS,
        )

    @staticmethod
    def _default_precision(gpu: bool) -> str:
        if not gpu:
            return "fp32"
        import torch

        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"

    def availability(self) -> list[str]:
        import torch

        reasons = []
        if not hasattr(torch._C, "_aoti"):
            reasons.append(f"this torch ({torch.__version__}) lacks AOTInductor (torch._C._aoti); install torch >= 2.6")
        return reasons

    def check(self, manifest: Manifest) -> list[str]:
        problems = super().check(manifest)
        if manifest.cache.get("quantization"):
            problems.append(f"the amd target keeps the cache in the model dtype; this artifact asks for "
                            f"{manifest.cache['quantization']} cache quantization")
        if manifest.raw["ir"]["dtype"] not in ("float32", "float16", "bfloat16"):
            problems.append(f"the amd target compiles float IR; this one is {manifest.raw['ir']['dtype']}")
        return problems

    def build_options(self, options: BuildOptions) -> dict[str, Any]:
        """Also refuses, before the export, a block size for int8 (torch's int8 kernel has no blocks) and
        --option device=gpu on a machine without one."""
        if (options.weights or options.precision) == "int8" and options.group_size not in (
                None, self.capabilities().default_group_size["int8"]):
            raise InputError(f"amd int8 keeps one scale per output channel; drop --group-size {options.group_size}, "
                             "or use --weights int4 for block scales")
        weights = options.weights or options.precision
        if weights in ("fp32", "fp16", "bf16") and options.kv not in (None, weights):
            # the compiled graph has one float type, so float weights hold their cache in it
            raise InputError(f"amd --weights {weights} keeps its cache in {weights}, not --kv {options.kv}; drop --kv, "
                             f"or pass --kv {options.kv} with int8/int4 weights (they dequantize into the --kv type)")
        extra = super().build_options(options)
        if extra["device"] == "gpu":
            dv.select("gpu")  # BackendUnavailableError, saying what to do, where there is none
        return extra

    # --- build ----------------------------------------------------------------------------------
    def build(self, folder: Path, manifest: Manifest, options: BuildOptions, progress: Progress) -> None:
        import torch

        from kvexport.export import decoder_from_ir
        from kvexport_amd import lowering, quant

        # every refusal comes before the minutes of compiling
        extra = self.build_options(options)
        self.require_available()
        problems = self.check(manifest)
        if problems:
            raise UnsupportedFeatureError("; ".join(problems))
        info = dv.select(extra["device"])
        precision = options.weights or options.precision or self._default_precision(info.kind != "cpu")
        quantized = precision in quant.MODES
        group_size = options.group_size if precision == "int4" else None
        if quantized:
            quant.check_mode(precision, group_size)
        # int8/int4 keep norms, attention and the cache in the --kv dtype (fp32 unless asked)
        dtype_name = (options.kv or "fp32") if quantized else precision
        if dtype_name not in lowering.DTYPES:
            raise InputError(f"the amd target compiles fp16, bf16 or fp32 (or int8/int4 weights over one of them), "
                             f"not {dtype_name!r}")
        # on the CPU, fp16/bf16 only when asked: torch computes them without the GPU's speed, but with
        # its rounding, which is how the low-precision tolerance rows are measured where no GPU is
        if "bf16" in (precision, dtype_name) and info.kind != "cpu" and not torch.cuda.is_bf16_supported():
            raise UnsupportedFeatureError(f"{info.name} has no bf16 support; pass --precision fp16")
        if options.max_batch < 1:
            raise InputError(f"max_batch must be at least 1, got {options.max_batch}")
        if dv.cxx_compiler() is None:
            raise BackendUnavailableError("AOTInductor compiles C++ at build time and no C++ compiler was found; "
                                          "install g++ (apt-get install g++) or set CXX")
        model_dir = extra.get("model_dir")

        t0 = time.perf_counter()
        mode = f"{precision} weights (group {group_size}) over {dtype_name}" if quantized else precision
        progress(f"amd: building for {info.kind} ({info.name}), {mode}, cache_len {manifest.max_seq}, "
                 f"batch 1..{options.max_batch}")
        if model_dir:
            decoder = lowering.decoder_from_checkpoint(Path(model_dir), manifest)
        else:
            decoder = decoder_from_ir(folder, manifest)
        reports: list[quant.QuantReport] = []
        weights: dict[str, Any] = {}

        def pack(model: torch.nn.Module) -> None:  # after the cast to the model dtype, which would touch scales
            if quantized:
                reports.append(quant.quantize_linears(model, precision, group_size,  # type: ignore[arg-type]
                                                      device=info.torch_device))
            weights.update(dtype=precision, group_size=group_size, bytes=quant.weight_bytes(model))

        program = lowering.export_program(decoder, max_batch=options.max_batch, dtype=lowering.DTYPES[dtype_name],
                                          device=info.torch_device, transform=pack)
        t_export = time.perf_counter() - t0
        progress(f"amd: torch.export done in {t_export:.1f}s; compiling with AOTInductor (minutes on a small CPU)")
        engine = folder / ENGINE_DIR / PACKAGE
        lowering.compile_package(program, engine, threads=options.threads)
        lowering.inspect_package(engine)
        seconds = time.perf_counter() - t0
        progress(f"amd: wrote {engine.relative_to(folder)} ({engine.stat().st_size / 1e6:.1f} MB) in {seconds:.1f}s")
        manifest.raw["target"] = {
            "backend": "amd",
            "precision": precision,
            "engine_files": [f"{ENGINE_DIR}/{PACKAGE}"],
            "fingerprint": info.fingerprint(),
            "weights": weights,  # bytes counted in the compiled model's tensors
            "options": {
                "model_dtype": dtype_name, **({"quantization": reports[0].to_dict()} if reports else {}),
                "device_kind": info.kind, "max_batch": options.max_batch, "cache_len": manifest.max_seq,
                "threads": options.threads, "source": "model_dir" if model_dir else "ir",
                "export_seconds": round(t_export, 2), "build_seconds": round(seconds, 2),
            },
        }

    # --- load -----------------------------------------------------------------------------------
    def open_session(self, folder: Path, manifest: Manifest, **options: Any) -> Any:
        """Open the package only after its fingerprint fits here. Backend.load, the only way in, has
        checked every file of the folder (the package included) against its sha256 in the manifest,
        so no caller reaches the native loader with an unchecked library."""
        import torch

        from kvexport.runtime.ring import RingSpec
        from kvexport_amd import lowering
        from kvexport_amd.session import AotiSession

        target = manifest.target
        if not target or target.get("backend") != "amd":
            raise ArtifactError(f"{folder} was not built for the amd target (target: "
                                f"{(target or {}).get('backend')}); build it with `kvexport build --target amd`")
        self.require_available()
        path = folder / target["engine_files"][0]
        built = target["fingerprint"]
        kind = built.get("device_kind")
        if kind == "cpu":
            here = dv.probe_cpu()
        elif dv.gpu_present():
            here = dv.probe_gpu()
        else:
            raise BackendUnavailableError(f"this artifact was compiled for a {kind} GPU ({built.get('device_name')}) "
                                          f"and this machine has none: {dv.no_gpu_reason()}")
        problems = dv.mismatches(built, here)
        if problems:
            raise ArtifactError("the amd package does not fit this machine: " + "; ".join(problems)
                                + ". AOTInductor code is compiled for one device and torch: rebuild here with "
                                "`kvexport build MODEL_DIR --target amd`")
        lowering.inspect_package(path)
        gpu = kind != "cpu"
        use_graph = parse_bool("graphs", options.get("graphs") if options.get("graphs") is not None else gpu)
        if options.get("threads"):
            torch.set_num_threads(int(options["threads"]))  # the ATen kernels the package calls (attention, GEMM)
        # run_single_threaded drops the runner's internal pool, which graph capture cannot live with
        runner = torch._C._aoti.AOTIModelPackageLoader(str(path), lowering.MODEL_NAME, gpu, 1, -1)
        cfg = manifest.config
        return AotiSession(
            runner, device=here.torch_device,
            dtype=lowering.DTYPES[target["options"].get("model_dtype", target["precision"])],
            num_layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
            max_seq=manifest.max_seq, vocab_size=cfg.vocab_size, max_batch=int(target["options"]["max_batch"]),
            use_graph=use_graph, ring=RingSpec.of(manifest),
            facts={"backend": "amd", "device": here.kind, "device_name": here.name,
                   "precision": target["precision"], "gfx_arch": here.gfx_arch},
        )

    # --- doctor ---------------------------------------------------------------------------------
    def doctor(self) -> dict[str, Any]:
        import torch

        facts: dict[str, Any] = {
            "torch": torch.__version__,
            "rocm": torch.version.hip is not None,
            "hip_version": torch.version.hip,
            "cuda_version": torch.version.cuda,
            "cxx_compiler": dv.cxx_compiler(),
        }
        if dv.gpu_present():
            info = dv.probe_gpu()
            facts.update(gpu=info.name, gfx_arch=info.gfx_arch, compute_capability=info.compute_capability,
                         builds_for=info.kind)
        else:
            facts.update(gpu=None, gfx_arch=None, builds_for="cpu", note=dv.no_gpu_reason())
        facts["cpu_flags"] = " ".join(dv.cpu_flags())
        return facts
