"""Ring caches on the amd target: a sliding-window layer keeps a W-slot ring, written in place by the package
(the in-place strategy's modular index write, decoder.write_rows_inplace).

The tiny mistral's compiled package (every layer slides) generates 4x its window past max_seq in
test_amd_build.py, beside the other compiled families (one compile per family in that file). Here, without a
compile: Gemma 2 and Gemma 3 mix sliding and global layers, and their exported programs run in AotiSession
(each family's package is compiled and verified, rings and batch checks included, from transformers' init in
tests/test_hf_init_amd.py).

A step longer than the window goes to the package in pieces of at most W tokens (runtime.ring.chunks); such a
piece of a batch is a strided view of the step's arrays, and the package reads every input at contiguous
strides (it checks them only under AOTI_RUNTIME_CHECK_INPUTS=1), so the rows after the first read another row's
ids and positions unless the session hands it dense copies: DenseRunner below holds the session to that.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvexport.artifact import export_artifact, open_artifact
from kvexport.export import decoder_from_ir
from kvexport.runtime.engine import Engine
from kvexport.runtime.ring import RingSpec
from kvexport.verify import Reference, compare
from kvexport.zoo import TINY_CONFIGS, write_checkpoint
from kvexport_amd import lowering
from kvexport_amd.session import AotiSession

from conftest import AMD_MAX_BATCH, AMD_MAX_SEQ
from test_amd_families import ExportedRunner

W = TINY_CONFIGS["mistral"]["sliding_window"]


class DenseRunner(ExportedRunner):
    """The exported program, refusing what the compiled package cannot read right: an input that is not dense."""

    def __init__(self, program: torch.export.ExportedProgram):
        super().__init__(program)
        self.calls = 0

    def boxed_run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        strided = [i for i, t in enumerate(inputs) if not t.is_contiguous()]
        assert not strided, f"inputs {strided} are strided views; the package would read them as dense"
        self.calls += 1
        return super().boxed_run(inputs)


def _session(program: torch.export.ExportedProgram, m,  # type: ignore[no-untyped-def]
             runner_type=DenseRunner) -> AotiSession:
    cfg = m.config
    return AotiSession(runner_type(program), device="cpu", dtype=torch.float32, num_layers=cfg.num_hidden_layers,
                       kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, max_seq=m.max_seq,
                       vocab_size=cfg.vocab_size, max_batch=AMD_MAX_BATCH, use_graph=False, facts={"backend": "amd"},
                       ring=RingSpec.of(m))


def ring_bytes(cfg, ring: RingSpec, batch: int, full_len: int) -> int:  # type: ignore[no-untyped-def]
    """K and V of every layer: a ring layer's W slots, another's full_len, fp32."""
    per_slot = 2 * batch * cfg.num_key_value_heads * cfg.head_dim * 4
    return sum(per_slot * (ring.window if i in ring.layers else full_len) for i in range(cfg.num_hidden_layers))


def generate_past_window(engine: Engine, ckpt: Path, prompt: list[int], n: int) -> tuple[list[int], float, int]:
    """n greedy tokens after prompt, token-checked against transformers: (tokens, max |dlogit|, cache bytes).
    The caches are the same tensors throughout (written in place)."""
    batch = engine.prefill(prompt, n)
    state = batch.state
    ptrs = [c.data_ptr() for c in state.caches]
    logits, tokens = [batch.logits[0].copy()], [int(batch.logits[0].argmax())]
    for _ in range(n - 1):
        logits.append(engine.decode(batch, np.array([tokens[-1]]))[0].copy())
        tokens.append(int(logits[-1].argmax()))
    assert [c.data_ptr() for c in state.caches] == ptrs
    held = engine.session.cache_bytes(state)
    engine.session.release(state)
    ref = Reference(ckpt, engine.max_seq).logits(prompt + tokens[:-1])[len(prompt) - 1:]
    assert list(ref.argmax(-1)) == tokens  # transformers picks the same token at every step
    return tokens, compare(ref, np.stack(logits))["max_abs_logit"], held


def test_session_hands_the_package_dense_inputs(tmp_path: Path) -> None:
    """The cause of the compiled ring package's wrong batch rows (4.94 before): a batch's prompt longer than W
    is cut into pieces whose ids and positions were strided views. The session now copies them dense; the
    exported program (strides or not) is the reference."""
    ckpt = write_checkpoint(TINY_CONFIGS["mistral"], tmp_path / "ckpt", seed=11)
    folder, m = open_artifact(export_artifact(ckpt, tmp_path / "mistral.kvx", max_seq=AMD_MAX_SEQ, ring=True))
    program = lowering.export_program(decoder_from_ir(folder, m), max_batch=AMD_MAX_BATCH, dtype=torch.float32,
                                      device="cpu")
    dense, loose = _session(program, m), _session(program, m, ExportedRunner)
    rng = np.random.default_rng(1)
    rows = [[int(t) for t in rng.integers(3, 259, n)] for n in (5, 17, 2 * W + 3)]  # three pieces
    out = []
    for session in (dense, loose):
        batch = Engine(folder, m, session).prefill(rows, 2)
        out.append(batch.logits.copy())
        session.release(batch.state)
    assert dense.runner.calls == 3  # 24 + 24 + 3 tokens: every piece passed the dense check
    np.testing.assert_allclose(out[0], out[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_mixed_model_holds_only_its_global_layers_at_full_length(family: str, tmp_path: Path) -> None:
    """gemma2 (sliding and global alternating) and gemma3_text (5 sliding : 1 global) through the amd lowering:
    the session's own buffers hold the global layers at max_seq slots and the sliding ones at their window;
    4x the window token-identical to transformers. (Their packages' cache checks, a left-padded batch and
    prefill(N)+decode(1) == prefill(N+1) past the window, run in build's verify in tests/test_hf_init_amd.py.)"""
    ckpt = write_checkpoint(TINY_CONFIGS[family], tmp_path / "ckpt", seed=11)
    folder, m = open_artifact(export_artifact(ckpt, tmp_path / f"{family}.kvx", max_seq=AMD_MAX_SEQ, ring=True))
    ring = RingSpec.of(m)
    cfg = m.config
    sliding = [i for i in range(cfg.num_hidden_layers) if cfg.window_of(i) is not None]
    assert ring is not None and sorted(ring.layers) == sliding and not ring.every_layer
    program = lowering.export_program(decoder_from_ir(folder, m), max_batch=AMD_MAX_BATCH, dtype=torch.float32,
                                      device="cpu")
    engine = Engine(folder, m, _session(program, m))
    assert engine.session.limit == AMD_MAX_SEQ  # its global layers bound a request
    window = cfg.sliding_window
    prompt = [int(t) for t in np.random.default_rng(8).integers(3, 259, 12)]
    _, worst, held = generate_past_window(engine, ckpt, prompt, 4 * window)  # 76 slots of max_seq's 80
    assert worst < 1e-4
    full = ring_bytes(cfg, RingSpec(window, frozenset(), cfg.num_hidden_layers, AMD_MAX_SEQ), 1, AMD_MAX_SEQ)
    assert held == ring_bytes(cfg, ring, 1, AMD_MAX_SEQ) < full
    print(f"\n{family}: amd session cache {held:,} bytes with rings, {full:,} every layer full length "
          f"(max_seq {AMD_MAX_SEQ}, max |dlogit| {worst:.2e})")
