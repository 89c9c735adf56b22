"""Weight-only int8/int4 linear layers for the amd target: torch's packed matmuls, compiled by AOTInductor.

Every nn.Linear of the owned decoder becomes a PackedLinear whose weights are buffers in the layout
of one ATen kernel, so torch.export records one op per layer and AOTInductor calls that kernel:
- int8: symmetric, one scale per output channel, `aten._weight_int8pack_mm` (CPU and CUDA/ROCm).
- int4: asymmetric per block of `group_size` input channels (scale and zero point, tinygemm's
  convention w = (q - 8) * scale + zero), `aten._weight_int4pack_mm_for_cpu` on the CPU and
  `aten._weight_int4pack_mm` on the GPU, each with its own packing op. The lm_head stays int8 under
  int4 (its logits decide every token; int8 there costs little), as the cpu target does.
The packed kernels take bf16 activations: that is their fast path on the CPU (fp32 activations fall
to a scalar loop) and the only one of the GPU int4 kernel. So the layer computes in bf16 and hands
back the model's dtype; norms, attention and the cache keep the model's dtype. torchao's
`Int8WeightOnlyConfig` was tried first: through torch.export it becomes int8 -> fp32 conversion plus an
fp32 GEMM every call (Inductor rewrites that into the int8 kernel only for bf16 models), and its CPU
int4 layout is not among `Int4WeightOnlyConfig`'s packing formats in torchao 0.18, so the kernels are
called directly here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvexport.errors import InputError

WeightMode = Literal["int8", "int4"]
MODES: tuple[WeightMode, ...] = ("int8", "int4")
COMPUTE = torch.bfloat16  # the packed kernels' activation dtype (see the module docstring)
INT4_GROUPS = (32, 64, 128)  # the block sizes _weight_int4pack_mm takes that --group-size offers
CPU_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu packs rows in 16s
GPU_N_MULTIPLE = 8  # _convert_weight_to_int4pack (CUDA/ROCm) packs rows in 8s


@dataclass
class QuantReport:
    """What quantize_linears did; stored in the manifest's target options."""

    mode: str
    group_size: int | None
    compute: str = "bf16"
    int8_layers: int = 0
    int4_layers: int = 0
    padded_layers: list[str] = field(default_factory=list)  # zero-padded to the kernel's multiples

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _round(t: Tensor) -> Tensor:
    """fp32 values as the kernel will read them (bf16), back in fp32."""
    return t.to(COMPUTE).float()


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """(N, K) fp32 -> int8 (N, K) and one bf16 scale per row: w ~ q * scale."""
    scale = _round((w.abs().amax(dim=1) / 127.0).clamp(min=1e-12))  # (N,)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(COMPUTE)


def quantize_int4(w: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """(N, K) fp32, K a multiple of group_size -> q int32 in [0, 15] (N, K), bf16 scale and zero (N, K/g):
    w ~ (q - 8) * scale + zero, the convention of torch's int4 kernels."""
    N, K = w.shape
    g = w.reshape(N, K // group_size, group_size)  # (N, G, g)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = _round(((hi - lo) / 15.0).clamp(min=1e-8))  # (N, G)
    zero = _round(lo + 8.0 * scale)  # (N, G): the value of q == 8
    q = torch.round((g - zero[..., None]) / scale[..., None] + 8.0).clamp(0, 15).to(torch.int32)
    return q.reshape(N, K), scale.to(COMPUTE), zero.to(COMPUTE)


def dequantize_int4(q: Tensor, scale: Tensor, zero: Tensor, group_size: int) -> Tensor:
    N, K = q.shape
    g = q.reshape(N, K // group_size, group_size).float()
    return ((g - 8.0) * scale.float()[..., None] + zero.float()[..., None]).reshape(N, K)


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W stored int8 (per row) or int4 (per block) in one ATen kernel's layout."""

    def __init__(self, linear: nn.Linear, mode: WeightMode, group_size: int | None, device: str):
        super().__init__()
        w = linear.weight.detach().float().cpu()  # (N, K)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.mode, self.group_size, self.gpu = mode, group_size, device != "cpu"
        self.pad_k = self.pad_n = 0
        if mode == "int8":
            q, scale = quantize_int8(w)
            self.register_buffer("qweight", q.to(device))  # (N, K) int8
            self.register_buffer("scales", scale.to(device))  # (N,) bf16
        else:
            assert group_size is not None
            n_multiple = GPU_N_MULTIPLE if self.gpu else CPU_N_MULTIPLE
            self.pad_k = -self.in_features % group_size
            self.pad_n = -self.out_features % n_multiple
            w = F.pad(w, (0, self.pad_k, 0, self.pad_n))  # zero rows/columns: (N + pad_n, K + pad_k)
            q, scale, zero = quantize_int4(w, group_size)
            self.register_buffer("qweight", _pack_int4(q, device))
            # (K/g, N, 2): scale and zero per block and output channel, as the kernels take them
            self.register_buffer("scales_zeros", torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(device))
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().to(device))

    @property
    def padded(self) -> bool:
        return bool(self.pad_k or self.pad_n)

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        h = x.reshape(-1, self.in_features).to(COMPUTE)  # (M, K)
        if self.mode == "int8":
            y = torch.ops.aten._weight_int8pack_mm(h, self.qweight, self.scales)  # (M, N)
        else:
            if self.pad_k:
                h = F.pad(h, (0, self.pad_k))  # zeros meet the zero-padded weight columns
            if self.gpu:
                y = torch.ops.aten._weight_int4pack_mm(h, self.qweight, self.group_size, self.scales_zeros)
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(h, self.qweight, self.group_size, self.scales_zeros)
            if self.pad_n:
                y = y[:, : self.out_features]
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        block = f", group_size={self.group_size}" if self.mode == "int4" else ""
        return f"{self.in_features} -> {self.out_features}, {self.mode}{block}"


def _pack_int4(q: Tensor, device: str) -> Tensor:
    """q int32 (N, K) in [0, 15] -> the packed weight of the device's int4 kernel."""
    if device == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)  # (N, K/2) uint8
    K = q.shape[1]
    inner_k_tiles = next(t for t in (8, 4, 2) if K % (t * 16) == 0)  # K is a multiple of the group (>= 32)
    pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # (N, K/2): even column in the high nibble
    return torch.ops.aten._convert_weight_to_int4pack(pairs.to(device), inner_k_tiles)


def check_mode(mode: str, group_size: int | None) -> None:
    if mode not in ("int8", "int4"):
        raise InputError(f"the amd target quantizes weights to int8 or int4, not {mode!r}")
    if mode == "int4" and group_size not in INT4_GROUPS:
        raise InputError(f"amd int4 takes --group-size {', '.join(map(str, INT4_GROUPS))}, not {group_size}")


def quantize_linears(model: nn.Module, mode: WeightMode, group_size: int | None, *, device: str) -> QuantReport:
    """Replace every nn.Linear under model with a PackedLinear, in place (lm_head int8 under int4)."""
    check_mode(mode, group_size)
    report = QuantReport(mode=mode, group_size=group_size if mode == "int4" else None)
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        layer_mode: WeightMode = "int8" if (mode == "int8" or name.endswith("lm_head")) else "int4"
        packed = PackedLinear(linear, layer_mode, group_size if layer_mode == "int4" else None, device)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, packed)
        if layer_mode == "int8":
            report.int8_layers += 1
        else:
            report.int4_layers += 1
        if packed.padded:
            report.padded_layers.append(name)
    return report


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and persistent buffer the compiled package holds (scales included);
    non-persistent buffers (the RoPE tables) are computed, not weights."""
    tensors = {id(p): p for p in model.parameters()}
    for m in model.modules():
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                tensors[id(b)] = b
    return sum(t.numel() * t.element_size() for t in tensors.values())
