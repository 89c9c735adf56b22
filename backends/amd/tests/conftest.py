"""amd fixtures: tiny seeded checkpoints and one CPU-compiled amd artifact per family (built once, lazily)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvexport.zoo import TINY_CONFIGS, write_checkpoint

AMD_FAMILIES = sorted(TINY_CONFIGS)  # every registered family
# Families whose AOTInductor package is also compiled here from seeded weights (1 to 2.5 minutes each
# on 2 cores): one per mechanism the compiled code must get right (learned positions and LayerNorm,
# llama3 RoPE, sliding window, biases and tied embeddings). Every family's package is compiled and
# verified once, from transformers' init, in tests/test_hf_init.py; every family runs the exported
# program through AotiSession against transformers in test_amd_families.py.
AMD_COMPILED_FAMILIES = ("gpt2", "llama", "mistral", "qwen2")
AMD_MAX_SEQ = 80  # room for verify's 33-token prompt + 32 decode steps
AMD_MAX_BATCH = 4
# The family built through `python -m kvexport build` as a user runs it, not build(): one compile serves
# the test of what the command prints and the tests of its artifact (a minute less than two builds); they
# are one file (test_amd_build.py), so that pytest-xdist (--dist loadfile) compiles them on one worker.
CLI_FAMILY = "llama"


class _LazyBuilds(dict):
    """family -> artifact folder, compiled (AOTInductor, CPU, fp32) and verified on first use."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root
        self.ckpts: dict[str, Path] = {}
        self.seconds: dict[str, float] = {}
        self.cli: subprocess.CompletedProcess[str] | None = None  # CLI_FAMILY's build command
        self.cli_logs = root / "cli-logs"

    def checkpoint(self, family: str) -> Path:
        if family not in self.ckpts:
            self.ckpts[family] = write_checkpoint(TINY_CONFIGS[family], self.root / f"ckpt-{family}", seed=11)
        return self.ckpts[family]

    def __missing__(self, family: str) -> Path:
        from kvexport.backends import BuildOptions
        from kvexport.build import build

        t0 = time.perf_counter()
        path = self.root / f"{family}-amd.kvx"
        if family == CLI_FAMILY:  # the same options and verify as build() below, from the command line
            env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
            env["KVEXPORT_LOG_DIR"] = str(self.cli_logs)
            self.cli = subprocess.run(
                [sys.executable, "-m", "kvexport", "build", str(self.checkpoint(family)), "--target", "amd",
                 "--max-seq", str(AMD_MAX_SEQ), "--max-batch", str(AMD_MAX_BATCH), "--threads", "2", "-o", str(path)],
                capture_output=True, text=True, timeout=1200, env=env)
            assert self.cli.returncode == 0, self.cli.stderr
        else:
            build(self.checkpoint(family), path, target="amd", max_seq=AMD_MAX_SEQ,
                  options=BuildOptions(max_batch=AMD_MAX_BATCH, threads=2), verify=True)
        self.seconds[family] = time.perf_counter() - t0
        self[family] = path
        return path


@pytest.fixture(scope="session")
def amd_builds(tmp_path_factory: pytest.TempPathFactory) -> _LazyBuilds:
    return _LazyBuilds(tmp_path_factory.mktemp("amd"))


def batch_greedy(engine, prompts: list[list[int]], steps: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Greedy tokens per row, decoding the prompts together as one left-padded batch."""
    batch = engine.prefill(prompts, steps)
    together: list[list[int]] = [[] for _ in prompts]
    logits = batch.logits
    for _ in range(steps):
        tok = logits.argmax(-1)
        for b in range(len(prompts)):
            together[b].append(int(tok[b]))
        logits = engine.decode(batch, tok)
    engine.session.release(batch.state)
    return together


def engine_greedy(engine, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:  # type: ignore[no-untyped-def]
    """Greedy tokens of one row and the (steps, V) logits that chose them."""
    batch = engine.prefill(prompt, steps)
    logits, tokens = [batch.logits[0].copy()], []
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits.append(engine.decode(batch, np.array([tokens[-1]]))[0].copy())
    engine.session.release(batch.state)
    return tokens, np.stack(logits[:-1])
