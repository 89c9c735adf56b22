"""Optimization profiles computed from the manifest."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvexport.errors import InputError
from kvexport.manifest import read
from kvexport_nvidia.profiles import DECODE, PREFILL, check_request, make_profiles, pick_profile

from nvidia_ort_twin import MAX_SEQ


@pytest.fixture(scope="module")
def manifest(tiny_ir: Path):  # type: ignore[no-untyped-def]
    return read(tiny_ir)


def test_prefill_and_decode_shapes(manifest) -> None:  # type: ignore[no-untyped-def]
    prefill, decode = make_profiles(manifest, max_batch=4, max_prefill=48)
    assert prefill.name == "prefill" and decode.name == "decode"
    assert prefill.shapes["input_ids"] == ((1, 1), (1, 48), (4, 48))  # opt: min(max_prefill, 128)
    assert prefill.shapes["attention_mask"] == ((1, 1, 1, MAX_SEQ), (1, 1, 48, MAX_SEQ), (4, 1, 48, MAX_SEQ))
    assert prefill.shapes["write_index"] == ((1,), (1,), (4,))
    cache = prefill.shapes["past_key_values.1.value"]
    assert cache == ((1, 2, MAX_SEQ, 16), (1, 2, MAX_SEQ, 16), (4, 2, MAX_SEQ, 16))  # static S_max
    assert decode.shapes["input_ids"] == ((1, 1), (1, 1), (4, 1))
    assert decode.shapes["attention_mask"][2] == (4, 1, 1, MAX_SEQ)
    names = {i["name"] for i in manifest.inputs}
    assert set(prefill.shapes) == set(decode.shapes) == names


def test_defaults_and_opt(manifest) -> None:  # type: ignore[no-untyped-def]
    prefill, _ = make_profiles(manifest, max_batch=1)
    assert prefill.shapes["input_ids"][2] == (1, MAX_SEQ)  # a prompt may fill the cache
    prefill, _ = make_profiles(manifest, max_batch=2, max_prefill=32, opt_prefill=7)
    assert prefill.shapes["input_ids"][1] == (1, 7)
    d = prefill.to_dict()
    assert d["shapes"]["input_ids"] == [[1, 1], [1, 7], [2, 32]]


@pytest.mark.parametrize("kw, match", [
    ({"max_batch": 0}, "max_batch"),
    ({"max_batch": 1, "max_prefill": MAX_SEQ + 1}, "max_prefill"),
    ({"max_batch": 1, "max_prefill": 8, "opt_prefill": 9}, "opt_prefill"),
])
def test_bad_limits_are_input_errors(manifest, kw, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InputError, match=match):
        make_profiles(manifest, **kw)


def test_concat_ir_is_refused(manifest) -> None:  # type: ignore[no-untyped-def]
    import copy

    m = copy.deepcopy(manifest)
    m.raw["ir"]["cache_style"] = "concat"
    with pytest.raises(InputError, match="static-cache"):
        make_profiles(m, max_batch=1)


def test_profile_choice_and_request_limits(manifest) -> None:  # type: ignore[no-untyped-def]
    profiles = make_profiles(manifest, max_batch=2, max_prefill=16)
    assert pick_profile(profiles, 1) == DECODE and pick_profile(profiles, 5) == PREFILL
    check_request(profiles, 2, 16)
    check_request(profiles, 1, 1)
    with pytest.raises(InputError, match="batch 1..2"):
        check_request(profiles, 3, 1)
    with pytest.raises(InputError, match="max_prefill"):
        check_request(profiles, 1, 17)
    assert profiles[PREFILL].covers("input_ids", (2, 9)) and not profiles[DECODE].covers("input_ids", (1, 2))
