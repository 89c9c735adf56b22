"""Fingerprint and rebuild decisions, fed fake device facts (no GPU needed)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvexport.errors import ArtifactError
from kvexport_nvidia import fingerprint as fp
from kvexport_nvidia.backend import cached_plan_ok
from kvexport.checkpoint import sha256_file

H200 = fp.DeviceInfo(tensorrt="10.15.1", gpu_name="NVIDIA H200", compute_capability="9.0", driver="580.65.06")


def _target(**fingerprint: str) -> dict:
    return {"backend": "nvidia", "precision": "fp16", "engine_files": [], "options": {"deferred": False},
            "fingerprint": {**H200.fingerprint(), **fingerprint}}


def test_matching_engine_is_used() -> None:
    d = fp.decide(_target(), H200)
    assert d.action is fp.Action.USE
    fp.require_usable(d, no_rebuild=True, artifact=Path("a.kvx"))  # no error


@pytest.mark.parametrize("field, value", [
    ("tensorrt", "11.0.0"), ("gpu_name", "NVIDIA A100-SXM4-80GB"), ("compute_capability", "8.0"), ("driver", "570.1"),
])
def test_any_fingerprint_difference_rebuilds(field: str, value: str) -> None:
    d = fp.decide(_target(**{field: value}), H200)
    assert d.action is fp.Action.REBUILD
    assert value in d.reason and str(getattr(H200, field)) in d.reason
    with pytest.raises(ArtifactError, match="no_rebuild"):
        fp.require_usable(d, no_rebuild=True, artifact=Path("a.kvx"))
    fp.require_usable(d, no_rebuild=False, artifact=Path("a.kvx"))


def test_deferred_artifact_builds_at_first_load() -> None:
    t = {"backend": "nvidia", "fingerprint": {}, "options": {"deferred": True}}
    d = fp.decide(t, H200)
    assert d.action is fp.Action.BUILD and "deferred" in d.reason
    assert fp.decide({"fingerprint": {}, "deferred": True, "options": {}}, H200).action is fp.Action.BUILD
    with pytest.raises(ArtifactError):
        fp.require_usable(d, no_rebuild=True, artifact=Path("a.kvx"))


def test_empty_fingerprint_is_a_mismatch_not_a_crash() -> None:
    d = fp.decide({"fingerprint": {}, "options": {}}, H200)
    assert d.action is fp.Action.REBUILD


def test_cache_key_separates_machines_irs_and_options() -> None:
    base = fp.cache_key("ir1", H200.fingerprint(), {"max_batch": 8})
    assert base == fp.cache_key("ir1", H200.fingerprint(), {"max_batch": 8})
    assert base != fp.cache_key("ir2", H200.fingerprint(), {"max_batch": 8})
    assert base != fp.cache_key("ir1", {**H200.fingerprint(), "driver": "1"}, {"max_batch": 8})
    assert base != fp.cache_key("ir1", H200.fingerprint(), {"max_batch": 4})


def test_cache_root_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVEXPORT_CACHE", str(tmp_path))
    assert fp.cache_root() == tmp_path / "nvidia"


def test_cached_plan_needs_matching_entry_and_bytes(tmp_path: Path) -> None:
    plan, entry = tmp_path / "model.plan", tmp_path / "entry.json"
    assert not cached_plan_ok(entry, plan, H200.fingerprint(), "ir")
    plan.write_bytes(b"plan bytes")
    entry.write_text(json.dumps({"sha256": sha256_file(plan), "fingerprint": H200.fingerprint(), "ir_sha256": "ir"}))
    assert cached_plan_ok(entry, plan, H200.fingerprint(), "ir")
    assert not cached_plan_ok(entry, plan, {**H200.fingerprint(), "tensorrt": "11.0"}, "ir")
    assert not cached_plan_ok(entry, plan, H200.fingerprint(), "other-ir")
    plan.write_bytes(b"plan bytes, truncated or edited")
    assert not cached_plan_ok(entry, plan, H200.fingerprint(), "ir")
    entry.write_text("{not json")
    assert not cached_plan_ok(entry, plan, H200.fingerprint(), "ir")


def test_nvidia_smi_parsing_and_absence(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fp.parse_smi_line("NVIDIA H200, 580.65.06, 9.0") == {
        "gpu_name": "NVIDIA H200", "driver": "580.65.06", "compute_capability": "9.0"}
    with pytest.raises(ValueError):
        fp.parse_smi_line("garbage")
    monkeypatch.setattr(fp.shutil, "which", lambda _name: None)
    info, why = fp.nvidia_smi()
    assert info is None and "nvidia-smi" in why
