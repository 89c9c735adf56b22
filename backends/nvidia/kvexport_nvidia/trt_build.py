"""Building a serialized TensorRT engine from the lowered ONNX graph (TensorRT Python API).

TensorRT is imported inside these functions only: the module imports on machines without it.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from kvexport.errors import BackendUnavailableError, KvexportError

from kvexport_nvidia.profiles import Profile

MIN_VERSION = (10, 15)  # IKVCacheUpdateLayer, IRotaryEmbeddingLayer and their ONNX importers


class EngineBuildError(KvexportError):
    """TensorRT's parser or builder refused the graph; the message carries every error it gave."""


def import_tensorrt() -> Any:
    """Import tensorrt or say exactly what to install; refuse versions without the KV-cache layers."""
    try:
        import tensorrt as trt
    except ImportError as e:
        raise BackendUnavailableError(
            f"the nvidia target needs TensorRT >= {MIN_VERSION[0]}.{MIN_VERSION[1]} (`pip install tensorrt`, "
            f"on a Linux machine with an NVIDIA GPU and driver); importing it failed: {e}"
        ) from e
    if version_tuple(trt.__version__) < MIN_VERSION:
        raise BackendUnavailableError(
            f"TensorRT {trt.__version__} lacks the KV-cache update and RoPE layers the nvidia target uses; "
            f"install TensorRT >= {MIN_VERSION[0]}.{MIN_VERSION[1]} (`pip install -U tensorrt`)"
        )
    return trt


def version_tuple(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split(".")[:3]:
        digits = re.match(r"\d*", part).group()  # type: ignore[union-attr]  # leading digits: "0rc1" -> 0
        out.append(int(digits) if digits else 0)
    return tuple(out)


def network_flags(trt: Any) -> int:
    """STRONGLY_TYPED: the ONNX dtypes decide each layer's precision (TensorRT 11 always does; on
    10.x the flag asks for it, and the precision builder flags stay off)."""
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 0 if flag is None else 1 << int(flag)


def _logger(trt: Any, sink: list[str]) -> Any:
    class _Capture(trt.ILogger):  # type: ignore[misc, name-defined]
        """Keeps warnings and errors so that a failed build can show them all."""

        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: Any, msg: str) -> None:
            if severity <= trt.ILogger.Severity.WARNING:
                sink.append(f"[{str(severity).rsplit('.', 1)[-1]}] {msg}")

    return _Capture()


def parser_errors(parser: Any) -> list[str]:
    """Every error the ONNX parser recorded, with the node it came from."""
    errors = []
    for i in range(parser.num_errors):
        e = parser.get_error(i)
        where = ""
        try:
            where = f" at node {e.node()} {e.node_name()!r} ({e.node_operator()})"
        except AttributeError:  # older bindings expose only desc/code/node
            where = f" at node {e.node()}"
        errors.append(f"{e.code()}: {e.desc()}{where}")
    return errors


def build_engine(onnx_path: Path, profiles: list[Profile], *, workspace_bytes: int | None = None,
                 progress: Callable[[str], None] | None = None, fp32_layers: Collection[str] = (),
                 precision: str = "fp16") -> bytes:
    """Parse the lowered ONNX file, add the profiles, build and return the serialized plan.
    fp32_layers: the ONNX nodes the lowering kept fp32 (MoE routers); their parsed layers must be fp32.
    precision: the engine's float type (the lowering's); the parsed cache inputs must be of it, and an fp32
    engine must hold no 16-bit layer and is built without TF32 (fp32_builder_config)."""
    say = progress or (lambda _m: None)
    trt = import_tensorrt()
    log: list[str] = []
    logger = _logger(trt, log)
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    # parse_from_file resolves the external weights next to the model
    if not parser.parse_from_file(str(onnx_path)):
        errors = parser_errors(parser)
        raise EngineBuildError(
            f"TensorRT {trt.__version__}'s ONNX parser rejected {onnx_path.name} ({len(errors)} error(s)):\n  "
            + "\n  ".join(errors or log or ["(no error recorded)"])
            + "\nThe graph came out of kvexport's lowering passes: please report this with the output of `kvexport doctor`."
        )
    _check_network_io(network, profiles)
    check_fp32_layers(trt, network, fp32_layers)
    check_precision(trt, network, precision)
    config = builder.create_builder_config()
    if precision == "fp32":
        fp32_builder_config(trt, config)
    if workspace_bytes:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_bytes))
    for p in profiles:
        prof = builder.create_optimization_profile()
        for name, (lo, opt, hi) in p.shapes.items():
            prof.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(prof)
    say(f"building the TensorRT {trt.__version__} engine ({len(profiles)} profiles; this takes minutes)")
    t0 = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineBuildError(
            "TensorRT's builder failed:\n  " + "\n  ".join(log[-20:] or ["(no message)"])
            + "\nTry a smaller --option max_batch / max_prefill, or report it with `kvexport doctor`."
        )
    say(f"engine built in {time.perf_counter() - t0:.0f}s")
    return bytes(plan)


def _check_network_io(network: Any, profiles: list[Profile]) -> None:
    """The parsed network's inputs are exactly the ones the profiles shape."""
    names = {network.get_input(i).name for i in range(network.num_inputs)}
    want = set(profiles[0].shapes)
    if names != want:
        raise EngineBuildError(
            f"the parsed network's inputs {sorted(names ^ want)} differ from the manifest's; rebuild the artifact"
        )


def check_fp32_layers(trt: Any, network: Any, nodes: Collection[str]) -> None:
    """The strongly typed network takes each layer's type from the ONNX dtypes: the layers the parser made
    of the nodes kept fp32 (the parser names a layer after its node, with a suffix where a node makes
    several) must have fp32 outputs, or TensorRT would route the experts in fp16."""
    if not nodes:
        return
    wanted, seen, wrong = set(nodes), set(), []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        node = next((n for n in wanted if layer.name == n or layer.name.startswith(n + "_")), None)
        if node is None:
            continue
        seen.add(node)
        for j in range(layer.num_outputs):
            out = layer.get_output(j)
            if out.dtype not in (trt.float32, trt.int32, trt.int64):  # TopK's indices are integers
                wrong.append(f"{layer.name} output {j} is {out.dtype}")
    missing = sorted(wanted - seen)
    if wrong or missing:
        raise EngineBuildError(
            "the MoE router layers must run in fp32 in the TensorRT network: "
            + "; ".join(wrong + [f"no layer for node {n!r}" for n in missing[:4]])
            + ". The prepared graph came from an older kvexport or was edited: rebuild the artifact."
        )


CACHE_PREFIX = "past_key_values."


def check_precision(trt: Any, network: Any, precision: str) -> None:
    """The strongly typed network runs in the ONNX file's types: the parsed KV-cache inputs (which the
    IKVCacheUpdateLayer writes in place, in float32, float16 or bfloat16 by its documented types) must be
    the engine's float type, and an fp32 engine must have no float16/bfloat16 layer output at all (IAttention,
    IRotaryEmbeddingLayer and IScatterLayer document float32 inputs too, so nothing in the graph needs one)."""
    want = {"fp32": trt.float32, "fp16": trt.float16, "bf16": trt.bfloat16}[precision]
    wrong = []
    for i in range(network.num_inputs):
        t = network.get_input(i)
        if t.name.startswith(CACHE_PREFIX) and t.dtype != want:
            wrong.append(f"cache input {t.name} is {t.dtype}")
    if precision == "fp32":
        narrow = (trt.float16, trt.bfloat16)
        for i in range(network.num_layers):
            layer = network.get_layer(i)
            wrong += [f"layer {layer.name} output {j} is {layer.get_output(j).dtype}"
                      for j in range(layer.num_outputs) if layer.get_output(j).dtype in narrow]
    if wrong:
        raise EngineBuildError(
            f"the parsed network is not the {precision} engine its manifest records: " + "; ".join(wrong[:6])
            + (f" (and {len(wrong) - 6} more)" if len(wrong) > 6 else "")
            + ". The prepared graph came from an older kvexport or was edited: rebuild the artifact."
        )


def fp32_builder_config(trt: Any, config: Any) -> None:
    """An fp32 engine computes in full fp32: TensorRT's builder allows TF32 (inputs rounded to 10-bit
    mantissas) for float32 matrix products by default, which would break the strict bar fp32 is for, so
    the TF32 flag is cleared where the installed TensorRT still has it."""
    flag = getattr(getattr(trt, "BuilderFlag", None), "TF32", None)
    if flag is not None:
        config.clear_flag(flag)


def deserialize(plan: bytes) -> tuple[Any, Any]:
    """bytes -> (IRuntime, ICudaEngine); the caller has already checked the plan's sha256 and keeps
    the runtime alive as long as the engine."""
    trt = import_tensorrt()
    log: list[str] = []
    runtime = trt.Runtime(_logger(trt, log))
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        raise EngineBuildError(
            "TensorRT could not deserialize the engine:\n  " + "\n  ".join(log[-10:] or ["(no message)"])
            + "\nIt was probably built with another TensorRT version or GPU; load without --no-rebuild to rebuild it."
        )
    return runtime, engine
