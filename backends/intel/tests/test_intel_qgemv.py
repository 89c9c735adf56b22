"""kvexport's decode matmul for the intel target (kvexport_intel.gemv, native/qgemv.cpp): the op's arithmetic
against a numpy account of it, the graph rewrite over NNCF's compressed weights, and engines that take it on the
trained default model (quality, routing of prompts and of steps of many rows to the plugin's matmuls)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("openvino", reason="the intel target needs openvino (pip install 'kvexport[intel]')")

from kvexport.errors import BackendUnavailableError, InputError  # noqa: E402
from kvexport_intel import gemv  # noqa: E402


@pytest.fixture(scope="module")
def op_lib() -> Path:
    try:
        return gemv.library()
    except BackendUnavailableError as e:
        pytest.skip(f"the op cannot be compiled here: {e}")


def _pack4(values: np.ndarray) -> np.ndarray:
    """4-bit values (any shape, an even count) as the IR packs them: the even index in the low nibble."""
    flat = values.reshape(-1).astype(np.uint8)
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)


def _account(x: np.ndarray, w: np.ndarray, z: np.ndarray, s: np.ndarray) -> np.ndarray:
    """What the op computes, in float64: X quantized to int8 per 32 values (amax / 127, rounded to nearest even,
    clipped to +-127), times (w - z) * s per group (w (N, K), z and s (N, groups))."""
    rows, K = x.shape
    blocks = x.reshape(rows, K // 32, 32).astype(np.float64)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, 127.0 / np.where(amax > 0, amax, 1), 0.0)
    q = np.clip(np.rint((blocks.astype(np.float32) * inv.astype(np.float32)).astype(np.float64)), -127, 127)
    xq = (q * (amax / 127.0)).reshape(rows, K)
    groups = z.shape[1]
    dq = (w.reshape(w.shape[0], groups, -1).astype(np.float64) - z[..., None]) * s[..., None].astype(np.float64)
    return xq @ dq.reshape(w.shape[0], K).T


def _run_op(op_lib: Path, x: np.ndarray, w_bytes: np.ndarray, z_bytes: np.ndarray, scales: np.ndarray, *, n: int,
            k: int, group: int, bits: int, flip: int = 0) -> np.ndarray:
    import openvino as ov
    import openvino.opset13 as opset
    from openvino.utils.node_factory import NodeFactory

    factory = NodeFactory()
    factory.add_extension(str(op_lib))
    core = ov.Core()
    core.add_extension(str(op_lib))
    param = opset.parameter([-1, -1, k], ov.Type.f32, name="x")
    op = factory.create(gemv.OP_TYPE, [param.output(0), opset.constant(w_bytes).output(0),
                                       opset.constant(z_bytes).output(0), opset.constant(scales).output(0)],
                        {"n": n, "k": k, "group": group, "bits": bits, "flip": flip})
    compiled = core.compile_model(ov.Model([op.output(0)], [param]), "CPU",
                                  {"INFERENCE_NUM_THREADS": 2, "INFERENCE_PRECISION_HINT": "f32"})
    return compiled(x[None])[0][0]


@pytest.mark.parametrize("rows", [1, 3, 5])  # 5: the activations quantized over the threads
@pytest.mark.parametrize("case", ["int4-g128", "int4-g256-f32-scales", "int4-g32", "int4-g64-f32-scales", "int8",
                                  "int4-g128-sym", "int4-g32-sym"])
def test_op_matches_its_arithmetic(op_lib: Path, case: str, rows: int) -> None:
    rng = np.random.default_rng(7)
    bits = 8 if case == "int8" else 4
    n, k = (37, 384) if bits == 8 else (41, 512)  # row counts off every multiple the kernels group by
    group = k if bits == 8 else int(case.split("-")[1][1:])
    groups = k // group
    sym = case.endswith("-sym")  # INT4_SYM: signed values, no zero points (the op takes zero points of 8, flipped)
    w = rng.integers(-8, 8, (n, k)) if sym else rng.integers(0, 2 ** bits, (n, k))
    z = np.zeros((n, groups), np.int64) if sym else rng.integers(0, 2 ** bits, (n, groups))
    s = (rng.random((n, groups)) * 0.02 + 0.001).astype(np.float32 if "f32" in case else np.float16)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: scale 0, no division by it
    if sym:
        w_bytes, z_bytes = _pack4(w & 0xF), np.full(-(-z.size // 2), 0x88, np.uint8)
    elif bits == 4:
        w_bytes, z_bytes = _pack4(w), _pack4(np.concatenate([z.reshape(-1), [0]]) if z.size % 2 else z)
    else:
        w_bytes, z_bytes = w.astype(np.uint8).reshape(-1), z.astype(np.uint8).reshape(-1)
    y = _run_op(op_lib, x, w_bytes, z_bytes, s.reshape(-1), n=n, k=k, group=group, bits=bits, flip=int(sym))
    want = _account(x, w, z, s.astype(np.float32))
    assert y.shape == (rows, n)
    np.testing.assert_allclose(y, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
    # and it is the matmul it stands for: int8 activations cost ~1% of its scale
    exact = x.astype(np.float64) @ (((w.reshape(n, groups, -1) - z[..., None]) * s.astype(np.float64)[..., None])
                                    .reshape(n, k)).T
    assert np.abs(y - exact).max() < 0.03 * np.abs(exact).max()


def _bf16(values: np.ndarray) -> np.ndarray:
    """f32 values' bf16 bit patterns (uint16), rounded to nearest even; a NaN stays a NaN."""
    u = np.ascontiguousarray(values, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), ((u >> 16) | 0x40).astype(np.uint16), rounded)


def _from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize(("n", "k"), [(41, 512), (37, 200), (19, 2144)])  # 200, 2144: tails of 8 and 96 values
def test_op_bf16_matches_its_arithmetic(op_lib: Path, n: int, k: int, rows: int) -> None:
    """bits 16: bf16 weights (the bytes of the copy kvexport_qgemv_bf16 makes of an f32 weight) against activations
    rounded to bf16, products summed in f32: the bf16 matmul OpenVINO's own runs under a bf16 precision."""
    x, w, y, want = _bf16_op(op_lib, np.random.default_rng(11), rows, n, k)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.abs(y - x.astype(np.float64) @ w.T.astype(np.float64)).max() > 1e-4  # bf16 really was read


def _bf16_op(op_lib: Path, rng: np.random.Generator, rows: int, n: int, k: int) -> tuple[np.ndarray, ...]:
    """X (rows, k) and W (n, k) drawn from `rng`, the op's Y over W's bf16 copy, and what it should be in float64:
    X rounded to bf16 times W's bf16 values."""
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    wb = _bf16(w)
    y = _run_op(op_lib, x, wb.reshape(-1).view(np.uint8), np.zeros(1, np.uint8), np.ones(1, np.float32), n=n, k=k,
                group=k, bits=16)
    assert y.shape == (rows, n) and np.isfinite(y).all()
    return x, w, y, _from_bf16(_bf16(x)).astype(np.float64) @ _from_bf16(wb).astype(np.float64).T


def _cpu_has_amx() -> bool:
    from kvexport_intel.isa import read_cpu_flags

    return {"amx_tile", "amx_bf16"} <= read_cpu_flags()


@pytest.mark.parametrize(("rows", "n", "k"), [
    (3, 64, 64),  # the fewest rows the tiles take: one 32-row pass block, 29 of its rows zero
    (32, 100, 2080),  # up to 32 rows: weight tiles read in place; 4 weight rows past the tiles'
    (37, 70, 96),  # rows off every tile multiple, weight rows past the last 32-row block (the row kernel's)
    (70, 96, 2048),
    (2100, 40, 4096),  # two passes over the weights (16 MiB of packed rows a pass at K 4096: 2048 rows)
    (45, 288, 2080),  # two chunks of K (2048, 32) and blocks of 4 and 1 pairs of weight tiles on each thread
    (17, 33, 200),  # K not a multiple of 32: the row kernel throughout
])
def test_op_bf16_rows_match_their_arithmetic(op_lib: Path, rows: int, n: int, k: int) -> None:
    """Steps of several rows over bf16 weights (prompts): through AMX-BF16 tiles where the CPU has them (the library
    says which), the same bf16 matmul as a row at a time: activations rounded to bf16, products summed in f32."""
    _, _, y, want = _bf16_op(op_lib, np.random.default_rng(rows), rows, n, k)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=2e-5 * np.abs(want).max())
    assert gemv.rows_kernel(op_lib) == ("AMX-BF16" if _cpu_has_amx() and os.environ.get(
        "KVEXPORT_QGEMV_PORTABLE") != "1" else "")


def test_op_library_rounds_f32_to_bf16_to_nearest_even(op_lib: Path) -> None:
    """kvexport_qgemv_bf16, the copy of an f32 weight bits 16 read: ties to even, NaN kept, infinities kept."""
    rng = np.random.default_rng(3)
    values = np.concatenate([rng.standard_normal(200_003).astype(np.float32),  # over several of its runs
                             np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), np.inf, -np.inf, np.nan, 0.0,
                                       -0.0, 3.4e38, 1e-40], np.float32)])
    got = gemv.to_bf16(op_lib, values).data.view(np.uint16)
    np.testing.assert_array_equal(got, _bf16(values))
    assert got[-10] == 0x3F80 and got[-9] == 0x3F82  # the two ties: down to even, up to even


def test_float_matmuls_become_qgemv_over_bf16_copies(op_lib: Path) -> None:
    """to_qgemv on a graph of f32 weights (an fp32/bf16 engine's IR): every X @ W^T over an f32 constant becomes the
    op over a bf16 copy; the graph's output is the bf16 matmul's."""
    import openvino as ov
    import openvino.opset13 as opset

    rng = np.random.default_rng(5)
    w1, w2 = rng.standard_normal((96, 64)).astype(np.float32), rng.standard_normal((40, 96)).astype(np.float32)
    x = opset.parameter([1, -1, 64], ov.Type.f32, name="x")
    h = opset.matmul(x, opset.constant(w1), False, True)
    model = ov.Model([opset.matmul(h, opset.constant(w2), False, True)], [x])
    assert gemv.to_qgemv(model, op_lib) == 0  # without floats (a compressed engine, f32 activations): left exact
    assert gemv.to_qgemv(model, op_lib, floats=True) == 2
    assert sum(op.get_type_name() == gemv.OP_TYPE for op in model.get_ops()) == 2
    core = ov.Core()
    core.add_extension(str(op_lib))
    xs = rng.standard_normal((1, 3, 64)).astype(np.float32)
    y = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(xs)[0]
    bf = lambda a: _from_bf16(_bf16(a)).astype(np.float64)  # noqa: E731
    want = bf(bf(xs[0]) @ bf(w1).T) @ bf(w2).T  # each op rounds its own input
    np.testing.assert_allclose(y[0], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_op_refuses_inputs_that_do_not_hold_its_weights(op_lib: Path) -> None:
    w = np.zeros(40 * 256 // 2, np.uint8)
    with pytest.raises(RuntimeError, match="do not hold N x K values"):
        _run_op(op_lib, np.zeros((1, 256), np.float32), w[:-1], np.zeros(40, np.uint8), np.ones(80, np.float16),
                n=40, k=256, group=128, bits=4)
    with pytest.raises(Exception, match="multiple of 128"):
        _run_op(op_lib, np.zeros((1, 192), np.float32), w, np.zeros(40, np.uint8), np.ones(80, np.float16),
                n=40, k=192, group=64, bits=4)


def test_portable_build_computes_as_this_one_does(op_lib: Path) -> None:
    """The op tests above in a process whose op is compiled without AVX512-VNNI: the portable loops a CPU without
    it runs where decode_matmul=kvexport is asked for (two builds of the op cannot share a process)."""
    if any(os.environ.get(name) == "1" for name in gemv.VARIANTS):
        pytest.skip("this process already runs another build of the op")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "op_"],
                          env={**os.environ, "KVEXPORT_QGEMV_PORTABLE": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and " passed" in done.stdout and "skipped" not in done.stdout, \
        done.stdout[-3000:] + done.stderr[-3000:]
    if os.environ.get("KVEXPORT_QGEMV_PORTABLE") != "1":
        assert gemv.kernel(op_lib) == ("AVX512-VNNI" if "avx512_vnni" in _flags() else "portable")
        assert gemv.kernel(op_lib, bf16=True) == ("AVX512-BF16" if "avx512_bf16" in _flags() else "portable")
    else:
        assert gemv.kernel(op_lib) == gemv.kernel(op_lib, bf16=True) == "portable"


def _flags() -> set[str]:
    from kvexport.doctor import read_cpu_flags

    return read_cpu_flags()


def test_choice_follows_the_option_the_weights_and_the_cpu(op_lib: Path) -> None:
    vnni = {"avx512f", "avx512bw", "avx512_vnni"}
    assert gemv.choose("openvino", vnni, "int4") == (False, "decode_matmul=openvino was asked for: the plugin's matmuls")
    use, why = gemv.choose(None, vnni, "fp16")
    assert not use and why.startswith("fp16 weights")
    bf16 = vnni | {"avx512_bf16"}
    for weights in ("fp32", "bf16"):  # float weights under bf16 activations: the op over bf16 copies
        use, why = gemv.choose(None, bf16, weights, activations="fp32")
        assert not use and why.startswith(f"{weights} weights at f32 activations: the plugin's f32 matmuls")
        assert gemv.choose(None, bf16, weights, activations="bf16")[0]
        use, why = gemv.choose(None, vnni, weights, activations="bf16")
        assert not use and "lacks AVX512-BF16" in why
        assert gemv.choose("kvexport", vnni, weights, activations="bf16")[0]  # asked for: the portable loops
    assert gemv.choose(None, {"avx512f", "avx512bw", "avx512_bf16"}, "int8")[1].endswith(
        "lacks AVX512-VNNI, which kvexport's decode matmul is written for: the plugin's matmuls "
        "(decode_matmul=kvexport runs its portable loops)")
    use, why = gemv.choose("auto", {"avx2", "fma"}, "int4")
    assert not use and "lacks AVX512-VNNI" in why
    use, why = gemv.choose("kvexport", {"avx2", "fma"}, "int8")  # asked for: the portable loops where no VNNI
    assert use and why.startswith("kvexport's QGemv")
    assert gemv.choose(None, vnni, "int4")[0]
    with pytest.raises(InputError, match="decode_matmul must be one of"):
        gemv.choose("mlas", vnni, "int4")


def test_a_bf16_copy_is_made_only_where_it_fits_twice_in_the_memory_available() -> None:
    """Float weights' decode steps read a second copy of the weights: auto takes the op only while that copy is at
    most half of the memory available (a model whose one bf16 copy fits is not pushed out by the second)."""
    gib = 2 ** 30
    assert gemv.copy_fits(None, 2 * gib, 4 * gib) == (True, None)
    fits, why = gemv.copy_fits("auto", 2 * gib + 1, 4 * gib)
    assert not fits and "(2.0 GiB, a second copy beside the plugin's)" in why and "available (4.0 GiB)" in why
    assert gemv.copy_fits("kvexport", 16 * gib, 4 * gib) == (True, None)  # asked for: made anyway
    assert gemv.copy_fits(None, 16 * gib, None) == (True, None)  # no /proc/meminfo: nothing to judge by
    assert gemv.available_memory() is None or gemv.available_memory() > 0


def test_prompts_take_the_op_where_it_has_amx_tiles(op_lib: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """choose_rows: steps of more than GEMV_ROWS rows over the bf16 copies take the op where its library has AMX-BF16
    (auto and kvexport); elsewhere auto keeps the plugin's second form and kvexport says what to do instead."""
    amx = gemv.rows_kernel(op_lib) == "AMX-BF16"
    assert amx == (_cpu_has_amx() and os.environ.get("KVEXPORT_QGEMV_PORTABLE") != "1")
    use, why = gemv.choose_rows(None, op_lib)
    assert use == amx and (why.startswith("kvexport's QGemv (AMX-BF16)") if amx else "does not lend" in why)
    assert gemv.choose_rows("openvino", op_lib)[0] is False
    monkeypatch.setattr(gemv, "rows_kernel", lambda lib: "")  # a library without the tiles
    use, why = gemv.choose_rows("auto", op_lib)
    assert not use and why.endswith("a second paged form with the plugin's matmuls")
    with pytest.raises(BackendUnavailableError, match="prompt_matmul=auto or openvino"):
        gemv.choose_rows("kvexport", op_lib)
    with pytest.raises(InputError, match="prompt_matmul must be one of"):
        gemv.choose_rows("amx", op_lib)


def test_two_forms_share_one_bf16_copy_of_a_weight(op_lib: Path) -> None:
    """to_qgemv with a session's `copies`: a second form read from the same IR reads the first form's bf16 copy of
    each weight; a weight of another shape or other values gets its own."""
    import openvino as ov
    import openvino.opset13 as opset

    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 32)).astype(np.float32)

    def form(weight: np.ndarray) -> ov.Model:
        x = opset.parameter([1, -1, 32], ov.Type.f32, name="x")
        const = opset.constant(weight)
        const.set_friendly_name("w")
        return ov.Model([opset.matmul(x, const, False, True)], [x])

    copies: dict = {}
    models = [form(w), form(w), form(w + 1), form(w[:32])]
    assert [gemv.to_qgemv(m, op_lib, floats=True, copies=copies) for m in models] == [1, 1, 1, 1]
    assert len(copies) == 3  # the first two forms share one
    data = [next(op for op in m.get_ops() if op.get_type_name() == gemv.OP_TYPE).input_value(1).get_node()
            .get_data().ctypes.data for m in models]
    assert data[0] == data[1] and len(set(data)) == 3


def test_without_a_compiler_auto_keeps_the_plugins_matmuls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVEXPORT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    vnni = {"avx512f", "avx512bw", "avx512_vnni"}
    use, why = gemv.choose(None, vnni, "int4")
    assert not use and "cannot be compiled here" in why and "decode_matmul=openvino" in why
    with pytest.raises(BackendUnavailableError, match="decode_matmul=openvino"):
        gemv.choose("kvexport", vnni, "int4")
    assert not list(tmp_path.glob("*.so"))
