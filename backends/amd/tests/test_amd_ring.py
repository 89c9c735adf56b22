"""The amd lowering with ring caches: the in-place strategy's modular index write into a W-slot ring, traced by
torch.export (`lowering.export_program`) and run by AotiSession through the exported program (as
test_amd_families.py does). The tiny mistral slides in every layer (window 24): it generates past max_seq
against transformers. The AOTInductor package compiled from this program gave the rows of a batch after the
first other logits than alone (cache_checks' batch independence 4.94, row 0 exact; the same with the rings'
mask split so that no input dim is derived), so `kvexport build --target amd` keeps full-length caches
(Capabilities.ring_cache False) and this lowering is not what it builds yet."""
from __future__ import annotations

import numpy as np
import torch

from kvexport.artifact import export_artifact, open_artifact
from kvexport.export import decoder_from_ir
from kvexport.runtime.engine import Engine
from kvexport.runtime.ring import RingSpec
from kvexport.verify import Reference, cache_checks, compare
from kvexport.zoo import TINY_CONFIGS, write_checkpoint
from kvexport_amd import lowering
from kvexport_amd.session import AotiSession

from conftest import AMD_MAX_BATCH, AMD_MAX_SEQ
from test_amd_families import ExportedRunner

W = TINY_CONFIGS["mistral"]["sliding_window"]


def test_ring_caches_generate_past_max_seq_token_identical(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ckpt = write_checkpoint(TINY_CONFIGS["mistral"], tmp_path / "ckpt", seed=11)
    folder, m = open_artifact(export_artifact(ckpt, tmp_path / "mistral.kvx", max_seq=AMD_MAX_SEQ, ring=True))
    ring = RingSpec.of(m)
    assert ring is not None and ring.every_layer and ring.window == W
    program = lowering.export_program(decoder_from_ir(folder, m), max_batch=AMD_MAX_BATCH, dtype=torch.float32,
                                      device="cpu")
    cfg = m.config
    session = AotiSession(ExportedRunner(program), device="cpu", dtype=torch.float32,
                          num_layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                          max_seq=m.max_seq, vocab_size=cfg.vocab_size, max_batch=AMD_MAX_BATCH, use_graph=False,
                          facts={"backend": "amd"}, ring=ring)
    engine = Engine(folder, m, session)
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 259, 30)]  # > W: prefilled in two pieces
    n = 4 * W + 4  # 130 slots: past max_seq (80)
    batch = engine.prefill(prompt, n)
    state = batch.state
    ptrs = [c.data_ptr() for c in state.caches]
    logits, tokens = [batch.logits[0].copy()], [int(batch.logits[0].argmax())]
    for _ in range(n - 1):
        logits.append(engine.decode(batch, np.array([tokens[-1]]))[0].copy())
        tokens.append(int(logits[-1].argmax()))
    # one W-slot ring per layer and kind, written in place (the same tensors throughout)
    assert session.cache_bytes(state) == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * W * cfg.head_dim * 4
    assert [c.data_ptr() for c in state.caches] == ptrs
    session.release(state)
    ref = Reference(ckpt, engine.max_seq).logits(prompt + tokens[:-1])[len(prompt) - 1:]
    assert list(ref.argmax(-1)) == tokens
    assert compare(ref, np.stack(logits))["max_abs_logit"] < 1e-4
    checks = cache_checks(engine, np.random.default_rng(0), lambda _m: None)  # prefills up to 49 > W
    assert checks["prefill_decode_max_abs"] < 1e-4 and checks["batch_independence_max_abs"] < 1e-4, checks

