"""Serving benchmark for `kvexport serve` (docs/serving.md, docs/performance.md "Serving").

Starts one server on the artifact and, in the same run:
1. concurrency: rounds of one streaming client alone, then N streaming clients at once, each
   asking for --tokens tokens (greedy, ignore_eos so every stream runs to the end); reports the
   aggregate decode tokens/s of N clients over one client's, and the median inter-token latency
   ratio (client-side, from SSE chunk arrival times);
2. soak (--soak REQUESTS, 0 to skip): REQUESTS requests from --soak-clients threads, mixed prompt
   lengths and max_tokens, half streamed, --cancel of them dropped mid-stream; reports 5xx and
   transport errors, RSS (from /metrics) after warm-up, running rows and queue depth at the end.

    python benchmarks/serve_bench.py out/bench.kvx --threads 2 --soak 2000 --json out/serve_bench.json
    python benchmarks/serve_bench.py out/bench-intel.kvx --option batch_rows=state --against batch_rows=paged
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from kvexport.doctor import cpu_info

WORDS = ("the model reads every weight once per token so batching rows costs little more than one row "
         "def main return import class self value result for while if else print list dict").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(artifact: str, threads: int, max_batch: int, max_queue: int, log: Path,
                 prefill_budget: int | None = None, options: list[str] = ()) -> tuple[Any, str]:
    port = free_port()
    budget = [] if prefill_budget is None else ["--prefill-budget", str(prefill_budget)]
    proc = subprocess.Popen([sys.executable, "-m", "kvexport", "serve", artifact, "--port", str(port),
                             "--threads", str(threads), "--max-batch", str(max_batch), "--max-queue", str(max_queue),
                             *budget, *(a for o in options for a in ("--option", o))],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("server did not start")


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def metric(m: dict[str, float], name: str) -> float:
    return sum(v for k, v in m.items() if k.split("{")[0] == name)


def prompt_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def stream_one(url: str, prompt: str, tokens: int) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    arrivals: list[float] = []
    n = 0
    with httpx.Client(timeout=600) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
    return {"start": t0, "arrivals": arrivals, "tokens": n}


def concurrency(urls: list[str], clients: int, tokens: int, rounds: int, prompt_words: int) -> list[dict[str, Any]]:
    """Rounds of one stream then `clients` streams, on each server in turn within a round (so several
    servers are compared in the same run, under the same load)."""
    rng = random.Random(0)
    prompts = [prompt_text(rng, prompt_words) for _ in range(clients)]
    for url in urls:
        stream_one(url, prompts[0], 8)  # warm-up
    per_server: list[list[dict[str, Any]]] = [[] for _ in urls]
    for rnd in range(rounds):
        for k, url in enumerate(urls):
            per_server[k].append(one_round(url, prompts, tokens, rnd, f"server {k} " if len(urls) > 1 else ""))
    return [{"clients": clients, "tokens": tokens, "prompt_words": prompt_words, "rounds": rows,
             "median_throughput_ratio": statistics.median(r["throughput_ratio"] for r in rows),
             "median_itl_ratio": statistics.median(r["itl_ratio"] for r in rows)} for rows in per_server]


def one_round(url: str, prompts: list[str], tokens: int, rnd: int, label: str) -> dict[str, Any]:
    clients = len(prompts)
    single = stream_one(url, prompts[0], tokens)
    with ThreadPoolExecutor(clients) as pool:
        many = list(pool.map(lambda p: stream_one(url, p, tokens), prompts))

    def decode_rate(runs: list[dict[str, Any]]) -> float:
        # tokens after each stream's first, over the span from the first first-token to the last token
        first = min(r["arrivals"][0] for r in runs)
        last = max(r["arrivals"][-1] for r in runs)
        return sum(r["tokens"] - 1 for r in runs) / (last - first)

    def gaps(runs: list[dict[str, Any]]) -> list[float]:
        return [b - a for r in runs for a, b in zip(r["arrivals"], r["arrivals"][1:])]

    s_rate, m_rate = decode_rate([single]), decode_rate(many)
    s_itl, m_itl = statistics.median(gaps([single])), statistics.median(gaps(many))
    s_ttft = single["arrivals"][0] - single["start"]
    m_ttft = statistics.median(r["arrivals"][0] - r["start"] for r in many)
    print(f"{label}round {rnd}: 1 stream {s_rate:.1f} tok/s, ITL {1e3 * s_itl:.1f} ms | {clients} streams "
          f"{m_rate:.1f} tok/s ({m_rate / s_rate:.2f}x), median ITL {1e3 * m_itl:.1f} ms ({m_itl / s_itl:.2f}x)",
          flush=True)
    return {"round": rnd, "single_tok_s": s_rate, "many_tok_s": m_rate, "throughput_ratio": m_rate / s_rate,
            "single_itl_ms": 1e3 * s_itl, "many_itl_ms": 1e3 * m_itl, "itl_ratio": m_itl / s_itl,
            "single_ttft_ms": 1e3 * s_ttft, "many_median_ttft_ms": 1e3 * m_ttft,
            "tokens": [r["tokens"] for r in many]}


def soak(url: str, requests: int, clients: int, cancel: float, words: tuple[int, ...] = (4, 12, 32, 64),
         seed: int = 1) -> dict[str, Any]:
    lock = threading.Lock()
    counts: dict[str, int] = {}
    rss: list[tuple[int, float]] = []
    done = [0]

    def bump(k: str) -> None:
        with lock:
            counts[k] = counts.get(k, 0) + 1

    def one(i: int) -> None:
        rng = random.Random(seed * 100003 + i)
        body: dict[str, Any] = {"prompt": prompt_text(rng, rng.choice(words)),
                                "max_tokens": rng.choice((4, 16, 32, 64)), "temperature": rng.choice((0, 0.8)),
                                "seed": i}
        stream = rng.random() < 0.5
        drop = stream and rng.random() < cancel * 2  # half the requests stream: 2x so `cancel` of all drop
        try:
            with httpx.Client(timeout=600) as c:
                if not stream:
                    r = c.post(url + "/v1/completions", json=body)
                    bump(f"{r.status_code}")
                    return
                with c.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
                    bump(f"{r.status_code}")
                    seen = 0
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            seen += 1
                            if drop and seen >= 2:
                                bump("cancelled")
                                break
        except httpx.HTTPError as e:
            bump(f"transport:{type(e).__name__}")
        finally:
            with lock:
                done[0] += 1
                k = done[0]
            if k % 100 == 0:
                rss.append((k, metric(metrics(url), "process_resident_memory_bytes")))
                print(f"soak: {k}/{requests} requests, RSS {rss[-1][1] / 2**20:.0f} MiB", flush=True)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(requests)))
    wall = time.perf_counter() - t0
    time.sleep(1.0)  # the last cancelled rows retire at the scheduler's next step
    m = metrics(url)
    warm = [v for k, v in rss if k > max(200, requests // 10)]
    flat = (max(warm) - min(warm)) / min(warm) if warm else None
    fivexx = sum(v for k, v in counts.items() if k.startswith("5"))
    return {"requests": requests, "clients": clients, "wall_s": wall, "status": counts, "http_5xx": fivexx,
            "server_5xx": sum(v for k, v in m.items()
                              if k.startswith('kvexport_http_responses_total{code="5')),
            "rss_mib": [(k, round(v / 2**20, 1)) for k, v in rss], "rss_spread_after_warmup": flat,
            "running_rows_end": metric(m, "kvexport_running_rows"), "queue_depth_end": metric(m, "kvexport_queue_depth"),
            "finished": {k.split('finish_reason="')[1].rstrip('"}'): v for k, v in m.items()
                         if k.startswith("kvexport_requests_finished_total")},
            "generated_tokens": metric(m, "kvexport_generation_tokens_total")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-words", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="concurrency rounds (0: skip)")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--prefill-budget", type=int, default=None, help="the server's --prefill-budget (default: its own)")
    ap.add_argument("--soak", type=int, default=0, help="requests in the soak (0: skip it)")
    ap.add_argument("--soak-clients", type=int, default=16)
    ap.add_argument("--soak-prompt-words", default="4,12,32,64", help="prompt lengths (words) the soak mixes")
    ap.add_argument("--cancel", type=float, default=0.05, help="fraction of soak requests dropped mid-stream")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="backend load option for the server (repeatable), as `kvexport serve --option`")
    ap.add_argument("--against", action="append", default=[], metavar="KEY=VALUE",
                    help="also start a second server with these load options added (repeatable); the concurrency "
                         "rounds alternate between the two and report the second's rates over the first's")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    log = Path(a.json or "serve_bench.json").with_suffix(".server.log")
    procs = []
    proc, url = start_server(a.artifact, a.threads, a.max_batch, 256, log, a.prefill_budget, a.option)
    procs.append(proc)
    urls = [url]
    result: dict[str, Any] = {"artifact": a.artifact, "threads": a.threads, "max_batch": a.max_batch,
                              "prefill_budget": a.prefill_budget, "options": a.option,
                              "cpu": cpu_info()["model"], "cores": os.cpu_count()}
    try:
        if a.against:
            other, other_url = start_server(a.artifact, a.threads, a.max_batch, 256, log.with_suffix(".against.log"),
                                            a.prefill_budget, [*a.option, *a.against])
            procs.append(other)
            urls.append(other_url)
        if a.rounds:
            runs = concurrency(urls, a.clients, a.tokens, a.rounds, a.prompt_words)
            result["concurrency"] = runs[0]
            for name, run in zip(("server", "against"), runs):
                print(f"{name}: median over rounds: throughput {run['median_throughput_ratio']:.2f}x, "
                      f"inter-token latency {run['median_itl_ratio']:.2f}x", flush=True)
            if a.against:
                first, second = runs[0]["rounds"], runs[1]["rounds"]
                paired = {k: statistics.median(b[k] / f[k] for f, b in zip(first, second))
                          for k in ("single_tok_s", "many_tok_s", "single_itl_ms", "many_itl_ms")}
                result["against"] = {"options": a.against, **runs[1], "median_paired_ratio": paired}
                print(f"against {a.against} over the first server, median of paired rounds: "
                      + ", ".join(f"{k} {v:.2f}x" for k, v in paired.items()), flush=True)
        if a.soak:
            result["soak"] = s = soak(url, a.soak, a.soak_clients, a.cancel,
                                          tuple(int(w) for w in a.soak_prompt_words.split(",")))
            print(f"soak: {s['requests']} requests in {s['wall_s']:.0f}s, status {s['status']}, 5xx {s['http_5xx']}, "
                  f"RSS spread after warm-up {100 * (s['rss_spread_after_warmup'] or 0):.1f}%, running rows at the end "
                  f"{s['running_rows_end']:.0f}, queue {s['queue_depth_end']:.0f}", flush=True)
    finally:
        exits = []
        for p in procs:
            p.send_signal(signal.SIGTERM)
            try:
                exits.append(p.wait(60))
            except subprocess.TimeoutExpired:
                p.kill()
                exits.append("killed")
        result["server_exit"] = exits[0] if len(exits) == 1 else exits
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
