"""The owned decoder (from the artifact's IR weights) -> torch.export -> an AOTInductor package (.pt2)."""
from __future__ import annotations

import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from kvexport.decoder import IN_PLACE
from kvexport.errors import ArtifactError, CheckpointError
from kvexport.manifest import Manifest

MODEL_NAME = "model"  # the name aoti_compile_and_package gives the one model in the package
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# Entries of a .pt2 that torch's Python loader would unpickle (torch.load) or deserialize into an
# ExportedProgram. The package this backend writes holds only the compiled library (weights inside
# the .so: aot_inductor.package_constants_in_so), its C++ source and JSON metadata; anything else
# is refused before the native loader sees the file.
_FORBIDDEN_DIRS = ("data/weights/", "data/constants/", "data/sample_inputs/", "models/")
_FORBIDDEN_SUFFIXES = (".pkl", ".pt", ".pth", ".bin", ".pickle")


# --- weights (from the IR: kvexport.export.decoder_from_ir) ------------------------------------
def decoder_from_checkpoint(model_dir: Path, manifest: Manifest) -> nn.Module:
    """The same decoder read from the source checkpoint; its files must be the ones the IR came from."""
    from kvexport.checkpoint import load_checkpoint

    ck = load_checkpoint(model_dir, manifest.max_seq, torch.float32,
                         last_token_only=bool(manifest.raw["ir"]["last_token_only"]),
                         ring=bool(manifest.cache.get("ring")))  # the IR's rings, which the session allocates
    expected = manifest.raw["model"]["source_files"]
    if expected and ck.source_hashes != expected:
        raise CheckpointError(f"{model_dir} is not the checkpoint this artifact was exported from (its files' "
                              "sha256 differ from manifest.model.source_files); pass the right folder or drop "
                              "--option model_dir to build from the artifact's own IR")
    return ck.decoder


class LogitsOnly(nn.Module):
    """forward(input_ids, position_ids, write_index, attention_mask, *past) -> float32 logits.

    With ring caches the decoder's inputs after write_index are its masks (attention_mask, absent where every
    layer is a ring, then the rings' mask) and the caches: they pass through in that order.

    The caches are updated in place, so the presents the decoder returns (the same tensors) are
    dropped: an output aliasing an input would make AOTInductor copy it.
    """

    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids: Tensor, position_ids: Tensor, write_index: Tensor, attention_mask: Tensor,
                *past: Tensor) -> Tensor:
        return self.decoder(input_ids, position_ids, write_index, attention_mask, *past)[0].float()


# --- export and compile ---------------------------------------------------------------------
def example_inputs(decoder: nn.Module, batch: int, seq: int, cache_len: int, dtype: torch.dtype,
                   device: str) -> tuple[Tensor, ...]:
    cfg = decoder.cfg
    rings, W = set(decoder.ring_layers), decoder.ring_window
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    pos = torch.arange(seq, device=device)[None].expand(batch, seq).contiguous()
    masks = [torch.ones(batch, 1, seq, n, dtype=torch.bool, device=device)
             for n, has in ((cache_len, len(rings) < cfg.num_hidden_layers), ((W or 0) + seq, bool(rings))) if has]
    caches = [torch.zeros(decoder.cache_shape(batch, W if k // 2 in rings else cache_len), dtype=dtype, device=device)
              for k in range(2 * cfg.num_hidden_layers)]  # a sliding layer's ring: W slots, static as the rest
    return (ids, pos, torch.zeros(batch, dtype=torch.long, device=device), *masks, *caches)


def export_program(decoder: nn.Module, *, max_batch: int, dtype: torch.dtype, device: str,
                   transform: Callable[[nn.Module], None] | None = None) -> torch.export.ExportedProgram:
    """torch.export with dynamic batch and seq; cache_len static at max_seq (graph capture needs it).
    transform (quant.quantize_linears) runs after the cast to dtype, so that it keeps its own dtypes."""
    cache_len = decoder.max_seq
    decoder = decoder.to(device=device, dtype=dtype)  # rope tables follow: apply_rope keeps the model dtype
    if transform is not None:
        transform(decoder)
    Dim = torch.export.Dim
    # batch 2 and seq 3 as examples so neither is specialised to 1; a limit of 1 keeps it static
    batch = Dim("batch", min=1, max=max_batch) if max_batch > 1 else None
    seq = Dim("seq", min=1, max=cache_len) if cache_len > 1 else None
    args = example_inputs(decoder, 2 if batch else 1, 3 if seq else 1, cache_len, dtype, device)
    row = {0: batch} if batch else {}
    n_masks = len(args) - 3 - 2 * decoder.cfg.num_hidden_layers
    masks = [{**row, **({2: seq} if seq else {})}] * n_masks  # attention_mask (B, 1, S, cache_len)
    if decoder.ring_layers:  # the rings' mask (B, 1, S, W + S)
        masks[-1] = {**row, **({2: seq, 3: seq + decoder.ring_window} if seq else {})}
    dynamic = (
        {**row, **({1: seq} if seq else {})},  # input_ids (B, S)
        {**row, **({1: seq} if seq else {})},  # position_ids (B, S)
        dict(row),  # write_index (B,)
        masks[0],
        (*masks[1:], *(dict(row) for _ in args[3 + n_masks:])),  # past (B, H_kv, cache_len or W, D)
    )
    # cache writes become index_put on the inputs: kept in place by Inductor
    with torch.no_grad(), decoder.configured(kv=IN_PLACE):
        return torch.export.export(LogitsOnly(decoder), args, dynamic_shapes=dynamic, strict=False)


def compile_package(program: torch.export.ExportedProgram, path: Path, *, threads: int | None) -> Path:
    """AOTInductor: C++ (CPU) or Triton (GPU) kernels plus a wrapper, compiled into one .pt2."""
    configs: dict[str, Any] = {"aot_inductor.package_constants_in_so": True}  # no pickled weights file
    if threads:
        configs["cpp.threads"] = int(threads)  # CPU kernels bake their OpenMP thread count in
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    out = torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=configs)
    return Path(out)


def inspect_package(path: Path) -> list[str]:
    """Members of a .pt2, after refusing any that torch would unpickle; it must hold the model's library."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError) as e:
        raise ArtifactError(f"{path} is not an AOTInductor package ({e}); rebuild with `kvexport build --target amd`") from e
    bad = [n for n in names
           if any(f"/{d}" in f"/{n}" for d in _FORBIDDEN_DIRS) or n.lower().endswith(_FORBIDDEN_SUFFIXES)]
    if bad:
        raise ArtifactError(f"{path} holds entries that would be unpickled on load ({', '.join(bad[:4])}); "
                            "kvexport loads only packages with the weights inside the compiled library. Rebuild "
                            "it with `kvexport build --target amd`")
    if not any(f"data/aotinductor/{MODEL_NAME}/" in n and n.endswith(".so") for n in names):
        raise ArtifactError(f"{path} has no compiled library for model {MODEL_NAME!r}; rebuild it with "
                            "`kvexport build --target amd`")
    return names
