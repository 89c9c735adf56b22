"""Tracing the owned decoder into the ONNX IR (opset 24) with the KV cache as named inputs/outputs."""
from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch

from kvexport.checkpoint import Checkpoint
from kvexport.decoder import CacheStyle, Decoder

OPSET = 24
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"

# Symbolic dim names: part of the IR contract (docs/ir.md).
BATCH, SEQ, CACHE_LEN, PAST_SEQ, TOTAL_SEQ = "batch", "seq", "cache_len", "past_seq", "total_seq"


def cache_names(num_layers: int, prefix: str) -> list[str]:
    """past_key_values.{i}.key / .value (prefix="past_key_values") or present.{i}.key / .value."""
    return [f"{prefix}.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]


def input_names(num_layers: int, style: CacheStyle) -> list[str]:
    head = ["input_ids", "position_ids"] + (["write_index"] if style == "static" else []) + ["attention_mask"]
    return head + cache_names(num_layers, "past_key_values")


def output_names(num_layers: int) -> list[str]:
    return ["logits", *cache_names(num_layers, "present")]


@dataclass(frozen=True)
class IOSpec:
    name: str
    dtype: str  # numpy-style name: int64, bool, float32, float16, bfloat16
    shape: tuple[int | str, ...]

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


def io_specs(dec: Decoder, style: CacheStyle, dtype: str) -> tuple[list[IOSpec], list[IOSpec]]:
    cfg = dec.cfg
    Hkv, D, L = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    past_len = CACHE_LEN if style == "static" else PAST_SEQ
    present_len = CACHE_LEN if style == "static" else TOTAL_SEQ
    mask_len = CACHE_LEN if style == "static" else TOTAL_SEQ
    ins = [IOSpec("input_ids", "int64", (BATCH, SEQ)), IOSpec("position_ids", "int64", (BATCH, SEQ))]
    if style == "static":
        ins.append(IOSpec("write_index", "int64", (BATCH,)))
    ins.append(IOSpec("attention_mask", "bool", (BATCH, 1, SEQ, mask_len)))
    ins += [IOSpec(n, dtype, (BATCH, Hkv, past_len, D)) for n in cache_names(L, "past_key_values")]
    outs = [IOSpec("logits", "float32" if dtype == "float32" else dtype, (BATCH, 1 if dec.last_token_only else SEQ, cfg.vocab_size))]
    outs += [IOSpec(n, dtype, (BATCH, Hkv, present_len, D)) for n in cache_names(L, "present")]
    return ins, outs


def _example_inputs(dec: Decoder, style: CacheStyle, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    B, S, P = 2, 3, 13  # distinct sizes so no dim is specialised by coincidence
    L = P if style == "concat" else 16
    total = P + S if style == "concat" else L
    ids = torch.zeros(B, S, dtype=torch.long)
    pos = torch.arange(S)[None].expand(B, S).contiguous()
    mask = torch.ones(B, 1, S, total, dtype=torch.bool)
    caches = [torch.zeros(dec.cache_shape(B, L), dtype=dtype) for _ in range(2 * dec.cfg.num_hidden_layers)]
    if style == "static":
        return (ids, pos, torch.zeros(B, dtype=torch.long), mask, *caches)
    return (ids, pos, mask, *caches)


def _dynamic_shapes(dec: Decoder, style: CacheStyle) -> tuple:
    """Shaped like forward(input_ids, position_ids, *rest): the varargs form one nested tuple."""
    Dim = torch.export.Dim
    batch, seq = Dim(BATCH, min=1, max=1024), Dim(SEQ, min=1, max=dec.max_seq)
    nc = 2 * dec.cfg.num_hidden_layers
    if style == "static":
        cache_len = Dim(CACHE_LEN, min=1, max=dec.max_seq)
        cache = {0: batch, 2: cache_len}
        return ({0: batch, 1: seq}, {0: batch, 1: seq}, ({0: batch}, {0: batch, 2: seq, 3: cache_len}, *[cache] * nc))
    past, total = Dim(PAST_SEQ, min=0, max=dec.max_seq), Dim(TOTAL_SEQ, min=1, max=dec.max_seq)
    cache = {0: batch, 2: past}
    return ({0: batch, 1: seq}, {0: batch, 1: seq}, ({0: batch, 2: seq, 3: total}, *[cache] * nc))


def _tensor_scatter_onnx(cache, update, write_index):  # type: ignore[no-untyped-def]
    from onnxscript.values import Opset

    return Opset("", OPSET).TensorScatter(cache, update, write_index, axis=-2, mode="linear")


def export_onnx(
    ck: Checkpoint,
    out_dir: str | Path,
    *,
    cache_style: CacheStyle = "static",
    last_token_only: bool = True,
    dtype: torch.dtype = torch.float32,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Trace `ck.decoder` with torch.onnx (dynamo) and write model.onnx + model.onnx.data."""
    say = progress or (lambda _m: None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dec = ck.decoder.to(dtype)
    dec.onnx_ops, dec.cache_style, dec.last_token_only = True, cache_style, last_token_only
    L = ck.config.num_hidden_layers
    t0 = time.perf_counter()
    say(f"tracing {ck.config.model_type} ({ck.config.num_parameters() / 1e6:.1f}M params, {cache_style} cache)")
    with warnings.catch_warnings(), _quiet_exporter():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            dec,
            _example_inputs(dec, cache_style, dtype),
            dynamo=True,
            opset_version=OPSET,
            input_names=input_names(L, cache_style),
            output_names=output_names(L),
            dynamic_shapes=_dynamic_shapes(dec, cache_style),
            custom_translation_table={torch.ops.kvexport.tensor_scatter.default: _tensor_scatter_onnx},
            optimize=True,
            verbose=False,
        )
    say(f"traced in {time.perf_counter() - t0:.1f}s; writing {MODEL_FILE}")
    model = program.model_proto
    finalize_graph(model, ck.config.model_type)
    path = out / MODEL_FILE
    (out / DATA_FILE).unlink(missing_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=DATA_FILE, size_threshold=1024)
    dec.onnx_ops = False
    return path


class _quiet_exporter:
    """torch.onnx prints progress lines and registry warnings; kvexport shows its own progress."""

    def __enter__(self) -> None:
        import contextlib
        import io

        self._loggers = [logging.getLogger(n) for n in ("torch.onnx", "onnxscript", "torch.export")]
        self._levels = [lg.level for lg in self._loggers]
        for lg in self._loggers:
            lg.setLevel(logging.ERROR)
        self._out = contextlib.redirect_stdout(io.StringIO())
        self._out.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._out.__exit__(*exc)
        for lg, lvl in zip(self._loggers, self._levels):
            lg.setLevel(lvl)


def finalize_graph(model: onnx.ModelProto, model_type: str) -> None:
    """Deterministic names: nodes `{module path}/{OpType}_{k}`, exporter-made initializers
    `{module path}/weight_t` (a MatMul's transposed weight) or `{module path}/const_{k}`."""
    model.graph.name = f"kvexport_{model_type}"
    model.producer_name = "kvexport"
    counts: dict[tuple[str, str], int] = {}
    consumer: dict[str, tuple[str, str, int]] = {}
    for node in model.graph.node:
        scope = _scope_of(node)
        key = (scope, node.op_type)
        k = counts.get(key, 0)
        counts[key] = k + 1
        node.name = f"{scope}/{node.op_type}_{k}"
        del node.metadata_props[:]
        for slot, name in enumerate(node.input):
            consumer.setdefault(name, (scope, node.op_type, slot))
    renames: dict[str, str] = {}
    taken = {i.name for i in model.graph.initializer}
    for init in model.graph.initializer:
        if not init.name.startswith("val_") or init.name not in consumer:
            continue
        scope, op, slot = consumer[init.name]
        new = f"{scope}/weight_t" if op == "MatMul" and slot == 1 else f"{scope}/{op}_const{slot}"
        n = 1
        while new in taken:
            new = f"{new.rsplit('~', 1)[0]}~{n}"
            n += 1
        taken.add(new)
        renames[init.name] = new
        init.name = new
    for node in model.graph.node:
        for slot, name in enumerate(node.input):
            if name in renames:
                node.input[slot] = renames[name]


def _scope_of(node: onnx.NodeProto) -> str:
    """`layers.3.attn.qkv_proj` etc. from the exporter's module-path metadata; `model` at the top."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            scopes = [s.strip().strip("'") for s in prop.value.strip("[]").split(",")]
            scopes = [s for s in scopes if s]
            if len(scopes) >= 2 and not scopes[-2].startswith("_"):
                return scopes[-2]
    return "model"
