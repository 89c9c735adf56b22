"""kvexport.load + Engine over the cpu backend: numerics, sampling, batches, cache policy, safety."""
from __future__ import annotations

import gc
import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

import kvexport
from kvexport.errors import ArtifactError, ContextOverflowError, InputError, ManifestError
from kvexport.runtime.buffers import ALIGN, capacity_for, capacity_ladder
from kvexport.tolerances import tolerance
from kvexport.verify import verify_engine
from tests.conftest import FAMILIES, HFReference, random_ids

TOL = tolerance("cpu", "fp32")


@pytest.fixture(scope="module")
def engines(artifacts: dict[str, Path]) -> dict[str, kvexport.runtime.engine.Engine]:
    class _Lazy(dict):
        def __missing__(self, f: str):  # type: ignore[no-untyped-def]
            self[f] = kvexport.load(artifacts[f], threads=2)
            return self[f]

    return _Lazy()  # type: ignore[return-value]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_identical_to_reference_for_64_steps(family: str, engines: dict, references: dict[str, HFReference]) -> None:
    engine = engines[family]
    prompt = random_ids(12, seed=3)
    gen = engine.generate(prompt, 64, stop=())
    toks = gen.token_ids
    if gen.finish_reason == "stop":  # sampled EOS: the reference must agree on it too
        assert toks[-1] in engine.eos_ids
    ref = references[family].logits(prompt + toks[:-1])[len(prompt) - 1 :]
    assert toks == ref.argmax(-1).tolist()
    assert len(toks) == 64 or gen.finish_reason == "stop"


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_passes_within_the_tolerance_table(family: str, engines: dict, checkpoints: dict[str, Path]) -> None:
    report = verify_engine(engines[family], checkpoints[family], decode_steps=16, prompt_lengths=(1, 9))
    assert report.passed, report.failures
    assert report.summary["max_abs_logit"] < TOL.max_abs_logit
    assert report.checks["batch_independence_max_abs"] < 1e-4  # a left-padded batch equals its rows alone
    assert report.checks["prefill_decode_max_abs"] < 1e-4  # prefill(N) + decode(1) equals prefill(N + 1)


def test_seeded_sampling_is_reproducible_and_seed_dependent(engines: dict) -> None:
    e = engines["llama"]
    kw = dict(temperature=1.0, top_k=50, top_p=0.9)
    a = e.generate("abc", 24, seed=1, **kw).token_ids
    b = e.generate("abc", 24, seed=1, **kw).token_ids
    c = e.generate("abc", 24, seed=2, **kw).token_ids
    assert a == b and a != c


def test_top_k_1_is_greedy(engines: dict) -> None:
    e = engines["qwen2"]
    assert e.generate("xyz", 16, temperature=0.7, top_k=1, seed=3).token_ids == e.generate("xyz", 16).token_ids


def test_stop_tokens_and_strings(engines: dict) -> None:
    e = engines["llama"]
    full = e.generate("hello", 20)
    stop_tok = full.token_ids[5]
    first = full.token_ids.index(stop_tok)
    g = e.generate("hello", 20, stop=[stop_tok])
    assert g.token_ids == full.token_ids[: first + 1] and g.finish_reason == "stop"
    assert e.generate("hello", 20).finish_reason == "length"
    assert full.text is not None
    needle = full.text[3:5]
    if needle:
        gs = e.generate("hello", 20, stop=[needle])
        assert needle not in (gs.text or "") and gs.finish_reason == "stop"


def test_stream_yields_what_generate_returns(engines: dict) -> None:
    e = engines["gpt2"]
    events = list(e.stream("stream me", 15))
    g = e.generate("stream me", 15)
    assert [ev.token_id for ev in events] == g.token_ids
    assert "".join(ev.text for ev in events) == g.text


def test_batch_rows_are_independent(engines: dict) -> None:
    e = engines["mistral"]
    prompts = [random_ids(n, seed=n) for n in (3, 17, 40)]  # 40 > sliding window 24
    together = e.generate(prompts, 24)
    alone = [e.generate(p, 24) for p in prompts]
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]


def test_overflow_is_refused_before_any_work(engines: dict) -> None:
    e = engines["llama"]
    calls = []
    orig = e.session.step
    e.session.step = lambda *a, **k: calls.append(1) or orig(*a, **k)  # type: ignore[method-assign]
    try:
        with pytest.raises(ContextOverflowError, match="max_seq=128"):
            e.generate(random_ids(100), 40)
    finally:
        e.session.step = orig  # type: ignore[method-assign]
    assert calls == []


@pytest.mark.parametrize("bad", [[1.5, 2.0], np.array([1.0, 2.0]), np.array([[[1]]]), [], [10**6], "x"])
def test_bad_prompts_get_input_errors(engines: dict, bad: object) -> None:
    e = engines["llama"]
    if isinstance(bad, str):
        with pytest.raises(InputError):
            e.generate(bad, 0)
        return
    with pytest.raises(InputError):
        e.generate(bad, 4)  # type: ignore[arg-type]


def test_cache_is_aligned_grows_along_the_ladder_and_copies_only_when_it_grows(engines: dict) -> None:
    e = engines["llama"]
    b = e.prefill(random_ids(10), 6)  # needs 16 slots: first ladder step
    st = b.state
    assert st.capacity == capacity_for(16, e.max_seq) == 64
    assert all(c.ctypes.data % ALIGN == 0 for c in st.caches)
    ptrs = [c.ctypes.data for c in st.caches]
    tok = b.logits.argmax(-1)
    for _ in range(53):  # 63 slots held: still the first buffer, written in place
        tok = e.decode(b, tok).argmax(-1)
    assert [c.ctypes.data for c in st.caches] == ptrs and st.bytes_copied == 0
    assert np.abs(st.caches[0][:, :, 62]).sum() > 0 and not st.caches[0][:, :, 63].any()
    tok = e.decode(b, tok).argmax(-1)  # slot 63: the buffer is now full
    held = [c[:, :, :64].copy() for c in st.caches]
    tok = e.decode(b, tok).argmax(-1)  # slot 64 does not fit: one growth step
    assert st.capacity == 96 and st.grow_events == [96]
    assert st.bytes_copied == sum(h.nbytes for h in held)
    assert all(np.array_equal(h, c[:, :, :64]) for h, c in zip(held, st.caches))
    copied = st.bytes_copied
    for _ in range(10):
        tok = e.decode(b, tok).argmax(-1)
    assert st.bytes_copied == copied  # per decode step: zero cache bytes copied
    e.session.release(b.state)


def test_grown_cache_gives_the_same_tokens_as_a_presized_one(engines: dict) -> None:
    e = engines["gpt2"]
    prompt = random_ids(20, seed=9)
    presized = e.generate(prompt, 60).token_ids
    b = e.prefill(prompt, 0)  # sized for the prompt only: decoding must grow it twice
    toks = [int(b.logits.argmax())]
    for _ in range(59):
        toks.append(int(e.decode(b, np.array([toks[-1]]))[0].argmax()))
    assert len(b.state.grow_events) >= 1
    assert toks == presized


def test_capacity_ladder() -> None:
    assert capacity_ladder(1000) == [64, 96, 128, 192, 256, 384, 512, 768, 1000]
    assert capacity_for(513, 2048) == 768 and capacity_for(5000, 2048) == 2048


def test_threads_share_one_engine_without_mixing_caches(engines: dict) -> None:
    e = engines["qwen2"]
    prompts = [random_ids(5 + 3 * i, seed=i) for i in range(6)]
    serial = [e.generate(p, 20).token_ids for p in prompts]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(3):
                results[i] = e.generate(prompts[i], 20).token_ids
                assert results[i] == serial[i]
        except BaseException as ex:  # noqa: BLE001 - re-raised in the main thread
            errors.append(ex)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and [results[i] for i in range(6)] == serial


def test_memory_does_not_grow_across_requests(engines: dict) -> None:
    import psutil

    e = engines["llama"]
    proc = psutil.Process()
    for i in range(50):
        e.generate(random_ids(8 + i % 20, seed=i), 8)
    gc.collect()
    base = proc.memory_info().rss
    for i in range(300):
        e.generate(random_ids(8 + i % 20, seed=i), 8)
    gc.collect()
    grown = proc.memory_info().rss - base
    assert grown < 8 * 2**20, f"RSS grew {grown / 2**20:.1f} MiB over 300 requests"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_corrupted_engine_file_is_named(artifacts: dict[str, Path], tmp_path: Path) -> None:
    a = _copy(artifacts["llama"], tmp_path / "a.kvx")
    data = a / "engine" / "model.opt.onnx.data"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 100)
    with pytest.raises(ArtifactError, match="model.opt.onnx.data"):
        kvexport.load(a)


def test_edited_ir_and_missing_file_are_named(artifacts: dict[str, Path], tmp_path: Path) -> None:
    a = _copy(artifacts["llama"], tmp_path / "a.kvx")
    raw = bytearray((a / "model.onnx").read_bytes())
    raw[-1] ^= 0xFF
    (a / "model.onnx").write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match="model.onnx does not match"):
        kvexport.load(a)
    b = _copy(artifacts["llama"], tmp_path / "b.kvx")
    (b / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match="tokenizer.json is missing"):
        kvexport.load(b)


def test_newer_schema_and_broken_manifest(artifacts: dict[str, Path], tmp_path: Path) -> None:
    a = _copy(artifacts["llama"], tmp_path / "a.kvx")
    m = json.loads((a / "manifest.json").read_text())
    m["schema_version"] = 99
    (a / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="newer than this kvexport"):
        kvexport.load(a)
    del m["cache"]
    m["schema_version"] = 1
    (a / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="`cache`"):
        kvexport.load(a)
    (a / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        kvexport.load(a)
    m["cache"] = json.loads((artifacts["llama"] / "manifest.json").read_text())["cache"]
    m["model"]["config"]["norm_offset"] = 0.0  # a field an older kvexport wrote and this one dropped
    (a / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ManifestError, match=r"fields this kvexport does not know \(norm_offset\).*kvexport build"):
        kvexport.load(a)


def test_loading_imports_no_python_from_the_artifact(artifacts: dict[str, Path], tmp_path: Path) -> None:
    from kvexport.artifact import finish
    from kvexport.manifest import read

    a = _copy(artifacts["llama"], tmp_path / "a.kvx")
    (a / "evil.py").write_text("raise SystemExit('imported!')\n")
    with pytest.raises(ArtifactError, match="evil.py is not listed"):
        kvexport.load(a)  # an unlisted file is refused outright
    finish(a, read(a))  # listed with its sha256: loading still never imports it
    import sys

    before = set(sys.modules)
    kvexport.load(a).generate([5, 6], 2)
    assert not any("evil" in m for m in set(sys.modules) - before)


def test_a_state_taken_back_to_fewer_slots_sees_only_them(engines: dict) -> None:
    """Step a state 12 slots deep one token at a time, then step it again at slot 8 (taken back, as a
    caller that drops a draft does): it must see slots 0..8 only, as a state that never went further."""
    e = engines["llama"]
    s = e.session
    ids = np.array([random_ids(13, seed=4)], dtype=np.int64)
    causal = np.tril(np.ones((8, 8), dtype=bool))[None, None]

    def prefilled() -> object:
        st = s.new_state(1, 64)
        s.step(st, ids[:, :8], np.arange(8)[None], causal)
        return st

    went_on = prefilled()
    for t in range(8, 12):
        s.step(went_on, ids[:, t:t + 1], np.array([[t]]), np.ones((1, 1, 1, t + 1), dtype=bool))
    back = s.step(went_on, ids[:, 12:13], np.array([[8]]), np.ones((1, 1, 1, 9), dtype=bool)).copy()
    fresh = prefilled()
    never = s.step(fresh, ids[:, 12:13], np.array([[8]]), np.ones((1, 1, 1, 9), dtype=bool)).copy()
    assert np.abs(back - never).max() <= TOL.max_abs_logit
    s.release(went_on)
    s.release(fresh)
