"""Every family not compiled from seeded weights in test_amd_build.py through the amd CPU pipeline up to
its compiled library, against transformers.

The amd build is: the owned decoder rebuilt from the artifact's IR, traced with the in-place cache
strategy by torch.export (`lowering.export_program`), compiled by AOTInductor, run by AotiSession.
Compiling takes one to two and a half minutes per family on 2 cores, so this check runs the
exported program itself in AotiSession (the runtime, cache ownership and masks of the real one);
each family's AOTInductor compile is built and verified once, from transformers' own init, in
tests/test_hf_init.py.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvexport.artifact import open_artifact
from kvexport.export import decoder_from_ir
from kvexport.runtime.engine import Engine
from kvexport.testing import family_ir, greedy_against_reference
from kvexport.verify import cache_checks
from kvexport_amd import lowering
from kvexport_amd.session import AotiSession

from conftest import AMD_COMPILED_FAMILIES, AMD_FAMILIES, AMD_MAX_BATCH, AMD_MAX_SEQ

STEPS = 64


class ExportedRunner:
    """The AOTInductor runner's call (`boxed_run`) over the exported program it would be compiled from."""

    def __init__(self, program: torch.export.ExportedProgram):
        self.module = program.module()

    def boxed_run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            return [self.module(*inputs)]  # the caches (inputs[4:]) are written in place, as the package does


@pytest.fixture(scope="module")
def exported_engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Engine]]:
    class _Lazy(dict):
        def __missing__(self, family: str) -> tuple[Path, Engine]:
            # the checkpoint and IR test_nvidia_families.py lowers too, exported once per run
            ckpt, ir = family_ir(tmp_path_factory, family, AMD_MAX_SEQ)
            folder, m = open_artifact(ir)
            program = lowering.export_program(decoder_from_ir(folder, m), max_batch=AMD_MAX_BATCH,
                                              dtype=torch.float32, device="cpu")
            cfg = m.config
            session = AotiSession(ExportedRunner(program), device="cpu", dtype=torch.float32,
                                  num_layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                                  head_dim=cfg.head_dim, max_seq=m.max_seq, vocab_size=cfg.vocab_size,
                                  max_batch=AMD_MAX_BATCH, use_graph=False, facts={"backend": "amd"})
            self[family] = (ckpt, Engine(folder, m, session))
            return self[family]

    return _Lazy()  # type: ignore[return-value]


@pytest.mark.parametrize("family", [f for f in AMD_FAMILIES if f not in AMD_COMPILED_FAMILIES])
def test_greedy_64_steps_and_cache_checks_match_transformers(family: str, exported_engines: dict) -> None:
    ckpt, engine = exported_engines[family]
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 259, 9)]
    tokens, ref_tokens, stats = greedy_against_reference(engine, ckpt, prompt, STEPS)
    assert ref_tokens == tokens  # transformers picks the same token at every one of the 64 steps
    assert stats["max_abs_logit"] < 1e-4, stats
    checks = cache_checks(engine, np.random.default_rng(0), lambda _m: None)
    # prefill(N)+decode(1) == prefill(N+1); a left-padded batch of 3 equals its rows alone
    assert checks["prefill_decode_max_abs"] < 1e-4 and checks["batch_independence_max_abs"] < 1e-4, checks
