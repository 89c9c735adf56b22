"""amd int8/int4 weights: torch's packed matmuls against the dequantized weights, the decoder's packed layers,
and the errors."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kvexport.errors import InputError
from kvexport_amd import quant

BF16_EPS = 2.0**-8  # bf16 keeps 8 significant bits: the kernels' output rounding


def _reference(layer: quant.PackedLinear, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x (rounded to bf16, as the kernel reads it) @ the weights the layer holds, dequantized, + bias."""
    w = linear.weight.detach()
    if layer.mode == "int8":
        deq = layer.qweight.float() * layer.scales.float()[:, None]
    else:
        padded = nn.functional.pad(w, (0, layer.pad_k, 0, layer.pad_n))
        deq = quant.dequantize_int4(*quant.quantize_int4(padded, layer.group_size), layer.group_size)  # type: ignore[arg-type]
        deq = deq[: linear.out_features, : linear.in_features]
    return x.to(torch.bfloat16).float() @ deq.T + linear.bias.detach()


@pytest.mark.parametrize("mode,group,n,k", [
    ("int8", None, 259, 256),  # the default model's lm_head: N odd
    ("int4", 32, 384, 256),
    ("int4", 128, 256, 704),  # K not a multiple of 128: zero-padded
    ("int4", 64, 259, 256),  # N not a multiple of 16: zero-padded rows
])
def test_packed_linear_is_the_dequantized_matmul(mode: str, group: int | None, n: int, k: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(k, n)
    layer = quant.PackedLinear(linear, mode, group, "cpu")  # type: ignore[arg-type]
    x = torch.randn(2, 3, k)
    y = layer(x)
    assert y.shape == (2, 3, n) and y.dtype == torch.float32
    ref = _reference(layer, linear, x)
    assert (y - ref).abs().max() <= 2 * BF16_EPS * ref.abs().max()  # the kernel: bf16 in, bf16 out
    err = (y - linear(x)).abs().max()
    assert 0 < err < (0.05 if mode == "int8" else 0.5)  # lossy, and by how much the mode allows
    assert layer.padded == (k % (group or k) != 0 or (mode == "int4" and n % 16 != 0))


def test_int4_quantization_rounds_to_nearest_within_each_block() -> None:
    w = torch.randn(32, 128)
    q, scale, zero = quant.quantize_int4(w, 32)
    assert q.min() >= 0 and q.max() <= 15 and scale.shape == zero.shape == (32, 4)
    err = (quant.dequantize_int4(q, scale, zero, 32) - w).abs().reshape(32, 4, 32).amax(-1)
    assert (err <= scale.float() * 0.5 + 1e-2 * scale.float()).all()  # half a step (+ bf16 rounding of zero)


def test_quantize_linears_packs_every_linear_and_keeps_lm_head_int8() -> None:
    from kvexport.checkpoint import load_checkpoint
    from kvexport.zoo import DEFAULT_MODEL_DIR

    dec = load_checkpoint(DEFAULT_MODEL_DIR, 32, torch.float32).decoder
    fp32_bytes = quant.weight_bytes(dec)
    report = quant.quantize_linears(dec, "int4", 128, device="cpu")
    assert not [m for m in dec.modules() if isinstance(m, nn.Linear)]
    assert (report.int4_layers, report.int8_layers) == (16, 1) and dec.lm_head.mode == "int8"
    assert report.padded_layers == [f"layers.{i}.mlp.down_proj" for i in range(4)]  # K 704 = 5.5 x 128
    assert quant.weight_bytes(dec) < 0.35 * fp32_bytes  # the fp32 embedding stays: 259 x 256


def test_bad_group_sizes_are_input_errors() -> None:
    with pytest.raises(InputError, match="group-size"):
        quant.check_mode("int4", 48)
    with pytest.raises(InputError, match="int8 or int4"):
        quant.check_mode("int2", None)
