"""Weight-map transforms: each `save` is the inverse of its `load` (the zoo writes test checkpoints with it)."""
from __future__ import annotations

import pytest
import torch

from kvexport.architectures import ARCHITECTURES, map_config
from kvexport.weightmap import GATE_UP, QKV, TRANSPOSE, DeinterleaveHeads, Offset, Transform
from kvexport.zoo import TINY_CONFIGS

CFG = map_config(TINY_CONFIGS["llama"])  # 4 query heads, 2 kv heads, head_dim 16


@pytest.mark.parametrize("transform,shape", [
    (QKV, (CFG.q_size + 2 * CFG.kv_size, CFG.hidden_size)),
    (GATE_UP, (2 * CFG.intermediate_size, CFG.hidden_size)),
    (TRANSPOSE, (CFG.hidden_size, 3 * CFG.hidden_size)),
    (Offset(1.0), (CFG.hidden_size,)),
    (DeinterleaveHeads(), (3 * CFG.q_size, CFG.hidden_size)),
    (DeinterleaveHeads(), (3 * CFG.q_size,)),
], ids=["concat-qkv", "concat-gate-up", "transpose", "offset", "deinterleave-weight", "deinterleave-bias"])
def test_save_inverts_load_and_moves_values(transform: Transform, shape: tuple[int, ...]) -> None:
    t = torch.randint(-64, 64, shape) / 16.0  # exact in float32, so the offset round trip is exact too
    parts = transform.save(t, CFG)
    assert torch.equal(transform.load(parts, CFG), t)
    assert len(parts) > 1 or not torch.equal(parts[0], t)  # not the identity: a wrong inverse would show


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
            assert spec.weights.source(name).names, (family, name)
