"""Tracing the owned decoder into the ONNX IR (opset 24) with the KV cache as named inputs/outputs."""
from __future__ import annotations

import hashlib
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir
import torch
from onnx import numpy_helper

from kvexport.checkpoint import Checkpoint
from kvexport.decoder import CacheStyle, Decoder, kv_step
from kvexport.errors import ArtifactError
from kvexport.manifest import Manifest
from kvexport.runtime.ring import MASK_INPUT, RING_DIM, RING_MASK_DIM

OPSET = 24
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"

# Symbolic dim names: part of the IR contract (docs/ir.md).
BATCH, SEQ, CACHE_LEN, PAST_SEQ, TOTAL_SEQ = "batch", "seq", "cache_len", "past_seq", "total_seq"


def cache_names(num_layers: int, prefix: str) -> list[str]:
    """past_key_values.{i}.key / .value (prefix="past_key_values") or present.{i}.key / .value."""
    return [f"{prefix}.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]


def input_names(num_layers: int, style: CacheStyle, *, full_mask: bool = True, ring_mask: bool = False) -> list[str]:
    """The graph's inputs in order. A static IR whose sliding-window layers keep rings takes their mask
    (MASK_INPUT) after the full-length layers' `attention_mask`, which it lacks when every layer is a ring."""
    head = ["input_ids", "position_ids"] + (["write_index"] if style == "static" else [])
    head += (["attention_mask"] if full_mask else []) + ([MASK_INPUT] if ring_mask else [])
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
    rings = set(dec.ring_layers)

    def slots(name: str, full: str) -> str:  # a ring layer's cache has its own slot count
        return RING_DIM if int(name.split(".")[-2]) in rings else full

    ins = [IOSpec("input_ids", "int64", (BATCH, SEQ)), IOSpec("position_ids", "int64", (BATCH, SEQ))]
    if style == "static":
        ins.append(IOSpec("write_index", "int64", (BATCH,)))
    if len(rings) < L:
        ins.append(IOSpec("attention_mask", "bool", (BATCH, 1, SEQ, mask_len)))
    if rings:
        ins.append(IOSpec(MASK_INPUT, "bool", (BATCH, 1, SEQ, RING_MASK_DIM)))
    ins += [IOSpec(n, dtype, (BATCH, Hkv, slots(n, past_len), D)) for n in cache_names(L, "past_key_values")]
    outs = [IOSpec("logits", "float32" if dtype == "float32" else dtype, (BATCH, 1 if dec.last_token_only else SEQ, cfg.vocab_size))]
    outs += [IOSpec(n, dtype, (BATCH, Hkv, slots(n, present_len), D)) for n in cache_names(L, "present")]
    return ins, outs


def _example_inputs(dec: Decoder, style: CacheStyle, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    B, S, P = 2, 3, 13  # distinct sizes so no dim is specialised by coincidence
    L = P if style == "concat" else 16
    total = P + S if style == "concat" else L
    R = min(7, dec.ring_window or 7)  # a ring's slots (its mask: R + S keys)
    rings = set(dec.ring_layers)
    ids = torch.zeros(B, S, dtype=torch.long)
    pos = torch.arange(S)[None].expand(B, S).contiguous()
    masks = [torch.ones(B, 1, S, total, dtype=torch.bool)] if len(rings) < dec.cfg.num_hidden_layers else []
    masks += [torch.ones(B, 1, S, R + S, dtype=torch.bool)] if rings else []
    caches = [torch.zeros(dec.cache_shape(B, R if i // 2 in rings else L), dtype=dtype)
              for i in range(2 * dec.cfg.num_hidden_layers)]
    if style == "static":
        return (ids, pos, torch.zeros(B, dtype=torch.long), *masks, *caches)
    return (ids, pos, *masks, *caches)


def _dynamic_shapes(dec: Decoder, style: CacheStyle) -> tuple:
    """Shaped like forward(input_ids, position_ids, *rest): the varargs form one nested tuple."""
    Dim = torch.export.Dim
    batch, seq = Dim(BATCH, min=1, max=1024), Dim(SEQ, min=1, max=dec.max_seq)
    nc = 2 * dec.cfg.num_hidden_layers
    if style == "static":
        cache_len = Dim(CACHE_LEN, min=1, max=dec.max_seq)
        cache = {0: batch, 2: cache_len}
        rings = set(dec.ring_layers)
        if rings:
            W = dec.ring_window
            ring = {0: batch, 2: Dim(RING_DIM, min=1, max=W)}
            masks = ([{0: batch, 2: seq, 3: cache_len}] if len(rings) < nc // 2 else [])
            masks.append({0: batch, 2: seq, 3: Dim(RING_MASK_DIM, min=2, max=W + dec.max_seq)})
            caches = [ring if i // 2 in rings else cache for i in range(nc)]
            return ({0: batch, 1: seq}, {0: batch, 1: seq}, ({0: batch}, *masks, *caches))
        return ({0: batch, 1: seq}, {0: batch, 1: seq}, ({0: batch}, {0: batch, 2: seq, 3: cache_len}, *[cache] * nc))
    past, total = Dim(PAST_SEQ, min=0, max=dec.max_seq), Dim(TOTAL_SEQ, min=1, max=dec.max_seq)
    cache = {0: batch, 2: past}
    return ({0: batch, 1: seq}, {0: batch, 1: seq}, ({0: batch, 2: seq, 3: total}, *[cache] * nc))


def _tensor_scatter_onnx(cache, update, write_index):  # type: ignore[no-untyped-def]
    from onnxscript.values import Opset

    return Opset("", OPSET).TensorScatter(cache, update, write_index, axis=-2, mode="linear")


def _ring_scatter_onnx(cache, update, write_index):  # type: ignore[no-untyped-def]
    from onnxscript.values import Opset

    return Opset("", OPSET).TensorScatter(cache, update, write_index, axis=-2, mode="circular")


@dataclass(frozen=True)
class ExportedIR:
    path: Path  # model.onnx (weights in model.onnx.data)
    weights: dict[str, dict]  # decoder parameter -> the initializer holding it (weight_map)


def export_onnx(
    ck: Checkpoint,
    out_dir: str | Path,
    *,
    cache_style: CacheStyle = "static",
    last_token_only: bool = True,
    dtype: torch.dtype = torch.float32,
    ring: bool = False,
    progress: Callable[[str], None] | None = None,
) -> ExportedIR:
    """Trace `ck.decoder` with torch.onnx (dynamo) and write model.onnx + model.onnx.data.

    ring: sliding-window layers keep a window-sized ring cache (static style; TensorScatter mode=circular).
    Also returns which initializer holds each decoder parameter (weight_map), for manifest `ir.weights`."""
    say = progress or (lambda _m: None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dec = ck.decoder.to(dtype)
    L = ck.config.num_hidden_layers
    t0 = time.perf_counter()
    say(f"tracing {ck.config.model_type} ({ck.config.num_parameters() / 1e6:.1f}M params, {cache_style} cache)")
    # ONNX ops for this trace only: the decoder's own strategy comes back even if tracing fails
    with dec.configured(kv=kv_step(cache_style, onnx_ops=True), last_token_only=last_token_only, ring=ring), \
            warnings.catch_warnings(), _quiet_exporter():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            dec,
            _example_inputs(dec, cache_style, dtype),
            dynamo=True,
            opset_version=OPSET,
            input_names=input_names(L, cache_style, full_mask=len(dec.ring_layers) < L, ring_mask=bool(dec.ring_layers)),
            output_names=output_names(L),
            dynamic_shapes=_dynamic_shapes(dec, cache_style),
            custom_translation_table={torch.ops.kvexport.tensor_scatter.default: _tensor_scatter_onnx,
                                      torch.ops.kvexport.ring_scatter.default: _ring_scatter_onnx},
            optimize=True,
            verbose=False,
        )
    say(f"traced in {time.perf_counter() - t0:.1f}s; writing {MODEL_FILE}")
    path = out / MODEL_FILE
    (out / DATA_FILE).unlink(missing_ok=True)
    # each weight goes from the decoder's tensor to model.onnx.data on its own (program.model_proto would
    # copy them all into one proto: a second model in memory, and past 2 GB a proto protobuf cannot write)
    onnx_ir.save(program.model, path, external_data=DATA_FILE, size_threshold_bytes=1024)
    # the exporter's graphs outlive `program` (onnxscript 0.7's module-level rewrite rules keep the last one
    # they matched): drop this one's hold on the weights; artifact.release_weights frees the rest
    for value in program.model.graph.initializers.values():
        value.const_value = None
    program.model.graph.initializers.clear()
    del program
    model = onnx.load(str(path), load_external_data=False)
    finalize_graph(model, ck.config.model_type)
    share_branch_copies(model, out)
    weights = weight_map(model, dec, out)
    lost = [n for n, _ in dec.named_parameters() if n not in weights]
    if lost:  # the IR still runs; only backends that rebuild the decoder from it (decoder_from_ir) refuse it
        say(f"warning: no initializer of the IR holds {', '.join(lost[:4])}{' ...' if len(lost) > 4 else ''}")
    onnx.save_model(model, str(path))  # names only changed: the weights stay where they were written
    return ExportedIR(path, weights)


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
    for node in _nodes_and_branches(model.graph):  # an If's branches read outer initializers by name too
        for slot, name in enumerate(node.input):
            if name in renames:
                node.input[slot] = renames[name]


def _nodes_and_branches(g: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """g's nodes, then those of every graph nested in them (an If's then/else branches)."""
    for node in g.node:
        yield node
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _nodes_and_branches(a.g)


def share_branch_copies(model: onnx.ModelProto, folder: Path) -> int:
    """An If branch (MoeMlp's gathered form) may read a weight through a copy the exporter made of it, under a
    `val_*` name (seen: qwen3_moe's expert down weights). Point the branch at the original and drop the copy.
    Its bytes stay in the external-data file, unreferenced; returns how many copies were dropped."""
    g = model.graph
    top = {i for n in g.node for i in n.input}
    if not any(a.type == onnx.AttributeProto.GRAPH for n in g.node for a in n.attribute):
        return 0
    copies = [t for t in g.initializer if t.name.startswith("val_") and t.name not in top and len(t.dims) >= 2]
    originals = [t for t in g.initializer if not t.name.startswith("val_")]
    renames: dict[str, str] = {}
    for c in copies:
        data = _init_bytes(c, folder)
        same = next((o for o in originals if o.data_type == c.data_type and list(o.dims) == list(c.dims)
                     and _init_bytes(o, folder) == data), None)
        if same is not None:
            renames[c.name] = same.name
    for n in _nodes_and_branches(g):
        for i, name in enumerate(n.input):
            if name in renames:
                n.input[i] = renames[name]
    kept = [t for t in g.initializer if t.name not in renames]
    del g.initializer[:]
    g.initializer.extend(kept)
    return len(renames)


def _scope_of(node: onnx.NodeProto) -> str:
    """`layers.3.attn.qkv_proj` etc. from the exporter's module-path metadata; `model` at the top."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            scopes = [s.strip().strip("'") for s in prop.value.strip("[]").split(",")]
            scopes = [s for s in scopes if s]
            if len(scopes) >= 2 and not scopes[-2].startswith("_"):
                return scopes[-2]
    return "model"


# --- the IR's weights <-> the owned decoder's parameters -------------------------------------
_ONNX_DTYPES = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
                torch.bfloat16: onnx.TensorProto.BFLOAT16}


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _external_span(init: onnx.TensorProto, folder: Path) -> tuple[Path, int, int]:
    """Where an external initializer's bytes lie: (file, offset, length), the length from its dims where the
    entry leaves it out."""
    where = {e.key: e.value for e in init.external_data}
    nbytes = int(np.prod(init.dims, dtype=np.int64)) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize
    return folder / where.get("location", ""), int(where.get("offset", 0)), int(where.get("length", nbytes))


def _init_bytes(init: onnx.TensorProto, folder: Path | None = None) -> bytes:
    """An initializer's bytes, read from its external-data file (relative to folder) when it has one."""
    if init.data_location == onnx.TensorProto.EXTERNAL:
        assert folder is not None, f"{init.name} is external: pass the folder its data lives in"
        path, offset, length = _external_span(init, Path(folder))
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(length)
    return init.raw_data if init.HasField("raw_data") else numpy_helper.to_array(init).tobytes()


def weight_map(model: onnx.ModelProto, dec: Decoder, folder: Path | None = None) -> dict[str, dict]:
    """Decoder parameter name -> {"initializer", "transposed", "shape"}: the initializer of `model`
    that holds the parameter's exact value (transposed: as a MatMul's `{module}/weight_t`).

    Names alone do not say it: the exporter stores equal tensors once, under the first name it met
    (a checkpoint as `transformers` initializes it has every bias zero and every norm weight one, so
    `layers.1.attn.qkv_proj.bias` lives in `layers.0.attn.qkv_proj.bias`), and a tied embedding under
    `lm_head.weight`. Each parameter is matched by value: its own name or `{module}/weight_t` first,
    else any initializer of the same dtype and shape with the same bytes (sha256), in graph order.
    A parameter that no initializer holds is left out (decoder_from_ir then names it).
    """
    inits = list(model.graph.initializer)
    by_name = {i.name: i for i in inits}
    digests: dict[str, str] = {}

    def digest(init: onnx.TensorProto) -> str:
        if init.name not in digests:
            digests[init.name] = hashlib.sha256(_init_bytes(init, folder)).hexdigest()
        return digests[init.name]

    out: dict[str, dict] = {}
    for name, p in dec.named_parameters():  # a tied lm_head appears once, as embed_tokens.weight
        dtype = _ONNX_DTYPES.get(p.dtype)
        module, leaf = name.rsplit(".", 1) if "." in name else ("model", name)
        forms = [(False, list(p.shape))] + ([(True, list(p.shape)[::-1])] if p.dim() == 2 else [])
        found = None
        for transposed, dims in forms:  # the names finalize_graph gives
            init = by_name.get(f"{module}/{leaf}_t" if transposed else name)
            if init is not None and init.data_type == dtype and list(init.dims) == dims:
                if _init_bytes(init, folder) == _tensor_bytes(p.t() if transposed else p):
                    found = (init.name, transposed)
                    break
        for transposed, dims in forms if found is None else []:  # merged with an equal tensor
            want = hashlib.sha256(_tensor_bytes(p.t() if transposed else p)).hexdigest()
            match = next((i for i in inits if i.data_type == dtype and list(i.dims) == dims and digest(i) == want), None)
            if match is not None:
                found = (match.name, transposed)
                break
        if found is not None:
            out[name] = {"initializer": found[0], "transposed": found[1], "shape": list(p.shape)}
    return out


def _legacy_weight_map(inits: dict[str, onnx.TensorProto], dec: Decoder) -> dict[str, dict]:
    """For an IR whose manifest predates `ir.weights`: parameters found by name (or `{module}/weight_t`)."""
    out: dict[str, dict] = {}
    for name, p in dec.named_parameters():
        module, leaf = name.rsplit(".", 1) if "." in name else ("model", name)
        aliases = [name] + (["lm_head.weight"] if dec.cfg.tie_word_embeddings and name == "embed_tokens.weight" else [])
        for alias in aliases:
            amod, aleaf = alias.rsplit(".", 1)
            hit = next(((n, t) for n, t in ((alias, False), (f"{amod}/{aleaf}_t", True)) if n in inits), None)
            if hit is not None:
                out[name] = {"initializer": hit[0], "transposed": hit[1], "shape": list(p.shape)}
                break
    return out


def _initializer_array(init: onnx.TensorProto, folder: Path) -> np.ndarray:
    """One initializer's values as a new writable array, read straight from its external data file (the
    protobuf keeps no copy). Raises ArtifactError for a location outside the artifact or a short file."""
    if init.data_location != onnx.TensorProto.EXTERNAL:
        return np.array(numpy_helper.to_array(init))
    path, offset, length = _external_span(init, folder)
    if folder.resolve() not in path.resolve().parents:
        raise ArtifactError(f"IR weight {init.name} points outside the artifact ({path.name!r}); "
                            "rebuild the artifact with `kvexport build`")
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type))
    count = int(np.prod(init.dims, dtype=np.int64))
    with open(path, "rb") as f:
        f.seek(offset)
        arr = np.fromfile(f, dtype=dtype, count=count)
    if arr.size != count or length != arr.nbytes:
        raise ArtifactError(f"IR weight {init.name}: {path.name} holds {arr.nbytes} of its "
                            f"{count * dtype.itemsize} bytes; the artifact is damaged, rebuild it with `kvexport build`")
    return arr.reshape(tuple(init.dims))


def decoder_from_ir(folder: str | Path, manifest: Manifest, *, cache_style: CacheStyle | None = None,
                    last_token_only: bool | None = None) -> Decoder:
    """Rebuild the owned Decoder (plain torch ops, float32, eval, no grad) from the artifact's own IR.

    Backends that lower from the decoder rather than from the ONNX graph (intel, amd) build from
    the IR, not the source checkpoint (which may be gone), so that the artifact stays self-contained
    and a later machine can rebuild it. Manifest `ir.weights` names the initializer that holds each
    parameter (weight_map). cache_style and last_token_only default to the IR's own.
    Raises ArtifactError for an IR that lacks a parameter or holds one of the wrong shape.
    """
    folder = Path(folder)
    cfg, ir = manifest.config, manifest.raw["ir"]
    # the graph without its weights: each is read from the external data file into its own array as the
    # decoder takes it, so the weights are held once (onnx.load with external data held them twice beside the
    # decoder's copies: 9.9 GiB for bench-1b's 4.6 GiB, past the 2x bound of issue 12's export)
    model = onnx.load(str(folder / ir["file"]), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}
    with torch.device("meta"):  # no random init of weights that are overwritten next
        dec = Decoder(cfg, manifest.max_seq, kv=kv_step(cache_style or ir["cache_style"]),
                      last_token_only=bool(ir["last_token_only"]) if last_token_only is None else last_token_only,
                      ring=bool(manifest.cache.get("ring")))
    recorded = ir.get("weights")
    where = recorded if recorded is not None else _legacy_weight_map(inits, dec)
    state: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for name, p in dec.named_parameters():
        entry = where.get(name)
        init = inits.get(entry["initializer"]) if entry else None
        if init is None:
            missing.append(name)
            continue
        arr = _initializer_array(init, folder)  # a fresh array: its own memory
        arr = arr.T if entry["transposed"] else arr
        if tuple(arr.shape) != tuple(p.shape) or list(entry["shape"]) != list(p.shape):
            raise ArtifactError(f"IR weight {init.name} has shape {tuple(arr.shape)}, the decoder expects "
                                f"{tuple(p.shape)} for {name}; rebuild the artifact with `kvexport build`")
        state[name] = torch.from_numpy(np.asarray(arr, dtype=np.float32, order="C"))  # copies only if it must
    if missing:
        raise ArtifactError(
            f"the IR in {folder} has no weight for {len(missing)} decoder parameter(s) ({', '.join(missing[:4])}"
            f"{' ...' if len(missing) > 4 else ''})"
            + ("" if recorded is not None else "; its manifest predates `ir.weights`")
            + ": it was not made by this kvexport's exporter. Rebuild the artifact from its checkpoint with `kvexport build`"
        )
    dec = dec.to_empty(device="cpu")
    dec.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        dec.lm_head.weight = dec.embed_tokens.weight  # to_empty gave the tied pair two tensors
    if cfg.position_kind == "rope":
        dec.set_rope_tables(dec.rope_positions)  # buffers were built on meta
    return dec.eval().requires_grad_(False)
