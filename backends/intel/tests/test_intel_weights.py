"""The intel target's weight modes on the trained default model: NNCF int8/int4 engines verify against their
tolerance rows, keep the fused attention-with-state path, shrink the weight bytes; bf16 where the CPU has it."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import kvexport
from kvexport.backends import BuildOptions
from kvexport.errors import InputError
from kvexport.testing import greedy_logits
from kvexport.verify import Reference, verify_engine

pytest.importorskip("openvino", reason="the intel target needs openvino (pip install 'kvexport[intel]')")
pytest.importorskip("nncf", reason="intel int8/int4 weights need nncf (pip install 'kvexport[intel]')")

from kvexport_intel import IntelBackend, compress, isa, lowering  # noqa: E402

MAX_SEQ = 256  # verify's text windows: 64 tokens prefilled, 192 decoded
# name -> build options; int4 without --group-size is NNCF's and optimum-intel's 128
MODES = {
    "fp32": BuildOptions(weights="fp32"),
    "int8": BuildOptions(weights="int8"),
    "bf16": BuildOptions(weights="bf16"),
    "int4-g128": BuildOptions(weights="int4"),
    "int4-g32": BuildOptions(weights="int4", group_size=32),
    "int4-g128-sym": BuildOptions(weights="int4", extra={"int4_sym": "true"}),
    "int4-g128+gptq": BuildOptions(weights="int4", extra={"quantizer": "gptq"}),
}


class _Builds(dict):
    """mode -> artifact of the default model, lowered on first use: the export once, each mode a rebuild
    of the engine from a copy of the fp32 artifact (what the backend does after the export)."""

    def __init__(self, root: Path, ckpt: Path):
        super().__init__()
        self.root, self.ckpt = root, ckpt

    def __missing__(self, mode: str) -> Path:
        from kvexport.artifact import finish, open_artifact
        from kvexport.build import _with_calibration_text, build

        if mode == "fp32":
            self[mode] = build(self.ckpt, self.root / "fp32.kvx", target="intel", max_seq=MAX_SEQ,
                               options=BuildOptions(weights="fp32"), verify=False)
            return self[mode]
        folder, manifest = open_artifact(shutil.copytree(self["fp32"], self.root / f"{mode}.kvx"))
        manifest.raw.pop("target")
        options = MODES[mode]
        asked = BuildOptions(weights=options.weights, group_size=options.group_size, extra=dict(options.extra))
        IntelBackend().build(folder, manifest, _with_calibration_text(asked, self.ckpt), lambda _m: None)
        finish(folder, manifest)
        self[mode] = folder
        return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvexport.zoo import write_default

    return write_default(tmp_path_factory.mktemp("intel-weights") / "default")


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory, trained: Path) -> _Builds:
    return _Builds(tmp_path_factory.mktemp("intel-weight-builds"), trained)


@pytest.fixture(scope="module")
def reference(trained: Path) -> Reference:
    return Reference(trained, MAX_SEQ)


# the default model's matmuls kvexport's QGemv takes: 4-bit ones over a multiple of 128 inputs (not its down_proj,
# K 704) and 8-bit rows of a multiple of 64 values, in each of its 4 layers, and the lm_head (8-bit under int4)
QGEMV_MATMULS = {"int8": 4 * 4 + 1, "int4-g128": 3 * 4 + 1, "int4-g32": 3 * 4 + 1}


@pytest.mark.parametrize("decode_matmul", ["kvexport", "openvino"])
@pytest.mark.parametrize("activations", ["fp32", "as built"])
@pytest.mark.parametrize("mode", ["int8", "int4-g128", "int4-g32"])
def test_compressed_weights_pass_their_tolerance_row_on_the_trained_model(mode: str, activations: str,
                                                                          decode_matmul: str, builds: _Builds,
                                                                          trained: Path, reference: Reference) -> None:
    """Judged with f32 activations on every CPU, and as built (bf16 activations, the cache held in bf16) where the
    CPU has bf16 hardware; there the record, and so the row, is `+kv-bf16`, measured with bf16 activations. Each
    with decode steps through kvexport's QGemv (its portable loops on a CPU without AVX512-VNNI) and through the
    plugin's matmuls."""
    bf16_cpu = isa.has_bf16(isa.read_cpu_flags())
    if activations == "as built" and not bf16_cpu:
        pytest.skip("without AMX-BF16 or AVX512-BF16 the engine is built with f32 activations: the fp32 case")
    engine = kvexport.load(str(builds[mode]), decode_matmul=decode_matmul,
                           **({"precision": "fp32"} if activations == "fp32" else {}))
    assert engine.session.describe()["precision"] == ("bf16" if activations == "as built" else "fp32")
    report = verify_engine(engine, trained, reference=reference)
    facts = engine.session.facts
    if decode_matmul == "kvexport":
        assert facts["decode_matmuls"].startswith(f"{QGEMV_MATMULS[mode]} through kvexport's QGemv")
        assert facts["prompt_form"].startswith("prompts through a second paged form, the plugin's matmuls")
    else:
        assert "decode_matmuls" not in facts and "prompt_form" not in facts
    t = report.text
    print(f"intel {mode} ({activations}, decode_matmul={decode_matmul}): top-1 {t['top1_agreement']:.4f}, mean KL {t['mean_kl']:.3g}, max KL "
          f"{t['max_kl']:.3g}, ppl {t['ppl_engine']:.4f} vs {t['ppl_reference']:.4f} ({t['ppl_change']:+.3%})")
    assert report.precision == mode + ("+kv-bf16" if bf16_cpu else "") and report.mode == "teacher-forced"
    assert report.passed, report.failures
    assert abs(t["ppl_change"]) <= (0.01 if mode == "int8" else 0.08)  # the issue's bar, under the row's own
    assert t["mean_kl"] > 1e-7  # the weights really were compressed: the engine is not the fp32 one


def test_int4_sym_decode_steps_through_qgemv_pass_the_int4_row(builds: _Builds, trained: Path,
                                                                 reference: Reference) -> None:
    """INT4_SYM's signed values (no zero points) through QGemv, which flips them against zero points of 8: the same
    matmuls taken as INT4_ASYM's, and the int4 row passed at f32 activations."""
    engine = kvexport.load(str(builds["int4-g128-sym"]), precision="fp32", decode_matmul="kvexport")
    report = verify_engine(engine, trained, reference=reference)
    assert engine.session.facts["decode_matmuls"].startswith(f"{QGEMV_MATMULS['int4-g128']} through kvexport's QGemv")
    t = report.text
    print(f"intel int4-g128 INT4_SYM (fp32, decode_matmul=kvexport): top-1 {t['top1_agreement']:.4f}, mean KL "
          f"{t['mean_kl']:.3g}, ppl {t['ppl_change']:+.3%}")
    assert report.passed, report.failures
    assert abs(t["ppl_change"]) <= 0.08 and t["mean_kl"] > 1e-7


def test_steps_of_more_rows_than_the_decode_matmul_takes_run_the_plugins(builds: _Builds) -> None:
    """Prompts, and decode steps of more than GEMV_ROWS rows (whose dot products would cost the op more than the
    plugin's matmuls), run the second paged form over the same blocks; one- and two-row steps run QGemv's."""
    from kvexport_intel.gemv import GEMV_ROWS

    engine = kvexport.load(str(builds["int4-g128"]), decode_matmul="kvexport")
    rows = engine.session.batched_rows(3)
    assert rows.decode_rows_max == GEMV_ROWS == 2
    calls = {"decode form": 0, "prompt form": 0}

    class Counted:
        def __init__(self, request: object, name: str):
            self.request, self.name = request, name

        def infer(self, *args: object, **kwargs: object) -> object:
            calls[self.name] += 1
            return self.request.infer(*args, **kwargs)

        def __getattr__(self, attr: str) -> object:
            return getattr(self.request, attr)

    rows.request, rows.prompt_request = Counted(rows.request, "decode form"), Counted(rows.prompt_request, "prompt form")
    try:
        rows.prompts([np.array([5, 6, 7]), np.array([8, 9]), np.array([10, 11, 12, 13])])
        assert calls == {"decode form": 0, "prompt form": 1}
        three = rows.decode(np.arange(3), np.array([1, 2, 3])).copy()
        assert calls == {"decode form": 0, "prompt form": 2}
        two = rows.decode(np.arange(2), np.array([4, 5])).copy()
        assert calls == {"decode form": 1, "prompt form": 2}
        assert three.shape == (3, engine.config.vocab_size) and two.shape == (2, engine.config.vocab_size)
        assert np.isfinite(three).all() and np.isfinite(two).all()
    finally:
        rows.release()


@pytest.mark.parametrize("mode", ["int8", "int4-g128"])
def test_compressed_engines_keep_the_fused_stateful_attention(mode: str, builds: _Builds) -> None:
    engine = kvexport.load(str(builds[mode]))
    layers = engine.config.num_hidden_layers
    compiled = engine.session.compiled
    assert lowering.fused_attention_layers(compiled) == layers
    assert lowering.runtime_op_counts(compiled)["ScaledDotProductAttention"] == layers
    weights = engine.manifest.target["weights"]
    # the default model fuses q/k/v and gate/up: 4 matmuls a layer, plus the embedding and lm_head
    if mode == "int8":
        assert weights["compressed_weights"] == {"int8": 4 * layers + 2}
    else:  # int4 in the blocks; the embedding and lm_head in NNCF's int8 backup, as optimum-intel leaves them
        assert weights["compressed_weights"] == {"int4": 4 * layers, "int8": 2}
        assert weights["mode"] == "INT4_ASYM" and weights["group_size"] == 128


def test_dynamic_quant_group_reaches_the_plugin_and_is_checked(builds: _Builds) -> None:
    """The load option dynamic_quant_group sets the plugin's DYNAMIC_QUANTIZATION_GROUP_SIZE for compressed weights
    (the compiled model reports it; the plugin's own default, 32 here, where not given; 0 off: the activations' own precision into
    the decompressed weights, logits near the default's); refused for fp32/bf16 weights and below 0."""
    default = kvexport.load(str(builds["int8"]), precision="fp32")
    off = kvexport.load(str(builds["int8"]), precision="fp32", dynamic_quant_group=0)
    import openvino as ov

    plugins_own = int(ov.Core().get_property("CPU", "DYNAMIC_QUANTIZATION_GROUP_SIZE"))  # 32 on the CPUs seen so far
    assert default.session.facts["dynamic_quant_group"] == plugins_own and off.session.facts["dynamic_quant_group"] == 0
    assert int(off.session.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == 0
    ids = [5, 9, 23, 40, 2, 17]
    assert len(off.generate(ids, max_new_tokens=8).token_ids) == 8
    got, want = greedy_logits(off, ids, 4), greedy_logits(default, ids, 4)  # the same weights, activations apart
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()
    with pytest.raises(InputError, match="dynamic_quant_group applies to int8/int4 weights"):
        kvexport.load(str(builds["fp32"]), dynamic_quant_group=0)
    with pytest.raises(InputError, match="dynamic_quant_group applies"):
        kvexport.load(str(builds["int8"]), dynamic_quant_group=-1)


@pytest.mark.parametrize("mode", ["int8", "int4-g128"])
def test_paged_form_splits_compressed_packed_projections(mode: str, builds: _Builds) -> None:
    """The paged form cuts a compressed packed q|k|v or gate|up weight (its int8/int4 values, zero points and
    scales) into one compressed MatMul per piece, as it does an f32 one: no VariadicSplit left on a matmul, every
    piece still compressed (the plugin's FullyConnectedCompressed), and the logits of the packed form's run."""
    import openvino as ov

    from kvexport_intel.paged import PagedRows, to_paged

    engine = kvexport.load(str(builds[mode]), precision="fp32")
    layers, core = engine.session.num_layers, ov.Core()
    ids = np.random.default_rng(4).integers(0, engine.vocab_size, 40)
    logits, runs = [], []
    for split in ("none", "all"):
        model = core.read_model(engine.session.model_path)
        assert to_paged(model, engine.session.windows, split) is None
        packed = sum(op.get_type_name() == "VariadicSplit" and op.input_value(0).get_node().get_type_name() == "MatMul"
                     for op in model.get_ordered_ops())
        assert packed == (0 if split == "all" else 2 * layers)
        compiled = core.compile_model(model, "CPU", {**engine.session.compile_config, "PERF_COUNT": True})
        rows = PagedRows(compiled, rows=1, max_seq=MAX_SEQ, num_layers=layers, vocab_size=engine.vocab_size)
        logits.append(rows.extend(0, ids).copy())
        runs.append(Counter(p.node_type for p in rows.request.profiling_info))  # what ran, by the plugin's names
    # q|k|v into three, gate|up into two: three compressed matmuls more a layer, none decompressed to run in f32
    assert runs[1]["FullyConnectedCompressed"] == runs[0]["FullyConnectedCompressed"] + 3 * layers
    assert runs[1]["FullyConnected"] == runs[0]["FullyConnected"]
    assert runs[0]["VariadicSplit"] >= 2 * layers and runs[1]["VariadicSplit"] == runs[0]["VariadicSplit"] - 2 * layers
    gap = float(np.abs(logits[0] - logits[1]).max())
    assert gap <= 1e-3 * float(np.abs(logits[0]).max()), gap  # the same weights, summed in another split


def test_rope_tables_stay_f32_when_weights_are_compressed(builds: _Builds) -> None:
    import openvino as ov

    model = ov.Core().read_model(str(builds["int4-g128"] / "engine" / lowering.XML))
    tables = compress.position_tables(model)
    assert len(tables) == 2  # cos and sin, gathered by position_ids
    for op in model.get_ops():
        if op.get_friendly_name() in tables:
            assert op.input_value(0).get_node().get_type_name() == "Constant"
            assert op.input_value(0).get_element_type().get_type_name() == "f32"


def test_weight_bytes_in_the_manifest_shrink_with_the_mode(builds: _Builds) -> None:
    size = {m: kvexport.load(str(builds[m])).manifest.target["weights"]["bytes"] for m in ("fp32", "int8", "int4-g128")}
    for m, b in size.items():
        assert b == (builds[m] / "engine" / lowering.BIN).stat().st_size  # counted, not estimated
    ratio = {m: size[m] / size["fp32"] for m in size}
    print("weight bytes against fp32: " + ", ".join(f"{m} {r:.3f}" for m, r in ratio.items()))
    assert 0.24 < ratio["int8"] < 0.30  # a byte a weight, a scale and a zero point per output channel
    assert ratio["int4-g128"] < 0.17  # half a byte a weight in the blocks; embedding and lm_head int8


def test_int8_takes_no_group_size_and_int4_sym_needs_int4() -> None:
    backend = IntelBackend()
    with pytest.raises(InputError, match="per output channel"):
        backend.build_options(BuildOptions(weights="int8", group_size=32))
    with pytest.raises(InputError, match="int4_sym"):
        backend.build_options(BuildOptions(weights="fp32", extra={"int4_sym": "true"}))
    assert backend.build_options(BuildOptions(weights="int4", extra={"int4_sym": "yes"}))["int4_sym"] is True


def test_auto_never_picks_bf16_without_bf16_hardware() -> None:
    backend = IntelBackend()
    avx2 = {"avx2", "fma"}
    amx = {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
    assert all(m.weights != "bf16" for m in backend.auto_modes(avx2))
    assert "bf16" in [m.weights for m in backend.auto_modes(amx)]
    assert backend.auto_modes(amx)[0].weights == backend.auto_modes(avx2)[0].weights  # fewest bytes first, on both


@pytest.mark.skipif(not isa.has_bf16(isa.read_cpu_flags()),
                    reason="OpenVINO runs bf16 only on CPUs with AMX-BF16 or AVX512-BF16; this one has neither")
@pytest.mark.parametrize("decode_matmul", ["auto", "openvino"])
def test_bf16_weights_run_in_bf16_and_pass_their_row(trained: Path, reference: Reference, builds: _Builds,
                                                    decode_matmul: str) -> None:
    """bf16 weights at bf16 activations, decode steps through kvexport's QGemv over bf16 copies of the IR's f32
    weights (auto, where the CPU has AVX512-BF16) and through the plugin's matmuls."""
    engine = kvexport.load(str(builds["bf16"]), decode_matmul=decode_matmul)
    assert engine.session.describe()["precision"] == "bf16"
    report = verify_engine(engine, trained, reference=reference)
    facts = engine.session.facts
    flags = isa.read_cpu_flags()
    ours = decode_matmul == "auto" and "avx512_bf16" in flags
    amx = ours and {"amx_tile", "amx_bf16"} <= flags  # prompts too, through its AMX-BF16 tiles: one form, one copy
    if ours:  # every matmul of the default model's 4 layers (qkv, o, gate_up, down) and the lm_head
        rows = "; AMX-BF16 for steps of more than 2 rows" if amx else ""
        assert facts["decode_matmuls"] == (f"{4 * 4 + 1} through kvexport's QGemv (AVX512-BF16{rows}, bf16 copies of "
                                           "the f32 weights)"), facts["decode_matmuls"]
        assert facts["prompt_form"].startswith("the decode form's: kvexport's QGemv" if amx else
                                               "prompts through a second paged form, the plugin's matmuls")
        assert (engine.session.prompt_form() is None) == amx
    else:
        assert "decode_matmuls" not in facts
    print(f"intel bf16 on this CPU (decode_matmul={decode_matmul}): {report.text}")
    assert report.precision == "bf16" and report.passed, report.failures
    assert np.isfinite(report.text["mean_kl"]) and report.text["mean_kl"] > 0  # bf16 really ran
    # the cache held in bf16 (half of f32's bytes), so prompts take paged attention, which keeps no f32 cache
    # under bf16 activations (before, they fell back to one stateful call here); the text is judged again through
    # the stateful call
    fp32_kv = json.loads((builds["fp32"] / "manifest.json").read_text())["target"]["kv"]
    kv = engine.manifest.raw["target"]["kv"]
    assert kv["dtype"] == "bf16" and 2 * kv["bytes_per_token"] == fp32_kv["bytes_per_token"]
    assert engine.session.describe()["kv_precision"] == "bf16"
    assert engine.session.describe()["long_prefill"].startswith("paged attention")
    assert report.other_text["path"].startswith("one stateful call"), report.other_text["path"]


@pytest.mark.skipif(not {"avx512f", "avx512bw", "avx512_bf16"} <= isa.read_cpu_flags(),
                    reason="bf16 decode steps take kvexport's QGemv by default only where the CPU has AVX512-BF16")
def test_bf16_engines_keep_one_copy_where_a_second_would_not_fit(builds: _Builds,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Where prompts keep the plugin's matmuls (prompt_matmul=openvino, and auto without AMX-BF16), the load judges
    the decode steps' bf16 copy, a second one, against the memory available (here made to look small): auto keeps
    the plugin's matmuls and says why; decode_matmul=kvexport makes the copy anyway. Where the op takes prompts too
    (AMX-BF16), its copy is the only one and is made whatever the memory."""
    from kvexport_intel import gemv

    monkeypatch.setattr(gemv, "available_memory", lambda: 1024)
    engine = kvexport.load(str(builds["bf16"]), prompt_matmul="openvino")
    assert "would take more than half of the memory available" in engine.session.facts["decode_matmul"]
    assert engine.session.decode_gemv is None and "decode_matmuls" not in engine.session.facts
    asked = kvexport.load(str(builds["bf16"]), decode_matmul="kvexport", prompt_matmul="openvino")
    asked.generate([5, 6, 7], max_new_tokens=2)
    assert asked.session.facts["decode_matmuls"].startswith("17 through kvexport's QGemv")
    auto = kvexport.load(str(builds["bf16"]))
    amx = {"amx_tile", "amx_bf16"} <= isa.read_cpu_flags()
    assert (auto.session.decode_gemv is not None) == amx, auto.session.facts["decode_matmul"]
    assert auto.session.facts["prompt_matmul"].startswith("kvexport's QGemv (AMX-BF16)" if amx else
                                                          "kvexport's prompt matmul is written for AMX-BF16")


def test_prompt_matmul_kvexport_is_refused_where_no_bf16_copies_exist(builds: _Builds) -> None:
    """prompt_matmul=kvexport reads the decode steps' bf16 copies: an engine without them (f32 activations, or
    decode_matmul=openvino) says so at load."""
    with pytest.raises(InputError, match="prompt_matmul=kvexport reads the bf16 copies"):
        kvexport.load(str(builds["bf16"]), precision="fp32", prompt_matmul="kvexport")
    with pytest.raises(InputError, match="load without prompt_matmul"):
        kvexport.load(str(builds["bf16"]), decode_matmul="openvino", prompt_matmul="kvexport")


def _weight_tensors(artifact: Path) -> dict[str, np.ndarray]:
    """The compressed IR's low-bit constants by name (weights and zero points)."""
    import openvino as ov

    model = ov.Core().read_model(str(artifact / "engine" / lowering.XML))
    return {op.get_friendly_name(): op.get_data().copy() for op in model.get_ops()
            if op.get_type_name() == "Constant" and op.get_element_type().get_type_name() in compress.LOW_BIT}


def test_gptq_moves_the_logits_less_than_data_free_rounding(builds: _Builds, trained: Path,
                                                            reference: Reference) -> None:
    """--option quantizer=gptq: NNCF's GPTQ against the matmuls' inputs on the checkpoint's held-out text's tail,
    the same graph and row as the data-free build, judged on the text's head, which it never saw."""
    import subprocess
    import sys

    rtn, gptq = builds["int4-g128"], builds["int4-g128+gptq"]
    w = kvexport.load(str(gptq)).manifest.target["weights"]
    assert w["quantizer"] == "gptq" and w["data_aware"] == {"gptq": True}
    assert w["calibration"] == {"source": "calibration text (tail)", "tokens": 2048,
                                "window": compress.CALIBRATION_WINDOW, "items": 2048 // compress.CALIBRATION_WINDOW}
    assert w["compressed_weights"] == kvexport.load(str(rtn)).manifest.target["weights"]["compressed_weights"]
    assert kvexport.load(str(rtn)).manifest.target["weights"]["quantizer"] == "rtn"
    a, b = _weight_tensors(rtn), _weight_tensors(gptq)
    assert a.keys() == b.keys()
    changed = [name for name in a if not np.array_equal(a[name], b[name])]
    assert changed, "GPTQ changed no compressed tensor"
    out = subprocess.run([sys.executable, "-m", "kvexport", "inspect", str(gptq), "--no-hash-check"],
                         capture_output=True, text=True, check=True).stdout
    assert f"rounding: NNCF gptq on 2048 tokens (calibration text (tail), {2048 // compress.CALIBRATION_WINDOW} " \
           "windows)" in out
    r_rtn = verify_engine(kvexport.load(str(rtn), precision="fp32"), trained, reference=reference)
    r_gptq = verify_engine(kvexport.load(str(gptq), precision="fp32"), trained, reference=reference)
    print("intel int4 g128 rtn", r_rtn.text, "gptq", r_gptq.text)
    assert r_gptq.passed, r_gptq.failures
    assert r_gptq.text["mean_kl"] < 0.6 * r_rtn.text["mean_kl"]  # measured 0.32x (AMD EPYC Zen 3)
    assert r_gptq.text["top1_agreement"] >= r_rtn.text["top1_agreement"]


def test_calibration_items_are_the_prefills_the_engine_runs(builds: _Builds) -> None:
    """Each NNCF item, run on a fresh state of the compiled IR, gives the logits the engine's own prefill of that
    window gives: positions from 0, a causal mask, the session's inputs."""
    import openvino as ov

    engine = kvexport.load(str(builds["fp32"]))
    model = ov.Core().read_model(str(builds["fp32"] / "engine" / lowering.XML))
    ids = [int(i) for i in np.random.default_rng(3).integers(3, 200, 50)]
    items = compress.calibration_dataset(model, None, ids, 16)
    assert [item["input_ids"].shape[1] for item in items] == [16, 16, 16, 2]
    request = engine.session.compiled.create_infer_request()
    for k, item in enumerate(items):
        request.reset_state()
        request.infer(item, share_inputs=True, share_outputs=True)  # as the session and NNCF run it
        got = request.get_output_tensor(0).data[0, -1]
        want = engine.prefill(ids[16 * k:16 * k + 16]).logits[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(items[0]["input_ids"], items[1]["input_ids"])  # the windows walk the text


def test_data_aware_quantizers_round_int4_only() -> None:
    backend = IntelBackend()
    for weights in ("int8", "fp32"):
        with pytest.raises(InputError, match="quantizer=gptq corrects int4 weights"):
            backend.build_options(BuildOptions(weights=weights, extra={"quantizer": "gptq"}))
    with pytest.raises(InputError, match="quantizer"):
        backend.build_options(BuildOptions(weights="int4", extra={"quantizer": "hqq"}))
    with pytest.raises(InputError, match="quantizer"):
        backend.build_options(BuildOptions(weights="int4", extra={"quantizer": "awq"}))  # measured, not offered
    assert backend.build_options(BuildOptions(weights="int4", extra={"quantizer": "gptq"}))["quantizer"] == "gptq"
    with pytest.raises(InputError, match="needs calibration text"):
        compress.compress(None, compress.plan("int4", None, False, "gptq"), [])


def test_the_i8_cache_passes_the_kv_int8_row_on_the_trained_model(builds: _Builds, trained: Path,
                                                                  reference: Reference) -> None:
    """The fp32 engine loaded with kv_precision=i8 (kvexport's int8 blocks, every prompt paged) on the held-out
    text: within the (intel, fp32+kv-int8) row and the issue's 1% perplexity bar. Measured on an AMD EPYC Zen 4:
    top-1 1.000, mean KL 1.7e-4, max KL 4.8e-3, ppl +0.09% (u8: 0.9974, 9.3e-5, 1.5e-3, +0.00%); with the prompt
    kernel's int8 scores and bf16 weighted values (VNNI, AVX512-BF16): 1.000, 1.6e-4, 4.9e-3, +0.07%."""
    from kvexport.tolerances import tolerance

    engine = kvexport.load(str(builds["fp32"]), precision="fp32", kv_precision="i8")
    t = verify_engine(engine, trained, reference=reference).text
    assert engine.session.facts["paged_attention"].startswith("kvexport's Int8PagedAttention")
    print(f"intel i8 cache: top-1 {t['top1_agreement']:.4f}, mean KL {t['mean_kl']:.3g}, max KL {t['max_kl']:.3g}, "
          f"ppl {t['ppl_change']:+.3%}")
    row = tolerance("intel", "fp32+kv-int8")
    assert t["top1_agreement"] >= row.min_top1_agreement and t["mean_kl"] <= row.max_mean_kl, t
    assert t["max_kl"] <= row.max_max_kl and abs(t["ppl_change"]) <= min(row.max_ppl_change, 0.01), t
    assert t["mean_kl"] > 1e-7  # the blocks really are rounded



def test_the_plugins_weight_copies_are_placed_in_huge_pages_after_a_warm_up_token(builds: _Builds) -> None:
    """OpenVINO's CPU plugin makes some of its weight copies on a model's first infer (on bench-1b int8 all 1.1 GB of
    them: docs/backends/intel.md), so the load runs one warm-up token through the path a fresh request takes (here
    paged: its block cache then waits in the pool for the first request) before it moves what the plugin mapped to
    huge pages, where THP can collapse. huge_pages=false leaves them (the warm-up still runs); paged_compile=first_use
    has no warm-up and nothing placed; the logits are the same every way; the option takes a boolean only."""
    from kvexport.runtime.hugepages import thp_mode

    art = builds["fp32"]
    ids = [5, 6, 7, 8, 9, 10, 11]
    logits, records, pooled = {}, {}, {}
    for name, opts in {"load": {}, "first_use": {"paged_compile": "first_use"}, "off": {"huge_pages": "false"}}.items():
        engine = kvexport.load(str(art), **opts)
        records[name], pooled[name] = engine.session.describe(), len(engine.session._row_pool)
        logits[name] = engine.prefill(ids).logits
    np.testing.assert_array_equal(logits["load"], logits["first_use"])
    np.testing.assert_array_equal(logits["load"], logits["off"])
    assert pooled == {"load": 1, "first_use": 0, "off": 1}, pooled
    assert records["load"]["long_prefill"] == "paged attention, decode paged" and records["load"]["warm_up_s"] >= 0

    assert records["load"]["huge_pages"]["asked"] is True and records["load"]["huge_pages"]["detail"]
    # how much is placed, in a process of its own: here earlier tests' engines were loaded and dropped, and the
    # plugin may put its copies in memory they freed, which the placement leaves as it was ("nothing to place")
    child = subprocess.run([sys.executable, "-c", "import json, sys, kvexport; print(json.dumps(kvexport.load("
                            "sys.argv[1]).session.describe()['huge_pages']))", str(art)],
                           capture_output=True, text=True, check=True, timeout=300)
    placed = json.loads(child.stdout.strip().splitlines()[-1])
    assert placed["asked"] is True and placed["detail"], placed
    if thp_mode() in ("always", "madvise") and not any(s in placed["detail"] for s in ("no MADV_COLLAPSE",
                                                                                        "kept small pages")):
        assert placed["huge_bytes"] >= 2 << 20, placed  # the plugin's copies of 11 MiB of f32 weights, and more
    assert records["first_use"]["huge_pages"]["detail"].startswith("not placed: paged_compile=first_use")
    assert "warm_up_s" not in records["first_use"] and "long_prefill" not in records["first_use"]
    assert records["off"]["huge_pages"] == {"asked": False, "huge_bytes": 0, "seconds": 0.0,
                                            "detail": "off (load option huge_pages=false)"}
    with pytest.raises(InputError, match="huge_pages"):
        kvexport.load(str(art), huge_pages="sometimes")
