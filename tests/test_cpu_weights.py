"""cpu --weights int8|int4: MatMulNBits made by ONNX Runtime's quantizer, each mode verified against its row
on the trained default model; an engine with perturbed scales fails its row; auto's pick is recorded."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import kvexport
from kvexport.artifact import export_artifact, finish, open_artifact
from kvexport.backends import BuildOptions
from kvexport.backends.cpu import ENGINE_DIR, OPT_MODEL, CpuBackend, CpuSession
from kvexport.backends.cpu_quant import (DEFAULT_GROUP_SIZE, INT8_DOT_FLAGS, _quantize, accuracy_level, fitted_block,
                                         head_block, unpack_split_matmuls)
from kvexport.doctor import read_cpu_flags
from kvexport.precision import record, resolve
from kvexport.runtime.engine import Engine
from kvexport.tolerances import precision_key
from kvexport.verify import HELDOUT_FILE, Reference, VerifyReport, verify_engine

MAX_SEQ = 256  # text windows of 256 tokens, as the rows were measured
MODES = {"int8": BuildOptions(weights="int8"), "int4-g32": BuildOptions(weights="auto"),  # auto: int4 g32 here
         "int4-g64": BuildOptions(weights="int4", group_size=64),
         "int4-g128": BuildOptions(weights="int4", group_size=128),
         "int4-g32+head-int4": BuildOptions(weights="int4", extra={"lm_head": "int4"})}
# builds of the same rows by another rounding: calibrated on the held-out text's tail, as `kvexport build` does
OTHER_BUILDS = {"int4-g32+gptq": BuildOptions(weights="int4", extra={"quantizer": "gptq"})}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvexport.zoo import write_default

    return write_default(tmp_path_factory.mktemp("cpu-weights") / "default")


@pytest.fixture(scope="module")
def ir(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's static IR, exported once; each mode lowers a copy of it."""
    return export_artifact(trained, tmp_path_factory.mktemp("cpu-weights-ir") / "ir.kvx", max_seq=MAX_SEQ)


@pytest.fixture(scope="module")
def reference(trained: Path) -> Reference:
    return Reference(trained, MAX_SEQ)


class _Builds(dict):
    """mode -> artifact: core's steps of `kvexport build` (resolve, lower, record, hash) on a copy of the IR."""

    def __init__(self, ir: Path, trained: Path):
        super().__init__()
        self.ir, self.trained = ir, trained
        self.said: dict[str, list[str]] = {}

    def __missing__(self, mode: str) -> Path:
        folder = self.ir.parent / f"{mode}.kvx"
        shutil.copytree(self.ir, folder)
        _, manifest = open_artifact(folder)
        backend, options, said = CpuBackend(), BuildOptions(**vars(MODES.get(mode) or OTHER_BUILDS[mode])), []
        if mode in OTHER_BUILDS:
            options.calibration_text = (self.trained / HELDOUT_FILE).read_text(encoding="utf-8")
        resolved = resolve(backend, options, read_cpu_flags(), said.append)
        backend.build(folder, manifest, options, said.append)
        record(backend, folder, manifest, resolved)
        finish(folder, manifest)
        self[mode], self.said[mode] = folder, said
        return folder


@pytest.fixture(scope="module")
def builds(ir: Path, trained: Path) -> _Builds:
    return _Builds(ir, trained)


def _verify(engine: Engine, trained: Path, reference: Reference) -> VerifyReport:
    return verify_engine(engine, trained, decode_steps=16, prompt_lengths=(7,), reference=reference)


@pytest.mark.parametrize("mode", list(MODES))
def test_each_weight_mode_builds_and_verifies_against_its_row(mode: str, builds: _Builds, trained: Path,
                                                              reference: Reference) -> None:
    art = builds[mode]
    t = open_artifact(art)[1].target
    assert precision_key(t) == mode and t["kv"]["dtype"] == "fp32"
    graph = onnx.load(str(art / ENGINE_DIR / OPT_MODEL), load_external_data=False)
    ops = [n.op_type for n in graph.graph.node]
    # 5 per layer (q|k|v, o, gate, up, down: the packed gate|up cut at its Split) and the lm_head
    assert "MatMul" not in ops and ops.count("MatMulNBits") == 5 * 4 + 1 and "Split" not in ops
    assert t["weights"]["split_matmuls_unpacked"] == 4
    bits = {n.name: next(a.i for a in n.attribute if a.name == "bits") for n in graph.graph.node
            if n.op_type == "MatMulNBits"}
    head = [b for name, b in bits.items() if name.startswith("lm_head")]
    attrs = [{"name": n.name, **{a.name: a.i for a in n.attribute}} for n in graph.graph.node if n.op_type == "MatMulNBits"]
    flags = read_cpu_flags()  # every mode's accuracy level follows this CPU's ISA
    group = DEFAULT_GROUP_SIZE["int8"] if mode == "int8" else int(mode.split("-g")[1].split("+")[0])
    assert t["weights"]["group_size"] == group
    # a default group size is fitted to each matrix's rows (down_proj's 704 under int8's 128 on AVX2: 64);
    # one asked for is kept, padded
    fitted = MODES[mode].group_size is None

    def block(a: dict) -> int:  # the 8-bit head under int4 takes the int8 default block (cpu_quant.head_block)
        b = head_block(group, a["bits"]) if a["name"].startswith("lm_head") and mode.startswith("int4") else group
        return fitted_block(a["K"], b) if fitted or b != group else b
    assert [a["block_size"] for a in attrs] == [block(a) for a in attrs]
    blocks = {str(b): [a["block_size"] for a in attrs].count(b) for b in {a["block_size"] for a in attrs}}
    assert t["weights"]["blocks"] == blocks
    assert {a["accuracy_level"] for a in attrs} == {accuracy_level(flags)[0]}
    if mode.endswith("+head-int4"):
        assert head == [4] and set(bits.values()) == {4}
    else:  # lm_head 8-bit under int4 by default
        assert head == [8] and set(bits.values()) == ({8} if mode == "int8" else {4, 8})
    # the default model's embeddings are untied: the fp32 table stays (one row a token)
    assert ops.count("Gather") == 1 and "GatherBlockQuantized" not in ops
    r = _verify(kvexport.load(str(art)), trained, reference)
    print(mode, r.text, r.failures)
    assert r.text["source"] == HELDOUT_FILE and r.mode == "teacher-forced"
    assert r.passed, r.failures


def test_weight_bytes_shrink_with_the_mode(builds: _Builds) -> None:
    """Counted in the engine: int8 under a third of fp32's bytes, int4 (8-bit lm_head) under a fifth of it."""
    w = {m: open_artifact(builds[m])[1].target["weights"] for m in ("int8", "int4-g32", "int4-g128")}
    m = open_artifact(builds["int8"])[1]
    fp32 = 4 * m.raw["model"]["num_parameters"]
    # the default model's embeddings are untied: its table stays fp32 (a Gather reads one row a token); the
    # matmul weights shrink (tied tables share the lm_head's blocks: test_cpu_tied_embeddings.py)
    assert all(v["embeddings"].startswith("fp32 Gather (untied") for v in w.values())
    emb = 4 * m.config.vocab_size * m.config.hidden_size
    assert (w["int8"]["bytes"] - emb) < 0.3 * (fp32 - emb)
    assert (w["int4-g32"]["bytes"] - emb) < 0.2 * (fp32 - emb)
    assert w["int4-g128"]["bytes"] < w["int4-g32"]["bytes"]  # fewer scales
    assert w["int4-g32"]["lm_head_bits"] == 8 and w["int4-g32"]["accuracy_level"] == accuracy_level(read_cpu_flags())[0]


def test_the_8bit_head_under_int4_takes_the_int8_block(builds: _Builds) -> None:
    """Under int4 the 8-bit lm_head is quantized at the int8 default block where that is wider than the group (128),
    the 4-bit head at the group; the record says which (the graph's blocks:
    test_each_weight_mode_builds_and_verifies_against_its_row)."""
    want = 128
    assert head_block(32, 8) == want and head_block(32, 4) == 32 and head_block(256, 8) == 256
    assert open_artifact(builds["int4-g32"])[1].target["weights"]["lm_head_block"] == want
    assert open_artifact(builds["int4-g32+head-int4"])[1].target["weights"]["lm_head_block"] == 32


def test_auto_picks_int4_and_records_its_reason(builds: _Builds) -> None:
    t = open_artifact(builds["int4-g32"])[1].target
    assert t["auto"]["weights"] == "int4" and t["auto"]["group_size"] == 32 and t["auto"]["kv"] == "fp32"
    assert "fewest bytes" in t["auto"]["reason"]
    assert any(s.startswith("auto: --weights int4 --kv fp32 --group-size 32") for s in builds.said["int4-g32"])


def test_decode_keeps_the_cache_in_place(builds: _Builds) -> None:
    engine = kvexport.load(str(builds["int4-g32"]))
    assert engine.session.describe()["huge_pages"]["asked"] is True  # quantized weights: huge pages by default
    b = engine.prefill([72, 101, 108, 108, 111], 40)
    for t in range(30):
        engine.decode(b, np.array([65 + t % 20]))
    assert engine.session.cache_bytes_copied(b.state) == 0


def test_perturbed_int4_scales_fail_the_row(builds: _Builds, trained: Path, reference: Reference,
                                            tmp_path: Path) -> None:
    """One layer's MLP down-projection with its block scales 1.5x: a broken quantizer's kind of bug."""
    art = builds["int4-g32"]
    model = onnx.load(str(art / ENGINE_DIR / OPT_MODEL))
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits" and "down_proj" in n.name]
    scales = {t.name: t for t in model.graph.initializer}[nodes[1].input[2]]
    scales.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scales) * 1.5, scales.name))
    onnx.save_model(model, str(tmp_path / "broken.onnx"), save_as_external_data=True, location="broken.onnx.data")
    good = kvexport.load(str(art))
    broken = Engine(art, good.manifest, CpuSession(tmp_path / "broken.onnx", good.manifest, 2))
    r = _verify(broken, trained, reference)
    print(r.text, r.failures)
    assert any(f.startswith(("text", "held-out")) for f in r.failures), r.failures


def test_gptq_moves_the_logits_less_than_round_to_nearest(builds: _Builds, trained: Path,
                                                          reference: Reference) -> None:
    """--option quantizer=gptq: the same int4 g32 graph and row as round-to-nearest, every matrix but the lm_head
    rounded again against the inputs it took on the held-out text's tail; on the held-out text's head (the
    positions verify judges, never calibrated on) its logits sit closer to fp32's than RTN's."""
    rtn, gptq = builds["int4-g32"], builds["int4-g32+gptq"]
    t = open_artifact(gptq)[1].target
    assert precision_key(t) == "int4-g32" and t["weights"]["method"] == "gptq"
    assert t["weights"]["matrices"] == 4 * 4  # 4 per layer; the lm_head stays round-to-nearest
    assert t["weights"]["calibration"] == {"source": "calibration text (tail)", "tokens": 2048}
    assert open_artifact(rtn)[1].target["weights"]["method"] == "rtn"
    out = subprocess.run([sys.executable, "-m", "kvexport", "inspect", str(gptq), "--no-hash-check"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "rounding: gptq, 16 matrices against their inputs on 2048 tokens (calibration text (tail))" in out

    def matrices(art: Path) -> dict[str, np.ndarray]:
        g = onnx.load(str(art / ENGINE_DIR / OPT_MODEL))
        inits = {i.name: numpy_helper.to_array(i) for i in g.graph.initializer}
        return {n.name: inits[n.input[1]] for n in g.graph.node if n.op_type == "MatMulNBits"}

    a, b = matrices(rtn), matrices(gptq)
    assert a.keys() == b.keys()
    assert [k for k in a if np.array_equal(a[k], b[k])] == [k for k in a if k.startswith("lm_head")]
    r_rtn = _verify(kvexport.load(str(rtn)), trained, reference)
    r_gptq = _verify(kvexport.load(str(gptq)), trained, reference)
    print("rtn", r_rtn.text, "gptq", r_gptq.text)
    assert r_gptq.passed, r_gptq.failures
    # measured on this model: mean KL 1.2e-3 against 3.8e-3, ppl +0.4% against +1.4% (docs/backends/cpu.md)
    assert r_gptq.text["mean_kl"] < 0.6 * r_rtn.text["mean_kl"]
    assert r_gptq.text["top1_agreement"] >= r_rtn.text["top1_agreement"]
    assert abs(r_gptq.text["ppl_change"]) < abs(r_rtn.text["ppl_change"])


def test_gptq_is_refused_where_nothing_is_rounded() -> None:
    from kvexport.errors import InputError

    with pytest.raises(InputError, match="quantizer=gptq rounds int8/int4 weights"):
        CpuBackend().build_options(BuildOptions(weights="fp32", extra={"quantizer": "gptq"}))
    with pytest.raises(InputError, match="quantizer"):
        CpuBackend().build_options(BuildOptions(weights="int4", extra={"quantizer": "awq"}))


def test_accuracy_level_follows_the_isa() -> None:
    for flag in INT8_DOT_FLAGS:
        assert accuracy_level({"avx2", flag})[0] == 4 and flag in accuracy_level({"avx2", flag})[1]
    level, why = accuracy_level({"avx2", "fma"})  # int8 compute measured faster on AVX2 alone too
    assert level == 4 and "AVX2 without VNNI" in why


def test_default_blocks_int8_128_int4_32() -> None:
    """int8 takes blocks of 128 (measured faster than 32 on AVX2 alone, AVX512-VNNI and AMX-INT8), int4 32 (as
    onnxruntime-genai's builder); the cpu target declares them, and a copy: a caller cannot change the defaults."""
    caps = CpuBackend().capabilities()
    assert caps.default_group_size == {"int8": 128, "int4": 32} == DEFAULT_GROUP_SIZE
    caps.default_group_size["int8"] = 16
    assert CpuBackend().capabilities().default_group_size["int8"] == 128


def test_a_default_block_is_fitted_to_the_rows_it_must_divide() -> None:
    assert fitted_block(2048, 128) == 128 and fitted_block(704, 128) == 64 and fitted_block(576, 128) == 64
    assert fitted_block(64, 128) == 64 and fitted_block(80, 32) == 16  # MatMulNBits' least block is 16
    assert fitted_block(100, 32) == 32  # no power of two from 16 up divides it: the group, padded


def test_another_onnxruntime_refuses_a_quantized_engine_instead_of_running_the_fp32_ir(
        builds: _Builds, tmp_path: Path) -> None:
    """The fallback for an engine graph made by another ONNX Runtime loads the portable IR, which holds
    fp32 weights: for an int8 artifact that is not the engine the manifest describes, so load refuses."""
    from kvexport.errors import ArtifactError
    from kvexport.manifest import MANIFEST_FILE

    folder = tmp_path / "other-ort.kvx"
    shutil.copytree(builds["int8"], folder)
    manifest_file = folder / MANIFEST_FILE
    raw = json.loads(manifest_file.read_text())
    raw["target"]["fingerprint"]["onnxruntime"] = "0.0.1"
    manifest_file.write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match="weights int8 .*onnxruntime 0.0.1.*Rebuild"):
        kvexport.load(str(folder))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_packed_matmul_is_cut_at_its_split_with_the_same_outputs(bits: int) -> None:
    """unpack_split_matmuls: a MatMulNBits read only by a Split of its last axis becomes one MatMulNBits per piece
    (given sizes or equal parts), each piece's outputs the packed node's exactly; a matmul read by more than a Split,
    or split along another axis, stays packed."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    k = 64
    weights = {f"w{i}": rng.standard_normal((k, n)).astype(np.float32) for i, n in enumerate((96, 96, 64, 64))}
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"m{i}"], name=f"mm{i}") for i in range(4)]
    nodes += [helper.make_node("Split", ["m0", "sizes"], ["gate", "up"], axis=-1),  # sizes given: cut
              helper.make_node("Split", ["m1"], ["a", "b", "c"], axis=2, num_outputs=3),  # equal parts: cut
              helper.make_node("Split", ["m2"], ["r0", "r1"], axis=1, num_outputs=2),  # tokens, not N: kept
              helper.make_node("Split", ["m3"], ["s0", "s1"], axis=-1, num_outputs=2),
              helper.make_node("Relu", ["m3"], ["also"])]  # read twice: kept
    outs = ["gate", "up", "a", "b", "c", "r0", "r1", "s0", "s1", "also"]
    graph = helper.make_graph(nodes, "packed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, k])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs],
                              [numpy_helper.from_array(w, n) for n, w in weights.items()]
                              + [numpy_helper.from_array(np.array([48, 48], np.int64), "sizes")])
    model = _quantize(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), bits, 32,
                      accuracy_level(read_cpu_flags())[0])
    x = rng.standard_normal((1, 4, k)).astype(np.float32)

    def run() -> list[np.ndarray]:
        return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(outs, {"x": x})

    packed = run()
    assert unpack_split_matmuls(model) == 2
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") == 2 + 3 + 2 and ops.count("Split") == 2
    assert sorted(helper.get_attribute_value(a) for n in model.graph.node if n.op_type == "MatMulNBits"
                  for a in n.attribute if a.name == "N") == [32, 32, 32, 48, 48, 64, 64]
    assert not any(t.name.startswith(("mm0", "mm1")) or t.name in ("w0", "w1") for t in model.graph.initializer)
    for o, a, b in zip(outs, packed, run()):
        assert np.array_equal(a, b), o
