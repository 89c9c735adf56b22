"""bench-125m on the intel target, BENCHMARKS.md protocol, with the baseline interleaved round by round.

The machine is shared: a baseline timed minutes after the engine sees different contention, so
each round times the engine, the lossy-KV engine and Hugging Face eager back to back, and every
figure is the best of the rounds.

usage: python backends/intel/benchmarks/bench_intel.py WORKDIR [--threads 2] [--precision fp32] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import kvexport
from kvexport.backends import BuildOptions
from kvexport.bench import _peak_rss_mb, _prompt, bench_engine, bench_hf, read_bandwidth_gbs
from kvexport.build import build
from kvexport.zoo import write_named


class HfEager:
    """transformers eager generate with its cache, the model loaded once (same timing as kvexport.bench)."""

    def __init__(self, model_dir: Path, threads: int):
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        torch.set_num_threads(threads)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()

    def run(self, prompt_len: int, new_tokens: int, vocab: int) -> dict[str, float]:
        x = self.torch.tensor([_prompt(prompt_len, vocab)])
        with self.torch.inference_mode():
            self.model.generate(x, max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
            t = time.perf_counter()
            self.model(x)
            ttft = time.perf_counter() - t
            t = time.perf_counter()
            self.model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            total = time.perf_counter() - t
        return {"ttft_s": ttft, "decode_tok_s": (new_tokens - 1) / max(total - ttft, 1e-9)}


def best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    top = max(rows, key=lambda r: r["decode_tok_s"])
    return {**top, "ttft_s": min(r["ttft_s"] for r in rows), "rounds": [r["decode_tok_s"] for r in rows]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--lossy-kv", default="u8")
    a = ap.parse_args()
    model = a.workdir / "bench-125m"
    if not (model / "config.json").is_file():
        write_named("bench-125m", model)
    art = a.workdir / "bench-125m-intel.kvx"
    if not (art / "manifest.json").is_file():
        build(model, art, target="intel", max_seq=2048,
              options=BuildOptions(precision=a.precision, threads=a.threads), verify=False, progress=print)
    load_opts = {"precision": a.precision} if a.precision else {}
    engine = kvexport.load(str(art), threads=a.threads, kv_precision="f32", **load_opts)
    lossy = kvexport.load(str(art), threads=a.threads, kv_precision=a.lossy_kv, **load_opts)
    facts = engine.session.describe()
    print(json.dumps(facts, default=str))
    hf = HfEager(model, a.threads)
    cfg = engine.config
    report: dict[str, Any] = {"threads": a.threads, "precision": facts["precision"], "new_tokens": a.new_tokens,
                              "rounds": a.rounds, "prompts": {}}
    for p in (32, 512):
        runs: dict[str, list[dict[str, Any]]] = {"engine": [], "lossy_kv": [], "hf_eager": []}
        bw = []
        for _ in range(a.rounds):
            bw.append(read_bandwidth_gbs(a.threads))
            runs["engine"].append(bench_engine(engine, p, a.new_tokens, repeats=1))
            runs["lossy_kv"].append(bench_engine(lossy, p, a.new_tokens, repeats=1))
            runs["hf_eager"].append(hf.run(p, a.new_tokens, cfg.vocab_size))
        row = {k: best(v) for k, v in runs.items()}
        row["hf_nocache"] = bench_hf(model, p, a.new_tokens, a.threads, False, cfg.vocab_size, repeats=1)
        weight_bytes = (cfg.num_parameters() - cfg.vocab_size * cfg.hidden_size) * 4
        kv_read = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * (p + a.new_tokens // 2)
        row["read_bandwidth_gbs"] = max(bw)
        row["bandwidth_bound_tok_s"] = max(bw) * 1e9 / (weight_bytes + kv_read)
        e, h = row["engine"], row["hf_eager"]
        row["ratios"] = {"decode_vs_hf_eager": e["decode_tok_s"] / h["decode_tok_s"],
                         "ttft_vs_hf_eager": e["ttft_s"] / h["ttft_s"],
                         "decode_vs_hf_nocache": e["decode_tok_s"] / row["hf_nocache"]["decode_tok_s"],
                         "fraction_of_bound": e["decode_tok_s"] / row["bandwidth_bound_tok_s"],
                         "lossy_kv_decode_vs_engine": row["lossy_kv"]["decode_tok_s"] / e["decode_tok_s"]}
        report["prompts"][p] = row
        print(f"prompt {p}: engine {e['decode_tok_s']:.1f} tok/s (rounds {[round(x, 1) for x in e['rounds']]}), "
              f"ttft {e['ttft_s'] * 1e3:.0f} ms, kv {e['kv_cache_bytes'] / 2**20:.1f} MiB | {a.lossy_kv} kv "
              f"{row['lossy_kv']['decode_tok_s']:.1f} tok/s, kv {row['lossy_kv']['kv_cache_bytes'] / 2**20:.1f} MiB | "
              f"HF eager {h['decode_tok_s']:.1f} tok/s (rounds {[round(x, 1) for x in h['rounds']]}), "
              f"ttft {h['ttft_s'] * 1e3:.0f} ms | HF no cache {row['hf_nocache']['decode_tok_s']:.2f} tok/s | "
              f"bandwidth {max(bw):.1f} GB/s, bound {row['bandwidth_bound_tok_s']:.1f} tok/s")
        print("  ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in row["ratios"].items()))
    report["peak_rss_mb"] = _peak_rss_mb()
    out = a.workdir / f"bench-intel-{facts['precision']}.json"
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
