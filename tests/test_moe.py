"""Mixture-of-experts layers: MoeMlp's gathered and dense forms, the IR's If between them, and the cpu
engine's lowering of each routed layer to ONNX Runtime's MoE kernel (issue 13)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import kvexport
from kvexport import manifest as mf
from kvexport.architectures import map_config
from kvexport.backends.cpu_fusion import moe_op_model
from kvexport.decoder import MoeMlp
from kvexport.verify import verify_engine
from kvexport.zoo import TINY_CONFIGS

MOE_FAMILIES = ["mixtral", "qwen3_moe"]


def _layer(family: str, seed: int = 0) -> MoeMlp:
    cfg = map_config(TINY_CONFIGS[family])
    torch.manual_seed(seed)
    moe = MoeMlp(cfg).eval().requires_grad_(False)
    for p in moe.parameters():
        p.copy_(torch.randn(p.shape) / p.shape[-2 if p.dim() == 3 else 1] ** 0.5)
    return moe


def _run(moe: MoeMlp, form: MoeMlp.Form, x: torch.Tensor) -> np.ndarray:
    moe.form = form
    try:
        return moe(x).numpy()
    finally:
        moe.form = "auto"


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_gathered_form_equals_the_dense_one(family: str) -> None:
    moe = _layer(family)
    for B, S in ((1, 1), (3, 1), (1, 7), (2, 5)):  # decode (T*k < E), a batch of decodes, prefills
        x = torch.randn(B, S, moe.gate_up.shape[1])
        dense, gathered = _run(moe, "dense", x), _run(moe, "gathered", x)
        assert np.abs(dense).max() > 0.1  # the experts contribute: a zero output would pass trivially
        assert np.abs(gathered - dense).max() < 1e-5, (B, S)
        assert np.abs(_run(moe, "auto", x) - dense).max() < 1e-5, (B, S)


def _outer_names(g: onnx.GraphProto) -> set[str]:
    return {i for n in g.node for i in n.input}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_ir_decode_branch_gathers_only_the_chosen_experts(family: str, artifacts: dict[str, Path]) -> None:
    folder = artifacts[family]
    cfg = mf.read(folder).config
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    routed = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    experts = {t.name for t in model.graph.initializer if t.name.endswith((".mlp.gate_up", ".mlp.down"))}
    ifs = [n for n in model.graph.node if n.op_type == "If"]
    assert len(ifs) == routed and len(experts) == 2 * routed
    top = {n.op_type for n in model.graph.node}
    assert "MatMul" in top and not experts & _outer_names(model.graph)  # no expert weight read outside the If
    for n in ifs:
        branches = {a.name: a.g for a in n.attribute}
        gather = [x for x in branches["then_branch"].node if x.op_type in ("Gather", "GatherND") and x.input[0] in experts]
        assert len(gather) == 2  # gate|up and down of the chosen experts only
        # the dense branch multiplies by the whole expert tensors
        assert {x.input[1] for x in branches["else_branch"].node if x.op_type == "MatMul"} & experts


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_cpu_engine_reads_only_the_chosen_experts_and_matches_transformers(
        family: str, artifacts: dict[str, Path], checkpoints: dict[str, Path]) -> None:
    """mixtral (renormalised top k): each routed layer is one MoE kernel node; the tiny qwen3_moe (not
    renormalised) keeps the IR's If, whose decode branch gathers the chosen experts."""
    folder = artifacts[family]
    m = mf.read(folder)
    cfg = m.config
    routed = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    g = onnx.load(str(folder / "engine" / "model.opt.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in g.node]
    kernel = routed if cfg.norm_topk_prob else 0
    assert m.target is not None and m.target["options"]["fused_moe_layers"] == kernel
    assert ops.count("MoE") == kernel and ops.count("If") == routed - kernel
    report = verify_engine(kvexport.load(str(folder)), checkpoints[family], decode_steps=24,
                           prompt_lengths=(1, 9), text_positions=16)
    assert report.passed, report.failures
    assert report.summary["max_abs_logit"] < 1e-4 and report.summary["greedy_agreement"] == 1.0


def test_moe_kernel_model_equals_the_layer() -> None:
    """The relayout (gate and up rows interleaved, down transposed) and the kernel's routing agree with
    MoeMlp for both renormalisations: mixtral renormalises its top 2, the tiny qwen3_moe does not."""
    for family in MOE_FAMILIES:
        moe = _layer(family, seed=1)
        model = moe_op_model(moe.router.weight.numpy().T, moe.gate_up.numpy(), moe.down.numpy(),
                             top_k=moe.top_k, renormalise=moe.renormalise)
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        x = torch.randn(2, 5, moe.gate_up.shape[1])
        got = sess.run(None, {"x": x.numpy()})[0]
        assert np.abs(got - _run(moe, "dense", x)).max() < 1e-5, family


@pytest.mark.parametrize(("name", "family", "params"), [("bench-moe", "mixtral", 1.104e9),
                                                        ("bench-qwen3-moe", "qwen3_moe", 1.088e9)])
def test_bench_moe_models_are_top_2_of_8_at_about_1_1b(name: str, family: str, params: float) -> None:
    from kvexport.bench import linear_shapes
    from kvexport.zoo import NAMED_MODELS

    c = map_config(NAMED_MODELS[name])
    assert c.model_type == family and (c.num_experts, c.num_experts_per_tok, c.norm_topk_prob) == (8, 2, True)
    assert all(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    assert abs(c.num_parameters() - params) < 1e6
    # a decode step reads the router and 2 of 8 experts per layer: 0.43B / 0.42B of the 1.1B weights
    assert 0.41e9 < sum(k * n for k, n in linear_shapes(c)) < 0.44e9
