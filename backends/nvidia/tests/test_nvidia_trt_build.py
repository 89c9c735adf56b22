"""Engine-build error paths, with a stand-in `tensorrt` module (the real one needs a GPU).

The stand-in only records calls and returns what a failing TensorRT returns (False, None); it
checks that kvexport surfaces every parser error and the builder log, refuses old TensorRT
versions, and asks for a strongly typed network.
"""
from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from kvexport.errors import BackendUnavailableError
from kvexport_nvidia import trt_build
from kvexport_nvidia.profiles import Profile
from kvexport_nvidia.trt_build import EngineBuildError, build_engine, import_tensorrt, network_flags, version_tuple


class _Error:
    def __init__(self, i: int):
        self.i = i

    def code(self) -> str:
        return "ErrorCode.UNSUPPORTED_NODE"

    def desc(self) -> str:
        return f"problem {self.i}"

    def node(self) -> int:
        return 10 + self.i

    def node_name(self) -> str:
        return f"layers.{self.i}.attn/Attention_0"

    def node_operator(self) -> str:
        return "Attention"


DTYPES = ("DataType.FLOAT", "DataType.HALF", "DataType.BF16")  # trt.float32, trt.float16, trt.bfloat16


def fake_trt(version: str = "10.15.1", *, parse_ok: bool = False, plan: bytes | None = None) -> types.ModuleType:
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version  # type: ignore[attr-defined]
    calls: dict[str, Any] = {"shapes": [], "profiles": 0}
    trt.calls = calls  # type: ignore[attr-defined]

    class ILogger:
        class Severity:
            ERROR, WARNING, INFO = 1, 2, 3

        def __init__(self) -> None:
            pass

    class Network:
        num_inputs, num_layers = 1, 0

        def get_input(self, i: int) -> Any:
            return types.SimpleNamespace(name="input_ids")

    class Builder:
        def __init__(self, logger: Any):
            self.logger = logger

        def create_network(self, flags: int) -> Network:
            calls["flags"] = flags
            return Network()

        def create_builder_config(self) -> Any:
            return types.SimpleNamespace(
                set_memory_pool_limit=lambda pool, n: calls.__setitem__("workspace", n),
                add_optimization_profile=lambda p: calls.__setitem__("profiles", calls["profiles"] + 1),
                clear_flag=lambda flag: calls.setdefault("cleared", []).append(flag))

        def create_optimization_profile(self) -> Any:
            return types.SimpleNamespace(set_shape=lambda *a: calls["shapes"].append(a))

        def build_serialized_network(self, network: Any, config: Any) -> bytes | None:
            self.logger.log(ILogger.Severity.ERROR, "out of memory while building tactic")
            return plan

    class OnnxParser:
        num_errors = 2

        def __init__(self, network: Any, logger: Any):
            pass

        def parse_from_file(self, path: str) -> bool:
            calls["parsed"] = path
            return parse_ok

        def get_error(self, i: int) -> _Error:
            return _Error(i)

    trt.ILogger, trt.Builder, trt.OnnxParser = ILogger, Builder, OnnxParser  # type: ignore[attr-defined]
    trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=1)  # type: ignore[attr-defined]
    trt.BuilderFlag = types.SimpleNamespace(TF32="BuilderFlag.TF32")  # type: ignore[attr-defined]
    trt.float32, trt.float16, trt.bfloat16 = DTYPES  # type: ignore[attr-defined]
    trt.int32, trt.int64 = "DataType.INT32", "DataType.INT64"  # type: ignore[attr-defined]
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE=0)  # type: ignore[attr-defined]
    return trt


PROFILES = [Profile("prefill", {"input_ids": ((1, 1), (1, 8), (2, 16))}),
            Profile("decode", {"input_ids": ((1, 1), (1, 1), (2, 1))})]


def test_missing_tensorrt_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import raises ImportError
    with pytest.raises(BackendUnavailableError, match=r"pip install tensorrt"):
        import_tensorrt()


def test_old_tensorrt_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", fake_trt("10.8.0.43"))
    with pytest.raises(BackendUnavailableError, match="10.8.0.43 lacks the KV-cache update"):
        import_tensorrt()
    monkeypatch.setitem(sys.modules, "tensorrt", fake_trt("11.4.0.106"))
    assert import_tensorrt().__version__ == "11.4.0.106"


def test_versions_and_flags() -> None:
    assert version_tuple("10.15.1.29") == (10, 15, 1) and version_tuple("11.0.0rc1") == (11, 0, 0)
    assert network_flags(fake_trt()) == 1 << 1
    no_flag = types.SimpleNamespace(NetworkDefinitionCreationFlag=types.SimpleNamespace())
    assert network_flags(no_flag) == 0


def test_every_parser_error_is_surfaced(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", fake_trt(parse_ok=False))
    with pytest.raises(EngineBuildError) as e:
        build_engine(tmp_path / "prepared.onnx", PROFILES)
    msg = str(e.value)
    assert "2 error(s)" in msg and "problem 0" in msg and "problem 1" in msg
    assert "layers.1.attn/Attention_0" in msg and "(Attention)" in msg and "UNSUPPORTED_NODE" in msg


def test_builder_failure_shows_its_log(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    trt = fake_trt(parse_ok=True, plan=None)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    with pytest.raises(EngineBuildError, match="out of memory while building tactic"):
        build_engine(tmp_path / "prepared.onnx", PROFILES, workspace_bytes=1 << 30)
    assert trt.calls["flags"] == 2 and trt.calls["workspace"] == 1 << 30  # type: ignore[attr-defined]


def test_profiles_reach_the_builder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    trt = fake_trt(parse_ok=True, plan=b"PLAN")
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    assert build_engine(tmp_path / "prepared.onnx", PROFILES) == b"PLAN"
    assert trt.calls["profiles"] == 2  # type: ignore[attr-defined]
    assert trt.calls["shapes"] == [("input_ids", (1, 1), (1, 8), (2, 16)), ("input_ids", (1, 1), (1, 1), (2, 1))]  # type: ignore[attr-defined]
    assert trt.calls["parsed"] == str(tmp_path / "prepared.onnx")  # type: ignore[attr-defined]


def test_network_inputs_must_match_the_profiles(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", fake_trt(parse_ok=True, plan=b"P"))
    extra = [Profile("prefill", {"input_ids": ((1, 1),) * 3, "write_index": ((1,),) * 3})]
    with pytest.raises(EngineBuildError, match="write_index"):
        build_engine(tmp_path / "prepared.onnx", extra)


def test_module_never_imports_tensorrt_at_import() -> None:
    assert "tensorrt" not in vars(trt_build)


def test_router_layers_parsed_in_fp16_are_refused() -> None:
    """The strongly typed network's router layers must come out fp32 (the lowering's Casts say so)."""
    trt = types.SimpleNamespace(float32="DataType.FLOAT", float16="DataType.HALF", int32="DataType.INT32",
                                int64="DataType.INT64")

    def network(dtypes: dict[str, list[str]]) -> Any:
        layers = [types.SimpleNamespace(name=name, num_outputs=len(d),
                                        get_output=lambda j, d=d: types.SimpleNamespace(dtype=d[j]))
                  for name, d in dtypes.items()]
        return types.SimpleNamespace(num_layers=len(layers), get_layer=lambda i: layers[i])

    nodes = ["layers.1.mlp.router/Gemm_0", "layers.1.mlp/TopK_0"]
    ok = network({"layers.1.mlp.router/Gemm_0": [trt.float32], "layers.1.mlp/TopK_0": [trt.float32, trt.int32],
                  "layers.1.mlp/If_0": [trt.float16]})
    trt_build.check_fp32_layers(trt, ok, nodes)
    half = network({"layers.1.mlp.router/Gemm_0_1": [trt.float16], "layers.1.mlp/TopK_0": [trt.float32, trt.int64]})
    with pytest.raises(EngineBuildError, match=r"Gemm_0_1 output 0 is DataType.HALF"):
        trt_build.check_fp32_layers(trt, half, nodes)
    with pytest.raises(EngineBuildError, match=r"no layer for node 'layers.1.mlp/TopK_0'"):
        trt_build.check_fp32_layers(trt, network({"layers.1.mlp.router/Gemm_0": [trt.float32]}), nodes)


def test_fp32_engines_are_built_without_tf32(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """TF32 rounds fp32 matrix inputs to 10-bit mantissas and is on by default: an fp32 build clears it,
    an fp16 build leaves the builder's defaults alone (its precision is the ONNX file's)."""
    trt = fake_trt(parse_ok=True, plan=b"PLAN")
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    build_engine(tmp_path / "prepared.onnx", PROFILES, precision="fp16")
    assert "cleared" not in trt.calls  # type: ignore[attr-defined]
    build_engine(tmp_path / "prepared.onnx", PROFILES, precision="fp32")
    assert trt.calls["cleared"] == ["BuilderFlag.TF32"]  # type: ignore[attr-defined]
    assert trt.calls["flags"] == 2  # type: ignore[attr-defined]  # strongly typed, as at fp16


def _typed_network(inputs: dict[str, str], layers: dict[str, list[str]]) -> Any:
    ins = [types.SimpleNamespace(name=n, dtype=d) for n, d in inputs.items()]
    lays = [types.SimpleNamespace(name=name, num_outputs=len(d), get_output=lambda j, d=d: types.SimpleNamespace(dtype=d[j]))
            for name, d in layers.items()]
    return types.SimpleNamespace(num_inputs=len(ins), get_input=lambda i: ins[i],
                                 num_layers=len(lays), get_layer=lambda i: lays[i])


def test_parsed_network_must_be_the_engine_precision() -> None:
    """The cache inputs (IKVCacheUpdateLayer's in-place tensors) are of the engine's type, and an fp32 network
    has no 16-bit layer: what TensorRT parsed is what the manifest records."""
    f32, f16, bf16 = DTYPES
    trt = types.SimpleNamespace(float32=f32, float16=f16, bfloat16=bf16)
    cache = {"input_ids": "DataType.INT64", "past_key_values.0.key": f32, "past_key_values.0.value": f32}
    layers = {"layers.0.attn/Attention_0": [f32], "layers.0.attn/TensorScatter_0": [f32], "lm_head/MatMul_0": [f32]}
    trt_build.check_precision(trt, _typed_network(cache, layers), "fp32")
    with pytest.raises(EngineBuildError, match=r"not the fp16 engine.*past_key_values.0.key is DataType.FLOAT"):
        trt_build.check_precision(trt, _typed_network(cache, layers), "fp16")
    half = {**layers, "layers.0.mlp/MatMul_0": [f16]}
    with pytest.raises(EngineBuildError, match=r"layer layers.0.mlp/MatMul_0 output 0 is DataType.HALF"):
        trt_build.check_precision(trt, _typed_network(cache, half), "fp32")
    # an fp16 network's layers may be anything its ONNX types say (the routers stay fp32); its cache is fp16
    trt_build.check_precision(trt, _typed_network({**cache, "past_key_values.0.key": f16,
                                                   "past_key_values.0.value": f16}, half), "fp16")
