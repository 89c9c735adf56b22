"""int8/int4 weights for the intel target: NNCF's weight compression of the stateful OpenVINO IR, data-free by
default, or with NNCF's GPTQ against a calibration text (`--option quantizer=gptq`, int4 only).

The defaults are those of `optimum-cli export openvino --weight-format int8|int4` (optimum-intel, checked
against its configuration in August 2026), so that an engine and OpenVINO GenAI's are compared like for like:
- int8: INT8_ASYM, one scale and zero point per output channel (NNCF's group size -1), every layer, the
  embedding and lm_head included.
- int4: INT4_ASYM with group size 128 on every decoder-block matmul (ratio 1.0); the embedding and lm_head
  take NNCF's backup precision, INT8_ASYM per channel (optimum-intel's `all_layers` unset).
- Tables gathered by position_ids (RoPE's cos/sin) stay f32: they are not weights of a matmul. INT4_SYM through
  `--option int4_sym=true`. A matmul whose input width the group size does not divide (the default
  model's MLP width 704 under 128) is compressed with the largest power-of-two group that does, at least
  32 (NNCF's `GroupSizeFallbackMode.ADJUST`, what optimum-intel's per-model defaults use), else int8.
The compressed weights stay Constants feeding Convert -> Subtract -> Multiply -> MatMul, which the CPU
plugin folds into FullyConnected with compressed weights; the attention and its state are untouched.
"""
from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections import Counter
from typing import Any

from kvexport.errors import BackendUnavailableError, InputError

BLOCK_MODES = ("int8", "int4")
# --option quantizer: NNCF's data-free rounding, or its GPTQ fed the calibration text. NNCF's AWQ and scale
# estimation were measured on the trained default model and moved its logits no less than data-free rounding
# (docs/backends/intel.md), so they are not offered.
QUANTIZERS = {"rtn": {}, "gptq": {"gptq": True}}
# NNCF's calibration dataset: the calibration text's tokens in windows of this many, one item (one fresh state) each;
# the cpu target's GPTQ prefills the same windows (kvexport.runtime.session.PREFILL_PIECE)
CALIBRATION_WINDOW = 256
DEFAULT_GROUP_SIZE = {"int8": None, "int4": 128}  # None: one scale per output channel
MIN_ADJUSTED_GROUP = 32


def nncf_version() -> str | None:
    try:
        import nncf
    except ImportError:
        return None
    return str(nncf.__version__)


def plan(weights: str, group_size: int | None, sym: bool, quantizer: str = "rtn") -> dict[str, Any]:
    """What compress() will ask NNCF for: recorded in the manifest, and checked before any export."""
    if weights not in BLOCK_MODES:
        raise InputError(f"NNCF compresses intel weights to {' or '.join(BLOCK_MODES)}, not {weights!r}")
    check_quantizer(weights, quantizer)
    group = group_size if group_size is not None else DEFAULT_GROUP_SIZE[weights]
    mode = f"INT8_{'SYM' if sym else 'ASYM'}" if weights == "int8" else f"INT4_{'SYM' if sym else 'ASYM'}"
    record: dict[str, Any] = {"method": "nncf.compress_weights", "mode": mode, "group_size": group or -1,
                              "ratio": 1.0}
    if weights == "int4":
        record |= {"all_layers": False, "backup": "INT8_ASYM (embedding, lm_head)",
                   "group_size_fallback": f"adjust (>= {MIN_ADJUSTED_GROUP}, else INT8_ASYM)"}
    record["quantizer"] = quantizer
    if QUANTIZERS[quantizer]:
        record["data_aware"] = dict(QUANTIZERS[quantizer])
    return record


def check_quantizer(weights: str, quantizer: str) -> None:
    """A data-aware quantizer rounds int4 weights only: refused for any other --weights before the export."""
    if quantizer not in QUANTIZERS:
        raise InputError(f"--option quantizer takes {', '.join(QUANTIZERS)}, not {quantizer!r}")
    if quantizer != "rtn" and weights != "int4":
        raise InputError(f"--option quantizer={quantizer} corrects int4 weights (NNCF's data-aware methods take no "
                         f"INT8 mode, and fp32/bf16 weights are not rounded); with --weights {weights} drop the "
                         "option, or build --weights int4")


def calibration_dataset(model: Any, ring: Any, ids: list[int], window: int) -> list[dict[str, Any]]:
    """NNCF's calibration items for the stateful IR: `ids` cut into windows of `window` tokens, each prefilled from
    position 0 onto a fresh state (NNCF's engine resets the state before every item), with the inputs the session
    itself gives such a step (kvexport_intel.session.step_inputs)."""
    import numpy as np

    from kvexport_intel.session import step_inputs

    names = {name for port in model.inputs for name in port.get_names()}
    items = []
    for start in range(0, len(ids) - 1, window):  # every window holds at least 2 tokens
        piece = np.asarray(ids[start:start + window], dtype=np.int64)[None]
        S = piece.shape[1]
        causal = np.tril(np.ones((S, S), dtype=bool))[None, None]
        items.append(step_inputs(names, ring, 0, np.zeros(1, dtype=np.int32), piece,
                                 np.arange(S, dtype=np.int64)[None], causal))
    return items


def require_nncf() -> None:
    if nncf_version() is None:
        raise BackendUnavailableError("--weights int8/int4 on the intel target compresses with NNCF, which is not "
                                      "installed: pip install 'kvexport[intel]' (or pip install nncf==3.4.0)")


def compress(model: Any, record: dict[str, Any], dataset: list[dict[str, Any]] | None = None) -> Any:
    """Compress `model`'s matmul and embedding weights in place as `record` (from plan()) says; a data-aware
    record's corrections see `dataset` (calibration_dataset()), every item of it."""
    import nncf

    kwargs: dict[str, Any] = {"mode": getattr(nncf.CompressWeightsMode, record["mode"]),
                              "group_size": record["group_size"], "ratio": record["ratio"]}
    if record.get("data_aware"):
        if not dataset:
            raise InputError(f"--option quantizer={record['quantizer']} needs calibration text; none was given")
        kwargs |= {**record["data_aware"], "dataset": nncf.Dataset(dataset), "subset_size": len(dataset)}
    tables = position_tables(model)
    if tables:  # RoPE's cos/sin (or learned positions): NNCF would take them for embeddings
        kwargs["ignored_scope"] = nncf.IgnoredScope(names=tables)
        record["kept_f32"] = "tables gathered by position_ids (RoPE cos/sin, learned positions)"
    if record["mode"].startswith("INT4"):
        kwargs["all_layers"] = record["all_layers"]
        kwargs["advanced_parameters"] = nncf.AdvancedCompressionParameters(
            group_size_fallback_mode=nncf.GroupSizeFallbackMode.ADJUST, min_adjusted_group_size=MIN_ADJUSTED_GROUP)
    record["nncf"] = nncf_version()
    nncf.set_log_level(logging.ERROR)
    # data-free: its bit-width table and a second's progress bar, recorded below instead; data-aware: minutes on a
    # large model, so its progress bars go to stderr, beside the build's own progress
    with contextlib.redirect_stdout(sys.stderr if record.get("data_aware") else io.StringIO()):
        model = nncf.compress_weights(model, **kwargs)
    record["compressed_weights"] = dict(sorted(compressed_weights(model).items()))
    return model


def position_tables(model: Any) -> list[str]:
    """Names of the Gathers that read a Constant table by position_ids. NNCF compresses every Gather of a
    Constant as an embedding; only the one indexed by input_ids is one (optimum-intel's IRs compute RoPE
    from positions and have no such tables). A RoPE table in int8 rotates every query and key slightly wrong."""
    names = []
    for op in model.get_ops():
        if op.get_type_name() == "Gather" and op.input_value(0).get_node().get_type_name() == "Constant" \
                and "position_ids" in _parameters_above(op.input_value(1)):
            names.append(op.get_friendly_name())
    return names


def _parameters_above(port: Any) -> set[str]:
    found, seen, stack = set(), set(), [port.get_node()]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.get_type_name() == "Parameter":
            found.add(node.output(0).get_any_name())
        stack += [i.get_node() for i in node.input_values()]
    return found


LOW_BIT = {"u4": "int4", "i4": "int4", "u8": "int8", "i8": "int8"}


def compressed_weights(model: Any) -> Counter[str]:
    """How many weight tensors the model holds per compressed width: Constants of a low-bit type that are
    decompressed (Convert) into the first input of a Subtract (asymmetric) or Multiply (symmetric); their
    zero points, also low-bit Constants, enter Subtract second and are not counted."""
    found: Counter[str] = Counter()
    for op in model.get_ops():
        if op.get_type_name() != "Constant" or op.get_element_type().get_type_name() not in LOW_BIT:
            continue
        for convert in op.output(0).get_target_inputs():
            for use in convert.get_node().output(0).get_target_inputs():
                if use.get_node().get_type_name() in ("Subtract", "Multiply") and use.get_index() == 0:
                    found[LOW_BIT[op.get_element_type().get_type_name()]] += 1
    return found
