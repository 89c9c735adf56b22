"""The CPU-compiled AOTInductor package of every tiny family against transformers; packaging and load errors;
what `kvexport build --target amd` shows a user on stderr (one compile of CLI_FAMILY serves that test and the
tests of its artifact, in this one file)."""
from __future__ import annotations

import json
import re
import shutil
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import kvexport
from kvexport.artifact import finish, open_artifact
from kvexport.errors import ArtifactError, BackendUnavailableError, ContextOverflowError, InputError
from kvexport.export import decoder_from_ir
from kvexport.tolerances import tolerance
from kvexport_amd import AmdBackend, lowering

from kvexport.runtime.ring import RingSpec
from kvexport.verify import cache_checks

from conftest import AMD_COMPILED_FAMILIES, AMD_MAX_SEQ, CLI_FAMILY, batch_greedy, engine_greedy
from test_amd_ring import generate_past_window, ring_bytes

STEPS = 32


def _hf(model_dir: Path):  # type: ignore[no-untyped-def]
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.mark.parametrize("family", AMD_COMPILED_FAMILIES)
def test_greedy_tokens_match_transformers(amd_builds, family: str) -> None:
    """32 greedy steps of the compiled package give transformers' tokens, logits within the amd fp32 tolerance."""
    folder = amd_builds[family]
    engine = kvexport.load(folder)
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 259, 9)]
    tokens, logits = engine_greedy(engine, prompt, STEPS)
    hf = _hf(amd_builds.checkpoint(family))
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
        ref_logits = hf(out[:, :-1]).logits[0, len(prompt) - 1:].numpy()
    assert tokens == out[0, len(prompt):].tolist()
    tol = tolerance("amd", "fp32")
    assert np.abs(ref_logits - logits).max() <= tol.max_abs_logit
    m = engine.manifest.raw
    assert m["verification"]["passed"] is True  # kvexport.build's own verify (prompts 1, 7, 33)
    print(f"\n{family}: amd build {amd_builds.seconds[family]:.1f}s total, "
          f"{m['target']['options']['build_seconds']:.1f}s export+compile, max|dlogit| "
          f"{np.abs(ref_logits - logits).max():.2e}")


def test_target_fields_and_package_holds_no_pickles(amd_builds) -> None:
    folder = amd_builds["llama"]
    _, m = open_artifact(folder)
    t = m.target
    assert t["backend"] == "amd" and t["precision"] == "fp32" and t["engine_files"] == ["engine/model.pt2"]
    fp = t["fingerprint"]
    assert fp["device_kind"] == "cpu" and fp["torch"] == torch.__version__ and isinstance(fp["cpu_flags"], list)
    assert t["options"]["cache_len"] == AMD_MAX_SEQ and t["options"]["source"] == "ir"
    assert t["options"]["build_seconds"] > 0
    names = zipfile.ZipFile(folder / "engine/model.pt2").namelist()
    assert any(n.endswith(".so") for n in names)
    assert not [n for n in names if n.endswith((".pkl", ".pt", ".pth")) or "/data/weights/" in n or "/models/" in n]
    assert "engine/model.pt2" in m.raw["files"]


def test_decoder_rebuilt_from_ir_equals_checkpoint(amd_builds) -> None:
    """The weights the package was compiled from are exactly the checkpoint's, for every compiled family."""
    for family in AMD_COMPILED_FAMILIES:
        folder, m = open_artifact(amd_builds[family])
        a = decoder_from_ir(folder, m).state_dict()
        b = lowering.decoder_from_checkpoint(amd_builds.checkpoint(family), m).state_dict()
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (family, k)


def test_cache_is_written_in_place(amd_builds) -> None:
    engine = kvexport.load(amd_builds["llama"])
    s = engine.session
    state = s.new_state(1, 16)
    ptrs = [c.data_ptr() for c in state.caches]
    before = s.cache_bytes(state)
    s.step(state, np.array([[5, 6, 7]]), np.array([[0, 1, 2]]), np.tril(np.ones((3, 3), bool))[None, None])
    assert float(state.caches[0][0, :, :3].abs().sum()) > 0  # slots 0..2 written by the package itself
    assert float(state.caches[0][0, :, 3:].abs().sum()) == 0  # nothing past them
    snapshot = state.caches[0][0, :, :3].clone()
    s.step(state, np.array([[9]]), np.array([[3]]), np.ones((1, 1, 1, 4), bool))
    assert torch.equal(state.caches[0][0, :, :3], snapshot)  # earlier slots never overwritten
    assert float(state.caches[0][0, :, 3].abs().sum()) > 0
    assert [c.data_ptr() for c in state.caches] == ptrs and s.cache_bytes(state) == before


def test_batch_rows_do_not_affect_each_other(amd_builds) -> None:
    engine = kvexport.load(amd_builds["qwen2"])
    prompts = [[40, 41, 42, 43, 44, 45, 46], [70, 71, 72]]
    alone = [engine_greedy(engine, p, 8)[0] for p in prompts]
    assert batch_greedy(engine, prompts, 8) == alone


def test_distinct_states_on_threads(amd_builds) -> None:
    engine = kvexport.load(amd_builds["llama"])
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(3)]
    expected = [engine_greedy(engine, p, 6)[0] for p in prompts]
    got: dict[int, list[int]] = {}

    def run(i: int) -> None:
        got[i] = engine_greedy(engine, prompts[i], 6)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(3)] == expected


def test_session_refuses_bad_steps(amd_builds) -> None:
    s = kvexport.load(amd_builds["llama"]).session
    with pytest.raises(ContextOverflowError):
        s.new_state(1, AMD_MAX_SEQ + 1)
    with pytest.raises(InputError, match="batch"):
        s.new_state(99, 8)
    state = s.new_state(1, 8)
    with pytest.raises(InputError, match="int64"):
        s.step(state, np.array([[1]], dtype=np.int32), np.array([[0]]), np.ones((1, 1, 1, 1), bool))
    with pytest.raises(InputError, match="attention_mask"):
        s.step(state, np.array([[1]]), np.array([[0]]), np.ones((1, 1, 1, 2), bool))
    big = AMD_MAX_SEQ + 1
    with pytest.raises(ContextOverflowError):
        s.step(state, np.ones((1, big), np.int64), np.arange(big)[None], np.ones((1, 1, big, big), bool))
    assert s.describe()["cache_policy"] == "fixed" and s.describe()["graph_capture"] is False


@pytest.fixture()
def copy_of(amd_builds, tmp_path: Path):  # type: ignore[no-untyped-def]
    def make(family: str = "llama") -> Path:
        return Path(shutil.copytree(amd_builds[family], tmp_path / "copy.kvx"))
    return make


def _forbid_native_load(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []

    def fake(*args: object) -> None:
        calls.append(str(args[0]))
        raise AssertionError("the native loader must not be reached")

    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader", fake)
    return calls


def test_tampered_package_is_never_loaded(copy_of, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = copy_of()
    pkg = folder / "engine/model.pt2"
    data = bytearray(pkg.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pkg.write_bytes(bytes(data))
    calls = _forbid_native_load(monkeypatch)
    with pytest.raises(ArtifactError, match="sha256"):
        kvexport.load(folder)
    _, m = open_artifact(folder, verify_hashes=False)  # a caller that skipped the folder check
    with pytest.raises(ArtifactError, match="sha256"):
        AmdBackend().load(folder, m)
    assert calls == []


def test_fingerprint_mismatch_fails_clearly(copy_of, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = copy_of()
    _, m = open_artifact(folder)
    m.raw["target"]["fingerprint"]["torch"] = "2.0.0"
    m.raw["target"]["fingerprint"]["cpu_flags"].append("avx10_9")
    finish(folder, m)
    calls = _forbid_native_load(monkeypatch)
    with pytest.raises(ArtifactError, match=r"torch 2\.0\.0.*avx10_9.*rebuild here"):
        kvexport.load(folder)
    m.raw["target"]["fingerprint"] = {"device_kind": "rocm", "device_name": "AMD Instinct MI300X",
                                      "torch": torch.__version__, "machine": "x86_64", "hip": "6.4",
                                      "gfx_arch": "gfx942:sramecc+:xnack-"}
    m.raw["target"]["precision"] = "bf16"
    finish(folder, m)
    with pytest.raises(BackendUnavailableError, match="ROCm"):
        kvexport.load(folder)
    assert calls == []


def test_package_with_pickled_entries_is_refused(copy_of, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = copy_of()
    pkg = folder / "engine/model.pt2"
    with zipfile.ZipFile(pkg, "a") as z:
        prefix = z.namelist()[0].split("/", 1)[0]
        z.writestr(f"{prefix}/data/weights/weight_0", b"\x80\x02}q\x00.")  # a pickle header
    _, m = open_artifact(folder, verify_hashes=False)
    finish(folder, m)  # re-hash: the sha256 passes, the content check must still refuse it
    calls = _forbid_native_load(monkeypatch)
    with pytest.raises(ArtifactError, match="unpickled"):
        kvexport.load(folder)
    assert calls == []


def test_not_an_amd_artifact(copy_of) -> None:
    folder = copy_of()
    _, m = open_artifact(folder)
    m.raw["target"]["backend"] = "cpu"
    with pytest.raises(ArtifactError, match="not built for the amd target"):
        AmdBackend().load(folder, m)
    assert json.loads((folder / "manifest.json").read_text())["target"]["backend"] == "amd"


@pytest.mark.slow
def test_cli_build_shows_progress_and_no_raw_warnings(amd_builds) -> None:
    """torch.export and AOTInductor warn (FutureWarnings, some from compile workers): the CLI sums them up
    in notice lines and keeps the details in a log; no `path:line: SomeWarning:` line or source line.
    The command is the one that builds amd_builds[CLI_FAMILY], the artifact the other amd tests use."""
    out = amd_builds[CLI_FAMILY]
    r = amd_builds.cli
    assert r is not None and r.returncode == 0, r
    assert (out / "manifest.json").is_file()
    assert "compiling with AOTInductor" in r.stderr and "artifact ready" in r.stderr
    assert not re.search(r"^\S+:\d+: \w*Warning: |warnings\.warn\(", r.stderr + r.stdout, re.M), r.stderr
    for notice in (ln for ln in r.stderr.splitlines() if ln.startswith("notice:")):
        log = Path(notice.split("details in ", 1)[1].split(" or rerun", 1)[0])
        assert log.parent == amd_builds.cli_logs and log.is_file()


def test_ring_caches_generate_4x_window_past_max_seq(amd_builds) -> None:
    """The tiny mistral slides in every layer (window 24) and its package keeps 24-slot rings: 100 new tokens
    after a 30-token prompt (130 slots, past max_seq 80) token-identical to transformers; the caches are the
    W-slot rings, written in place; prefill(N)+decode(1) == prefill(N+1) up to N = 48 > W; a left-padded batch
    (rows of 5, 17 and 29 tokens: its prefill goes in two pieces) equals its rows alone."""
    engine = kvexport.load(amd_builds["mistral"])
    ring, cfg = RingSpec.of(engine.manifest), engine.config
    W = cfg.sliding_window
    assert ring is not None and ring.every_layer and ring.window == W
    assert engine.session.limit == ring.max_positions > AMD_MAX_SEQ
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 259, 30)]  # > W: prefilled in two pieces
    n = 4 * W + 4
    _, worst, held = generate_past_window(engine, amd_builds.checkpoint("mistral"), prompt, n)
    assert worst < 1e-4
    rings_only = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * W * cfg.head_dim * 4  # K, V; fp32
    assert held == ring_bytes(cfg, ring, 1, AMD_MAX_SEQ) == rings_only
    checks = cache_checks(engine, np.random.default_rng(0), lambda _m: None)  # prefills up to 49 > W
    assert checks["prefill_decode_max_abs"] < 1e-4 and checks["batch_independence_max_abs"] < 1e-4, checks
    print(f"\nmistral: compiled package, {len(prompt) + n} slots held, cache {held:,} bytes, max |dlogit| "
          f"{worst:.2e}, {checks}")
