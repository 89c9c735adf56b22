"""The one precision vocabulary (--weights/--group-size/--kv/auto) and the one --option parser, in core."""
from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvexport.backends import AutoMode, Backend, BuildOptions, Capabilities, Option, parse_bool, parse_options
from kvexport.errors import InputError
from kvexport.precision import canonical, resolve
from kvexport.tolerances import TOLERANCES


class Toy(Backend):
    """A target that builds fp32 and int4 weights, an fp32 or int8 cache, and prefers int4 where AVX-VNNI is."""

    name = "cpu"  # its rows are the cpu target's, so auto sees which modes have one

    def __init__(self, weights: tuple[str, ...] = ("fp32", "int8", "int4"), auto: list[AutoMode] | None = None):
        self.weights, self.auto = weights, auto

    def capabilities(self) -> Capabilities:
        return Capabilities(name="cpu", description="toy", ir_cache_style="static", cache_policy="grow",
                            precisions=self.weights, default_precision="fp32", devices=("cpu",),
                            kv_modes=("fp32", "int8"), group_sizes=(32, 128),
                            options=(Option("fast", "bool", False, "go fast"), Option("n", "int", 3, "how many"),
                                     Option("mode", "str", "a", "which", choices=("a", "b")),
                                     Option("graphs", "bool", None, "at load", phase="load")),
                            option_aliases={"kv_precision": ("kv", {"f32": "fp32", "u8": "int8"})})

    def auto_modes(self, flags: set[str]) -> list[AutoMode]:
        if self.auto is not None:
            return self.auto
        return super().auto_modes(flags)

    def availability(self) -> list[str]:
        return []

    def build(self, *a: Any) -> None:  # pragma: no cover - never reached: resolve refuses before
        raise AssertionError

    def open_session(self, *a: Any, **k: Any) -> Any:  # pragma: no cover
        raise AssertionError


@pytest.mark.parametrize(("options", "match"), [
    (BuildOptions(weights="int3"), "--weights is one of fp32, fp16, bf16, int8, int4 or auto, not 'int3'"),
    (BuildOptions(kv="int2"), "--kv is one of fp32, fp16, bf16, int8 or auto"),
    (BuildOptions(weights="bf16"), "builds weight precisions fp32, int8, int4"),
    (BuildOptions(kv="fp16"), "builds KV-cache precisions fp32, int8"),
    (BuildOptions(weights="int4", group_size=48), "--group-size is one of 32, 64, 128, not 48"),
    (BuildOptions(weights="int4", group_size=64), "builds group sizes 32, 128, not 64"),
    (BuildOptions(weights="fp32", group_size=32), "--group-size applies to --weights int8 or int4"),
    (BuildOptions(group_size=32), "--group-size applies to --weights int8 or int4, not fp32"),
    (BuildOptions(precision="fp32", weights="int4"), "--precision is another name for --weights"),
    (BuildOptions(kv="fp32", extra={"kv_precision": "u8"}), "kv_precision=u8 is --kv int8, and --kv fp32"),
    (BuildOptions(extra={"kv_precision": "q4"}), "kv_precision is one of f32, u8"),
])
def test_bad_modes_are_refused_with_what_the_target_builds(options: BuildOptions, match: str) -> None:
    with pytest.raises(InputError, match=match.replace("+", r"\+")):
        resolve(Toy(), options, set())


def test_int4_on_a_target_that_lacks_it_is_refused() -> None:
    with pytest.raises(InputError, match="builds weight precisions fp32, bf16 .*not int4"):
        resolve(Toy(weights=("fp32", "bf16")), BuildOptions(weights="int4", group_size=32), set())


def test_defaults_aliases_and_the_default_group_size() -> None:
    o = BuildOptions(precision="float32")
    r = resolve(Toy(), o, set())
    assert (r.weights, r.group_size, r.kv, r.auto) == ("fp32", None, "fp32", None) and o.weights == "fp32"
    o = BuildOptions(weights="int4")
    assert resolve(Toy(), o, set()).group_size == 32 and (o.group_size, o.kv) == (32, "fp32")
    o = BuildOptions()  # nothing asked: the backend keeps its own default
    assert resolve(Toy(), o, set()).weights is None and o.weights is None and o.kv == "fp32"


def test_kv_precision_option_is_an_alias_of_kv_and_says_so() -> None:
    said: list[str] = []
    o = BuildOptions(extra={"kv_precision": "u8"})
    assert resolve(Toy(), o, set(), said.append).kv == "int8"
    assert o.kv == "int8" and o.extra["kv_precision"] == "u8"  # the backend still sees which int8 format
    assert any("is a --kv int8 cache" in m for m in said)


def test_auto_takes_the_first_preference_that_fits_and_has_a_tolerance_row() -> None:
    prefs = [AutoMode("int4", "int8", "no row for this pair", 64),
             AutoMode("int4", "fp32", "int4 reads an eighth of fp32's bytes"),
             AutoMode("fp32", "fp32", "exact")]
    assert ("cpu", "int4-g64+kv-int8") not in TOLERANCES  # the first is skipped for want of a row
    have_int4 = ("cpu", "int4-g32") in TOLERANCES
    said: list[str] = []
    o = BuildOptions(weights="auto")
    r = resolve(Toy(auto=prefs), o, {"avx2"}, said.append)
    want = prefs[1] if have_int4 else prefs[2]
    assert (r.weights, r.kv, r.auto.reason) == (want.weights, want.kv, want.reason)
    assert o.weights == want.weights and any(want.reason in m and m.startswith("auto:") for m in said)
    # a named cache narrows auto's choice to the preferences with that cache
    r = resolve(Toy(auto=prefs), BuildOptions(weights="auto", kv="fp32"), set())
    assert r.kv == "fp32"
    with pytest.raises(InputError, match="auto found no mode"):
        resolve(Toy(auto=prefs[:1]), BuildOptions(kv="auto"), set())


@pytest.mark.parametrize(("value", "want"), [
    *[(w, True) for w in ("true", "1", "yes", "on", "TRUE", " On ", True)],
    *[(w, False) for w in ("false", "0", "no", "off", "No", False)],
])
def test_one_rule_for_booleans(value: Any, want: bool) -> None:
    assert parse_bool("fast", value) is want


@pytest.mark.parametrize("value", ["maybe", "2", "", "enabled", "t"])
def test_anything_else_is_not_a_boolean(value: str) -> None:
    with pytest.raises(InputError, match="option fast is true or false"):
        parse_bool("fast", value)


def test_declared_options_are_typed_defaulted_and_checked() -> None:
    toy = Toy()
    declared = toy.capabilities().options
    assert parse_options(declared, {"fast": "yes", "n": "7"}, target="toy", phase="build") == \
        {"fast": True, "n": 7, "mode": "a"}
    assert toy.build_options(BuildOptions(extra={"mode": "B", "kv_precision": "u8"}))["mode"] == "b"
    with pytest.raises(InputError, match=r"unknown toy options \['graphs'\] at build; the toy target takes fast"):
        parse_options(declared, {"graphs": "1"}, target="toy", phase="build")  # a load option, not a build one
    with pytest.raises(InputError, match="option n takes an integer, got 'many'"):
        parse_options(declared, {"n": "many"}, target="toy", phase="build")
    with pytest.raises(InputError, match="option mode is one of a, b, not 'c'"):
        parse_options(declared, {"mode": "c"}, target="toy", phase="build")
    assert parse_options(declared, {"graphs": "off"}, target="toy", phase="load") == {"graphs": False}


def test_load_options_are_checked_by_core_for_every_target() -> None:
    """Backend.load's options: the declared load ones typed, threads where the target takes a thread count,
    no_rebuild kept where loading may rebuild and dropped where it never does (it holds already), anything else
    refused with what the target takes."""
    toy = Toy()
    assert toy.load_options({"graphs": "on", "threads": None, "no_rebuild": True}) == {"graphs": True}
    assert toy.load_options({"threads": 4}) == {"threads": 4}
    with pytest.raises(InputError, match=r"unknown cpu load options \['fast'\]; the cpu target takes threads \(int\)"):
        toy.load_options({"fast": True})  # a build option, not a load one
    with pytest.raises(InputError, match="option graphs is true or false"):
        toy.load_options({"graphs": "maybe"})

    class Rebuilds(Toy):
        def capabilities(self) -> Capabilities:
            return dataclasses.replace(super().capabilities(), rebuilds_at_load=True, threads_option=False)

    assert Rebuilds().load_options({"no_rebuild": True, "threads": None}) == {"no_rebuild": True}
    with pytest.raises(InputError, match="sets no thread count"):
        Rebuilds().load_options({"threads": 2})


def test_cli_refuses_bad_modes_before_any_export(tmp_path: Path) -> None:
    for args, needle in [(["--weights", "int3"], "--weights is one of"),
                         (["--weights", "int4", "--group-size", "48"], "--group-size is one of 32, 64, 128, not 48"),
                         (["--kv", "int8", "--target", "nvidia"], "builds KV-cache precisions fp16, bf16"),
                         # a TensorRT engine keeps its cache in its own float type
                         (["--weights", "fp32", "--kv", "fp16", "--target", "nvidia"], "--weights fp32 takes --kv fp32"),
                         # a combination nobody measured has no row to verify against (not a KeyError after the build)
                         (["--weights", "int8", "--kv", "int8"], "has no tolerance row for int8+kv-int8"),
                         (["--option", "quantizer=gptq"], "quantizer=gptq rounds int8/int4 weights; --weights fp32")]:
        p = subprocess.run([sys.executable, "-m", "kvexport", "build", "-o", str(tmp_path / "x.kvx"), *args],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert not any(tmp_path.iterdir())  # refused before the export wrote anything


def inspect(folder: Path) -> str:
    p = subprocess.run([sys.executable, "-m", "kvexport", "inspect", str(folder), "--no-hash-check"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_build_records_weight_and_cache_bytes_and_inspect_prints_them(artifacts: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    folder = artifacts["llama"]
    m = json.loads((folder / "manifest.json").read_text())
    t, cfg = m["target"], m["model"]["config"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    assert t["precision"] == "fp32" and t["weights"]["dtype"] == "fp32" and t["weights"]["group_size"] is None
    assert t["weights"]["bytes"] >= 4 * m["model"]["num_parameters"]  # every fp32 weight, counted in the engine
    assert canonical(t["kv"]["dtype"]) == "fp32" and t["kv"]["bytes_per_token"] == per_token and "auto" not in t
    out = inspect(folder)
    assert f"weights: fp32, {t['weights']['bytes']} bytes" in out
    assert "engine files on disk" not in out  # the files hold what the weights line counts
    # an engine whose runtime holds its weights in another size than its files (intel bf16: f32 on disk, converted
    # when the plugin compiles) says both
    held = tmp_path / "held.kvx"
    shutil.copytree(folder, held)
    m2 = json.loads((held / "manifest.json").read_text())
    m2["target"]["weights"] = {**m2["target"]["weights"], "dtype": "bf16", "bytes": t["weights"]["bytes"] // 2}
    (held / "manifest.json").write_text(json.dumps(m2))
    disk = sum((held / f).stat().st_size for f in t["engine_files"])
    assert f"engine files on disk: {disk / 2**20:.1f} MiB; the weights above are counted as the runtime holds " \
           "them (bf16)" in inspect(held)
    assert f"KV cache: fp32, {per_token} bytes per token per row" in out
    # an intel u8 build from before target.kv: inspect reads its kv_precision, not the IR's f32 cache type
    legacy = tmp_path / "legacy.kvx"
    shutil.copytree(folder, legacy)
    del t["kv"], t["weights"]
    t["options"]["kv_precision"] = "u8"
    (legacy / "manifest.json").write_text(json.dumps(m))
    int8 = per_token // 4 + per_token // 4 // cfg["head_dim"] * 8  # one byte each, f32 scale + zero point per head
    assert f"KV cache: int8, {int8} bytes per token per row" in inspect(legacy)
