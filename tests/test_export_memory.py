"""The IR's weights go to external data one tensor at a time: no whole-model proto is ever built."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from kvexport.artifact import open_artifact
from kvexport.checkpoint import load_checkpoint
from kvexport.export import DATA_FILE, MODEL_FILE, decoder_from_ir, export_onnx


def test_export_never_builds_the_whole_model_proto(checkpoints: dict[str, Path], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """program.model_proto copies every weight into one proto (a second model in memory, and past 2 GB
    one protobuf cannot serialize): export must not touch it."""
    from torch.onnx._internal.exporter._onnx_program import ONNXProgram

    def refuse(self: object) -> None:
        raise AssertionError("export built the whole-model proto")

    monkeypatch.setattr(ONNXProgram, "model_proto", property(refuse))
    ck = load_checkpoint(checkpoints["llama"])
    ir = export_onnx(ck, tmp_path)
    params = dict(ck.decoder.named_parameters())
    assert set(ir.weights) == set(params)  # every parameter found in the IR by value


def test_ir_weights_live_in_external_data_above_the_threshold(artifacts: dict[str, Path],
                                                              checkpoints: dict[str, Path]) -> None:
    folder, manifest = open_artifact(artifacts["llama"])
    model = onnx.load(str(folder / MODEL_FILE), load_external_data=False)
    data_size = (folder / DATA_FILE).stat().st_size
    spans = []
    for init in model.graph.initializer:
        nbytes = int(np.prod(init.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
        if init.data_location == onnx.TensorProto.EXTERNAL:
            where = {e.key: e.value for e in init.external_data}
            assert where["location"] == DATA_FILE and int(where["length"]) == nbytes
            spans.append((int(where.get("offset", 0)), nbytes))
        else:
            assert nbytes <= 1024, f"{init.name} ({nbytes} bytes) is inline in {MODEL_FILE}"
    spans.sort()
    assert spans and sum(n for _, n in spans) <= data_size and spans[-1][0] + spans[-1][1] <= data_size
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))  # no two tensors overlap
    assert (folder / MODEL_FILE).stat().st_size < data_size / 4
    # loading works from the external data: the decoder rebuilt from the IR has the checkpoint's weights
    got = decoder_from_ir(folder, manifest).state_dict()
    want = load_checkpoint(checkpoints["llama"]).decoder.state_dict()
    assert all(np.array_equal(got[n].numpy(), want[n].numpy()) for n in want if n.endswith("weight"))
    import onnxruntime as ort

    sess = ort.InferenceSession(str(folder / MODEL_FILE), providers=["CPUExecutionProvider"])
    assert [o.name for o in sess.get_outputs()][0] == "logits"


def test_decoder_from_ir_refuses_short_external_data(artifacts: dict[str, Path], tmp_path: Path) -> None:
    """decoder_from_ir reads each weight straight from the external data file (the IR's weights are held once,
    not once in the protobuf and again in the decoder): a truncated file is a typed error, not short weights."""
    import shutil

    from kvexport.errors import ArtifactError

    folder, manifest = open_artifact(artifacts["llama"])
    copy = tmp_path / "ir"
    shutil.copytree(folder, copy)
    with open(copy / DATA_FILE, "r+b") as f:
        f.truncate((copy / DATA_FILE).stat().st_size - 4)
    with pytest.raises(ArtifactError, match="damaged"):
        decoder_from_ir(copy, manifest)
