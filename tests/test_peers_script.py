"""benchmarks/peers.py on kvexport artifacts alone (the peers' own virtualenv is not made in CI): its worker
protocol decodes the engine's own greedy tokens a block of steps per call, and `bench --step-blocks` pairs those
blocks across the systems."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvexport

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "peers.py"


@pytest.fixture(scope="module")
def peers():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("peers_script", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _greedy(art: Path, ids: list[int], new: int) -> list[int]:
    engine = kvexport.load(str(art), threads=1)
    batch = engine.prefill(ids, new)
    tok = batch.logits.argmax(-1)
    out = [int(tok[0])]
    for _ in range(new - 1):
        tok = engine.decode(batch, tok).argmax(-1)
        out.append(int(tok[0]))
    return out


def test_a_step_worker_decodes_the_engines_own_greedy_tokens_a_block_a_call(peers, artifacts) -> None:  # type: ignore[no-untyped-def]
    art = artifacts["llama"]
    w = peers.Worker(art, 1, {"steps": "true"})
    try:
        assert w.kind == "kvexport"
        first = w.send("START 9 6")
        got = [first["token"]]
        assert first["ttft_s"] > 0
        for size in (3, 2):  # the request goes on where the last block stopped
            out = w.send(f"STEPS {size}")
            assert len(out["step_s"]) == len(out["tokens"]) == size and min(out["step_s"]) > 0
            got += out["tokens"]
        assert w.send("END") == {}
        again = w.send("START 9 6")["token"]  # the released request's slot serves the next one
        w.send("END")
    finally:
        w.close()
    ids = peers.prompt_ids(9, kvexport.load(str(art), threads=1).vocab_size)
    want = _greedy(art, ids, 6)
    assert got == want and again == want[0]


def _bench(*args: str) -> dict:
    p = subprocess.run([sys.executable, str(SCRIPT), "bench", *args, "--threads", "1", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout[p.stdout.index("\n{") + 1:])


def test_step_blocks_pair_every_block_of_every_round_and_keep_a_repeated_system_apart(artifacts) -> None:  # type: ignore[no-untyped-def]
    art = str(artifacts["llama"])
    report = _bench(art, art, "--prompt-lens", "7", "--new-tokens", "6", "--rounds", "3", "--step-blocks", "2")
    assert report["timing"] == "step_blocks"
    row = report["prompts"]["7"]
    assert list(row) == [art, art + "#2"]  # the same artifact twice is two systems, not one
    main, other = row[art], row[art + "#2"]
    assert main["decode_ratio_vs_first"] == 1.0 and main["decode_ratio_quartiles"] == [1.0, 1.0]
    for v in (main, other):
        # the 5 decode steps after the first token make blocks of 2 and 2 (a last block of 1 would count nothing)
        assert v["paired_blocks"] == 3 * 2
        assert len(v["ttft_s_per_round"]) == 3
        # the same engine twice decodes the same greedy tokens: the first and the four steps blocked, each round
        assert v["same_tokens_as_first"] == v["tokens_compared"] == 3 * 5
    assert other["decode_ratio_quartiles"][0] <= other["decode_ratio_vs_first"] <= other["decode_ratio_quartiles"][1]
    assert np.isclose(other["ttft_ratio_vs_first"], other["ttft_s"] / main["ttft_s"])


def test_rounds_stay_the_default_timing(artifacts) -> None:  # type: ignore[no-untyped-def]
    art = str(artifacts["llama"])
    report = _bench(art, "--prompt-lens", "7", "--new-tokens", "4", "--rounds", "2", "--no-length-warmup")
    row = report["prompts"]["7"][art]
    assert report["timing"] == "rounds" and len(row["decode_tok_s_per_round"]) == 2
    assert row["decode_ratio_vs_first"] == 1.0 and "paired_steps" not in row


def test_a_negative_block_is_refused_before_any_worker_starts(artifacts) -> None:  # type: ignore[no-untyped-def]
    p = subprocess.run([sys.executable, str(SCRIPT), "bench", str(artifacts["llama"]), "--step-blocks", "-2"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "--step-blocks takes a number of decode steps" in p.stderr
    assert "[kvexport]" not in p.stdout  # no worker was loaded


def test_a_kvexport_system_takes_its_cache_precision_as_a_load_option(peers, artifacts) -> None:  # type: ignore[no-untyped-def]
    """`ART@kv_precision=i8` reaches the engine as its load option (the intel target's own int8 cache); a value the
    option does not take is refused while the specs are read."""
    art = str(artifacts["llama"])
    folder, options = peers.system_spec(f"{art}@kv_precision=i8,precision=fp32", "u8")
    assert folder == Path(art) and options["kv_precision"] == "i8" and options["precision"] == "fp32"
    with pytest.raises(SystemExit, match="kv_precision"):
        peers.system_spec(f"{art}@kv_precision=int3", "u8")
