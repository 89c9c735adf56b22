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

import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvexport.config import DecoderConfig
from kvexport.decoder import ConcatTorch, Decoder, Step, scatter_rows, softcapped_attention
from kvexport.errors import ArtifactError
from kvexport.manifest import Manifest
from kvexport.runtime.ring import MASK_INPUT, RingSpec

XML, BIN = "openvino_model.xml", "openvino_model.bin"
STEP_INPUTS = ("input_ids", "position_ids", "attention_mask", "beam_idx")


# --- the traced step ------------------------------------------------------------------------
class BeamConcat(ConcatTorch):
    """The concat strategy in the shape the fusion matches: Gather(beam_idx) on the past, Concat with
    the new rows, and for GQA the unsqueeze -> expand -> reshape broadcast of K/V to the query heads.

    A sliding layer on a ring (`attend_ring`) attends over the same Concat of its ring and the new rows, under
    the rings' mask (kvexport.runtime.ring.sliding_mask), and assigns the ring with the new rows written at
    their slots modulo its length (ScatterElementsUpdate). The ring starts empty and grows with the request
    until it is `window` slots long, as the cpu runtime's does: its length is min(window, slots held), so the
    slot arithmetic of ring.py holds at every length. Its Assign is not the Concat, so the plugin's fusion
    leaves it a plain ScaledDotProductAttention over the W + S keys (or MatMul + Softmax with a softcap)."""

    keeps_rings = True

    def __init__(self, beam_idx: Tensor):
        self.beam_idx = beam_idx  # (B,) int32

    def attend(self, q: Tensor, k: Tensor, v: Tensor, step: Step, past_k: Tensor, past_v: Tensor,
               cfg: DecoderConfig) -> tuple[Tensor, Tensor, Tensor]:
        k_all = torch.cat([past_k.index_select(0, self.beam_idx), k], dim=2)  # (B, H_kv, P+S, D): the Assign'd state
        v_all = torch.cat([past_v.index_select(0, self.beam_idx), v], dim=2)
        return self.attention(q, k_all, v_all, step.mask, cfg), k_all, v_all

    def attend_ring(self, q: Tensor, k: Tensor, v: Tensor, step: Step, past_k: Tensor, past_v: Tensor,
                    cfg: DecoderConfig) -> tuple[Tensor, Tensor, Tensor]:
        assert step.window is not None and step.write_index is not None
        k_all = torch.cat([past_k.index_select(0, self.beam_idx), k], dim=2)  # (B, H_kv, R + S, D)
        v_all = torch.cat([past_v.index_select(0, self.beam_idx), v], dim=2)
        y = self.attention(q, k_all, v_all, step.mask, cfg)
        return y, self.ring_write(k_all, k, step), self.ring_write(v_all, v, step)

    @staticmethod
    def ring_write(both: Tensor, new: Tensor, step: Step) -> Tensor:
        """both (B, H_kv, R + S, D), the ring (R = min(W, T) slots) then the S new rows, the Concat the attention
        read -> the ring (B, H_kv, min(W, T + S), D): its first min(W, R + S) rows, with the S new rows written at
        slots (T + s) mod that length. Below W the new rows already sit at their slots T + s; once they pass W
        the scatter wraps them. S <= W (ring.chunks). Reusing the attention's Concat saves a second one (with
        zero rows) per K and V: fewer ring-sized copies a step."""
        return scatter_rows(both[:, :, : step.window], new, step.write_index, circular=True)

    def attention(self, q: Tensor, k_all: Tensor, v_all: Tensor, mask: Tensor, cfg: DecoderConfig) -> Tensor:
        """q (B, H_q, S, D) over k_all, v_all (B, H_kv, N, D) under the additive mask (B, 1, S, N)."""
        Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        B, _, T, D = k_all.shape
        rep = Hq // Hkv
        if rep > 1:  # unsqueeze -> expand -> reshape: the GQA broadcast the fusion recognises
            k_rep = k_all[:, :, None].expand(B, Hkv, rep, T, D).reshape(B, Hq, T, D)
            v_rep = v_all[:, :, None].expand(B, Hkv, rep, T, D).reshape(B, Hq, T, D)
        else:
            k_rep, v_rep = k_all, v_all
        if cfg.attn_logit_softcap is not None:  # no SDPA node to fuse: SDPA has no softcap (Gemma 2)
            return softcapped_attention(q, k_rep, v_rep, mask, cfg.scale, cfg.attn_logit_softcap, 1)
        return F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask, scale=cfg.scale)  # (B, H_q, S, D)


class StatefulStep(nn.Module):
    """forward(input_ids, position_ids, [write_index], [attention_mask], [sliding_attention_mask], beam_idx, *past)
    -> (logits, *present).

    Masks are float additive: attention_mask (B, 1, S, P+S) over the full-length layers' past and the new rows
    (absent where every layer is a ring), sliding_attention_mask (B, 1, S, R+S) over a ring's R slots and the new
    rows, with write_index (B,) the slots held before the step (both only where rings are on: `ring`).
    beam_idx int32 (B,) reorders the past rows (the identity here, but the fusion pattern requires the Gather).
    """

    def __init__(self, dec: Decoder, ring: bool = False):
        super().__init__()
        self.dec, self.ring = dec, ring
        with dec.configured(kv=BeamConcat(torch.zeros(0, dtype=torch.int32)), ring=ring):
            self.rings = dec.ring_layers  # the sliding layers, where rings are on and their window fits max_seq
            L = dec.cfg.num_hidden_layers
            self.spec = RingSpec(dec.ring_window, frozenset(self.rings), L, dec.max_positions) if self.rings else None
        self.names = step_inputs(dec.cfg.num_hidden_layers, self.rings)[2:]  # the inputs between positions and caches

    def forward(self, input_ids: Tensor, position_ids: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        named, past = dict(zip(self.names, rest)), rest[len(self.names):]
        kv = BeamConcat(named["beam_idx"])
        with self.dec.configured(kv=kv, ring=self.ring):
            step = self.dec.step(position_ids, named.get("write_index"), named.get("attention_mask"), kv)  # type: ignore[arg-type]
            return self.dec.decode(input_ids, step._replace(ring_mask=named.get(MASK_INPUT)), past)  # (B, 1, vocab)


def step_inputs(num_layers: int, rings: tuple[int, ...] | frozenset[int]) -> list[str]:
    """The traced step's inputs before the caches, in order (STEP_INPUTS without rings)."""
    if not rings:
        return list(STEP_INPUTS)
    full = ["attention_mask"] if len(rings) < num_layers else []
    return ["input_ids", "position_ids", "write_index", *full, MASK_INPUT, "beam_idx"]


def _example(step: StatefulStep) -> tuple[Tensor, ...]:
    cfg, rings = step.dec.cfg, set(step.rings)
    B, S, P = 2, 3, 5  # distinct sizes so no dim is specialised by coincidence
    R = min(P, step.dec.ring_window or P)  # a ring shorter than its window: nothing of it is specialised either
    named = {"input_ids": torch.zeros(B, S, dtype=torch.long), "position_ids": torch.arange(S).repeat(B, 1),
             "write_index": torch.full((B,), P, dtype=torch.long), "attention_mask": torch.zeros(B, 1, S, P + S),
             MASK_INPUT: torch.zeros(B, 1, S, R + S), "beam_idx": torch.arange(B, dtype=torch.int32)}
    caches = [torch.zeros(B, cfg.num_key_value_heads, R if i // 2 in rings else P, cfg.head_dim)
              for i in range(2 * cfg.num_hidden_layers)]
    return (*(named[n] for n in step_inputs(cfg.num_hidden_layers, step.rings)), *caches)


def convert(dec: Decoder, manifest: Manifest, *, ring: bool = True) -> tuple[Any, RingSpec | None]:
    """Trace StatefulStep through OpenVINO's PyTorch frontend and make its KV pairs internal state. ring: the
    sliding-window layers keep window-sized rings (BeamConcat.attend_ring). Returns the model and its rings."""
    import openvino as ov

    pairs = manifest.kv_pairs()
    step = StatefulStep(dec, ring)
    with torch.no_grad():
        model = ov.convert_model(step, example_input=_example(step))
    names = [*step_inputs(dec.cfg.num_hidden_layers, step.rings), *(p for p, _ in pairs)]
    if len(model.inputs) != len(names):
        raise ArtifactError(f"traced {len(model.inputs)} inputs, expected {len(names)}; the decoder and manifest disagree")
    for port, name in zip(model.inputs, names):
        port.get_tensor().set_names({name})
    for port, name in zip(model.outputs, ["logits", *(o for _, o in pairs)]):
        port.get_tensor().set_names({name})
    make_stateful(model, pairs, manifest.cache["kv_heads"], manifest.cache["head_dim"])
    return model, step.spec


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


def static_split_lengths(model: Any) -> int:
    """Give every VariadicSplit whose lengths are computed (the decoder's gate|up chunk traces to a Concat of
    shape arithmetic) but whose pieces have static sizes along its axis those sizes as a Constant; returns how many.
    The CPU plugin runs a VariadicSplit with computed lengths as a reference node: a copy of the packed projection's
    output (0.11 s of a 4096-token prompt on bench-125m, more under load), no Swish fused into the matmul before it,
    and, its output shapes read from its inputs' data, a sync point of the dynamic graph in every step. With
    constant lengths it is the plugin's own Split."""
    import openvino as ov

    n = 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "VariadicSplit" or op.input_value(2).get_node().get_type_name() == "Constant":
            continue
        axis_node, rank = op.input_value(1).get_node(), op.get_input_partial_shape(0).rank
        if axis_node.get_type_name() != "Constant" or rank.is_dynamic:
            continue
        axis = int(np.ravel(axis_node.get_data())[0]) % rank.get_length()
        dims = [op.get_output_partial_shape(i)[axis] for i in range(op.get_output_size())]
        if any(d.is_dynamic for d in dims):
            continue
        kind = op.get_input_element_type(2).to_dtype()
        lengths = ov.opset13.constant(np.array([d.get_length() for d in dims], dtype=kind))
        op.input(2).replace_source_output(lengths.output(0))
        n += 1
    if n:
        model.validate_nodes_and_infer_types()
    return n


def read_engine(core: Any, xml: str | Path) -> Any:
    """An engine's IR read for compiling: its split lengths made constant (static_split_lengths), so that engines
    built before that was done at build run the plugin's Split too."""
    model = core.read_model(str(xml))
    static_split_lengths(model)
    return model


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


# weight constants of at least this many elements become inputs of the build's fused-path check
WEIGHT_INPUT_MIN = 4096


def _weight_input_shape(op: Any) -> Any:
    """The shape a weight constant takes as an input of the check: its own, with its contraction dimension (a
    MatMul's K; an embedding table's rows) dynamic, or None where the constant is not a plain weight (read by
    anything but MatMul's second input or Gather's table, e.g. NNCF's compressed weights, which stay constants).
    One dimension dynamic keeps the plugin from allocating an input buffer of the weight's size at compile; the
    output channels stay static, as the plugin's fused bias needs (a bias sized to a dynamic output fails)."""
    import openvino as ov

    shape = list(op.get_output_shape(0))
    targets = list(op.output(0).get_target_inputs())
    if len(shape) < 2 or math.prod(shape) < WEIGHT_INPUT_MIN or not targets:
        return None
    dims: set[int] = set()
    for t in targets:
        node = t.get_node()
        kind = node.get_type_name()
        if kind == "MatMul" and t.get_index() == 1:
            dims.add(len(shape) - (1 if node.get_attributes()["transpose_b"] else 2))
        elif kind == "Gather" and t.get_index() == 0:
            dims.add(0)
        else:
            return None
    if len(dims) != 1:
        return None
    dim = dims.pop()
    return ov.PartialShape([-1 if i == dim else n for i, n in enumerate(shape)])


def weights_as_inputs(xml: Path) -> Any:
    """The stateful IR at `xml` with its weight constants (WEIGHT_INPUT_MIN elements or more, read by a MatMul or an
    embedding Gather) turned into Parameters with one dynamic dimension (_weight_input_shape). Compiling it runs the
    plugin's graph transformations, the stateful attention fusion among them, without the packed copy of every
    weight a compile makes (an f32 compile of bench-1b beside the decoder's weights took the build past twice the
    weights' bytes); the file's weights, mapped and never read, take no memory (model.clone() would copy them),
    and the dynamic dimension keeps the plugin from allocating an input buffer per weight at compile (static
    shapes took the weights' size again). Its fused-attention count and its ScaledDotProductAttention and
    MemoryInput/MemoryOutput counts are the engine's own: a load compiles the real model, and tests/ compare the
    two on every family. Shape arithmetic is not (dynamic shapes keep Concatenations that static ones fold)."""
    import openvino as ov

    model = ov.Core().read_model(str(xml))
    inputs = []
    for op in model.get_ordered_ops():
        shape = _weight_input_shape(op) if op.get_type_name() == "Constant" else None
        if shape is None:
            continue
        param = ov.opset13.parameter(shape, op.get_output_element_type(0), name=f"{op.get_friendly_name()}/as_input")
        op.output(0).replace(param.output(0))
        inputs.append(param)
    model.add_parameters(inputs)
    model.validate_nodes_and_infer_types()
    return model
