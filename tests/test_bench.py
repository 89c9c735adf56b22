"""`kvexport bench`'s floor: the weight matrices a decode step reads, timed alone."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from kvexport.architectures import get_arch, map_config
from kvexport.bench import (QMATMUL_TAG, Floors, Gemv, GemvFloor, check_comparable, engine_gemvs, floor_label,
                            format_report, fp32_gemvs, linear_shapes, nominal_gemvs, onnx_gemvs, paired_steps, parse_prompt_lens,
                            placement_differs, run_bench, step_pair_figures)
from kvexport.errors import ContextOverflowError, InputError
from kvexport.runtime.hugepages import Placement
from kvexport.zoo import NAMED_MODELS, TINY_CONFIGS, write_checkpoint


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_linear_shapes_cover_every_weight_matrix_of_the_checkpoint(family: str, tmp_path: Path) -> None:
    cfg = map_config(TINY_CONFIGS[family])
    folder = write_checkpoint(TINY_CONFIGS[family], tmp_path / family)
    tensors = load_file(str(folder / "model.safetensors"))
    wm = get_arch(cfg.model_type).weights
    # the tables a step gathers one row of, by the family's own names
    gathered = {n for c in ("embed_tokens.weight", "embed_positions.weight") if c in wm.globals for n in wm.source(c).names}
    read = sum(t.size for name, t in tensors.items() if t.ndim == 2 and not any(name.endswith(g) for g in gathered))
    if cfg.tie_word_embeddings:  # the lm_head is the embedding table, read whole
        read += cfg.vocab_size * cfg.hidden_size
    # a routed layer's step reads its top k experts (gate, up, down each), not the other E - k
    unread = cfg.num_experts - cfg.num_experts_per_tok
    read -= sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) * unread * 3 * cfg.hidden_size * cfg.moe_intermediate_size
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


def test_quantized_floor_runs_one_matmulnbits_per_matrix_at_its_bits_and_block_size() -> None:
    gemvs = [Gemv(64, 128, 4, 32), Gemv(128, 64, 8, 32, zero_points=True), Gemv(64, 320)]
    floor = GemvFloor(None, threads=1, gemvs=gemvs)
    # int4 g32: 2 blocks of 16 bytes + a 4-byte scale per column; int8 g32 with zero points: 4 blocks of
    # 32 bytes + scale, and one zero-point byte per block; fp32: 4 bytes per weight
    assert floor.weight_bytes == 128 * 2 * (16 + 4) + 64 * 4 * (32 + 4) + 64 * 4 + 64 * 320 * 4
    assert floor.label == "fp32 + int8-g32 (1 matrix) + int4-g32 (1 matrix)"
    assert floor.measure(steps=3) > 0
    outputs = floor._buffers[-len(gemvs):]
    assert all(np.isfinite(y).all() and np.abs(y).max() > 0 for y in outputs)


def test_engine_matrices_are_read_from_the_quantizer_output_graph(tmp_path: Path) -> None:
    """onnx_gemvs finds each MatMulNBits the onnxruntime quantizer wrote, with its K, N, bits, block size
    and zero points, and keeps a MatMul the quantizer left in fp32."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    rng = np.random.default_rng(0)
    w1, w2, w3 = (rng.standard_normal(s).astype(np.float32) for s in ((64, 96), (96, 64), (64, 40)))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"], name="a"), helper.make_node("MatMul", ["h", "w2"], ["g"], name="b"),
         helper.make_node("MatMul", ["g", "w3"], ["y"], name="head")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 40])],
        [numpy_helper.from_array(w, n) for w, n in ((w1, "w1"), (w2, "w2"), (w3, "w3"))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    q = MatMulNBitsQuantizer(model, bits=4, block_size=32, is_symmetric=False, accuracy_level=4,
                             nodes_to_exclude=["head"])
    q.process()
    onnx.save_model(q.model.model, str(tmp_path / "q.onnx"))
    found = onnx_gemvs(tmp_path / "q.onnx")
    assert sorted(found, key=lambda g: g.k) == [Gemv(64, 96, 4, 32, 4, True), Gemv(64, 40), Gemv(96, 64, 4, 32, 4, True)]
    assert GemvFloor(None, threads=1, gemvs=found).measure(steps=2) > 0


def test_nominal_matrices_follow_the_recorded_weight_mode() -> None:
    cfg = map_config(TINY_CONFIGS["llama"])
    assert nominal_gemvs(cfg, "fp32", None) == fp32_gemvs(cfg)
    int4 = nominal_gemvs(cfg, "int4", 64)
    assert [(g.k, g.n) for g in int4] == linear_shapes(cfg) and {(g.bits, g.block_size) for g in int4} == {(4, 64)}
    assert sum(g.nbytes for g in int4) < sum(g.nbytes for g in nominal_gemvs(cfg, "int8", 64)) < 4 * sum(
        k * n for k, n in linear_shapes(cfg))


def test_per_channel_weights_get_a_block_a_floor_can_run() -> None:
    """NNCF's int8 (one scale per output channel) is recorded with group -1 by the intel target: its matrices got
    block -1, negative bytes, a negative bandwidth bound, and a floor that could not be built (`kvexport bench` on an
    intel int8 artifact died). They now take MatMulNBits' largest block, their bytes within 2% of per channel."""
    cfg = map_config({**TINY_CONFIGS["llama"], "hidden_size": 768, "intermediate_size": 2048})
    for group in (-1, None, 0):
        int8 = nominal_gemvs(cfg, "int8", group)
        assert {g.block_size for g in int8} == {256}, int8
        for g in int8:
            assert g.n * (g.k + 4) <= g.nbytes <= 1.02 * g.n * (g.k + 4), g
    narrow = nominal_gemvs(map_config(TINY_CONFIGS["llama"]), "int8", -1)  # hidden 64: a block covering k
    assert all(g.block_size in (16, 32, 64, 128, 256) and g.block_size >= g.k and g.nbytes > 0 for g in narrow)
    assert GemvFloor(None, threads=1, gemvs=narrow).measure(steps=2) > 0


def test_compared_engines_get_per_round_ratios_and_each_its_own_floor(artifacts: dict[str, Path]) -> None:
    import kvexport

    main = kvexport.load(str(artifacts["llama"]), threads=1)
    other = kvexport.load(str(artifacts["llama"]), threads=2)
    r = run_bench(main, reference=None, prompt_lens=(8,), new_tokens=6, threads=1, others=[("two", other)],
                  baselines=False, rounds=2)
    row = r["prompts"]["8"]
    e, o = row["engine"], row["other:two"]
    assert e["mode"] == o["mode"] == "fp32" and e["floor"] == o["floor"] == "fp32"
    assert list(row["floors"]) == ["fp32"]  # one floor for engines with the same weights
    assert len(o["decode_ratio_vs_main_per_round"]) == 2
    assert min(o["decode_ratio_vs_main_per_round"]) <= o["decode_ratio_vs_main_median_round"] <= max(
        o["decode_ratio_vs_main_per_round"])
    assert o["fraction_of_own_floor"] == pytest.approx(o["decode_tok_s"] / row["gemv_floor_tok_s"])
    # each run is paired with the floor timed just before it: one fraction per round; the best-over-best figure's
    # floor is the best of those floor runs
    timed_floors = []
    for x in (e, o):
        per_round = x["fraction_of_own_floor_per_round"]
        assert len(per_round) == 2 and all(f > 0 for f in per_round)
        assert x["fraction_of_own_floor_median_round"] == pytest.approx(float(np.median(per_round)))
        timed_floors += [run / f for run, f in zip(x["decode_tok_s_per_round"], per_round)]
    assert max(timed_floors) == pytest.approx(row["gemv_floor_tok_s"])
    assert o["ttft_ratio_vs_main"] == pytest.approx(o["ttft_s"] / e["ttft_s"])
    text = format_report(r)
    assert "of its fp32 floor" in text and "median" in text and "paired rounds" in text


def test_paired_steps_alternate_engines_step_by_step_on_their_own_greedy_tokens(artifacts: dict[str, Path]) -> None:
    """One step of each engine after another (every other step reversed), each fed its own argmax, every cache
    released after; the tokens are the ones a plain greedy generation gives."""
    import kvexport

    a, b = (kvexport.load(str(artifacts["llama"]), threads=1) for _ in range(2))
    log: list[tuple[str, int]] = []
    for name, e in (("a", a), ("b", b)):
        decode = e.decode

        def logged(batch: object, tokens: np.ndarray, *, copy: bool = True, _n: str = name,
                   _d: object = decode) -> np.ndarray:
            log.append((_n, int(tokens[0])))
            return _d(batch, tokens, copy=copy)  # type: ignore[operator]

        e.decode = logged  # type: ignore[method-assign]
    released: list[object] = []
    release = a.session.release
    a.session.release = lambda state: (released.append(state), release(state))  # type: ignore[method-assign]
    times = paired_steps([("a", a), ("b", b)], 8, 4)
    assert [n for n, _ in log] == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert {k: len(v) for k, v in times.items()} == {"a": 4, "b": 4} and min(times["a"] + times["b"]) > 0
    assert len(released) == 1
    from kvexport.bench import _prompt

    ids = _prompt(8, a.vocab_size)
    fed = [t for n, t in log if n == "a"]
    batch = b.prefill(ids, 5)
    tok = batch.logits.argmax(-1)
    expect = []
    for _ in range(4):
        expect.append(int(tok[0]))
        tok = b.decode(batch, tok).argmax(-1)
    b.session.release(batch.state)
    assert fed == expect  # each step's input is the engine's own previous greedy token
    with pytest.raises(ContextOverflowError, match="max_seq"):  # refused before any engine holds a cache
        paired_steps([("a", a), ("b", b)], a.max_seq, 4)
    assert len(released) == 1


def test_step_pair_figures_are_the_other_engines_speed_over_the_main_ones() -> None:
    f = step_pair_figures([0.02, 0.02, 0.03, 0.01], [0.01, 0.02, 0.02, 0.02])
    assert f["steps"] == 4
    assert f["median"] == pytest.approx(float(np.median([2.0, 1.0, 1.5, 0.5])))
    assert f["quartiles"][0] <= f["median"] <= f["quartiles"][1]
    assert f["step_ms"] == pytest.approx(20.0) and f["main_step_ms"] == pytest.approx(20.0)


def test_step_pairs_in_a_bench_run_and_its_report(artifacts: dict[str, Path]) -> None:
    import kvexport

    main = kvexport.load(str(artifacts["llama"]), threads=1)
    other = kvexport.load(str(artifacts["llama"]), threads=1)
    r = run_bench(main, reference=None, prompt_lens=(8,), new_tokens=6, threads=1, others=[("again", other)],
                  baselines=False, floor=False, rounds=2, step_pairs=True)
    sp = r["prompts"]["8"]["other:again"]["step_pairs"]
    assert sp["steps"] == 2 * 5 and sp["quartiles"][0] <= sp["median"] <= sp["quartiles"][1]
    assert "step_pairs" not in r["prompts"]["8"]["engine"]
    assert "median of 10 paired steps" in format_report(r)


def test_step_pairs_without_another_engine_are_refused(artifacts: dict[str, Path],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from kvexport import cli

    assert cli.main(["bench", str(artifacts["llama"]), "--step-pairs", "--no-baselines", "-q"]) == InputError.exit_code
    err = capsys.readouterr().err
    assert "--step-pairs" in err and "give --compare" in err


def test_each_run_is_held_to_the_floor_timed_just_before_it(artifacts: dict[str, Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's speed drifts over minutes: a floor timed at another moment than the run it judges can land in
    another drift, so the per-round fraction divides each run by its own floor run, in the order they ran."""
    import kvexport
    from kvexport import bench

    log: list[str] = []
    floor_rates = iter([10.0, 20.0, 40.0, 80.0])
    decode_rates = iter([5.0, 5.0, 5.0, 5.0])

    def fake_floor(self: GemvFloor, steps: int = 20) -> float:
        log.append(f"floor {steps}")
        return next(floor_rates)

    def fake_engine(engine: object, prompt_len: int, new_tokens: int) -> dict[str, object]:
        log.append("engine")
        return {"ttft_s": 0.1, "decode_tok_s": next(decode_rates), "python_overhead": None, "kv_cache_bytes": None,
                "cache_bytes_copied_per_decode_step": None, "not_measured": {}}

    monkeypatch.setattr(GemvFloor, "measure", fake_floor)
    monkeypatch.setattr(bench, "bench_engine", fake_engine)
    main = kvexport.load(str(artifacts["llama"]), threads=1)
    r = run_bench(main, reference=None, prompt_lens=(8,), new_tokens=6, threads=1, others=[("same", main)],
                  baselines=False, rounds=2)
    assert log == ["floor 5", "engine"] * 4  # as many floor steps as the engine decodes, just before each run
    row = r["prompts"]["8"]
    # round 1 runs main then other, round 2 other then main
    assert row["engine"]["fraction_of_own_floor_per_round"] == pytest.approx([5 / 10, 5 / 80])
    assert row["other:same"]["fraction_of_own_floor_per_round"] == pytest.approx([5 / 20, 5 / 40])
    assert row["engine"]["fraction_of_own_floor"] == pytest.approx(5 / 80)  # best over best
    assert row["gemv_floor_tok_s"] == 80.0


def test_the_cli_makes_each_floor_just_after_its_engine_loads(artifacts: dict[str, Path],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Placing a floor's weights in huge pages needs free 2 MiB pages: made after every engine had loaded (a 10 GB
    fp32 one among them), an int8 floor found none where its engine had found them. So `kvexport bench` makes each
    engine's floor as soon as that engine is loaded, and run_bench times those floors."""
    from kvexport import bench, cli

    log: list[str] = []
    load, add = cli._load, Floors.add

    def logged_load(path: str, *args: object, **kwargs: object) -> object:
        log.append("load")
        return load(path, *args, **kwargs)  # type: ignore[arg-type]

    def logged_add(self: Floors, key: str, engine: object) -> GemvFloor:
        log.append(f"floor {key}")
        return add(self, key, engine)  # type: ignore[arg-type]

    seen: dict[str, object] = {}

    def fake_run_bench(engine: object, **kwargs: object) -> dict[str, object]:
        seen.update(kwargs)
        return {}

    monkeypatch.setattr(cli, "_load", logged_load)
    monkeypatch.setattr(Floors, "add", logged_add)
    monkeypatch.setattr(bench, "run_bench", fake_run_bench)
    monkeypatch.setattr(bench, "format_report", lambda r: "")
    art = str(artifacts["llama"])
    assert cli.main(["bench", art, "--compare", art, "--variant", "threads=1", "--no-baselines", "-q"]) == 0
    assert log == ["load", "floor engine", "load", f"floor other:{art}", "load", f"floor other:{art} [threads=1]"]
    prepared = seen["prepared"]
    assert isinstance(prepared, Floors) and list(prepared.floors) == ["fp32"]  # one floor for one kind of weights
    assert set(prepared.floor_of) == {"engine", f"other:{art}", f"other:{art} [threads=1]"}
    log.clear()
    assert cli.main(["bench", art, "--no-floor", "--no-baselines", "-q"]) == 0
    assert log == ["load"] and seen["prepared"] is None


def test_prepared_floors_are_the_ones_timed(artifacts: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import kvexport

    main = kvexport.load(str(artifacts["llama"]), threads=1)
    floors = Floors(threads=1)
    floors.add("engine", main)
    made: list[object] = []
    monkeypatch.setattr(GemvFloor, "__init__", lambda self, *a, **k: made.append(self))  # no other floor is made
    r = run_bench(main, reference=None, prompt_lens=(8,), new_tokens=4, threads=1, baselines=False, rounds=1,
                  prepared=floors)
    assert not made and r["prompts"]["8"]["engine"]["floor"] == "fp32"
    assert r["huge_pages"]["fp32 floor"] == floors.floors["fp32"].huge_pages.record()


def test_an_engine_and_a_floor_placed_unalike_are_flagged() -> None:
    gib = 1 << 30
    placed, unplaced = Placement(gib, 1.0, "1 GiB placed"), Placement(0, 1.0, "16 of 16 spans kept small pages")
    assert placement_differs(placed, placed, gib) is None
    assert placement_differs(unplaced, unplaced, gib) is None
    assert placement_differs(None, placed, gib) is None  # an engine that places nothing (not an ONNX Runtime one)
    off = Placement(0, 0.0, "off", asked=False)
    assert placement_differs(off, off, gib) is None
    why = placement_differs(unplaced, placed, gib)
    assert why is not None and "0%" in why and "100%" in why and "huge_pages=false" in why
    assert placement_differs(Placement(gib // 2, 1.0, "half"), placed, gib) is not None
    assert placement_differs(Placement(gib * 9 // 10, 1.0, "most"), placed, gib) is None  # within the tolerance


def test_compare_refuses_an_artifact_of_another_model(artifacts: dict[str, Path], tmp_path: Path) -> None:
    raw = json.loads((artifacts["llama"] / "manifest.json").read_text())
    raw["model"]["config"]["hidden_size"] *= 2
    (tmp_path / "other.kvx").mkdir()
    (tmp_path / "other.kvx" / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(InputError, match="hidden_size"):
        check_comparable(artifacts["llama"], [tmp_path / "other.kvx"])
    check_comparable(artifacts["llama"], [artifacts["llama"]])


def test_compare_takes_an_older_manifest_without_the_newer_default_fields(artifacts: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    """An artifact of the same checkpoint built by a kvexport that did not yet write a field (its value then was
    the default) is the same model; a field absent there but not at its default here is a difference."""
    raw = json.loads((artifacts["llama"] / "manifest.json").read_text())
    cfg = raw["model"]["config"]
    assert cfg["layer_types"] == [] and cfg["num_experts"] == 0  # llama: both at DecoderConfig's defaults
    del cfg["layer_types"], cfg["num_experts"]
    (tmp_path / "old.kvx").mkdir()
    (tmp_path / "old.kvx" / "manifest.json").write_text(json.dumps(raw))
    check_comparable(artifacts["llama"], [tmp_path / "old.kvx"])
    check_comparable(tmp_path / "old.kvx", [artifacts["llama"]])
    raw["model"]["config"]["num_experts"] = 8
    (tmp_path / "old.kvx" / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(InputError, match="num_experts"):
        check_comparable(artifacts["llama"], [tmp_path / "old.kvx"])


@pytest.mark.parametrize("text", ["32,x", "0,512", ""])
def test_bad_prompt_lens_are_refused(text: str) -> None:
    with pytest.raises(InputError, match="--prompt-lens"):
        parse_prompt_lens(text)
    assert parse_prompt_lens("32,512,4096") == (32, 512, 4096)


def test_bench_1b_has_llama_3_2_1b_shape() -> None:
    c = map_config(NAMED_MODELS["bench-1b"])
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (2048, 16, 32, 8)
    assert (c.intermediate_size, c.vocab_size, c.head_dim, c.tie_word_embeddings) == (8192, 128256, 64, True)
    assert (c.rope.type, c.rope.theta, c.rope.factor) == ("llama3", 500000.0, 32.0)
    assert 1.23e9 < c.num_parameters() < 1.24e9  # Llama-3.2-1B: 1.236B


def test_checkpoints_are_written_one_shard_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each shard is saved before the parameters of the next are drawn, so memory holds one shard
    (bench-1b is ~4.9 GB in fp32), and the shards hold exactly random_decoder's values."""
    import torch

    from kvexport import zoo
    from kvexport.checkpoint import load_checkpoint

    events: list[str] = []
    draw, save = zoo._init_value, zoo.save_file
    monkeypatch.setattr(zoo, "_init_value", lambda *a: (events.append("draw"), draw(*a))[1])
    monkeypatch.setattr(zoo, "save_file", lambda *a, **k: (events.append("save"), save(*a, **k))[1])
    folder = zoo.write_checkpoint(TINY_CONFIGS["llama"], tmp_path / "m", seed=3, shard_bytes=40_000)
    last_draw = len(events) - 1 - events[::-1].index("draw")
    assert events.count("save") > 2 and events.index("save") < last_draw  # shards left before the model was drawn
    want = zoo.random_decoder(map_config(TINY_CONFIGS["llama"]), seed=3).state_dict()
    got = load_checkpoint(folder).decoder.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_an_int4_artifact_is_held_to_its_own_matmulnbits_floor(artifacts: dict[str, Path], checkpoints: dict[str, Path],
                                                               tmp_path: Path) -> None:
    import kvexport
    from kvexport.backends import BuildOptions
    from kvexport.build import build
    from kvexport.native import kernel

    int4 = build(checkpoints["llama"], tmp_path / "int4.kvx", target="cpu", max_seq=128, verify=False,
                 options=BuildOptions(weights="int4", group_size=32))
    fp32 = kvexport.load(str(artifacts["llama"]), threads=1)
    q = kvexport.load(str(int4), threads=1)
    gemvs = engine_gemvs(q)
    assert {(g.bits, g.block_size) for g in gemvs if g.bits is not None} >= {(4, 32)}  # read from its graph
    r = run_bench(fp32, reference=None, prompt_lens=(8,), new_tokens=6, threads=1, others=[("int4", q)],
                  baselines=False, rounds=1)
    row = r["prompts"]["8"]
    o = row["other:int4"]
    # the floor runs the quantized-matmul kernel the engine runs: kvexport's where the load swapped it in (kvexport.native)
    native = q.session.describe()["quantized_matmul"]["nodes"] > 0
    assert native == kernel().usable
    assert o["floor"] == floor_label(gemvs) + (QMATMUL_TAG if native else "")
    # the report names the kernels each engine's load swapped in: the fp32 engine's only its cache attention
    said = q.session.describe()["quantized_matmul"]
    attn = {key: e.session.describe()["cache_attention"] for key, e in (("engine", fp32), ("other:int4", q))}
    want = {key: {a["kernel"]: a["nodes"]} for key, a in attn.items() if a["nodes"]}
    if native:
        want["other:int4"] = {said["kernel"]: said["nodes"], **want.get("other:int4", {})}
    assert r.get("native_kernels", {}) == want
    assert (f"other:int4: {said['kernel']} in {said['nodes']} nodes" in format_report(r)) == native
    assert ("engine: kvexport Fp32CacheAttention" in format_report(r)) == bool(attn["engine"]["nodes"])
    assert o["mode"] == "int4-g32" and o["floor"].startswith("int4-g32")
    assert set(row["floors"]) == {"fp32", o["floor"]}
    assert row["floors"][o["floor"]]["weight_bytes"] < row["floors"]["fp32"]["weight_bytes"] / 3
    assert o["fraction_of_own_floor"] == pytest.approx(o["decode_tok_s"] / row["floors"][o["floor"]]["tok_s"])
