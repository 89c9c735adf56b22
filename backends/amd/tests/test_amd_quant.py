"""amd int8/int4 weights: torch's packed matmuls against the dequantized weights, the decoder's packed layers,
the CPU-compiled package of the trained default model against its tolerance rows, and the errors."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kvexport.backends import BuildOptions
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


# --- the compiled package of the trained default model (minutes on 2 cores: one build per mode) -------------
QUANT_MAX_SEQ = 256  # verify's teacher-forced windows are min(max_seq, 256) tokens


class _DefaultBuilds(dict):
    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, mode: tuple[str, int | None]) -> Path:
        from kvexport.build import build
        from kvexport.zoo import write_named

        ckpt = self.root / "default"
        if not ckpt.exists():
            write_named("default", ckpt)
        weights, group = mode
        path = build(ckpt, self.root / f"default-{weights}-{group}.kvx", target="amd", max_seq=QUANT_MAX_SEQ,
                     options=BuildOptions(weights=weights, group_size=group, max_batch=2, threads=2), verify=True)
        self[mode] = path
        return path


@pytest.fixture(scope="module")
def default_builds(tmp_path_factory: pytest.TempPathFactory) -> _DefaultBuilds:
    return _DefaultBuilds(tmp_path_factory.mktemp("amd-quant"))


@pytest.mark.slow
@pytest.mark.parametrize("weights,group,key", [("int8", None, "int8"), ("int4", 32, "int4-g32")])
def test_default_model_package_passes_its_row(default_builds, weights: str, group: int | None, key: str) -> None:  # type: ignore[no-untyped-def]
    """kvexport.build compiles the trained default model with packed int8/int4 weights and its own verify
    passes the (amd, mode) teacher-forced row; the package calls the packed kernel and records its bytes."""
    import json
    import zipfile

    import kvexport

    folder = default_builds[(weights, group)]
    engine = kvexport.load(folder, threads=2)
    t = engine.manifest.target
    v = engine.manifest.raw["verification"]
    assert v["passed"] is True and v["mode"] == "teacher-forced"
    assert t["weights"]["dtype"] == weights and t["weights"]["group_size"] == group
    assert t["options"]["model_dtype"] == "fp32" and t["options"]["quantization"]["compute"] == "bf16"
    assert t["weights"]["bytes"] < (0.4 if weights == "int8" else 0.3) * 4 * engine.manifest.raw["model"]["num_parameters"]
    report = json.loads((folder / "verify.json").read_text())
    assert (report["backend"], report["precision"]) == ("amd", key)
    assert report["text"]["ppl_change"] < (0.01 if weights == "int8" else 0.08)  # the bars
    with zipfile.ZipFile(folder / "engine/model.pt2") as z:
        wrapper = "".join(z.read(n).decode(errors="replace") for n in z.namelist() if n.endswith("wrapper.cpp"))
    calls = {kind: wrapper.count(f"aoti_torch_cpu__weight_{kind}pack_mm") for kind in ("int8", "int4")}
    # the compiled library calls the packed kernels, one per linear layer (the lm_head int8 under int4)
    assert calls == ({"int8": 17, "int4": 0} if weights == "int8" else {"int8": 1, "int4": 16})
    out = engine.generate("def ", max_new_tokens=8)
    assert len(out.token_ids) == 8 and out.text  # type: ignore[union-attr]


def test_int8_with_a_block_size_is_refused_before_export(tmp_path: Path) -> None:
    from kvexport.build import build
    from kvexport.zoo import DEFAULT_MODEL_DIR

    with pytest.raises(InputError, match="per output channel"):
        build(DEFAULT_MODEL_DIR, tmp_path / "x.kvx", target="amd", max_seq=64, verify=False,
              options=BuildOptions(weights="int8", group_size=64))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("weights", "kv"), [("fp16", "bf16"), ("fp32", "fp16"), ("bf16", "fp32")])
def test_float_weights_with_a_cache_in_another_float_type_are_refused_before_export(
        tmp_path: Path, weights: str, kv: str) -> None:
    """The compiled graph has one float type: --weights fp16 --kv bf16 once built an fp16 cache and recorded
    bf16 in the manifest."""
    from kvexport.build import build
    from kvexport.zoo import DEFAULT_MODEL_DIR

    with pytest.raises(InputError, match=f"keeps its cache in {weights}, not --kv {kv}"):
        build(DEFAULT_MODEL_DIR, tmp_path / "x.kvx", target="amd", max_seq=64, verify=False,
              options=BuildOptions(weights=weights, kv=kv))
    assert not list(tmp_path.iterdir())
