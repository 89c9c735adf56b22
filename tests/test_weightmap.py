"""Weight-map transforms: each `save` is the inverse of its `load` (the zoo writes test checkpoints with it)."""
from __future__ import annotations

import pytest
import torch

from kvexport.architectures import ARCHITECTURES, map_config
from kvexport.weightmap import (EXPERT_DOWN, EXPERT_GATE_UP, GATE_UP, QKV, TRANSPOSE, DeinterleaveHeads, Offset,
                                Transform, expand_experts)
from kvexport.zoo import TINY_CONFIGS

CFG = map_config(TINY_CONFIGS["llama"])  # 4 query heads, 2 kv heads, head_dim 16


@pytest.mark.parametrize("transform,shape", [
    (QKV, (CFG.q_size + 2 * CFG.kv_size, CFG.hidden_size)),
    (GATE_UP, (2 * CFG.intermediate_size, CFG.hidden_size)),
    (TRANSPOSE, (CFG.hidden_size, 3 * CFG.hidden_size)),
    (Offset(1.0), (CFG.hidden_size,)),
    (DeinterleaveHeads(), (3 * CFG.q_size, CFG.hidden_size)),
    (DeinterleaveHeads(), (3 * CFG.q_size,)),
    (EXPERT_GATE_UP, (4, CFG.hidden_size, 2 * 24)),  # 4 experts of width 24
    (EXPERT_DOWN, (4, 24, CFG.hidden_size)),
], ids=["concat-qkv", "concat-gate-up", "transpose", "offset", "deinterleave-weight", "deinterleave-bias",
        "experts-gate-up", "experts-down"])
def test_save_inverts_load_and_moves_values(transform: Transform, shape: tuple[int, ...]) -> None:
    t = torch.randint(-64, 64, shape) / 16.0  # exact in float32, so the offset round trip is exact too
    parts = transform.save(t, CFG)
    assert torch.equal(transform.load(parts, CFG), t)
    assert len(parts) > 1 or not torch.equal(parts[0], t)  # not the identity: a wrong inverse would show


def test_expert_tensors_stack_expert_major_as_matmul_operands() -> None:
    cfg = map_config(TINY_CONFIGS["mixtral"])
    names = expand_experts(("e{e}.w1", "e{e}.w3"), cfg)
    assert names[:4] == ("e0.w1", "e0.w3", "e1.w1", "e1.w3") and len(names) == 2 * cfg.num_experts
    w1 = [torch.full((3, 5), float(e)) for e in range(cfg.num_experts)]  # nn.Linear (out 3, in 5) per expert
    w3 = [torch.full((3, 5), 10.0 + e) for e in range(cfg.num_experts)]
    stacked = EXPERT_GATE_UP.load([t for pair in zip(w1, w3) for t in pair], cfg)  # (E, in, [gate, up])
    assert stacked.shape == (cfg.num_experts, 5, 6)
    assert float(stacked[2, 0, 0]) == 2.0 and float(stacked[2, 0, 5]) == 12.0
    with pytest.raises(ValueError, match="num_experts"):
        expand_experts(("e{e}.w2",), None)


def test_deinterleave_puts_head_h_rows_where_gpt_neox_reads_them() -> None:
    H, D = CFG.num_attention_heads, CFG.head_dim
    stored = torch.arange(3 * H * D, dtype=torch.float32)  # GPT-NeoX rows: head h holds [q_h, k_h, v_h]
    canonical = DeinterleaveHeads().load([stored], CFG)
    q, k, v = canonical.split(H * D)
    view = stored.view(H, 3, D)  # how GPT-NeoX's attention splits its projection
    assert torch.equal(q.view(H, D), view[:, 0]) and torch.equal(k.view(H, D), view[:, 1])
    assert torch.equal(v.view(H, D), view[:, 2])


def test_every_family_maps_every_decoder_parameter() -> None:
    from kvexport.decoder import Decoder

    for family, spec in ARCHITECTURES.items():
        cfg = map_config(TINY_CONFIGS[family])
        with torch.device("meta"):
            dec = Decoder(cfg, max_seq=1)
        for name, _ in dec.named_parameters():
            assert spec.weights.source(name, cfg).names, (family, name)
