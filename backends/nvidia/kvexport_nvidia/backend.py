"""NvidiaBackend: lowers the static IR for TensorRT, builds (or defers) the engine, loads it."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from kvexport.backends import AutoMode, Backend, BuildOptions, Capabilities, Option, Progress
from kvexport.errors import ArtifactError, BackendUnavailableError, InputError, UnsupportedFeatureError
from kvexport.manifest import Manifest
from kvexport.runtime.ring import RingSpec

from kvexport_nvidia import fingerprint as fp
from kvexport_nvidia.lowering import lower_file
from kvexport_nvidia.profiles import Profile, make_profiles
from kvexport_nvidia.quantize import MODES as QUANT_MODES
from kvexport_nvidia.quantize import check_mode

ENGINE_DIR = "engine"
PREPARED = "prepared.onnx"  # the lowered IR: fp16/bf16 (fp32 to verify), cache_len pinned, parser-ready
PLAN = "model.plan"
PRECISION_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
# fp32 engines are for verification and debugging: the fp32 packaged graph meets the strict bar against
# the reference, so a difference in an fp16/bf16 engine can be told apart from a lowering bug. `auto` and
# the default stay fp16 (bf16 on request): fp32 reads twice the bytes a decode step needs.
SERVING_PRECISIONS = ("fp16", "bf16")
OPTIONS = (
    Option("defer", "bool", False, "package the prepared IR; the engine is built at first load on the GPU"),
    Option("max_prefill", "int", None, "longest prefill chunk the engine takes (default: max_seq)"),
    Option("opt_prefill", "int", None, "the prefill length TensorRT tunes for"),
    Option("workspace_mb", "int", None, "TensorRT builder workspace in MiB"),
    Option("cuda_graph", "bool", True, "replay the decode step as a CUDA graph", phase="load"),
    Option("device", "int", 0, "the CUDA device the engine runs on", phase="load"),
)


# --- what this machine has (module-level so tests can stand in for a GPU machine) ---------------
def tensorrt_installed() -> bool:
    return importlib.util.find_spec("tensorrt") is not None


def torch_cuda_build() -> str | None:
    import torch

    return torch.version.cuda


def probe_device(device_index: int = 0) -> fp.DeviceInfo:
    """This machine's fingerprint; needs TensorRT and a GPU (callers check availability first)."""
    from kvexport_nvidia.trt_build import import_tensorrt

    trt = import_tensorrt()
    smi, why = fp.nvidia_smi()
    if smi is None:
        raise BackendUnavailableError(f"the nvidia target needs an NVIDIA GPU: {why}")
    import torch

    name, cc = smi["gpu_name"], smi["compute_capability"]
    if torch.cuda.is_available():  # the device the runtime will use, not only GPU 0 of nvidia-smi
        name = torch.cuda.get_device_name(device_index)
        cc = "{}.{}".format(*torch.cuda.get_device_capability(device_index))
    return fp.DeviceInfo(tensorrt=trt.__version__, gpu_name=name, compute_capability=cc, driver=smi["driver"])


class NvidiaBackend(Backend):
    name = "nvidia"

    def capabilities(self) -> Capabilities:
        return Capabilities(
            name="nvidia",
            description="TensorRT engine: in-place KV-cache update, fused attention and RoPE layers, "
                        "CUDA-graph decode (NVIDIA GPU, TensorRT >= 10.15); fp16 by default and under auto, "
                        "--weights fp32 to verify or debug against the reference",
            ir_cache_style="static",
            cache_policy="fixed",  # IKVCacheUpdateLayer and graph capture need the static max_seq cache
            ring_cache=True,  # sliding layers: a ring of min(window, max_seq) slots written by IScatterLayer (rings.py)
            # int8/int4: weight-only, DequantizeLinear on the weights (kvexport_nvidia.quantize); int8 per channel
            precisions=("fp16", "bf16", "fp32", "int8", "int4"),
            default_precision="fp16",
            devices=("cuda",),
            sdk=("tensorrt", "torch"),
            deferred_build=True,
            rebuilds_at_load=True,  # a plan for another GPU or TensorRT is rebuilt from the packaged IR
            threads_option=False,
            kv_modes=("fp16", "bf16", "fp32"),
            kv_follows_weights=True,  # the cache is in the engine's dtype
            options=OPTIONS,
        )

    def availability(self) -> list[str]:
        reasons = []
        if not tensorrt_installed():
            reasons.append("TensorRT is not installed (on the GPU machine: `pip install 'tensorrt>=10.15'`)")
        smi, why = fp.nvidia_smi()
        if smi is None:
            reasons.append(f"no NVIDIA GPU is visible ({why}), and TensorRT engines build and run only on one")
        if torch_cuda_build() is None:
            reasons.append("this torch is a CPU-only build, and the nvidia runtime keeps the cache in torch.cuda "
                           "tensors (install a CUDA build of torch on the GPU machine)")
        return reasons

    def check(self, manifest: Manifest) -> list[str]:
        problems = super().check(manifest)
        dtype = manifest.raw["ir"]["dtype"]
        if dtype not in ("float32", *PRECISION_DTYPE.values()):
            problems.append(f"the nvidia target lowers fp32/fp16/bf16 IR; this one is {dtype}")
        return problems

    def build_options(self, options: BuildOptions) -> dict[str, Any]:
        """Also refuses, before the export, a block size for int8 (its weights are per channel, as TensorRT's
        INT8 weights have always been) and a cache in another float type than the engine's."""
        weights = options.weights or options.precision
        if weights == "int8" and options.group_size not in (None, self.capabilities().default_group_size["int8"]):
            raise InputError(f"nvidia int8 keeps one scale per output channel; drop --group-size {options.group_size}, "
                             "or use --weights int4 for block scales")
        engine_dtype(weights or self.capabilities().default_precision, options.kv)
        return super().build_options(options)

    def auto_modes(self, flags: set[str]) -> list[AutoMode]:
        """fp16 with its fp16 cache: the serving default on every GPU; fp32 is asked for by name only."""
        return [AutoMode("fp16", "fp16", "fp16: the nvidia default (fp32 is for verification, by name only)")]

    # --- build ----------------------------------------------------------------------------------
    def build(self, folder: Path, manifest: Manifest, options: BuildOptions, progress: Progress) -> None:
        caps = self.capabilities()
        weights = options.weights or options.precision or caps.default_precision
        quantized = weights in QUANT_MODES
        group_size = options.group_size if weights == "int4" else None
        if quantized:
            check_mode(weights, group_size)
        precision = engine_dtype(weights, options.kv)
        ir_dtype = manifest.raw["ir"]["dtype"]
        if ir_dtype not in ("float32", PRECISION_DTYPE[precision]):
            raise InputError(f"this IR is {ir_dtype}; a {precision} engine needs an fp32 or {precision} IR")
        extra = self.build_options(options)
        problems = self.check(manifest)
        if problems:
            raise UnsupportedFeatureError("; ".join(problems))
        defer = extra["defer"]
        build_opts = {
            "max_batch": options.max_batch,
            "max_prefill": extra["max_prefill"] or manifest.max_seq,
            "opt_prefill": extra["opt_prefill"],
            "workspace_mb": extra["workspace_mb"],
        }
        profiles = make_profiles(manifest, max_batch=build_opts["max_batch"], max_prefill=build_opts["max_prefill"],
                                 opt_prefill=build_opts["opt_prefill"])
        reasons = self.availability()
        if reasons and not defer:
            raise BackendUnavailableError(unavailable_message(reasons))

        engine_dir = folder / ENGINE_DIR
        engine_dir.mkdir(exist_ok=True)
        mode = f"{weights} weights" + (f" (group {group_size})" if group_size else "") + f" over {precision}" \
            if quantized else precision
        progress(f"lowering the IR for TensorRT ({mode}, cache pinned to max_seq {manifest.max_seq})")
        ring = RingSpec.of(manifest)
        report = lower_file(folder / manifest.raw["ir"]["file"], engine_dir / PREPARED, max_seq=manifest.max_seq,
                            precision=precision, pairs=manifest.kv_pairs(),  # type: ignore[arg-type]
                            weights=weights if quantized else None, group_size=group_size,  # type: ignore[arg-type]
                            ring_len=ring.length(manifest.max_seq) if ring else None)
        files = [f"{ENGINE_DIR}/{PREPARED}", f"{ENGINE_DIR}/{PREPARED}.data"]
        target_options: dict[str, Any] = {
            **build_opts, "deferred": defer, "profiles": [p.to_dict() for p in profiles], "lowering": report.to_dict(),
        }
        fingerprint: dict[str, str] = {}
        if defer:
            progress("deferred: the prepared IR is packaged; the engine is built at first load on an NVIDIA GPU")
        else:
            from kvexport_nvidia.trt_build import build_engine

            info = probe_device()
            plan = build_engine(engine_dir / PREPARED, profiles, workspace_bytes=_mb(build_opts["workspace_mb"]),
                                progress=progress, fp32_layers=report.fp32_layers, precision=precision)
            (engine_dir / PLAN).write_bytes(plan)
            files.append(f"{ENGINE_DIR}/{PLAN}")
            fingerprint = info.fingerprint()
        # `deferred` at the top level too: kvexport.build skips verification of an engine not built yet
        manifest.raw["target"] = {"backend": "nvidia", "precision": weights, "engine_files": files,
                                  "fingerprint": fingerprint, "options": {**target_options, "model_dtype": precision},
                                  "deferred": defer,
                                  "weights": {"dtype": weights, "group_size": group_size,
                                              "bytes": report.initializer_bytes}}
        if ring is not None:  # a ring's present is IScatterLayer's new tensor: a second buffer, swapped each step
            manifest.raw["target"]["ring_buffers"] = 2

    # --- load -------------------------------------------------------------------------------------
    def open_session(self, folder: Path, manifest: Manifest, *, threads: int | None = None, no_rebuild: bool = False,
                     cuda_graph: bool = True, device: int = 0, progress: Progress | None = None) -> Any:
        # the options are checked and typed by Backend.load (load_options); threads never reaches here
        target = manifest.target
        if not target or target.get("backend") != "nvidia":
            raise ArtifactError(f"{folder} holds no nvidia engine; build one with `kvexport build --target nvidia`")
        reasons = self.availability()
        if reasons:
            what = ("its engine is built at first load on the GPU machine" if fp.is_deferred(target)
                    else "its TensorRT engine runs on an NVIDIA GPU")
            raise BackendUnavailableError(f"{folder}: {what}, and this machine cannot: " + "; ".join(reasons)
                                          + ". Copy the artifact to a machine with an NVIDIA GPU and TensorRT, "
                                            "or build one for this machine with `--target cpu`.")
        say = progress or (lambda m: print(f"kvexport: {m}", file=sys.stderr))
        info = probe_device(device)
        decision = fp.decide(target, info)
        fp.require_usable(decision, no_rebuild=no_rebuild, artifact=folder)
        if decision.action is fp.Action.USE:  # Backend.load has checked every listed file's sha256
            if f"{ENGINE_DIR}/{PLAN}" not in manifest.raw["files"]:
                raise ArtifactError(f"{folder} records a built engine but manifest.json lists no {ENGINE_DIR}/{PLAN}; "
                                    "rebuild the artifact with `kvexport build --target nvidia`")
            plan_path = folder / ENGINE_DIR / PLAN
        else:
            say(decision.reason)
            plan_path = self._cached_or_rebuilt(folder, manifest, info, say)
        return self._session(plan_path, manifest, device=device, cuda_graph=cuda_graph, info=info)

    def _cached_or_rebuilt(self, folder: Path, manifest: Manifest, info: fp.DeviceInfo, say: Progress) -> Path:
        """A plan for this machine from the cache folder, built from the packaged IR when missing."""
        from kvexport_nvidia.trt_build import build_engine

        target = manifest.target or {}
        ir_sha = manifest.raw["files"][f"{ENGINE_DIR}/{PREPARED}.data"] + manifest.raw["files"][f"{ENGINE_DIR}/{PREPARED}"]
        build_opts = rebuild_options(target)
        entry_dir = fp.cache_root() / fp.cache_key(ir_sha, info.fingerprint(), build_opts)
        plan_path, entry_path = entry_dir / PLAN, entry_dir / "entry.json"
        if cached_plan_ok(entry_path, plan_path, info.fingerprint(), ir_sha):
            say(f"using the engine rebuilt earlier for this machine: {plan_path}")
            return plan_path
        profiles = profiles_from_target(target)
        say(f"building the engine into {entry_dir}")
        plan = build_engine(folder / ENGINE_DIR / PREPARED, profiles, workspace_bytes=_mb(build_opts["workspace_mb"]),
                            progress=say, fp32_layers=target["options"].get("lowering", {}).get("fp32_layers", ()),
                            precision=build_opts["model_dtype"] or "fp16")
        entry_dir.mkdir(parents=True, exist_ok=True)
        tmp = plan_path.with_suffix(".partial")
        tmp.write_bytes(plan)
        tmp.replace(plan_path)
        from kvexport.checkpoint import sha256_file  # imports torch: not before a build is refused

        entry = {"sha256": sha256_file(plan_path), "fingerprint": info.fingerprint(), "ir_sha256": ir_sha}
        entry_path.write_text(json.dumps(entry, indent=2) + "\n")
        return plan_path

    def _session(self, plan_path: Path, manifest: Manifest, *, device: int, cuda_graph: bool, info: fp.DeviceInfo) -> Any:
        import torch

        from kvexport_nvidia.runtime import TrtSession
        from kvexport_nvidia.trt_build import deserialize

        torch.cuda.set_device(device)
        runtime, engine = deserialize(plan_path.read_bytes())
        target = manifest.target or {}
        return TrtSession(engine, runtime, pairs=manifest.kv_pairs(), profiles=profiles_from_target(target),
                          max_seq=manifest.max_seq, vocab_size=manifest.config.vocab_size, device_index=device,
                          cuda_graph=cuda_graph, info={"precision": target.get("precision"), **info.fingerprint()},
                          ring=RingSpec.of(manifest))

    def doctor(self) -> dict[str, Any]:
        smi, why = fp.nvidia_smi()
        out: dict[str, Any] = {"gpu": smi or why, "torch_cuda": torch_cuda_build()}
        if tensorrt_installed():
            try:
                import tensorrt as trt

                out["tensorrt"] = trt.__version__
            except ImportError as e:  # installed but broken (for example the placeholder wheel)
                out["tensorrt"] = f"installed but fails to import: {e}"
        else:
            out["tensorrt"] = "not installed"
        out["ready"] = not self.availability()
        return out


# --- helpers (pure, tested without a GPU) ---------------------------------------------------------
def engine_dtype(weights: str, kv: str | None) -> str:
    """The engine's float type (its activations and its cache) for --weights/--kv, or a typed refusal.
    Float weights are the engine's type and the cache is in it too; int8/int4 weights dequantize into an
    fp16 or bf16 engine, the --kv one. fp32 engines hold fp32 weights (they exist to verify, not to serve)."""
    if weights in QUANT_MODES:
        precision = kv or "fp16"
        if precision not in SERVING_PRECISIONS:
            raise InputError(f"nvidia {weights} weights dequantize into an fp16 or bf16 engine (--kv fp16|bf16), "
                             f"not {precision}; for an fp32 engine build --weights fp32")
        return precision
    if weights not in PRECISION_DTYPE:
        raise InputError(f"the nvidia target builds fp16, bf16 or fp32 engines (or int8/int4 weights over fp16/bf16), "
                         f"not {weights!r} (--weights fp16|bf16|fp32|int8|int4)")
    if kv is not None and kv != weights:
        raise InputError(f"a TensorRT engine keeps its cache in its own float type: --weights {weights} takes "
                         f"--kv {weights} (or no --kv), not --kv {kv}")
    return weights


def unavailable_message(reasons: list[str]) -> str:
    return ("target 'nvidia' cannot build an engine here: " + "; ".join(reasons) + ". "
            "Run the build on the GPU machine, or package the prepared IR now with `--defer` (or `--option defer=true`): "
            "the artifact then builds its TensorRT engine at first load on an NVIDIA GPU (minutes, once; cached).")


REBUILD_KEYS = ("max_batch", "max_prefill", "opt_prefill", "workspace_mb", "model_dtype")


def rebuild_options(target: dict[str, Any]) -> dict[str, Any]:
    """The build options a rebuilt plan's cache folder is keyed by (fingerprint.cache_key), the engine's float
    type among them as well as in the IR's hash: an fp32 plan never serves an fp16 artifact."""
    return {k: target["options"].get(k) for k in REBUILD_KEYS}


def profiles_from_target(target: dict[str, Any]) -> list[Profile]:
    return [Profile(p["name"], {k: tuple(tuple(s) for s in v) for k, v in p["shapes"].items()})  # type: ignore[misc]
            for p in target["options"]["profiles"]]


def cached_plan_ok(entry_path: Path, plan_path: Path, fingerprint: dict[str, str], ir_sha: str) -> bool:
    """A cached rebuild is used only if its entry names this machine and IR and its bytes match."""
    from kvexport.checkpoint import sha256_file

    if not entry_path.is_file() or not plan_path.is_file():
        return False
    try:
        entry = json.loads(entry_path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (isinstance(entry, dict) and entry.get("fingerprint") == fingerprint and entry.get("ir_sha256") == ir_sha
            and entry.get("sha256") == sha256_file(plan_path))


def _mb(value: int | None) -> int | None:
    return None if value is None else value * (1 << 20)


__all__ = ["NvidiaBackend", "cached_plan_ok", "engine_dtype", "profiles_from_target", "rebuild_options",
           "unavailable_message"]
