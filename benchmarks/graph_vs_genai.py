"""A kvexport `cpu` artifact's decode step against an onnxruntime-genai model's graph, both driven from this process.

`peers.py bench` times each system through its own runtime, in processes of their own, and this host's speed
moves between runs by more than the difference it looks for. This script takes the runtimes out: it loads
genai's `model.onnx` as a plain ONNX Runtime session (genai's own session options from its genai_config.json;
past and present bound to one shared buffer, as genai binds them under `past_present_share_buffer`) beside the
artifact (`kvexport.load`), and times both in blocks of decode steps after a fresh prompt, alternating which goes
first. It prints the median step of each and, per block, genai's step over ours (above 1: ours is faster).
`--profile DIR` also runs ONNX Runtime's profiler on both and prints each one's kernel time per decode step by
operator. Runs in kvexport's own environment (onnxruntime-genai is not needed: only its model folder).

    python benchmarks/graph_vs_genai.py b1-int4.kvx peers1b/ortgenai-int4-g32 --blocks 20
"""
from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path
from typing import Any

import numpy as np


def genai_session(folder: Path, profile: Path | None) -> tuple[Any, dict[str, Any]]:
    import onnxruntime as ort

    config = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    so = ort.SessionOptions()
    opts = config.get("session_options", {})
    so.intra_op_num_threads = int(opts.get("intra_op_num_threads", 0))
    so.inter_op_num_threads = int(opts.get("inter_op_num_threads", 0))
    if profile is not None:
        so.enable_profiling, so.profile_file_prefix = True, str(profile / "genai")
    return ort.InferenceSession(str(folder / config["filename"]), so, providers=["CPUExecutionProvider"]), config


class GenaiSteps:
    """genai's graph stepped as genai steps it: one shared K/V buffer per layer, the mask growing by one a step."""

    def __init__(self, sess: Any, config: dict[str, Any], max_len: int):
        self.sess, self.config = sess, config
        shape = (1, config["num_key_value_heads"], max_len, config["head_size"])
        names = config["inputs"]
        self.kv = {}
        for i in range(config["num_hidden_layers"]):
            for past, present in (("past_key_names", "present_key_names"), ("past_value_names", "present_value_names")):
                self.kv[names[past] % i] = (config["outputs"][present] % i, np.zeros(shape, np.float32))
        self.vocab = int(sess.get_outputs()[0].shape[-1])

    def block(self, prompt: list[int], steps: int) -> list[float]:
        b = self.sess.io_binding()
        for name, (present, buf) in self.kv.items():
            b.bind_cpu_input(name, buf)
            b.bind_output(present, "cpu", 0, np.float32, buf.shape, buf.ctypes.data)
        names = self.config["inputs"]
        b.bind_cpu_input(names["input_ids"], np.array([prompt], np.int64))
        b.bind_cpu_input(names["attention_mask"], np.ones((1, len(prompt)), np.int64))
        b.bind_output(self.config["outputs"]["logits"])
        self.sess.run_with_iobinding(b)
        tok = int(b.get_outputs()[0].numpy()[0, -1].argmax())
        logits = np.empty((1, 1, self.vocab), np.float32)
        times = []
        for s in range(steps):
            t = time.perf_counter()
            b.bind_cpu_input(names["input_ids"], np.array([[tok]], np.int64))
            b.bind_cpu_input(names["attention_mask"], np.ones((1, len(prompt) + 1 + s), np.int64))
            b.bind_output(self.config["outputs"]["logits"], "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
            self.sess.run_with_iobinding(b)
            tok = int(logits[0, -1].argmax())
            times.append(time.perf_counter() - t)
        return times


def ours_block(engine: Any, prompt: list[int], steps: int) -> list[float]:
    batch = engine.prefill(prompt, steps + 1, copy=False)
    tok = batch.logits.argmax(-1)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        tok = engine.decode(batch, tok, copy=False).argmax(-1)
        times.append(time.perf_counter() - t)
    engine.session.release(batch.state)
    return times


def kernel_ms_per_run(trace: str) -> dict[str, float]:
    """Kernel time by operator per decode run of an ONNX Runtime profile: the runs no longer than twice the median
    run (a prompt's run is many times a step's)."""
    events = json.loads(Path(trace).read_text())
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    nodes = sorted((e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")),
                   key=lambda e: e["ts"])
    limit = 2 * float(np.median([r["dur"] for r in runs]))
    total: collections.Counter[str] = collections.Counter()
    kept, j = 0, 0
    for r in runs:
        while j < len(nodes) and nodes[j]["ts"] < r["ts"]:
            j += 1
        if r["dur"] > limit:
            continue
        kept += 1
        k = j
        while k < len(nodes) and nodes[k]["ts"] < r["ts"] + r["dur"]:
            total[nodes[k]["args"]["op_name"]] += nodes[k]["dur"]
            k += 1
    return {op: us / max(kept, 1) / 1000 for op, us in total.most_common()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", help="a kvexport cpu artifact")
    ap.add_argument("genai", help="an onnxruntime-genai model folder of the same checkpoint (peers.py build)")
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per block")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens before each block")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", type=Path, help="a folder for ONNX Runtime's profiles of both")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="a load option of the artifact (e.g. huge_pages=false), as `kvexport run --option` takes it")
    a = ap.parse_args()
    if a.profile is not None:
        import kvexport.backends.cpu as cpu

        a.profile.mkdir(parents=True, exist_ok=True)
        plain = cpu.session_options

        def profiled(threads: int, optimized_path: Path | None = None) -> Any:
            so = plain(threads, optimized_path)
            so.enable_profiling, so.profile_file_prefix = True, str(a.profile / "ours")
            return so

        cpu.session_options = profiled
    import kvexport

    options = dict(o.split("=", 1) for o in a.option)
    engine = kvexport.load(a.artifact, threads=a.threads, **options)
    sess, config = genai_session(Path(a.genai), a.profile)
    if config.get("session_options", {}).get("intra_op_num_threads") != a.threads:
        print(f"note: genai's session options ask {config.get('session_options', {}).get('intra_op_num_threads')} "
              f"threads, ours {a.threads}")
    genai = GenaiSteps(sess, config, a.prompt + a.steps + 1)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, min(engine.vocab_size, 259), a.prompt)]
    print(f"ours: {engine.session.describe().get('huge_pages')}")

    def run_ours() -> float:
        return float(np.median(ours_block(engine, prompt, a.steps)))

    def run_genai() -> float:
        return float(np.median(genai.block(prompt, a.steps)))

    run_ours(), run_genai()  # warm-up: one untimed block each
    o, g = [], []
    for i in range(a.blocks):  # every other block the other goes first
        if i % 2 == 0:
            o.append(run_ours())
            g.append(run_genai())
        else:
            g.append(run_genai())
            o.append(run_ours())
    r = np.array(g) / np.array(o)
    print(f"median step: ours {np.median(o) * 1e3:.2f} ms, genai's graph {np.median(g) * 1e3:.2f} ms; genai's step over "
          f"ours per block: median {np.median(r):.3f} (quartiles {np.percentile(r, 25):.3f}-{np.percentile(r, 75):.3f}), "
          f"{a.blocks} blocks of {a.steps} steps after a {a.prompt}-token prompt")
    if a.profile is not None:
        traces = {"ours": engine.session.sess.end_profiling(), "genai": sess.end_profiling()}
        for name, trace in traces.items():
            ops = kernel_ms_per_run(trace)
            print(f"{name} ({trace}): kernels {sum(ops.values()):.2f} ms a step; "
                  + ", ".join(f"{op} {ms:.2f}" for op, ms in list(ops.items())[:8]))


if __name__ == "__main__":
    main()
