"""The tolerance table: one place, keyed by (backend, precision[+lossy kv])."""
from __future__ import annotations

import pytest

from kvexport import backends
from kvexport.build import PRECISION_ALIASES
from kvexport.tolerances import TOLERANCES, precision_key, tolerance


def test_precision_key_marks_a_lossy_kv_cache() -> None:
    assert precision_key({"precision": "fp32", "options": {"kv_precision": "f32"}}) == "fp32"
    assert precision_key({"precision": "fp32", "options": {}}) == "fp32"
    assert precision_key({"precision": "bf16", "options": {"kv_precision": "u8"}}) == "bf16+kv-u8"


def test_every_registered_target_has_a_row_for_each_precision() -> None:
    for name in backends.names():
        try:
            caps = backends.get(name).capabilities()
        except Exception as e:  # noqa: BLE001 - a backend that cannot load is reported by doctor
            pytest.fail(f"backend {name} failed to load: {e}")
        for p in caps.precisions:
            assert (name, p) in TOLERANCES, (name, p)


def test_unknown_key_says_where_to_add_it() -> None:
    with pytest.raises(KeyError, match="tolerances.py"):
        tolerance("cpu", "int3")


def test_precision_aliases_are_canonical() -> None:
    assert PRECISION_ALIASES["f32"] == "fp32" and PRECISION_ALIASES["bfloat16"] == "bf16"
