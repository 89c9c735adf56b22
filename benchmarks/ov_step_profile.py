"""One decode step of a kvexport `intel` artifact and of an OpenVINO IR folder (optimum-cli's export), timed in one
process with their steps interleaved, and OpenVINO's PERF_COUNT summed by node type and by matmul.

    python benchmarks/ov_step_profile.py b1-intel-int8.kvx peers/openvino-int8 [--prompt 32 --steps 14]

Both are compiled with the settings their own runners use (kvexport's intel compile config; peers.py's
OpenVinoRunner properties: 2 threads, one stream, f32 inference precision, f32 KV cache, latency hint; with
`--precision bf16` both bf16 with a bf16 cache) plus PERF_COUNT. PERF_COUNT's real times are summed over nodes
and compare only with each other, not with the step's wall time. The first two steps are warm-up.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import numpy as np
import openvino as ov

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "backends" / "intel"))
from kvexport_intel import OV_PRECISION, _compile_config  # noqa: E402

PEER_PROPS = {"INFERENCE_NUM_THREADS": 2, "NUM_STREAMS": 1, "INFERENCE_PRECISION_HINT": "f32",
              "KV_CACHE_PRECISION": "f32", "PERFORMANCE_HINT": "LATENCY"}
GROUPS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "qkv_proj": "qkv",
          "gate_proj": "gate_up", "up_proj": "gate_up", "gate_up_proj": "gate_up"}


class System:
    def __init__(self, core: ov.Core, folder: Path, precision: str = "fp32"):
        self.kvexport = (folder / "manifest.json").is_file()
        xml = folder / ("engine" if self.kvexport else "") / "openvino_model.xml"
        kv = "bf16" if precision == "bf16" else "f32"  # the cache each engine holds under these activations
        props = (_compile_config(precision, kv, 2, pinned=True, compressed=True) if self.kvexport
                 else {**PEER_PROPS, "INFERENCE_PRECISION_HINT": OV_PRECISION[precision], "KV_CACHE_PRECISION": kv})
        self.request = core.compile_model(core.read_model(str(xml)), "CPU", {**props, "PERF_COUNT": True}) \
            .create_infer_request()
        self.request.reset_state()
        self.name, self.wall = folder.name, []
        self.by_type: collections.Counter[str] = collections.Counter()
        self.by_matmul: collections.Counter[str] = collections.Counter()

    def step(self, tokens: list[int], start: int, record: bool) -> int:
        S, total = len(tokens), start + len(tokens)
        x = {"input_ids": np.array([tokens], np.int64), "beam_idx": np.zeros(1, np.int32),
             "position_ids": np.arange(start, total, dtype=np.int64)[None]}
        if self.kvexport:  # additive (B, 1, S, T+S) mask, as kvexport_intel.session feeds it
            causal = np.tril(np.ones((S, total), bool), total - S)
            x["attention_mask"] = np.where(causal, np.float32(0), np.float32(-1e30))[None, None]
        else:
            x["attention_mask"] = np.ones((1, total), np.int64)
        t = time.perf_counter()
        self.request.infer(x)
        if record:
            self.wall.append(time.perf_counter() - t)
            for node in self.request.profiling_info:
                ms = node.real_time.total_seconds() * 1e3
                self.by_type[node.node_type] += ms
                if node.node_type == "FullyConnectedCompressed" or node.node_type == "FullyConnected":
                    layer = node.node_name.split("/")[0].split(".")[-1]
                    self.by_matmul[GROUPS.get(layer, layer)] += ms
        return int(self.request.get_output_tensor(0).data[0, -1].argmax())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("first")
    p.add_argument("second")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="both compiled with this inference precision (and, under bf16, a bf16 cache)")
    a = p.parse_args()
    core = ov.Core()
    systems = [System(core, Path(a.first), a.precision), System(core, Path(a.second), a.precision)]
    ids = [int(t) for t in np.random.default_rng(0).integers(3, 259, a.prompt)]
    tokens = [s.step(ids, 0, record=False) for s in systems]
    for k in range(a.steps):
        order = range(len(systems)) if k % 2 == 0 else reversed(range(len(systems)))  # alternate who goes first
        for i in order:
            tokens[i] = systems[i].step([tokens[i]], a.prompt + k, record=k >= 2)
    n = a.steps - 2
    ratios = [x / y for x, y in zip(systems[0].wall, systems[1].wall)]
    print(f"step wall median: {systems[0].name} {np.median(systems[0].wall) * 1e3:.1f} ms, {systems[1].name} "
          f"{np.median(systems[1].wall) * 1e3:.1f} ms; paired first/second median {np.median(ratios):.3f} "
          f"(range {min(ratios):.2f}-{max(ratios):.2f})")
    for s in systems:
        print(f"{s.name} PERF_COUNT by type (ms/step): " + ", ".join(f"{t} {v / n:.1f}" for t, v in s.by_type.most_common(8)))
        print(f"{s.name} PERF_COUNT by matmul (ms/step): " + ", ".join(f"{t} {v / n:.1f}" for t, v in s.by_matmul.most_common()))


if __name__ == "__main__":
    main()
