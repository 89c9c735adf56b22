"""Every registered family lowers for TensorRT, and its packaged fp16 graph verifies (ONNX Runtime)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvexport.artifact import export_artifact, finish, open_artifact
from kvexport.backends import BuildOptions
from kvexport.manifest import read
from kvexport.zoo import TINY_CONFIGS, write_checkpoint
from kvexport_nvidia.backend import ENGINE_DIR, PREPARED, NvidiaBackend

from nvidia_ort_twin import OrtTwinSession


# A top-k router's choice is discrete: where the fp32 reference's k-th and (k+1)-th expert probabilities nearly tie,
# any fp16 graph may pick the other expert (measured on the tiny qwen3_moe at seed 5: 0.25225 / 0.25231 became
# 0.25243 / 0.25229 through the fp16 residual stream, KL 0.015 at that position, with the router in fp32 or fp16).
# So each MoE family's checkpoint here is one whose reference routing has no near tie on the verify text, and
# the test checks that premise: the smallest top-k margin must be 3x the tie that flipped (5e-5).
# Smallest margins measured: qwen3_moe seed 5 5.1e-5 (flips), seed 7 (tests/conftest.py's seed) 3.2e-4; mixtral
# seed 5 1.7e-4 (verifies), seed 7 2.3e-5.
SEEDS = {"qwen3_moe": 7}
MIN_ROUTER_MARGIN = 1.5e-4


def router_margin(ckpt: Path, max_seq: int) -> float:
    """Smallest gap between the k-th and (k+1)-th expert probability of transformers' fp32 routers over the built-in
    text, in the windows of `max_seq` tokens that verify feeds (kvexport.verify.teacher_forced)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvexport.verify import BUILTIN_TEXT, TEXT_POSITIONS

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    k = model.config.num_experts_per_tok
    ids = AutoTokenizer.from_pretrained(ckpt)(BUILTIN_TEXT)["input_ids"]
    margin = 1.0
    for start in range(0, min(len(ids), 2 * TEXT_POSITIONS), max_seq):
        with torch.no_grad():
            out = model(torch.tensor([ids[start:start + max_seq]]), output_router_logits=True)
        for logits in out.router_logits:
            p = torch.softmax(logits.float(), -1).sort(-1, descending=True).values
            margin = min(margin, float((p[:, k - 1] - p[:, k]).min()))
    return margin


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(set(TINY_CONFIGS) - {"llama"}))  # llama: test_nvidia_backend
def test_family_lowers_and_verifies(family: str, tmp_path: Path) -> None:
    from kvexport.runtime.engine import Engine
    from kvexport.verify import verify_engine

    ckpt = write_checkpoint(TINY_CONFIGS[family], tmp_path / family, seed=SEEDS.get(family, 5))
    if TINY_CONFIGS[family].get("num_experts_per_tok"):
        assert router_margin(ckpt, 64) > MIN_ROUTER_MARGIN, "a near tie in the reference routing: pick another seed"
    folder = export_artifact(ckpt, tmp_path / f"{family}.kvx", max_seq=64)
    m = read(folder)
    NvidiaBackend().build(folder, m, BuildOptions(max_batch=2, extra={"defer": True}), lambda _m: None)
    finish(folder, m)
    folder, m = open_artifact(folder)
    report = verify_engine(Engine(folder, m, OrtTwinSession(folder / ENGINE_DIR / PREPARED, m)), ckpt, decode_steps=8)
    assert report.passed, (family, report.failures)
