"""Lowering to an OpenVINO stateful IR shaped for the CPU plugin's fused attention-with-KV-cache path.

The CPU plugin's StatefulSDPAFusion rewrites `ReadValue -> Gather(beam_idx) -> Concat(past, new)
-> [Unsqueeze -> Broadcast -> Reshape for GQA] -> ScaledDotProductAttention` (with the Concat also
feeding an Assign of the same variable) into one ScaledDotProductAttentionWithKVCache node that
keeps the cache in its own MemoryInput/MemoryOutput buffers. The ONNX frontend's import of the
IR's `Attention` (Tile for GQA, IsNaN/Select mask handling) does not match that pattern, so the
graph is traced from the owned decoder with plain torch ops in exactly that shape, with the
weights read back from the artifact's own ONNX IR (the artifact stays self-contained).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvexport.config import DecoderConfig
from kvexport.decoder import ConcatTorch, Decoder, Step, softcapped_attention
from kvexport.errors import ArtifactError
from kvexport.manifest import Manifest

XML, BIN = "openvino_model.xml", "openvino_model.bin"
STEP_INPUTS = ("input_ids", "position_ids", "attention_mask", "beam_idx")


# --- the traced step ------------------------------------------------------------------------
class BeamConcat(ConcatTorch):
    """The concat strategy in the shape the fusion matches: Gather(beam_idx) on the past, Concat with
    the new rows, and for GQA the unsqueeze -> expand -> reshape broadcast of K/V to the query heads."""

    def __init__(self, beam_idx: Tensor):
        self.beam_idx = beam_idx  # (B,) int32

    def attend(self, q: Tensor, k: Tensor, v: Tensor, step: Step, past_k: Tensor, past_v: Tensor,
               cfg: DecoderConfig) -> tuple[Tensor, Tensor, Tensor]:
        Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        k_all = torch.cat([past_k.index_select(0, self.beam_idx), k], dim=2)  # (B, H_kv, P+S, D): the Assign'd state
        v_all = torch.cat([past_v.index_select(0, self.beam_idx), v], dim=2)
        B, _, T, D = k_all.shape
        rep = Hq // Hkv
        if rep > 1:  # unsqueeze -> expand -> reshape: the GQA broadcast the fusion recognises
            k_rep = k_all[:, :, None].expand(B, Hkv, rep, T, D).reshape(B, Hq, T, D)
            v_rep = v_all[:, :, None].expand(B, Hkv, rep, T, D).reshape(B, Hq, T, D)
        else:
            k_rep, v_rep = k_all, v_all
        if cfg.attn_logit_softcap is not None:  # no SDPA node to fuse: SDPA has no softcap (Gemma 2)
            y = softcapped_attention(q, k_rep, v_rep, step.mask, cfg.scale, cfg.attn_logit_softcap, 1)
        else:
            y = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=step.mask, scale=cfg.scale)  # (B, H_q, S, D)
        return y, k_all, v_all


class StatefulStep(nn.Module):
    """forward(input_ids, position_ids, attention_mask, beam_idx, *past) -> (logits, *present).

    attention_mask is float additive (B, 1, S, P+S); beam_idx int32 (B,) reorders the past rows
    (the identity here, but the fusion pattern requires the Gather).
    """

    def __init__(self, dec: Decoder):
        super().__init__()
        self.dec = dec

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor, beam_idx: Tensor,
                *past: Tensor) -> tuple[Tensor, ...]:
        step = self.dec.step(position_ids, None, attention_mask, BeamConcat(beam_idx))
        return self.dec.decode(input_ids, step, past)  # the decoder is last-token-only: (B, 1, vocab)


def _example(dec: Decoder) -> tuple[Tensor, ...]:
    cfg = dec.cfg
    B, S, P = 2, 3, 5  # distinct sizes so no dim is specialised by coincidence
    caches = [torch.zeros(B, cfg.num_key_value_heads, P, cfg.head_dim) for _ in range(2 * cfg.num_hidden_layers)]
    return (torch.zeros(B, S, dtype=torch.long), torch.arange(S).repeat(B, 1), torch.zeros(B, 1, S, P + S),
            torch.arange(B, dtype=torch.int32), *caches)


def convert(dec: Decoder, manifest: Manifest) -> Any:
    """Trace StatefulStep through OpenVINO's PyTorch frontend and make its KV pairs internal state."""
    import openvino as ov

    pairs = manifest.kv_pairs()
    with torch.no_grad():
        model = ov.convert_model(StatefulStep(dec), example_input=_example(dec))
    names = [*STEP_INPUTS, *(p for p, _ in pairs)]
    if len(model.inputs) != len(names):
        raise ArtifactError(f"traced {len(model.inputs)} inputs, expected {len(names)}; the decoder and manifest disagree")
    for port, name in zip(model.inputs, names):
        port.get_tensor().set_names({name})
    for port, name in zip(model.outputs, ["logits", *(o for _, o in pairs)]):
        port.get_tensor().set_names({name})
    make_stateful(model, pairs, manifest.cache["kv_heads"], manifest.cache["head_dim"])
    return model


def make_stateful(model: Any, pairs: list[tuple[str, str]], kv_heads: int, head_dim: int) -> None:
    """Each (past input, present output) pair becomes one variable: ReadValue whose initial value is a
    zero-length (B, H_kv, 0, D) tensor, and an Assign of the present. The CPU plugin needs the
    initializer subgraph: a ReadValue without one fails to compile."""
    import openvino as ov
    import openvino.opset13 as ops
    from openvino._pyopenvino.op import assign, read_value
    from openvino.op.util import Variable, VariableInfo

    params = {p.get_output_tensor(0).get_any_name(): p for p in model.get_parameters()}
    results = {r.output(0).get_any_name(): r for r in model.get_results()}
    ids = params["input_ids"]
    batch = ops.gather(ops.shape_of(ids, "i64"), ops.constant([0], dtype=np.int64), ops.constant(0, dtype=np.int64))
    shape = ops.concat([batch, ops.constant([kv_heads, 0, head_dim], dtype=np.int64)], 0)
    sinks = []
    for past, present in pairs:
        info = VariableInfo()
        info.variable_id = past
        info.data_type = ov.Type.f32
        info.data_shape = ov.PartialShape([-1, kv_heads, -1, head_dim])
        var = Variable(info)
        param, result = params[past], results[present]
        init = ops.broadcast(ops.constant(0.0, dtype=np.float32), shape)  # (B, H_kv, 0, D)
        rv = read_value(init, var)
        param.output(0).replace(rv.output(0))
        src = result.input_value(0)
        sinks.append(assign(src.get_node() if src.get_node().get_output_size() == 1 else src, var))
        model.remove_result(result)
        model.remove_parameter(param)
        model.add_variables([var])
    model.add_sinks(sinks)
    model.validate_nodes_and_infer_types()


def runtime_op_counts(compiled: Any) -> Counter[str]:
    """Layer types of the compiled runtime graph (what the plugin actually executes)."""
    return Counter(str(op.get_rt_info()["layerType"].astype(str)) for op in compiled.get_runtime_model().get_ops())


def fused_attention_layers(compiled: Any) -> int:
    """How many runtime ScaledDotProductAttention nodes read their K/V straight from MemoryInput state."""
    n = 0
    for op in compiled.get_runtime_model().get_ops():
        if op.get_rt_info()["layerType"].astype(str) != "ScaledDotProductAttention":
            continue
        feeds = [i.get_node().get_rt_info()["layerType"].astype(str) for i in op.input_values()]
        n += feeds.count("MemoryInput") == 2
    return n
