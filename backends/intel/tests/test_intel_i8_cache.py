"""The intel target's i8 cache (kvexport_intel.int8_blocks): kvexport's Int8PagedAttention op against a numpy
reference over the blocks it wrote, the blocks themselves against the keys and values they were given, and an
engine loaded with kv_precision=i8 against the same engine's f32 cache."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvexport
from kvexport.errors import BackendUnavailableError, InputError
from kvexport.testing import greedy_logits
from kvexport.tolerances import tolerance
from kvexport.verify import compare
from kvexport.zoo import TINY_CONFIGS

ov = pytest.importorskip("openvino", reason="the intel target needs openvino (pip install 'kvexport[intel]')")

from kvexport_intel import int8_blocks  # noqa: E402
from kvexport_intel.int8_blocks import BLOCK, dequantize, library  # noqa: E402


@pytest.fixture(scope="module")
def op_lib() -> Path:
    """The op as this CPU compiles it (without AVX-512 where KVEXPORT_I8_PORTABLE=1: the loops an AVX2 CPU runs),
    once per machine and source (a few seconds)."""
    return library()


def op_model(lib: Path, H: int, KV: int, D: int, window: int) -> object:
    import openvino.opset13 as opset
    from openvino.utils.node_factory import NodeFactory

    factory = NodeFactory()
    factory.add_extension(str(lib))
    q = opset.parameter([-1, H * D], ov.Type.f32, name="q")
    k = opset.parameter([-1, KV * D], ov.Type.f32, name="k")
    v = opset.parameter([-1, KV * D], ov.Type.f32, name="v")
    caches = [opset.parameter([-1, KV, BLOCK, D + 4], ov.Type.i8, name=n) for n in ("kc", "vc")]
    seq = [opset.parameter([-1], ov.Type.i32, name=n) for n in ("past", "begins", "blocks", "block_begins")]
    op = factory.create("Int8PagedAttention", [q.output(0), k.output(0), v.output(0), *(c.output(0) for c in caches),
                                               *(s.output(0) for s in seq),
                                               opset.constant(np.float32(D ** -0.5)).output(0),
                                               opset.constant(np.int32(window)).output(0)],
                        {"heads": H, "kv_heads": KV, "head_dim": D, "block_size": BLOCK})
    core = ov.Core()
    core.add_extension(str(lib))
    return core.compile_model(ov.Model([op.output(0)], [q, k, v, *caches, *seq]), "CPU", {"INFERENCE_NUM_THREADS": 2})


def as_kernel(op_lib: Path, q: np.ndarray, values: np.ndarray, prompt: bool = True) -> tuple[np.ndarray, float]:
    """What this build's prompt kernel (or decode kernel: prompt=False) computes with, for the reference: the query
    rows (tokens, heads, D) it multiplies (where its scores are int8 products, VNNI's or AVX2's int16 pairs: each
    head's row, scaled by D^-0.5 in f32, rounded to int8 with one scale, as the kernel does), and how far its output
    may be from the reference's (where its weighted values are bf16 pair products: each weight rounded to bf16's 8
    significant bits, at most 2^-8 of it off, so the output at most 2^-8 of the largest value; where they are AVX2's
    int16 pair products: 2^-9)."""
    decode, prompts = int8_blocks.kernels(op_lib, q.shape[-1]).split("; prompts: ")
    said = prompts if prompt else decode
    atol = 2e-5
    if "weighted values bf16" in said:
        atol += 2.0 ** -8 * float(np.abs(values).max())
    if "weighted values int16" in said:  # a chunk's 128 weights each at most 0.5 / 32767 of its largest off
        atol += 2.0 ** -9 * float(np.abs(values).max())
    if "scores int8" in said:
        scale = np.float32(q.shape[-1] ** -0.5)
        x = q.astype(np.float32) * scale
        amax = np.abs(x).max(axis=-1, keepdims=True)
        qi = np.clip(np.rint(x * (np.float32(127) / np.where(amax > 0, amax, 1))), -127, 127)
        q = qi.astype(np.float64) * (amax / np.float32(127)).astype(np.float64) / np.float64(scale)
    return q, atol


def reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, pos: int, window: int) -> np.ndarray:
    """One token's attention at position `pos` over slots 0..pos (keys, values: (KV, slots, D)), in float64."""
    H, D = q.shape
    G = H // keys.shape[0]
    lo = max(0, pos - window + 1) if window else 0
    out = np.empty((H, D))
    for h in range(H):
        s = keys[h // G, lo:pos + 1].astype(np.float64) @ q[h].astype(np.float64) * D ** -0.5
        p = np.exp(s - s.max())
        out[h] = p @ values[h // G, lo:pos + 1] / p.sum()
    return out


@pytest.mark.parametrize("D, window", [(16, 0), (32, 0), (64, 0), (64, 20), (96, 0), (128, 20)])
def test_op_attends_over_the_blocks_it_wrote(op_lib: Path, D: int, window: int) -> None:
    """Two sequences over scattered blocks: a 40-token prompt (two blocks), and 5 new tokens after 37 held ones; then
    a decode step of both. Each new key and value lands in its slot as int8 with one scale, within half a step of
    what was given, blocks outside the tables stay zero, and every token's output is the attention over the
    dequantized blocks (a numpy reference in float64)."""
    H, KV = 4, 2
    compiled = op_model(op_lib, H, KV, D, window)
    request = compiled.create_infer_request()
    caches = [np.zeros((9, KV, BLOCK, D + 4), np.int8) for _ in range(2)]
    for name, c in zip(("kc", "vc"), caches):
        request.set_tensor(name, ov.Tensor(c, shared_memory=True))
    tables = [[5, 2], [7, 1]]  # sequence 0: slots 0-63 in blocks 5, 2; sequence 1: in blocks 7, 1
    rng = np.random.default_rng(D + window)
    held = [np.zeros((KV, 0, D)), np.zeros((KV, 0, D))], [np.zeros((KV, 0, D)), np.zeros((KV, 0, D))]

    def step(past: list[int], counts: list[int]) -> None:
        T = sum(counts)
        q, k, v = (rng.standard_normal((T, n * D)).astype(np.float32) * 2 for n in (H, KV, KV))
        out = request.infer({"q": q, "k": k, "v": v, "past": np.array(past, np.int32),
                             "begins": np.array([0, *np.cumsum(counts)], np.int32),
                             "blocks": np.array(sum(tables, []), np.int32),
                             "block_begins": np.array([0, 2, 4], np.int32)})[0]
        blocks = [dequantize(c, D) for c in caches]
        prompt = counts != [1] * len(counts)  # else a decode step, which takes the decode kernel
        t = 0
        for s, (p, n) in enumerate(zip(past, counts)):
            # what the blocks hold for this sequence: (KV, slots, D)
            kv = [b[tables[s]].transpose(1, 0, 2, 3).reshape(KV, -1, D) for b in blocks]
            for j in range(n):
                for given, got in zip((k, v), kv):
                    x = given[t + j].reshape(KV, D)
                    step_ = np.abs(x).max(axis=1, keepdims=True) / 127
                    assert np.all(np.abs(got[:, p + j] - x) <= step_ / 2 + 1e-6)
                qj, atol = as_kernel(op_lib, q[t + j].reshape(H, D), kv[1], prompt)
                want = reference(qj, kv[0], kv[1], p + j, window)
                np.testing.assert_allclose(out[t + j].reshape(H, D), want, rtol=0, atol=atol)
            t += n

    step([0, 37], [40, 5])
    step([40, 42], [1, 1])
    used = {5, 2, 7, 1}
    for c in caches:
        assert not c[[b for b in range(9) if b not in used]].any()
        assert c[[5, 7]].any()


def fed(engine: kvexport.runtime.engine.Engine, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The logits of one request fed `tokens` after its prompt (teacher-forced): (1 + len(tokens), V)."""
    b = engine.prefill(prompt, len(tokens) + 1)
    out = [b.logits[0].copy()]
    for t in tokens:
        engine.decode(b, np.array([t]))
        out.append(b.logits[0].copy())
    engine.session.release(b.state)
    return np.array(out)


def test_op_decodes_over_runs_of_slots_merged(op_lib: Path) -> None:
    """A decode step over 700 held slots (23 blocks, in reverse order): the op cuts them into runs of 512 for the
    threads and merges the runs' softmaxes; the result is the attention over all of them."""
    H, KV, D = 8, 2, 64
    compiled = op_model(op_lib, H, KV, D, 0)
    request = compiled.create_infer_request()
    nb = 23
    caches = [np.zeros((nb, KV, BLOCK, D + 4), np.int8) for _ in range(2)]
    for name, c in zip(("kc", "vc"), caches):
        request.set_tensor(name, ov.Tensor(c, shared_memory=True))
    table = np.arange(nb, dtype=np.int32)[::-1].copy()
    rng = np.random.default_rng(1)
    seq = {"blocks": table, "block_begins": np.array([0, nb], np.int32)}
    for past, count in ((0, 700), (700, 1)):
        q, k, v = (rng.standard_normal((count, n * D)).astype(np.float32) for n in (H, KV, KV))
        out = request.infer({"q": q, "k": k, "v": v, "past": np.array([past], np.int32),
                             "begins": np.array([0, count], np.int32), **seq})[0]
    kv = [dequantize(c, D)[table].transpose(1, 0, 2, 3).reshape(KV, -1, D) for c in caches]
    qd, atol = as_kernel(op_lib, q[0].reshape(H, D), kv[1], prompt=False)
    np.testing.assert_allclose(out[0].reshape(H, D), reference(qd, kv[0], kv[1], 700, 0), rtol=0, atol=atol)


def test_op_refuses_sequences_outside_its_caches(op_lib: Path) -> None:
    """A block index past the caches, or a table too short for the slots a sequence holds, is an error before
    anything is written (it would write out of bounds)."""
    H, KV, D = 4, 2, 16
    request = op_model(op_lib, H, KV, D, 0).create_infer_request()
    caches = [np.zeros((3, KV, BLOCK, D + 4), np.int8) for _ in range(2)]
    for name, c in zip(("kc", "vc"), caches):
        request.set_tensor(name, ov.Tensor(c, shared_memory=True))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((4, n * D)).astype(np.float32) for n in (H, KV, KV))
    step = {"q": q, "k": k, "v": v, "past": np.array([0], np.int32), "begins": np.array([0, 4], np.int32),
            "block_begins": np.array([0, 1], np.int32)}
    with pytest.raises(RuntimeError, match="block 3 is not one of the caches' 3"):
        request.infer({**step, "blocks": np.array([3], np.int32)})
    with pytest.raises(RuntimeError, match="holds 36 slots but its block table has 1 blocks"):
        request.infer({**step, "past": np.array([32], np.int32), "blocks": np.array([0], np.int32)})
    assert not any(c.any() for c in caches)
    request.infer({**step, "blocks": np.array([2], np.int32)})  # a good one writes block 2 only
    assert caches[0][2].any() and not caches[0][:2].any()


def test_i8_engine_within_the_int8_row_of_its_f32_cache(intel_artifacts: dict) -> None:
    """A tiny llama loaded with kv_precision=i8: its prompt and decode steps go through kvexport's op over int8
    blocks of head_dim + 4 bytes a slot and head, nothing copied per step, and fed the f32 cache's greedy tokens
    its logits stay within the (intel, fp32+kv-int8) row of the f32 cache's (the random tiny model has near-ties:
    its own greedy tokens may part where |dlogit| is a few hundredths)."""
    _, art = intel_artifacts["llama"]
    ids = [int(t) for t in np.random.default_rng(3).integers(3, 259, 70)]  # three blocks, the last part full
    ref = greedy_logits(kvexport.load(str(art), precision="fp32"), ids, 24)
    engine = kvexport.load(str(art), precision="fp32", kv_precision="i8")
    got = fed(engine, ids, [int(t) for t in ref.argmax(-1)[:-1]])
    s = engine.session
    assert s.facts["paged_attention"] == f"kvexport's Int8PagedAttention over int8 blocks ({s.num_layers} layers)"
    assert s.facts["i8_kernels"].startswith("decode: ")
    b = engine.prefill(ids, 2)
    assert {c.dtype for c in b.state.rows.caches} == {np.dtype(np.int8)}
    assert s.cache_bytes(b.state) == len(ids) * s.num_layers * 2 * s.kv_heads * (s.head_dim + 4)
    assert s.cache_bytes_copied(b.state) == 0
    s.release(b.state)
    row = tolerance("intel", "fp32+kv-int8")
    c = compare(ref, got)
    assert c["mean_kl"] <= row.max_mean_kl and c["max_abs_logit"] < 0.1, c  # top-1 is judged on a trained model
    assert np.abs(ref - got).max() > 1e-5  # the blocks are rounded: not the f32 cache's logits


def test_a_build_may_choose_i8_and_records_its_bytes(intel_artifacts: dict, tmp_path: Path) -> None:
    """`--kv int8 --option kv_precision=i8` builds an artifact that loads with the i8 cache: the manifest records
    kv_precision i8 and the cache's own bytes a token (head_dim + 4 a KV head, key and value, every layer), which a
    loaded request's blocks measure; --kv fp32 with kv_precision=i8 is refused before the export."""
    from kvexport.backends import BuildOptions
    from kvexport.build import build

    ckpt, _ = intel_artifacts["llama"]
    with pytest.raises(InputError, match="kv_precision=i8 is --kv int8, and --kv fp32 was given too"):
        build(ckpt, tmp_path / "no.kvx", target="intel", max_seq=64, verify=False,
              options=BuildOptions(kv="fp32", extra={"kv_precision": "i8"}))
    assert not (tmp_path / "no.kvx").exists()
    art = build(ckpt, tmp_path / "i8.kvx", target="intel", max_seq=64, verify=False,
                options=BuildOptions(kv="int8", extra={"kv_precision": "i8"}))
    engine = kvexport.load(str(art), precision="fp32")
    target, s = engine.manifest.target, engine.session
    per_token = s.num_layers * 2 * s.kv_heads * (s.head_dim + 4)
    assert target["options"]["kv_precision"] == "i8" and s.facts["kv_precision"] == "i8"
    assert target["kv"]["dtype"] == "int8" and target["kv"]["bytes_per_token"] == per_token
    b = engine.prefill([5, 9, 23, 41, 7] * 8, 2)
    assert s.cache_bytes(b.state) == 40 * per_token
    assert s.facts["paged_attention"].startswith("kvexport's Int8PagedAttention")
    s.release(b.state)
    assert "why" not in target["kv"]  # named, not chosen


def test_an_i8_artifact_holds_u8_where_its_op_cannot_be_compiled(intel_artifacts: dict, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Loaded where no compiler is (and no compiled op in the cache), an i8 artifact holds OpenVINO's u8 and says
    so; asked for i8 by name there, the load is refused with what to do."""
    from kvexport.backends import BuildOptions
    from kvexport.build import build
    from kvexport_intel import IntelBackendWarning

    art = build(intel_artifacts["llama"][0], tmp_path / "i8.kvx", target="intel", max_seq=64, verify=False,
                options=BuildOptions(kv="int8", extra={"kv_precision": "i8"}))
    monkeypatch.setenv("KVEXPORT_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.warns(IntelBackendWarning, match="cannot be compiled here, so it holds u8"):
        engine = kvexport.load(str(art), precision="fp32")
    assert engine.session.facts["kv_precision"] == "u8" and "holds u8" in engine.session.facts["warning"]
    assert engine.generate([5, 9, 23], max_new_tokens=3).token_ids
    with pytest.raises(BackendUnavailableError, match="kv_precision=u8"):
        kvexport.load(str(art), precision="fp32", kv_precision="i8").prefill([5, 9, 23], 2)


AMX = {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"}


@pytest.mark.parametrize("flags, activations, head_dim, why", [
    ({"sse4_2", "avx"}, None, None, "neither AVX-512 nor AVX2 with FMA"),
    ({"avx2"}, None, None, "neither AVX-512 nor AVX2 with FMA"),
    (AMX, None, 80, "does not for head_dim 80"),  # an AMX CPU's own precision is bf16
    (AMX, "bf16", 16, "does not for head_dim 16"),
    ({"avx2", "fma", "amx_int8", "amx_tile"}, "bf16", 64, "lacks one of AMX-TILE, AMX-INT8, AMX-BF16"),
])
def test_kv_int8_alone_takes_u8_where_i8_does_not_pay(flags: set, activations: str | None, head_dim: int | None,
                                                      why: str) -> None:
    fmt, reason = int8_blocks.int8_format(flags, activations=activations, head_dim=head_dim)
    assert fmt == "u8" and why in reason and "kv_precision=i8" in reason


@pytest.mark.parametrize("head_dim", [None, 32, 64, 96, 128])
def test_kv_int8_alone_on_amx_under_bf16_takes_i8_where_its_prompts_run_on_tiles(op_lib: Path,
                                                                                 head_dim: int | None) -> None:
    """Under bf16 activations OpenVINO's u8 kernel computes prompts on AMX tiles; so does the i8 op for head sizes 32,
    64, 96 and 128 where it is compiled with AMX and Linux grants the tiles: i8 there, and the reason says so; where the op
    as compiled here runs its prompts on vectors (a CPU without AMX running this test with an AMX CPU's flags), u8.
    `kvexport doctor` (compile=False) assumes the tiles."""
    on_tiles = "prompts: AMX" in int8_blocks.kernels(op_lib, head_dim or 64)
    fmt, reason = int8_blocks.int8_format(AMX, activations="bf16", head_dim=head_dim)
    if on_tiles:
        assert fmt == "i8" and "prompts on AMX tiles" in reason and "kv_precision=u8" in reason
    else:
        assert fmt == "u8" and "runs no prompt on them" in reason and "kv_precision=i8" in reason
    fmt, reason = int8_blocks.int8_format(AMX, compile=False, activations="bf16", head_dim=head_dim)
    assert fmt == "i8" and "prompts on AMX tiles" in reason


def test_kv_int8_alone_takes_i8_on_amx_under_f32_activations() -> None:
    """Under f32 activations OpenVINO's u8 kernel computes no prompt on AMX tiles, and i8 decoded faster there: an AMX
    CPU holds i8 for an f32 build (where its op compiles), whatever its head size, and says why."""
    fmt, reason = int8_blocks.int8_format(AMX, activations="fp32", head_dim=80)
    assert fmt == "i8" and "with AMX, under f32 activations" in reason and "kv_precision=u8" in reason
    assert int8_blocks.int8_format(AMX - {"avx512_bf16", "amx_bf16"})[0] == "i8"  # no bf16 hardware: f32 by default


@pytest.mark.parametrize("flags, isa", [({"avx2", "fma"}, "AVX2"), ({"avx2", "fma", "avx512f"}, "AVX-512")])
def test_kv_int8_alone_takes_i8_where_its_kernels_are(flags: set, isa: str) -> None:
    fmt, reason = int8_blocks.int8_format(flags)
    assert fmt == "i8" and f"their {isa} kernels" in reason and "kv_precision=u8" in reason


def test_kv_int8_alone_takes_u8_without_a_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVEXPORT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    fmt, reason = int8_blocks.int8_format({"avx2", "avx512f"})
    assert fmt == "u8" and "cannot be compiled here" in reason


def test_kv_int8_alone_builds_the_format_this_cpu_pays_for(intel_artifacts: dict, tmp_path: Path) -> None:
    """`--kv int8` without kv_precision: i8 on an AVX-512 or AVX2 CPU (where the op compiles) unless it has AMX and the
    build runs bf16 activations (this CPU's own precision where it has bf16 hardware), else u8; the build prints the
    pick and its reason, the manifest records format, bytes a token and reason, and `kvexport inspect` shows them."""
    from kvexport.backends import BuildOptions
    from kvexport.build import build
    from kvexport.doctor import read_cpu_flags

    flags = read_cpu_flags()
    vector = "avx512f" in flags or {"avx2", "fma"} <= flags
    u8_on_tiles = {"amx_bf16", "amx_int8"} & flags and {"amx_bf16", "avx512_bf16"} & flags  # AMX under bf16
    head_dim = TINY_CONFIGS["llama"]["hidden_size"] // TINY_CONFIGS["llama"]["num_attention_heads"]
    i8_on_tiles = head_dim in int8_blocks.AMX_HEAD_DIMS and "prompts: AMX" in int8_blocks.kernels(library(), head_dim)
    expected = "i8" if vector and (not u8_on_tiles or i8_on_tiles) else "u8"
    said: list[str] = []
    art = build(intel_artifacts["llama"][0], tmp_path / "kv8.kvx", target="intel", max_seq=64, verify=False,
                options=BuildOptions(kv="int8"), progress=said.append)
    engine = kvexport.load(str(art), precision="fp32")
    kv, s = engine.manifest.target["kv"], engine.session
    slot = s.head_dim + 4 if expected == "i8" else s.head_dim + 8
    assert kv["dtype"] == "int8" and kv["format"].startswith(expected + ":")
    assert kv["bytes_per_token"] == s.num_layers * 2 * s.kv_heads * slot
    assert kv["why"].startswith(f"--kv int8 holds {expected}: ") and any(kv["why"] in m for m in said), said
    assert engine.manifest.target["options"]["kv_precision"] == expected == s.facts["kv_precision"]
    shown = subprocess.run([sys.executable, "-m", "kvexport", "inspect", str(art)], capture_output=True, text=True,
                           timeout=120)
    assert f"KV cache: int8, {kv['bytes_per_token']} bytes per token per row" in shown.stdout, shown.stderr
    assert f"    format: {kv['format']}\n    why: {kv['why']}\n" in shown.stdout


@pytest.mark.parametrize("variant", [*int8_blocks.VARIANTS, "KVEXPORT_I8_AVX2+KVEXPORT_I8_F32_PROMPTS"])
def test_other_builds_attend_as_this_one_does(variant: str) -> None:
    """The op tests above again, in a process whose op is compiled as another CPU's is (two builds of the op cannot
    share a process): KVEXPORT_I8_AVX2 without AVX-512 (an AVX2 Zen 3's: AVX2 kernels, prompts in int16 pairs),
    KVEXPORT_I8_PORTABLE without AVX2 (the portable loops alone), KVEXPORT_I8_F32_PROMPTS with every kernel in f32
    (with AVX-512: an AVX-512 CPU without VNNI and AVX512-BF16; with KVEXPORT_I8_AVX2 too: the AVX2 kernels in f32),
    KVEXPORT_I8_NO_BF16 with VNNI scores and f32 weighted values (an AVX-512 CPU with VNNI and without AVX512-BF16),
    KVEXPORT_I8_NO_AMX on an AMX CPU with its prompts in VNNI and AVX512-BF16 rather than on AMX tiles."""
    if any(os.environ.get(name) == "1" for name in int8_blocks.VARIANTS):
        pytest.skip("this process already runs another build of the op")
    from kvexport.doctor import read_cpu_flags

    needs = {"KVEXPORT_I8_AVX2": "avx2", "KVEXPORT_I8_F32_PROMPTS": "avx2", "KVEXPORT_I8_NO_BF16": "avx512_vnni",
             "KVEXPORT_I8_NO_AMX": "amx_tile"}
    names = variant.split("+")
    lacking = [needs[name] for name in names if name in needs and needs[name] not in read_cpu_flags()]
    if lacking:
        pytest.skip(f"this CPU has no {lacking[0]}: its op has no kernels of that build to test")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "op_"],
                          env={**os.environ, **{name: "1" for name in names}}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and " passed" in done.stdout and "skipped" not in done.stdout, \
        done.stdout[-3000:] + done.stderr[-3000:]


def test_i8_without_a_compiler_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVEXPORT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(BackendUnavailableError, match="kv_precision=u8"):
        int8_blocks.library()
    assert not list(tmp_path.glob("*.so"))


def test_the_decode_benchmark_builds_against_this_source(op_lib: Path) -> None:
    """benchmarks/i8_decode_op.py compiles its driver around the op's source as it is (its decode called directly)
    and prints three timings a layer: a change to the op's decode signature or layout that the driver no longer
    fits fails here rather than in the next session that times it."""
    script = Path(__file__).resolve().parents[3] / "benchmarks" / "i8_decode_op.py"
    done = subprocess.run([sys.executable, str(script), "600", "2", "3"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("decode over 600 slots, a layer:"), line
    timings = [float(x) for x in line.replace("(", " ").replace(")", " ").split() if x.replace(".", "", 1).isdigit()]
    assert len(timings) == 7 and all(t > 0 for t in timings[1:]), line  # the slots, then three medians and quartiles


def test_the_benchmark_times_a_prompt_through_the_ops_own_prompt_path(op_lib: Path) -> None:
    """benchmarks/i8_decode_op.py --prompt calls the op's prompt (the tiles the engine's prompts take) and names the
    kernels it timed, as the library says them."""
    script = Path(__file__).resolve().parents[3] / "benchmarks" / "i8_decode_op.py"
    done = subprocess.run([sys.executable, str(script), "300", "2", "3", "--prompt"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith(f"prompt of 300 tokens, a layer ({int8_blocks.kernels(op_lib, 64)}): "), line


def test_prompts_run_on_amx_tiles_where_the_cpu_has_them(op_lib: Path) -> None:
    """On a CPU with AMX-TILE, AMX-INT8 and AMX-BF16 (Linux granting the tiles, as every kernel since 5.16 does) the
    op's prompts for head sizes 32, 64, 96 and 128 take its AMX form, which the op tests above then hold to the
    reference; other head sizes keep the portable loops."""
    from kvexport.doctor import read_cpu_flags

    if not {"amx_tile", "amx_int8", "amx_bf16"} <= read_cpu_flags():
        pytest.skip("this CPU has no AMX: its op's prompts run on vectors (the other tests cover them)")
    for D in int8_blocks.AMX_HEAD_DIMS:
        assert "prompts: AMX, scores int8 (AMX-INT8), weighted values bf16 (AMX-BF16)" in int8_blocks.kernels(op_lib, D)
    assert "prompts: portable f32" in int8_blocks.kernels(op_lib, 80)
