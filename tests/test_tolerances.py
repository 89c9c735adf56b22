"""The tolerance table: one place, keyed by (backend, precision[+lossy kv])."""
from __future__ import annotations

import pytest

from kvexport import backends
from kvexport.build import PRECISION_ALIASES
from kvexport.tolerances import TOLERANCES, precision_key, tolerance


def test_precision_key_marks_a_lossy_kv_cache() -> None:
    assert precision_key({"precision": "fp32", "options": {"kv_precision": "f32"}}) == "fp32"
    assert precision_key({"precision": "fp32", "options": {}}) == "fp32"
    # an intel artifact from before --kv: its u8 cache is kv int8, its f16 cache kv fp16
    assert precision_key({"precision": "bf16", "options": {"kv_precision": "u8"}}) == "bf16+kv-int8"
    assert precision_key({"precision": "fp32", "options": {"kv_precision": "f16"}}) == "fp32+kv-fp16"


@pytest.mark.parametrize("weights,kv,key", [
    ({"dtype": "fp32", "group_size": None}, {"dtype": "fp32"}, "fp32"),
    ({"dtype": "int8", "group_size": 32}, {"dtype": "fp32"}, "int8"),
    ({"dtype": "int4", "group_size": 32}, {"dtype": "fp32"}, "int4-g32"),
    ({"dtype": "int4", "group_size": 128}, {"dtype": "int8"}, "int4-g128+kv-int8"),
    ({"dtype": "fp32", "group_size": None}, {"dtype": "int8"}, "fp32+kv-int8"),
    ({"dtype": "fp16", "group_size": None}, {"dtype": "fp16"}, "fp16"),  # a cache in the weights' own type
    ({"dtype": "int8", "group_size": None}, {"dtype": "int8"}, "int8+kv-int8"),  # int8 weights, int8 cache: both lossy
])
def test_precision_key_reads_the_weights_and_kv_records(weights: dict, kv: dict, key: str) -> None:
    assert precision_key({"precision": weights["dtype"], "weights": weights, "kv": kv}) == key


def test_every_registered_target_has_a_row_for_each_precision() -> None:
    for name in backends.names():
        try:
            caps = backends.get(name).capabilities()
        except Exception as e:  # noqa: BLE001 - a backend that cannot load is reported by doctor
            pytest.fail(f"backend {name} failed to load: {e}")
        for p in caps.precisions:
            if p in ("fp32", "fp16", "bf16"):  # block modes are keyed with their group size
                assert (name, p) in TOLERANCES, (name, p)


def test_unknown_key_says_where_to_add_it() -> None:
    with pytest.raises(KeyError, match="tolerances.py"):
        tolerance("cpu", "int3")


def test_precision_aliases_are_canonical() -> None:
    assert PRECISION_ALIASES["f32"] == "fp32" and PRECISION_ALIASES["bfloat16"] == "bf16"
