"""`kvexport bench`'s floor: the weight matrices a decode step reads, timed alone."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from kvexport.architectures import map_config
from kvexport.bench import GemvFloor, linear_shapes
from kvexport.zoo import TINY_CONFIGS, write_checkpoint


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_linear_shapes_cover_every_weight_matrix_of_the_checkpoint(family: str, tmp_path: Path) -> None:
    cfg = map_config(TINY_CONFIGS[family])
    folder = write_checkpoint(TINY_CONFIGS[family], tmp_path / family)
    tensors = load_file(str(folder / "model.safetensors"))
    gathered = ("embed_tokens", "wte", "wpe")  # tables a step gathers one row of
    read = sum(t.size for name, t in tensors.items() if t.ndim == 2 and not any(g in name for g in gathered))
    if cfg.tie_word_embeddings:  # the lm_head is the embedding table, read whole
        read += cfg.vocab_size * cfg.hidden_size
    assert sum(k * n for k, n in linear_shapes(cfg)) == read


def test_gemv_floor_runs_one_matmul_per_shape() -> None:
    cfg = map_config(TINY_CONFIGS["llama"])
    floor = GemvFloor(cfg, threads=1)
    shapes = linear_shapes(cfg)
    assert [tuple(o.shape) for o in floor.sess.get_outputs()] == [(1, n) for _, n in shapes]
    assert floor.weight_bytes == 4 * sum(k * n for k, n in shapes)
    assert floor.measure(steps=3) > 0
    outputs = floor._buffers[-len(shapes):]
    assert all(np.isfinite(y).all() and np.abs(y).max() > 0 for y in outputs)  # the MatMuls wrote their outputs
