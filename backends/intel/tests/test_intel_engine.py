"""The intel target end to end on tiny configs: numerics against transformers, the fused path, API and errors."""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

import kvexport
from kvexport.errors import ArtifactError, ContextOverflowError, InputError
from kvexport.runtime.ring import RingSpec
from kvexport.tolerances import tolerance
from kvexport.verify import Reference, cache_checks, compare, self_consistency_limit
from kvexport.zoo import TINY_CONFIGS

pytest.importorskip("openvino", reason="the intel target needs openvino (pip install 'kvexport[intel]')")

from kvexport_intel import IntelBackendWarning, isa, lowering  # noqa: E402

# The precisions this CPU runs natively: fp32 everywhere, bf16 where AMX-BF16 or AVX512-BF16 exist.
# Tests whose claim holds at any precision run at each; the automatic precision differs by CPU kind.
HERE = ["fp32", "bf16"] if isa.has_bf16(isa.read_cpu_flags()) else ["fp32"]


FAMILIES = sorted(TINY_CONFIGS)
STEPS = 64


def greedy_run(engine: kvexport.runtime.engine.Engine, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """prefill + steps-1 decodes, greedy; returns the tokens and the (steps, V) logits that chose them."""
    batch = engine.prefill(prompt, steps)
    logits = [batch.logits[0].copy()]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        logits.append(engine.decode(batch, np.array([tokens[-1]]))[0].copy())
        tokens.append(int(logits[-1].argmax()))
    engine.session.release(batch.state)
    return tokens, np.stack(logits)


def prompt_ids(n: int, seed: int = 3) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 259, n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_greedy_tokens_identical_to_transformers_over_64_steps(family: str, intel_artifacts: dict) -> None:
    ckpt, art = intel_artifacts[family]
    engine = kvexport.load(str(art), precision="fp32")
    prompt = prompt_ids(9)
    tokens, logits = greedy_run(engine, prompt, STEPS)
    ref = Reference(ckpt, engine.max_seq).logits(prompt + tokens[:-1])[len(prompt) - 1:]  # (STEPS, V)
    stats = compare(ref, logits)
    print(f"{family}: fp32 over {STEPS} steps: {stats}")
    assert list(ref.argmax(-1)) == tokens  # the reference would have chosen the same token at every step
    tol = tolerance("intel", "fp32")
    assert stats["max_abs_logit"] <= tol.max_abs_logit and stats["mean_kl"] <= tol.max_mean_kl


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_compiles_to_the_fused_stateful_path(family: str, intel_artifacts: dict) -> None:
    _, art = intel_artifacts[family]
    engine = kvexport.load(str(art))
    layers = engine.config.num_hidden_layers
    compiled = engine.session.compiled
    ops = lowering.runtime_op_counts(compiled)
    if engine.config.attn_logit_softcap is not None:  # SDPA has no softcap: gemma2 attends by MatMul + Softmax
        assert lowering.fused_attention_layers(compiled) == ops["ScaledDotProductAttention"] == 0
        assert engine.manifest.target["fingerprint"]["fused_attention_layers"] == 0
        return
    # sliding layers keep rings (test_intel_ring.py): their state is assigned from a scatter, not fused
    rings = len(RingSpec.of(engine.manifest).layers) if RingSpec.of(engine.manifest) else 0
    full = layers - rings
    assert lowering.fused_attention_layers(compiled) == full
    assert ops["ScaledDotProductAttention"] == full and ops["MemoryInput"] == 2 * layers
    # each ring's K and V write (its attention is MatMul/Snippets), and one a routed layer: the dense form's routing
    # matrix (ScatterElements of the top-k weights; kvexport.decoder.MoeMlp)
    routed = sum(engine.config.is_moe_layer(i) for i in range(layers))
    assert ops["ScatterElementsUpdate"] == 2 * rings + routed
    # no per-layer K/V Concatenation is left: nothing of that kind reads the state (a ring's is behind its Gather)
    rt = compiled.get_runtime_model()
    for op in rt.get_ops():
        if op.get_rt_info()["layerType"].astype(str) == "Concatenation":
            assert "MemoryInput" not in [i.get_node().get_rt_info()["layerType"].astype(str) for i in op.input_values()]
    fp = engine.manifest.target["fingerprint"]
    assert fp["fused_attention_layers"] == full and set(fp["isa"]) >= {"amx_tile", "amx_bf16", "amx_int8", "avx512_bf16"}
    # the build counted them on a compile with the weights as inputs (lowering.weights_as_inputs); this load
    # compiled the real model, and every count the build recorded is this one's
    assert fp["runtime_ops"] == {k: ops[k] for k in fp["runtime_ops"]}


@pytest.mark.parametrize("precision", HERE)
def test_cache_checks_and_left_padded_rows(intel_artifacts: dict, precision: str) -> None:
    """prefill(N)+decode(1) == prefill(N+1); rows of different lengths in one batch do not touch each other.
    Exact at fp32; at bf16 the two paths round differently, so they are held to the self-consistency
    limit verify uses for that precision (a cache bug moves logits by whole units, not by rounding)."""
    _, art = intel_artifacts["llama"]
    engine = kvexport.load(str(art), precision=precision)
    assert engine.session.describe()["precision"] == precision
    checks = cache_checks(engine, np.random.default_rng(0), lambda _m: None)
    limit = 1e-4 if precision == "fp32" else self_consistency_limit(tolerance("intel", precision))
    print(f"{precision}: {checks} (limit {limit})")
    assert checks["prefill_decode_max_abs"] < limit and checks["batch_independence_max_abs"] < limit, checks


def test_engine_api_and_errors(intel_artifacts: dict) -> None:
    _, art = intel_artifacts["llama"]
    # fp32 on every CPU: a batched row equals the same prompt alone token for token only where
    # nothing rounds differently by batch shape (at bf16, near-tied random logits may flip)
    engine = kvexport.load(str(art), precision="fp32")
    gen = engine.generate(prompt_ids(5), max_new_tokens=8)
    assert 1 <= len(gen.token_ids) <= 8
    both = engine.generate([prompt_ids(4), prompt_ids(11, seed=5)], max_new_tokens=6)
    assert len(both) == 2
    assert both[1].token_ids == engine.generate(prompt_ids(11, seed=5), max_new_tokens=6).token_ids
    with pytest.raises(ContextOverflowError):
        engine.generate(prompt_ids(120), max_new_tokens=20)
    with pytest.raises(InputError, match="numa_node"):
        kvexport.load(str(art), numa_node="lots")
    with pytest.raises(InputError, match="kv_precision"):
        kvexport.load(str(art), kv_precision="q4")
    with pytest.raises(InputError, match="takes threads"):
        kvexport.load(str(art), streams=4)
    s = engine.session
    state = s.new_state(1, 4)
    with pytest.raises(InputError, match="attention_mask"):
        s.step(state, np.zeros((1, 2), np.int64), np.zeros((1, 2), np.int64), np.ones((1, 1, 2, 5), bool))
    s.release(state)
    with pytest.raises(InputError, match="released"):
        s.step(state, np.zeros((1, 1), np.int64), np.zeros((1, 1), np.int64), np.ones((1, 1, 1, 1), bool))


@pytest.mark.parametrize("precision", HERE)
def test_threads_hold_their_own_caches(intel_artifacts: dict, precision: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    _, art = intel_artifacts["llama"]
    engine = kvexport.load(str(art), precision=precision)  # same shapes alone and together: identical at any precision
    prompts = [prompt_ids(n, seed=n) for n in (3, 8, 13, 21)]
    alone = [engine.generate(p, max_new_tokens=10).token_ids for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: engine.generate(p, max_new_tokens=10).token_ids, prompts))
    assert together == alone


def test_tampered_engine_file_is_refused(intel_artifacts: dict, tmp_path: Path) -> None:
    _, art = intel_artifacts["llama"]
    bad = shutil.copytree(art, tmp_path / "bad.kvx")
    with open(bad / "engine" / lowering.BIN, "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(ArtifactError, match="sha256"):
        kvexport.load(str(bad))


def test_kv_cache_precision_memory_and_agreement(intel_artifacts: dict) -> None:
    """u8 / f16 KV cache through OpenVINO's cache-precision properties: agreement lost (the memory
    they save is measured in test_intel_state_bytes.py)."""
    _, art = intel_artifacts["llama"]
    prompt = prompt_ids(17)
    base = kvexport.load(str(art), kv_precision="f32", precision="fp32")  # the cache's cost alone, on every CPU
    tokens, ref = greedy_run(base, prompt, 32)
    for kv in ("f16", "u8"):
        eng = kvexport.load(str(art), kv_precision=kv, precision="fp32")
        assert eng.session.describe()["kv_precision"] == kv
        batch = eng.prefill(prompt, 32)  # teacher-forced on the f32 path so the steps line up
        got = [batch.logits[0].copy()] + [eng.decode(batch, np.array([t]))[0].copy() for t in tokens[:-1]]
        stats = compare(ref, np.stack(got))
        print(f"kv {kv} vs the f32 cache: {stats}")
        assert stats["max_abs_logit"] > 0  # the property took effect: a lossy cache changes the logits
        assert stats["greedy_agreement"] >= 0.9


def test_bf16_artifact_runs_bf16_or_falls_back_with_a_warning(intel_artifacts: dict, tmp_path: Path) -> None:
    ckpt, art = intel_artifacts["llama"]
    b16 = Path(shutil.copytree(art, tmp_path / "bf16.kvx"))
    m = json.loads((b16 / "manifest.json").read_text())
    m["target"]["precision"] = m["target"]["activations"] = "bf16"  # as `--weights bf16` records it (same engine files)
    (b16 / "manifest.json").write_text(json.dumps(m))
    flags = isa.read_cpu_flags()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = kvexport.load(str(b16))
    if isa.has_bf16(flags):
        assert engine.session.describe()["precision"] == "bf16"
        prompt = prompt_ids(9)
        tokens, logits = greedy_run(engine, prompt, STEPS)
        ref = Reference(ckpt, engine.max_seq).logits(prompt + tokens[:-1])[len(prompt) - 1:]
        stats = compare(ref, logits)
        print(f"bf16 over {STEPS} steps: {stats}")
        # greedy tokens on random weights flip at near-ties under bf16 (no measure); the KL stays small.
        # bf16 is judged teacher-forced on the trained default model in tests/test_verify.py
        assert stats["mean_kl"] <= tolerance("intel", "bf16").max_mean_kl
    else:
        assert engine.session.describe()["precision"] == "fp32"
        assert any(issubclass(w.category, IntelBackendWarning) and "bf16" in str(w.message) for w in caught)
        assert engine.generate(prompt_ids(5), max_new_tokens=4).token_ids  # and it runs


def test_a_lossy_kv_cache_is_costed_by_the_session_not_the_build(intel_artifacts: dict, tmp_path: Path) -> None:
    """The build records no cost (it would compile the engine at f32 beside the decoder's weights); the loaded
    session measures it against its f32-cache twin, which verify reports; a lossless cache has none."""
    from kvexport.artifact import finish, open_artifact
    from kvexport.backends import BuildOptions
    from kvexport_intel import IntelBackend

    _, art = intel_artifacts["llama"]
    folder, manifest = open_artifact(shutil.copytree(art, tmp_path / "u8.kvx"))
    said: list[str] = []
    IntelBackend().build(folder, manifest, BuildOptions(extra={"kv_precision": "u8"}), said.append)
    assert manifest.raw["target"]["options"]["kv_precision"] == "u8"
    assert "kv_precision_cost" not in manifest.raw["target"]["options"]
    assert any("measured by verify" in m for m in said)
    finish(folder, manifest)
    heard: list[str] = []
    cost = kvexport.load(str(folder)).session.lossy_cache_cost(heard.append)
    print(f"u8 KV cost against the f32 cache: {cost}")
    assert cost is not None and cost["kv_precision"] == "u8" and "not measured" in cost["memory"]
    assert 0 < cost["max_abs_logit"] and cost["greedy_agreement"] >= 0.9
    assert heard and "u8" in heard[0]
    assert kvexport.load(str(art), precision="fp32").session.lossy_cache_cost() is None  # f32 cache: nothing lost
