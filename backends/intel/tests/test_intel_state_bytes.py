"""The intel target's cache figures are measured or say they are not: the state bytes OpenVINO
reports grow with the tokens held; the memory a u8 cache saves is measured as process RSS; and
`kvexport bench` prints no constant as a measurement."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvexport

pytest.importorskip("openvino", reason="the intel target needs openvino (pip install 'kvexport[intel]')")


def test_reported_state_bytes_grow_with_the_tokens_held(intel_artifacts: dict) -> None:
    _, art = intel_artifacts["llama"]
    engine = kvexport.load(str(art), kv_precision="f32", precision="fp32", batch_rows="state")  # a batch in the state
    cfg = engine.config
    per_token_row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    batch = engine.prefill([[5, 6, 7, 8, 9], [4, 4]], 20)
    seen = [engine.session.cache_bytes(batch.state)]
    for _ in range(12):
        engine.decode(batch, batch.logits.argmax(-1))
        seen.append(engine.session.cache_bytes(batch.state))
    held = [5 + i for i in range(13)]
    assert seen == [2 * t * per_token_row for t in held]  # what OpenVINO's state tensors hold, step by step
    shapes = {tuple(v.state.shape) for v in batch.state.request.query_state()}
    assert shapes == {(2, cfg.num_key_value_heads, 17, cfg.head_dim)}


def _rss_growth(art: Path, kv: str) -> dict:
    """state_rss_growth in a fresh process (one session, nothing else allocated in between)."""
    code = ("import json, sys, kvexport\n"
            "from kvexport_intel.kvcost import state_rss_growth\n"
            f"e = kvexport.load({str(art)!r}, kv_precision={kv!r}, precision='fp32', batch_rows='state')\n"
            "print(json.dumps(state_rss_growth(e.session, batch=128, tokens=120)))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_measured_state_memory_shrinks_with_a_u8_cache(intel_artifacts: dict) -> None:
    _, art = intel_artifacts["llama"]
    f32, u8 = _rss_growth(art, "f32"), _rss_growth(art, "u8")
    print(f"RSS growth over {f32['tokens']} tokens x {f32['batch']} rows: f32 {f32['rss_growth_bytes'] / 2**20:.1f} MiB "
          f"(state reported {f32['state_bytes_reported'] / 2**20:.1f} MiB), u8 {u8['rss_growth_bytes'] / 2**20:.1f} MiB "
          f"(reported {u8['state_bytes_reported'] / 2**20:.1f} MiB, in f32): "
          f"{f32['rss_growth_bytes'] / u8['rss_growth_bytes']:.2f}x less")
    assert f32["rss_growth_bytes"] >= 0.9 * f32["state_bytes_reported"]  # the f32 state really is held
    assert u8["state_bytes_reported"] == f32["state_bytes_reported"]  # OpenVINO reports u8 as f32 ...
    assert u8["rss_growth_bytes"] < 0.6 * f32["rss_growth_bytes"]  # ... but stores much less


def test_bench_prints_measured_figures_or_says_not_measured(intel_artifacts: dict) -> None:
    from kvexport.bench import format_report, run_bench

    _, art = intel_artifacts["llama"]
    # requests the state holds: prompts below paged_prefill_min (every prompt takes the paged form by default)
    f32 = kvexport.load(str(art), kv_precision="f32", precision="fp32", paged_prefill_min=1000)
    u8 = kvexport.load(str(art), kv_precision="u8", precision="fp32", paged_prefill_min=1000)
    r = run_bench(f32, reference=None, prompt_lens=(8,), new_tokens=8, threads=1, others=[("u8", u8)],
                  baselines=False, floor=False, rounds=1)
    row = r["prompts"]["8"]
    e, v = row["engine"], row["other:u8"]
    assert e["cache_bytes_copied_per_decode_step"] is None and v["cache_bytes_copied_per_decode_step"] is None
    assert e["kv_cache_bytes"] == 2 * 15 * f32.config.num_hidden_layers * f32.config.num_key_value_heads \
        * f32.config.head_dim * 4  # measured after 8 + 7 tokens
    assert v["kv_cache_bytes"] is None and "query_state" in v["not_measured"]["cache_bytes"]
    text = format_report(r)
    print(text)
    assert "copied/step not measured (the state holds this request; OpenVINO" in text
    assert "kv not measured (the state holds this request; OpenVINO returns its u8" in text
    assert "copied/step 0 B" not in text
    assert np.isfinite(e["decode_tok_s"])
    # where each engine's weight copies lie, as its load placed them (kvexport_intel.place_weights)
    assert {k: v["asked"] for k, v in r["huge_pages"].items()} == {"engine": True, "other:u8": True}, r["huge_pages"]
    assert f"huge pages: engine: {r['huge_pages']['engine']['detail']}" in text


def test_bench_measures_a_paged_request(intel_artifacts: dict) -> None:
    """A request that decodes paged (the prompt at the paged_prefill_min threshold) holds its cache in blocks this
    session allocated: its u8 bytes (scales included) are measured, and a paged step copies nothing."""
    from kvexport.bench import format_report, run_bench

    _, art = intel_artifacts["llama"]
    u8 = kvexport.load(str(art), kv_precision="u8", precision="fp32", paged_prefill_min=8)
    r = run_bench(u8, reference=None, prompt_lens=(8,), new_tokens=8, threads=1, baselines=False, floor=False,
                  rounds=1)
    assert u8.session.facts["long_prefill"] == "paged attention, decode paged"
    v = r["prompts"]["8"]["engine"]
    assert v["cache_bytes_copied_per_decode_step"] == 0 and not v["not_measured"]
    cfg = u8.config
    d = cfg.head_dim  # per slot and head: a u8 key and a u8 value, each with its own f32 scale and zero point
    assert v["kv_cache_bytes"] == 15 * cfg.num_hidden_layers * cfg.num_key_value_heads * 2 * (d + 8)
    text = format_report(r)
    assert "copied/step 0 B" in text and "not measured" not in text
