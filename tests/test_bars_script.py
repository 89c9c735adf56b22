"""benchmarks/bars.py without running its plan (that takes hours): every command it would run parses under the
parser of the program it calls, every load option it gives an artifact is one that artifact's target declares,
a group brings along what its measurements need, and the table's arithmetic reads the outputs the way
`kvexport bench --json`, `peers.py bench --json` and `kvexport verify --json` write them."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kvexport import backends
from kvexport.cli import parser as kvexport_parser

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
AVX2 = {"avx2", "fma"}
ZEN4 = AVX2 | {"avx512f", "avx512_vnni", "avx512_bf16"}
AMX = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}


def _module(name: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(f"{name}_script", BENCH / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bars():  # type: ignore[no-untyped-def]
    return _module("bars")


@pytest.fixture(scope="module")
def peers():  # type: ignore[no-untyped-def]
    return _module("peers")


def _target(path: str) -> str:
    name = Path(path).name
    return "intel" if "-intel-" in name else "cpu"


@pytest.mark.parametrize("flags", [AVX2, ZEN4, AMX], ids=["avx2", "avx512-bf16", "amx"])
def test_every_planned_command_parses_and_its_load_options_are_declared(bars, peers, flags, tmp_path) -> None:  # type: ignore[no-untyped-def]
    plan = bars.make_plan(tmp_path, flags)
    names = [s.name for s in plan.steps]
    assert len(names) == len(set(names)), "two steps would keep their output in one file"
    checked = 0
    for step in plan.steps:
        argv = step.argv
        if argv[1:3] == ["-m", "kvexport"]:
            a = kvexport_parser().parse_args(argv[3:])
            options = [*(getattr(a, "option", None) or []), *(getattr(a, "variant", None) or [])]
            artifact = getattr(a, "artifact", None)
            for text in options:
                for pair in text.split(","):
                    key, _, value = pair.partition("=")
                    backends.get(_target(artifact)).load_options({key: value})
                    checked += 1
        else:
            assert argv[1] == str(bars.PEERS)
            a = peers.parser().parse_args(argv[2:])
            for system in getattr(a, "systems", []):
                path, _, opts = system.partition("@")
                if opts and (Path(path).suffix == ".kvx"):
                    for pair in opts.split(","):
                        key, _, value = pair.partition("=")
                        backends.get(_target(path)).load_options({key: value})
                        checked += 1
    assert checked >= 4  # precision=fp32 and kv_precision=f32 on the intel artifacts at least
    bf16 = "intel-bf16-vs-openvino" in names
    assert bf16 == bool({"avx512_bf16", "amx_bf16"} & flags)
    if bf16:  # like for like: the engine built to run bf16, against the peer under its bf16 hint
        build = next(s for s in plan.steps if s.name == "build-b1-intel-bf16").argv
        assert build[build.index("--weights") + 1] == "bf16"
    peer = next(s for s in plan.steps if s.name == "intel-int8-vs-openvino").argv
    assert any(x.endswith("@precision=bf16,kv=bf16") for x in peer) == bf16  # the peer runs the engine's precision


def test_a_group_brings_what_its_measurements_use(bars, tmp_path) -> None:  # type: ignore[no-untyped-def]
    plan = bars.make_plan(tmp_path, ZEN4)
    names = [s.name for s in bars.needed(plan, {"intel"})]
    for need in ("checkpoint-bench-1b", "build-b1-intel-int8", "build-peers1b-openvino-int8", "peers-setup",
                 "intel-int8-vs-openvino"):
        assert need in names
    assert "cpu-int8" not in names and "build-b1-cpu-int8" not in names
    assert names.index("build-b1-intel-int8") < names.index("intel-int8-vs-openvino")
    quality = [s.name for s in bars.needed(plan, {"quality"})]
    assert quality and all(n.startswith(("build-def-", "verify-def-")) for n in quality)


def test_a_folder_an_interrupted_step_left_is_made_again(bars, tmp_path) -> None:  # type: ignore[no-untyped-def]
    peer = tmp_path / "openvino-int8"
    peer.mkdir()
    (peer / "config.json").write_text("{}")  # optimum-cli's first file, before the model
    assert not bars.complete(peer)
    (peer / "openvino_model.xml").write_text("<net/>")
    assert bars.complete(peer)
    art = tmp_path / "b1-cpu-int8.kvx"
    (art / "engine").mkdir(parents=True)
    assert not bars.complete(art)
    (art / "manifest.json").write_text("{}")
    assert bars.complete(art)


def test_the_last_json_document_after_progress_lines(bars) -> None:  # type: ignore[no-untyped-def]
    text = "cpu: x\nprompt 32 round 1: a {b}\n{\n  \"prompts\": {\"32\": 1}\n}\n"
    assert bars.last_json(text) == {"prompts": {"32": 1}}
    with pytest.raises(ValueError):
        bars.last_json("no json here\n")


def _write(work: Path, name: str, output: dict) -> None:
    (work / "results").mkdir(parents=True, exist_ok=True)
    (work / "results" / f"{name}.json").write_text(json.dumps({"argv": [], "rc": 0, "wall_s": 1.0, "output": output}))


def _modes(speed: float, floor: float, own: float, differs: str | None = None) -> dict:
    """`kvexport bench QUANTIZED --compare fp32 --json`: fp32's ratios over the quantized engine."""
    engine = {"fraction_of_own_floor_median_round": own, **({"floor_placement_differs": differs} if differs else {})}
    fp32 = {"decode_ratio_vs_main_median_round": 1 / speed, "floor_ratio_vs_main": 1 / floor}
    return {"prompts": {p: {"engine": engine, "other:/w/b1-cpu-fp32.kvx": fp32} for p in ("32", "512")}}


def test_the_table_reads_ratios_the_way_the_commands_write_them(bars, tmp_path) -> None:  # type: ignore[no-untyped-def]
    work = tmp_path
    # kvexport bench: the quantized engine is the main one, fp32 its --compare
    _write(work, "cpu-int8", _modes(2.6, 2.9, 0.9))
    _write(work, "cpu-int4", _modes(3.2, 3.4, 0.95))
    # peers.py bench: ratios are the peer over the first system (kvexport's), so kvexport over it is the inverse
    _write(work, "cpu-vs-ortgenai", {"prompts": {p: {
        "/w/b1-cpu-int4.kvx": {"decode_ratio_vs_first": 1.0, "ttft_ratio_vs_first_median_round": 1.0},
        "/w/peers1b/ortgenai-int4-g32": {"decode_ratio_vs_first": 0.8, "ttft_ratio_vs_first_median_round": 1.5}}
        for p in ("32", "512")}})
    _write(work, "intel-int8-vs-openvino", {"prompts": {p: {
        "/w/b1-intel-int8.kvx": {"decode_ratio_vs_first": 1.0},
        "/w/peers1b/openvino-int8@precision=bf16,kv=bf16": {"decode_ratio_vs_first": 1.02,
                                                             "decode_ratio_quartiles": [0.98, 1.05]}}
        for p in ("32", "512")}})
    _write(work, "verify-def-cpu-int8", {"passed": True, "text": {"ppl_change": 0.004, "top1_agreement": 0.99,
                                                                   "mean_kl": 1e-3}})
    _write(work, "verify-def-cpu-int4-g32", {"passed": False, "text": {"ppl_change": 0.09, "top1_agreement": 0.9,
                                                                        "mean_kl": 1e-2}})
    rows = {bar: (figure, verdict) for bar, figure, verdict in bars.bars(work, ZEN4)}

    def row(prefix: str) -> tuple[str, str]:
        return next(v for k, v in rows.items() if k.startswith(prefix))

    assert row("`cpu` int8 decode")[1] == "met"  # 2.6x >= 2.5x, 90% of its floor
    assert "2.60x fp32 (floors 2.90x), 90% of its floor" in row("`cpu` int8 decode")[0]
    figure, verdict = row("`cpu` int4 decode >= 4.0x")
    assert verdict == "met" and "floors 3.40x" in figure  # 3.2x is >= 90% of the floors' 3.4x (3.06x)
    assert row("`cpu` int4 decode >= 1.1x onnxruntime")[1] == "met"  # 1 / 0.8 = 1.25x
    assert "1.25x" in row("`cpu` int4 decode >= 1.1x onnxruntime")[0]
    assert row("`cpu` int4 TTFT")[1] == "met" and "0.67x" in row("`cpu` int4 TTFT")[0]  # 1 / 1.5
    assert row("`intel` int8 decode")[1] == "**missed**"  # the peer ran 1.02x: intel 0.98x
    assert row("`intel` int4 g128")[1] == "not run"
    assert row("quality def-cpu-int8")[1] == "met" and "+0.40%" in row("quality def-cpu-int8")[0]
    assert row("quality def-cpu-int4-g32")[1] == "**missed**"  # +9% > 8%
    assert "FAILED" in row("quality def-cpu-int4-g32")[0]
    assert row("`intel` bf16")[1] == "not applicable: no AMX"
    # an engine whose weights were not placed in huge pages where its floor's were: the fraction compares nothing
    _write(work, "cpu-int8", _modes(2.6, 2.9, 0.5, differs="the engine has 5% of its weights' bytes in huge pages "
                                                          "and its floor 100% (details)"))
    figure, verdict = next((f, v) for b, f, v in bars.bars(work, ZEN4) if b.startswith("`cpu` int8 decode"))
    assert verdict == "inconclusive" and "5% of its weights' bytes in huge pages" in figure
    amx = {bar: verdict for bar, _, verdict in bars.bars(work, AMX)}
    assert next(v for k, v in amx.items() if k.startswith("`intel` bf16")) == "not run"  # a bar there
