"""Sliding-window layers on rings in the intel engine's state (kvexport_intel.lowering.BeamConcat.attend_ring):
the tiny mistral (window 24, every layer slides) generates past max_seq token-identical to transformers with
OpenVINO's state bounded by the window; gemma2 and gemma3_text hold only their global layers at full length."""
from __future__ import annotations

import numpy as np
import pytest

import kvexport
from kvexport.runtime.ring import RingSpec
from kvexport.testing import prefill_decode_gap
from kvexport.tolerances import tolerance
from kvexport.verify import Reference, compare, self_consistency_limit
from kvexport.zoo import TINY_CONFIGS

pytest.importorskip("openvino", reason="the intel target needs openvino (pip install 'kvexport[intel]')")

from kvexport_intel import lowering  # noqa: E402

TOL = tolerance("intel", "fp32")
W = TINY_CONFIGS["mistral"]["sliding_window"]  # 24
POSITIONS = TINY_CONFIGS["mistral"]["max_position_embeddings"]  # 256


def prompt_ids(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 259, n)]


def per_slot(engine: kvexport.runtime.engine.Engine) -> int:
    """Bytes of one layer's K and V for one token of one row, f32."""
    return 2 * engine.config.num_key_value_heads * engine.config.head_dim * 4


def greedy(engine: kvexport.runtime.engine.Engine, prompt: list[int], n: int,
           seen: list[int] | None = None) -> tuple[list[int], np.ndarray]:
    """n greedy tokens and their logits; `seen` collects OpenVINO's state bytes after every step."""
    b = engine.prefill(prompt, n)
    logits, toks = [b.logits[0].copy()], [int(b.logits[0].argmax())]
    for _ in range(n - 1):
        if seen is not None:
            seen.append(engine.session.state_bytes(b.state))
        logits.append(engine.decode(b, np.array([toks[-1]]))[0].copy())
        toks.append(int(logits[-1].argmax()))
    if seen is not None:
        seen.append(engine.session.state_bytes(b.state))
    engine.session.release(b.state)
    return toks, np.stack(logits)


@pytest.fixture(scope="module")
def mistral(intel_artifacts: dict) -> kvexport.runtime.engine.Engine:
    return kvexport.load(str(intel_artifacts["mistral"][1]), precision="fp32")


def test_generates_past_max_seq_token_identical_with_state_bounded_by_the_window(
        mistral: kvexport.runtime.engine.Engine, intel_artifacts: dict) -> None:
    """A 40-token prompt (prefilled in ring-sized pieces) and 150 tokens: 189 slots, past max_seq 128 and 4x the
    window; every state tensor OpenVINO holds stays at 24 slots once the request has held 24."""
    e = mistral
    spec = RingSpec.of(e.manifest)
    assert spec is not None and spec.window == W and spec.every_layer and e.limit == POSITIONS > e.max_seq
    assert e.manifest.cache.get("ring") is None  # the concat IR is full length; the rings are the engine's
    prompt, n = prompt_ids(40, seed=4), 150
    assert n >= 4 * W and len(prompt) + n > e.max_seq
    seen: list[int] = []
    toks, logits = greedy(e, prompt, n, seen)
    L = e.config.num_hidden_layers
    assert seen == [L * min(W, len(prompt) + i) * per_slot(e) for i in range(n)]  # held before each step, bounded
    assert max(seen) == L * W * per_slot(e)
    ref = Reference(intel_artifacts["mistral"][0], POSITIONS).logits(prompt + toks[:-1])[len(prompt) - 1:]
    stats = compare(ref, logits)
    print(f"mistral on rings, {len(prompt) + n - 1} slots: {stats}; state {max(seen)} bytes, "
          f"{L * (len(prompt) + n - 1) * per_slot(e)} were every layer full length")
    assert toks == ref.argmax(-1).tolist() and stats["max_abs_logit"] <= TOL.max_abs_logit
    b = e.prefill(prompt, 1)
    assert {tuple(v.state.shape) for v in b.state.request.query_state()} == {(1, e.config.num_key_value_heads, W,
                                                                               e.config.head_dim)}
    e.session.release(b.state)
    state = e.session.new_state(1, 4)  # a released request's InferRequest comes back empty
    assert e.session.state_bytes(state) == 0
    e.session.release(state)


def test_prefill_then_decode_and_left_padded_rows_across_the_ring(mistral: kvexport.runtime.engine.Engine) -> None:
    """prefill(N) + decode(1) == prefill(N + 1) at the window's edges; a left-padded batch (one row padded by more
    than the window) equals its rows alone."""
    e = mistral
    ids = prompt_ids(60, seed=11)
    for n in (W - 1, W, W + 1, 2 * W, 49):
        assert prefill_decode_gap(e, ids, n) < 1e-5, n
    prompts = [prompt_ids(n, seed=n) for n in (5, 30, 57)]
    together = e.generate(prompts, 40, stop=())
    assert [g.token_ids for g in together] == [e.generate(p, 40, stop=()).token_ids for p in prompts]


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_mixed_model_holds_only_its_global_layers_at_full_length(family: str, intel_artifacts: dict) -> None:
    """Sliding layers on rings, global ones on OpenVINO's fused stateful attention (gemma2 has none: softcap),
    4x the window token-identical to transformers; the state bytes beside an all-global cache."""
    ckpt, art = intel_artifacts[family]
    e = kvexport.load(str(art), precision="fp32")
    cfg = e.config
    sliding = [i for i in range(cfg.num_hidden_layers) if cfg.window_of(i) is not None]
    spec = RingSpec.of(e.manifest)
    assert spec is not None and sorted(spec.layers) == sliding and e.limit == e.max_seq
    glob = cfg.num_hidden_layers - len(sliding)
    fused = 0 if cfg.attn_logit_softcap is not None else glob
    assert lowering.fused_attention_layers(e.session.compiled) == fused
    assert lowering.runtime_op_counts(e.session.compiled)["ScatterElementsUpdate"] == 2 * len(sliding)  # ring writes
    window = cfg.sliding_window
    prompt, n = prompt_ids(20, seed=8), 4 * window + 8
    seen: list[int] = []
    toks, logits = greedy(e, prompt, n, seen)
    held = len(prompt) + n - 1
    rings = (glob * held + len(sliding) * window) * per_slot(e)
    full = cfg.num_hidden_layers * held * per_slot(e)
    assert seen[-1] == rings < full
    print(f"\n{family}: state {rings} bytes with {len(sliding)} of {cfg.num_hidden_layers} layers on {window}-slot "
          f"rings, {full} were every layer full length ({held} slots)")
    ref = Reference(ckpt, e.max_seq).logits(prompt + toks[:-1])[len(prompt) - 1:]
    assert toks == ref.argmax(-1).tolist() and compare(ref, logits)["max_abs_logit"] <= TOL.max_abs_logit


def test_inspect_prints_the_engines_rings(intel_artifacts: dict, capsys: pytest.CaptureFixture[str]) -> None:
    from kvexport.cli import main

    assert main(["inspect", str(intel_artifacts["mistral"][1])]) == 0
    out = capsys.readouterr().out
    # 2 layers x K,V x 2 kv heads x 16 head_dim x 4 bytes = 512 bytes a slot: 24 slots on rings, 128 full length
    assert f"2 of 2 keep {W} slots; {512 * W} bytes (0.01 MiB) per row at max_seq beside {512 * 128} bytes" in out, out
    assert f"positions up to {POSITIONS} (past max_seq)" in out


@pytest.fixture(scope="module", params=["fp16", "int8"])
def lossy_mistral(request: pytest.FixtureRequest, intel_artifacts: dict,
                  tmp_path_factory: pytest.TempPathFactory) -> tuple[str, kvexport.runtime.engine.Engine, list[str]]:
    """The tiny mistral built with a lossy cache (one build per mode), and what the build said."""
    from kvexport.backends import BuildOptions
    from kvexport.build import build

    said: list[str] = []
    out = build(intel_artifacts["mistral"][0], tmp_path_factory.mktemp("kv") / f"m-{request.param}.kvx", target="intel",
                max_seq=128, verify=False, options=BuildOptions(weights="fp32", kv=request.param), progress=said.append)
    return request.param, kvexport.load(str(out), precision="fp32"), said


def test_a_lossy_cache_keeps_sliding_layers_full_length(lossy_mistral: tuple, mistral: kvexport.runtime.engine.Engine
                                                        ) -> None:
    """OpenVINO applies KV_CACHE_PRECISION only to its fused attention's state (a ring's plain state stayed f32:
    measured bit-identical logits at f32, f16 and u8), so --kv fp16/int8 builds the sliding layers full length on
    the fused node, says so, and its cache is the lossy one: the same teacher-forced tokens' logits move from the
    f32 ring engine's, within the self-consistency limit of that precision's row."""
    kv, e, said = lossy_mistral
    assert any("full-length caches" in s and "stay f32" in s for s in said), said
    assert RingSpec.of(e.manifest) is None and e.limit == e.max_seq == 128
    assert lowering.fused_attention_layers(e.session.compiled) == e.config.num_hidden_layers
    assert lowering.runtime_op_counts(e.session.compiled)["ScatterElementsUpdate"] == 0
    prompt, n = prompt_ids(20, seed=4), 70  # 89 slots, past the 24-slot window, within max_seq
    toks, exact = greedy(mistral, prompt, n)
    b = e.prefill(prompt, n)
    lossy = [b.logits[0].copy()]
    for t in toks[:-1]:  # the f32 engine's tokens, so both see the same text
        lossy.append(e.decode(b, np.array([t]))[0].copy())
    held = e.session.state_bytes(b.state)
    e.session.release(b.state)
    assert held == e.config.num_hidden_layers * (len(prompt) + n - 1) * per_slot(e)  # full length (the f32 view)
    gap = float(np.abs(np.stack(lossy) - exact).max())
    limit = self_consistency_limit(tolerance("intel", f"fp32+kv-{kv}"))
    print(f"kv {kv}: max |dlogit| against the f32 ring engine {gap:.3g} (limit {limit})")
    assert 0 < gap < limit


def test_rings_with_a_lossy_cache_are_refused_before_the_export(intel_artifacts: dict, tmp_path) -> None:
    from kvexport.backends import BuildOptions
    from kvexport.build import build
    from kvexport.errors import InputError

    with pytest.raises(InputError, match="ring_cache=true with the [ui]8 cache.*--kv fp32"):
        build(intel_artifacts["mistral"][0], tmp_path / "r.kvx", target="intel", verify=False,
              options=BuildOptions(kv="int8", extra={"ring_cache": "true"}))
    assert not (tmp_path / "r.kvx.building").exists()


def test_gptq_calibration_items_are_the_prefills_a_ring_engine_runs(mistral: kvexport.runtime.engine.Engine,
                                                                    intel_artifacts: dict) -> None:
    """--option quantizer=gptq's NNCF items on an engine whose every layer slides: windows no longer than the ring,
    with the rings' mask and write index, each giving on a fresh state the logits of the engine's own prefill."""
    import openvino as ov

    from kvexport_intel import compress

    folder = intel_artifacts["mistral"][1]
    model = ov.Core().read_model(str(folder / "engine" / lowering.XML))
    ids = prompt_ids(60, 5)
    items = compress.calibration_dataset(model, RingSpec.of(mistral.manifest), ids, W)
    assert [item["input_ids"].shape[1] for item in items] == [24, 24, 12]
    assert "attention_mask" not in items[0] and "write_index" in items[0]  # every layer a ring
    request = mistral.session.compiled.create_infer_request()
    for k, item in enumerate(items):
        request.reset_state()
        request.infer(item, share_inputs=True, share_outputs=True)  # as the session and NNCF run it
        want = mistral.prefill(ids[W * k:W * k + W]).logits[0]
        np.testing.assert_allclose(request.get_output_tensor(0).data[0, -1], want, rtol=1e-5, atol=1e-5)
