"""verify against real bugs: a correct engine passes, an engine with one injected KV-cache bug fails,
at fp32 (strict) and below it (teacher-forced); a wrong reference or a missing transformers is refused."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvexport.runtime.engine import Engine, load
from kvexport.runtime.session import Session
from kvexport.testing import default_checkpoint_once, exports_made_once
from kvexport.verify import HELDOUT_FILE, SELF_CHECK, TEXT_POSITIONS, Reference, VerifyReport, verify_engine

MAX_SEQ = 256  # text windows of 256 tokens: 64 prefilled, 192 fed by decode steps
MUTATIONS = ("rope", "stale", "gqa")


def _cpu_has_bf16() -> bool:
    from kvexport_intel import isa

    return isa.has_bf16(isa.read_cpu_flags())


def _openvino() -> bool:
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


# name -> (target, build options): fp32 strict, and below fp32 on every CPU (amd bf16 through torch,
# intel with a u8 cache), plus intel bf16 where the CPU computes it (AMX / AVX512-BF16).
ENGINES: dict[str, tuple[str, dict[str, Any]]] = {
    "cpu-fp32": ("cpu", {}),
    "cpu-fp32+kv-int8": ("cpu", {"kv": "int8"}),
    "amd-bf16": ("amd", {"precision": "bf16", "max_batch": 4, "threads": 2}),
    "intel-fp32+kv-u8": ("intel", {"precision": "fp32", "extra": {"kv_precision": "u8"}}),
    "intel-bf16": ("intel", {"precision": "bf16"}),
}


def _skip_reason(name: str) -> str | None:
    target = ENGINES[name][0]
    if target == "intel" and not _openvino():
        return "the intel target needs openvino (pip install 'kvexport[intel]')"
    if name == "intel-bf16" and not _cpu_has_bf16():
        return "OpenVINO runs bf16 only on CPUs with AMX-BF16 or AVX512-BF16; this one has neither"
    return None


class _Builds(dict):
    def __init__(self, root: Path, ckpt: Path, tmp_path_factory: pytest.TempPathFactory):
        super().__init__()
        self.root, self.ckpt, self.factory = root, ckpt, tmp_path_factory

    def __missing__(self, name: str) -> Path:
        from kvexport.backends import BuildOptions
        from kvexport.build import build

        reason = _skip_reason(name)
        if reason:
            pytest.skip(reason)
        target, opts = ENGINES[name]
        with exports_made_once(self.factory):  # cpu and amd share one export of the default model at MAX_SEQ
            self[name] = build(self.ckpt, self.root / f"{name}.kvx", target=target, max_seq=MAX_SEQ,
                               options=BuildOptions(**opts), verify=False)
        return self[name]


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's checkpoint folder: trained, with its held-out text (what the rows were set on)."""
    path = default_checkpoint_once(tmp_path_factory)
    assert (path / HELDOUT_FILE).is_file()
    return path


@pytest.fixture(scope="session")
def builds(tmp_path_factory: pytest.TempPathFactory, trained: Path) -> _Builds:
    return _Builds(tmp_path_factory.mktemp("verify-builds"), trained, tmp_path_factory)


@pytest.fixture(scope="session")
def reference(trained: Path) -> Reference:
    return Reference(trained, MAX_SEQ)


# --- the injected bugs: a Session wrapper around a correct engine ----------------------------------
def _edit_cache(state: Any, edit: Any) -> None:
    """Apply edit(x) in place to every K/V cache tensor (B, H_kv, slots, D) of a backend's state."""
    if getattr(state, "rows", None) is not None:  # intel, a paged request: its blocks (blocks, H_kv, block, row)
        table = state.rows.tables[0]
        for c in state.rows.caches:
            held = c[table]  # a gathered copy of the request's blocks
            n, h, block, width = held.shape
            x = held.transpose(1, 0, 2, 3).reshape(1, h, n * block, width)  # a u8 row holds its scale too
            edit(x)
            c[table] = x.reshape(h, n, block, width).transpose(1, 0, 2, 3)
    elif hasattr(state, "request"):  # intel: the caches are the InferRequest's variables
        import openvino as ov

        for var in state.request.query_state():
            x = var.state.data.copy()
            edit(x)
            var.state = ov.Tensor(x)
    else:  # cpu (numpy) and amd (torch) bind their caches as arrays the state holds
        for x in state.caches:
            edit(x)


class Mutated(Session):
    """A correct Session with one KV-cache bug.

    rope:  decode steps rotate with position_ids + 1 (prefill is right): RoPE positions off by one.
    stale: each decode step's K/V land one slot back (write_index - 1), its own slot keeps stale zeros.
    gqa:   the K/V rows each step writes are stored under the other KV head: a wrong GQA head mapping.
    """

    def __init__(self, inner: Session, bug: str, kv_heads: int):
        self.inner, self.bug = inner, bug
        self.max_seq, self.vocab_size = inner.max_seq, inner.vocab_size
        self.perm = [(h + 1) % kv_heads for h in range(kv_heads)]  # every KV head to the next one

    def new_state(self, batch: int, capacity: int) -> Any:
        return self.inner.new_state(batch, capacity)

    def release(self, state: Any) -> None:
        self.inner.release(state)

    def step(self, state: Any, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        S, total = input_ids.shape[1], attention_mask.shape[-1]
        T = total - S  # slots held before this step: it writes slots T .. total-1
        if self.bug == "rope" and S == 1:
            position_ids = position_ids + 1
        logits = self.inner.step(state, input_ids, position_ids, attention_mask)
        if self.bug == "stale" and S == 1 and T > 0:
            def edit(x: Any) -> None:
                x[:, :, T - 1] = x[:, :, T]
                x[:, :, T] = 0
            _edit_cache(state, edit)
        elif self.bug == "gqa":
            def edit(x: Any) -> None:
                x[:, :, T:total] = x[:, self.perm, T:total]
            _edit_cache(state, edit)
        return logits


def mutated(engine: Engine, bug: str) -> Engine:
    return Engine(engine.folder, engine.manifest, Mutated(engine.session, bug, engine.config.num_key_value_heads))


def _verify(engine: Engine, trained: Path, reference: Reference, text_positions: int = TEXT_POSITIONS) -> VerifyReport:
    # fewer greedy steps than `kvexport verify` runs: the text is what the lossy rows judge
    return verify_engine(engine, trained, decode_steps=16, prompt_lengths=(7,), text_positions=text_positions,
                         reference=reference)


def _show(name: str, bug: str, r: VerifyReport) -> str:
    s, t = r.summary, r.text
    return (f"{name} {bug}: {r.mode} greedy {s['greedy_agreement']:.3f} max|dlogit| {s['max_abs_logit']:.2e}; "
            f"text top-1 {t['top1_agreement']:.4f} mean KL {t['mean_kl']:.2e} max KL {t['max_kl']:.2e} "
            f"ppl {t['ppl_change']:+.2%}; cache checks {r.checks}; failures {r.failures}")


@pytest.fixture(scope="session")
def engines(builds: _Builds) -> dict[str, Engine]:
    class _Lazy(dict):
        def __missing__(self, name: str) -> Engine:
            self[name] = load(builds[name])
            return self[name]

    return _Lazy()  # type: ignore[return-value]


@pytest.mark.parametrize("name", list(ENGINES))
def test_a_correct_engine_passes(name: str, engines: dict, trained: Path, reference: Reference) -> None:
    r = _verify(engines[name], trained, reference)
    print(_show(name, "none", r))
    assert r.mode == ("strict" if r.precision == "fp32" else "teacher-forced")
    assert r.text["source"] == HELDOUT_FILE and r.text["positions"] == TEXT_POSITIONS  # as the rows were set
    if name.startswith("intel"):  # fresh prompts take paged attention (its own u8 blocks); the text is judged again
        # through the fused attention with state, the other path
        assert engines[name].session.describe()["long_prefill"] == "paged attention, decode paged"
        from kvexport_intel.session import STATE_PATH

        assert r.other_text["path"] == STATE_PATH, r.other_text
        assert r.other_text["positions"] == TEXT_POSITIONS
    else:
        assert r.other_text == {}
    assert r.passed, r.failures


@pytest.mark.parametrize("bug", MUTATIONS)
@pytest.mark.parametrize("name", list(ENGINES))
def test_an_engine_with_a_cache_bug_fails(name: str, bug: str, engines: dict, trained: Path,
                                          reference: Reference) -> None:
    r = _verify(mutated(engines[name], bug), trained, reference, text_positions=192)  # one window: bugs fail by far
    print(_show(name, bug, r))
    assert not r.passed
    if r.mode == "teacher-forced":  # failed on the text's measures, not only on the engine-against-itself checks
        assert any(f.startswith(("text", "held-out")) for f in r.failures), r.failures


def test_an_int8_cache_with_halved_scales_fails(builds: _Builds, trained: Path, reference: Reference,
                                                tmp_path: Path) -> None:
    """cpu --kv int8 with every calibrated scale halved: keys and values past half their range clip."""
    import onnx
    from onnx import numpy_helper

    from kvexport.backends.cpu import ENGINE_DIR, OPT_MODEL, CpuSession

    art = builds["cpu-fp32+kv-int8"]
    model = onnx.load(str(art / ENGINE_DIR / OPT_MODEL))  # its small initializers, the scales, are inline
    scales = [t for t in model.graph.initializer if t.name.endswith(("/k_scale", "/v_scale"))]
    assert len(scales) == 2 * 4  # one K and one V scale per layer
    for t in scales:
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) / 2, t.name))
    onnx.save_model(model, str(tmp_path / "halved.onnx"), save_as_external_data=True, location="halved.onnx.data")
    engine = load(art)
    broken = Engine(art, engine.manifest, CpuSession(tmp_path / "halved.onnx", engine.manifest, 2))
    r = _verify(broken, trained, reference, text_positions=192)
    print(_show("cpu-fp32+kv-int8", "halved scales", r))
    assert any(f.startswith(("text", "held-out")) for f in r.failures), r.failures


# --- refusals before any work -----------------------------------------------------------------------
def _kvx(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvexport", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


def test_a_reference_of_another_model_is_refused_by_name(builds: _Builds, tmp_path: Path) -> None:
    from kvexport.zoo import TINY_CONFIGS, write_checkpoint

    other = write_checkpoint({**TINY_CONFIGS["gpt2"], "vocab_size": 300}, tmp_path / "tiny-gpt2")
    p = _kvx("verify", str(builds["cpu-fp32"]), "--reference", str(other))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    for what in ("family: artifact 'llama', reference 'gpt2'", "vocabulary", "layers: artifact 4, reference 2"):
        assert what in p.stderr, p.stderr
    assert not (builds["cpu-fp32"] / "verify.json").exists()  # refused before running anything


def test_without_transformers_verify_refuses_unless_a_self_check_is_asked(
        builds: _Builds, trained: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvexport.build import build, run_verify
    from kvexport.errors import ReferenceUnavailableError

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    art = builds["cpu-fp32"]
    with pytest.raises(ReferenceUnavailableError, match=r"pip install 'kvexport\[verify\]'"):
        run_verify(art, trained)
    with pytest.raises(ReferenceUnavailableError, match="--no-verify"):
        build(trained, art.parent / "never.kvx", target="cpu", max_seq=MAX_SEQ)
    assert not (art.parent / "never.kvx").exists()  # refused before exporting
    result = run_verify(art, trained, decode_steps=8, self_check=True)
    assert result["passed"] and result["reference"] == SELF_CHECK
    import json

    assert json.loads((art / "verify.json").read_text())["reference"] == "kvexport-eager (self-check)"


@pytest.mark.parametrize("rows", [1, 2])
def test_cache_checks_stay_within_the_rows_an_engine_was_compiled_for(artifacts: dict, rows: int) -> None:
    """An engine compiled for fewer rows than verify's three-row check (amd's --max-batch 2) is checked with
    as many as it holds, instead of failing in verify after the whole build."""
    import kvexport
    from kvexport.verify import cache_checks

    engine = kvexport.load(str(artifacts["llama"]))
    engine.session.max_batch = rows  # what a batch-limited backend's session declares
    real_prefill, widest = engine.prefill, []

    def prefill(prompts, *a, **k):
        widest.append(len(prompts) if prompts and isinstance(prompts[0], list) else 1)
        return real_prefill(prompts, *a, **k)

    engine.prefill = prefill
    checks = cache_checks(engine, np.random.default_rng(0), lambda _m: None)
    assert max(widest) == rows
    assert ("batch_independence_max_abs" in checks) is (rows > 1)
    assert all(v < 1e-4 for v in checks.values()), checks


def test_the_other_prompt_path_is_judged_by_the_same_row() -> None:
    """The other prompt path's text outside the row fails the report, named as that path's, even where the ordinary
    text passes; a strict row holds its logits to the row's max |dlogit|."""
    from kvexport.tolerances import tolerance
    from kvexport.verify import _judge

    good = {"source": HELDOUT_FILE, "positions": TEXT_POSITIONS, "top1_agreement": 0.997, "mean_kl": 2e-5,
            "max_kl": 7e-4, "max_abs_logit": 0.1, "ppl_engine": 10.0, "ppl_reference": 10.0, "ppl_change": 0.0}
    bad = {**good, "top1_agreement": 0.9, "mean_kl": 1e-2, "max_abs_logit": 5.0}
    for key, summary in (("fp32+kv-int8", {}), ("fp32", {"max_abs_logit": 1e-5, "greedy_agreement": 1.0,
                                                          "mean_kl": 0.0})):
        tol = tolerance("intel", key)
        for other_text, fails in (({}, False), (good, key == "fp32"), (bad, True)):
            r = VerifyReport("intel", key, "test", {}, "", summary=summary, text=good, other_text=other_text)
            _judge(r, tol)
            assert bool(r.failures) == fails, (key, r.failures)
            assert all(f.startswith("other prompt path") for f in r.failures), r.failures
