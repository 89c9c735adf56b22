"""`kvexport bench`: the protocol of docs/benchmarks.md, every figure a ratio against baselines of the same run."""
from __future__ import annotations

import os
import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvexport.config import DecoderConfig
from kvexport.runtime.engine import Engine

Progress = Callable[[str], None]


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _peakrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class BandwidthProbe:
    """Streaming read bandwidth: best of 5 sums over a buffer far larger than the caches.

    The buffer is allocated once per bench run and kept: allocating and freeing 512 MiB between
    timed runs made the run right after it ~10% slower on this project's KVM guests (measured:
    prompt 512, the first engine after a fresh-buffer probe 36-37 tok/s against 40-41 for the
    same engine second in the round; with a kept buffer both 41), which biased the ratios against
    whichever runner came first. Freed guest memory is reported back to the host and faulted in
    again, work that lands on the next runner's cores."""

    def __init__(self, threads: int, mbytes: int = 512):
        import torch

        self.torch, self.threads = torch, threads
        self.x = torch.ones(mbytes * 2**20 // 4, dtype=torch.float32)

    def measure(self) -> float:
        torch = self.torch
        prev = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            best = 0.0
            for _ in range(5):
                t = time.perf_counter()
                self.x.sum()
                best = max(best, self.x.numel() * 4 / (time.perf_counter() - t) / 1e9)
            return best
        finally:
            torch.set_num_threads(prev)


def linear_shapes(cfg: DecoderConfig) -> list[tuple[int, int]]:
    """(K, N) of every weight matrix one decode step reads, as the cpu engine multiplies them
    (q|k|v packed, gate|up packed), then the lm_head. The embedding tables are gathered, not read."""
    h = cfg.hidden_size
    mlp_in = (2 if cfg.mlp_kind == "gated" else 1) * cfg.intermediate_size
    layer = [(h, cfg.q_size + 2 * cfg.kv_size), (cfg.q_size, h), (h, mlp_in), (cfg.intermediate_size, h)]
    return layer * cfg.num_hidden_layers + [(h, cfg.vocab_size)]


class GemvFloor:
    """A decode step that does nothing but read its weights: one ONNX Runtime MatMul (M=1) per
    weight matrix of `linear_shapes`, random fp32 weights, the engine's threads and session options.

    An engine can approach this rate, not pass it: what separates them is everything else a step
    does (attention over the cache, norms, rotary, kernel launches, Python). The bandwidth bound
    says what the memory could give; this says what the matrix kernels on this machine do give.
    The weights go through an external-data file so no 2 GB protobuf is built in memory."""

    def __init__(self, cfg: DecoderConfig, threads: int, seed: int = 0):
        import onnx
        import onnxruntime as ort
        from onnx import TensorProto, helper

        from kvexport.backends.cpu import session_options

        self.shapes = linear_shapes(cfg)
        rng = np.random.default_rng(seed)
        nodes, inits, outputs = [], [], []
        with tempfile.TemporaryDirectory(prefix="kvexport-floor-") as tmp:
            offset = 0
            with open(Path(tmp) / "w.bin", "wb") as f:
                for i, (k, n) in enumerate(self.shapes):
                    w = rng.standard_normal((k, n), dtype=np.float32)
                    w.tofile(f)
                    t = TensorProto(name=f"w{i}", data_type=TensorProto.FLOAT, dims=[k, n],
                                    data_location=TensorProto.EXTERNAL)
                    for key, value in (("location", "w.bin"), ("offset", str(offset)), ("length", str(w.nbytes))):
                        t.external_data.add(key=key, value=value)
                    offset += w.nbytes
                    inits.append(t)
                    nodes.append(helper.make_node("MatMul", [f"x{k}", f"w{i}"], [f"y{i}"]))
                    outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, n]))
            ks = sorted({k for k, _ in self.shapes})
            graph = helper.make_graph(nodes, "gemv_floor",
                                      [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [1, k]) for k in ks],
                                      outputs, inits)
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
            onnx.save_model(model, str(Path(tmp) / "floor.onnx"))
            # ONNX Runtime pre-packs each weight into memory of its own while the session is made
            self.sess = ort.InferenceSession(str(Path(tmp) / "floor.onnx"), session_options(threads),
                                             providers=["CPUExecutionProvider"])
        self.binding = self.sess.io_binding()
        self._buffers = [rng.standard_normal((1, k), dtype=np.float32) for k in ks]
        for k, x in zip(ks, self._buffers):
            self.binding.bind_cpu_input(f"x{k}", x)
        for i, (_, n) in enumerate(self.shapes):
            y = np.empty((1, n), np.float32)
            self._buffers.append(y)
            self.binding.bind_output(f"y{i}", "cpu", 0, np.float32, y.shape, y.ctypes.data)

    @property
    def weight_bytes(self) -> int:
        return sum(k * n for k, n in self.shapes) * 4

    def measure(self, steps: int = 20) -> float:
        """Steps per second over `steps` back-to-back steps (a rate over a run, like decode tok/s)."""
        self.sess.run_with_iobinding(self.binding)
        t = time.perf_counter()
        for _ in range(steps):
            self.sess.run_with_iobinding(self.binding)
        return steps / (time.perf_counter() - t)


def _prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, min(vocab, 259), n)]


def bench_engine(engine: Engine, prompt_len: int, new_tokens: int) -> dict[str, Any]:
    """One greedy run: TTFT (prefill + first token) and decode tok/s (the tokens after the first)."""
    ids = _prompt(prompt_len, engine.vocab_size)
    engine.check_fits(prompt_len, new_tokens)
    t0 = time.perf_counter()
    batch = engine.prefill(ids, new_tokens, copy=False)  # logits consumed at once: no copy
    assert batch.logits is not None
    tok = batch.logits.argmax(-1)
    ttft = time.perf_counter() - t0
    run0 = getattr(batch.state, "run_seconds", None)
    copied0 = engine.session.cache_bytes_copied(batch.state)
    t1 = time.perf_counter()
    for _ in range(new_tokens - 1):
        tok = engine.decode(batch, tok, copy=False).argmax(-1)
    decode = time.perf_counter() - t1
    run = getattr(batch.state, "run_seconds", None)
    copied = engine.session.cache_bytes_copied(batch.state)
    result = {
        "ttft_s": ttft,
        "decode_tok_s": (new_tokens - 1) / decode,
        "python_overhead": None if run is None or run0 is None else 1.0 - (run - run0) / decode,
        # None where the backend cannot measure a figure; `not_measured` then says why
        "kv_cache_bytes": engine.session.cache_bytes(batch.state),
        "cache_bytes_copied_per_decode_step": (None if copied is None or copied0 is None
                                               else (copied - copied0) / (new_tokens - 1)),
    }
    result["not_measured"] = {k: why for k, why in engine.session.not_measured().items()
                              if result[{"cache_bytes": "kv_cache_bytes",
                                         "cache_bytes_copied": "cache_bytes_copied_per_decode_step"}[k]] is None}
    engine.session.release(batch.state)
    return result


class HFBaseline:
    """transformers eager, greedy, with or without its KV cache; the model is loaded once."""

    def __init__(self, model_dir: Path, threads: int):
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        torch.set_num_threads(threads)
        self.torch = torch
        self.rss0 = rss_mb()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()
        # the model's memory once it has run (safetensors maps weights lazily), frameworks already imported
        self.load_rss_mb = 0.0
        self.vocab = self.model.config.vocab_size

    def run(self, prompt_len: int, new_tokens: int, use_cache: bool) -> dict[str, Any]:
        torch = self.torch
        x = torch.tensor([_prompt(prompt_len, self.vocab)])
        # without a cache every token re-reads the whole prefix: a few tokens give its rate
        n = new_tokens if use_cache else max(3, min(new_tokens, 8 if prompt_len <= 64 else 3))
        def timed(k: int) -> float:
            t = time.perf_counter()
            self.model.generate(x, max_new_tokens=k, min_new_tokens=k, do_sample=False, use_cache=use_cache,
                                pad_token_id=0)
            return time.perf_counter() - t

        with torch.inference_mode():
            timed(2)  # warm-up: generate()'s first call per shape builds its caches
            first = timed(1)  # prefill + first token, through the same generate() path
            total = timed(n)
        self.load_rss_mb = max(self.load_rss_mb, rss_mb() - self.rss0)
        # decode rate from the difference of two generate() calls: the prefill and generate's own
        # set-up cancel out (a tiny model can still make it noisy: its decode is not the point)
        return {"ttft_s": first, "decode_tok_s": (n - 1) / max(total - first, 1e-6), "tokens": n}


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Fastest decode run, with the fastest TTFT seen: noise on a shared machine only ever slows."""
    best = dict(max(runs, key=lambda r: r["decode_tok_s"]))
    best["ttft_s"] = min(r["ttft_s"] for r in runs)
    best["decode_tok_s_per_round"] = [r["decode_tok_s"] for r in runs]
    return best


def run_bench(engine: Engine, *, reference: Path | None, prompt_lens: tuple[int, ...] = (32, 512),
              new_tokens: int = 64, threads: int = 2, others: list[tuple[str, Engine]] | None = None,
              baselines: bool = True, floor: bool = True, rounds: int = 3, engine_load_rss_mb: float | None = None,
              progress: Progress | None = None) -> dict[str, Any]:
    """Engine, other engines and the transformers baseline are timed back to back in each round,
    so a burst of load from elsewhere hits all of them; each keeps its best round."""
    say = progress or (lambda _m: None)
    cfg = engine.config
    report: dict[str, Any] = {
        "artifact": str(engine.folder), "threads": threads, "new_tokens": new_tokens, "cpu_count": os.cpu_count(),
        "backend": (engine.manifest.target or {}).get("backend"), "max_seq": engine.max_seq, "rounds": rounds,
        "prompts": {},
    }
    bw = 0.0  # best read bandwidth seen in any round: the bound is an upper limit, so take the highest
    itemsize = 4 if engine.manifest.cache["dtype"] == "float32" else 2
    # per token: every weight matrix is read once (the embedding tables are gathered, one row each)
    weight_bytes = sum(k * n for k, n in linear_shapes(cfg)) * itemsize
    probe = BandwidthProbe(threads)  # before the baseline: its RSS is not the transformers model's
    if floor:
        say("preparing the GEMV floor (the model's weight shapes as bare ONNX Runtime MatMuls)")
    gemv = GemvFloor(cfg, threads) if floor else None
    hf = HFBaseline(reference, threads) if baselines and reference is not None else None
    engine_rss = 0.0
    for p in prompt_lens:
        if p + new_tokens > engine.max_seq:
            say(f"skip prompt {p}: exceeds max_seq {engine.max_seq}")
            continue
        runs: dict[str, list[dict[str, Any]]] = {"engine": [], "hf_cache": []}
        floor_rate = 0.0  # the floor's best round at this prompt, timed just before the engine
        for r in range(rounds):
            say(f"prompt {p}, round {r + 1}/{rounds}")
            bw = max(bw, probe.measure())
            if gemv is not None:
                floor_rate = max(floor_rate, gemv.measure())
            runs["engine"].append(bench_engine(engine, p, new_tokens))
            engine_rss = max(engine_rss, rss_mb())
            for label, other in others or []:
                runs.setdefault(f"other:{label}", []).append(bench_engine(other, p, new_tokens))
            if hf is not None:
                runs["hf_cache"].append(hf.run(p, new_tokens, True))
        row: dict[str, Any] = {k: _best(v) for k, v in runs.items() if v}
        kv_read = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * itemsize * (p + new_tokens // 2)
        bound = bw * 1e9 / (weight_bytes + kv_read)
        row["bandwidth_bound_tok_s"] = bound
        row["fraction_of_bound"] = row["engine"]["decode_tok_s"] / bound
        if gemv is not None:
            row["gemv_floor_tok_s"] = floor_rate
            row["fraction_of_floor"] = row["engine"]["decode_tok_s"] / floor_rate
        for k in [k for k in row if k.startswith("other:")]:
            row[k]["decode_ratio_vs_main"] = row[k]["decode_tok_s"] / row["engine"]["decode_tok_s"]
        if hf is not None:
            say(f"prompt {p}: transformers eager without cache")
            row["hf_nocache"] = hf.run(p, new_tokens, False)
            e, h, hn = row["engine"], row["hf_cache"], row["hf_nocache"]
            # transformers' DynamicCache holds exactly the tokens seen, in the model dtype
            h["kv_cache_bytes"] = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * (p + new_tokens)
            # each round's engine and transformers runs are back to back: their ratio sees the same
            # machine, so the median over rounds is the figure least moved by the host's drift
            paired = [x["decode_tok_s"] / y["decode_tok_s"] for x, y in zip(runs["engine"], runs["hf_cache"])]
            row["ratios"] = {
                "decode_vs_hf_cache_per_round": paired,
                "decode_vs_hf_cache_median_round": float(np.median(paired)),
                "decode_vs_hf_cache": e["decode_tok_s"] / h["decode_tok_s"],
                "decode_vs_hf_nocache": e["decode_tok_s"] / hn["decode_tok_s"],
                "ttft_vs_hf_cache": e["ttft_s"] / h["ttft_s"],
                "kv_bytes_vs_hf_cache": (None if e["kv_cache_bytes"] is None
                                         else e["kv_cache_bytes"] / h["kv_cache_bytes"]),
            }
            if gemv is not None:  # the most any engine on these MatMul kernels could show against transformers
                row["ratios"]["floor_vs_hf_cache"] = floor_rate / h["decode_tok_s"]
        report["prompts"][str(p)] = row
    report["read_bandwidth_gbs"] = bw
    report["rss_mb_engine"] = engine_rss
    report["peak_rss_mb"] = _peakrss_mb()
    if engine_load_rss_mb is not None and hf is not None:
        report["memory"] = {"engine_load_rss_mb": engine_load_rss_mb, "hf_load_rss_mb": hf.load_rss_mb,
                            "ratio": engine_load_rss_mb / max(hf.load_rss_mb, 1e-9)}
    return report


def _kv(e: dict[str, Any]) -> str:
    """The engine's cache figures as measured, or `not measured (why)`."""
    why = e.get("not_measured", {})
    kv = (f"kv {e['kv_cache_bytes'] / 2**20:.1f} MiB" if e["kv_cache_bytes"] is not None
          else f"kv not measured ({why.get('cache_bytes', 'no figure from this backend')})")
    copied = e["cache_bytes_copied_per_decode_step"]
    return kv + ("   copied/step " + (f"{copied:.0f} B" if copied is not None else
                                     f"not measured ({why.get('cache_bytes_copied', 'no figure from this backend')})"))


def format_report(r: dict[str, Any]) -> str:
    lines = [f"kvexport bench: {r['artifact']} ({r['backend']}, {r['threads']} threads, max_seq {r['max_seq']}, "
             f"{r['new_tokens']} new tokens, greedy, best of {r['rounds']} interleaved rounds)",
             f"read bandwidth (best seen in this run): {r['read_bandwidth_gbs']:.1f} GB/s"]
    for p, row in r["prompts"].items():
        e = row["engine"]
        lines.append(f"prompt {p}:")
        lines.append(f"  engine      decode {e['decode_tok_s']:7.1f} tok/s   ttft {e['ttft_s'] * 1e3:7.1f} ms   {_kv(e)}"
                     + (f"   python overhead {e['python_overhead'] * 100:.1f}%" if e["python_overhead"] is not None else ""))
        lines.append(f"  bound       {row['bandwidth_bound_tok_s']:7.1f} tok/s (weights + KV / bandwidth): "
                     f"engine reaches {row['fraction_of_bound'] * 100:.0f}%")
        if "gemv_floor_tok_s" in row:
            lines.append(f"  floor       {row['gemv_floor_tok_s']:7.1f} tok/s (the weight GEMVs alone, ONNX Runtime MatMul): "
                         f"engine reaches {row['fraction_of_floor'] * 100:.0f}%")
        for k, v in row.items():
            if k.startswith("other:"):
                lines.append(f"  {k[6:]}: decode {v['decode_tok_s']:.1f} tok/s = {v['decode_ratio_vs_main']:.3f}x the main "
                             f"engine, ttft {v['ttft_s'] * 1e3:.1f} ms, {_kv(v)}")
        if "ratios" in row:
            h, hn, q = row["hf_cache"], row["hf_nocache"], row["ratios"]
            lines.append(f"  HF eager    decode {h['decode_tok_s']:7.1f} tok/s   ttft {h['ttft_s'] * 1e3:7.1f} ms")
            lines.append(f"  HF no cache decode {hn['decode_tok_s']:7.1f} tok/s")
            rounds = ", ".join(f"{x:.2f}" for x in q["decode_vs_hf_cache_per_round"])
            lines.append(f"  per round   decode ÷ HF eager {rounds} (median {q['decode_vs_hf_cache_median_round']:.2f}x)")
            lines.append(f"  ratios      decode {q['decode_vs_hf_cache']:.2f}x HF eager, {q['decode_vs_hf_nocache']:.1f}x no-cache; "
                         f"ttft {q['ttft_vs_hf_cache']:.2f}x HF eager; KV bytes "
                         + (f"{q['kv_bytes_vs_hf_cache']:.2f}x HF's" if q["kv_bytes_vs_hf_cache"] is not None
                            else "not measured"))
            if "floor_vs_hf_cache" in q:
                lines.append(f"  floor       ÷ HF eager {q['floor_vs_hf_cache']:.2f}x (the ratio a step of bare weight GEMVs would show)")
    lines.append(f"RSS: {r['rss_mb_engine']:.0f} MiB after the engine's runs; process peak {r['peak_rss_mb']:.0f} MiB"
                 " (baselines included)")
    if "memory" in r:
        m = r["memory"]
        lines.append(f"memory: engine load {m['engine_load_rss_mb']:.0f} MiB, HF eager model after running {m['hf_load_rss_mb']:.0f} MiB "
                     f"({m['ratio']:.2f}x)")
    return "\n".join(lines)
