"""Same-run decode timings (1 token, 2 threads) of one bench-sized mixture-of-experts layer (hidden 2048, 8
experts of width 1024, top-2; 16 such layers with their attention and a 32000-token vocabulary make 1.10B
parameters): kvexport's dense MoeMlp in ONNX Runtime and in eager torch against transformers'
MixtralSparseMoeBlock (eager, the two chosen experts only), all with the same weights; prints each round and the
median per-round ratio to transformers.

    python benchmarks/moe_layer.py [--rounds 7] [--iters 50] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch

from kvexport.architectures import map_config
from kvexport.decoder import MoeMlp
from timing import seconds_per_call  # benchmarks/timing.py, beside this script

HF_CONFIG = {"model_type": "mixtral", "hidden_size": 2048, "intermediate_size": 1024, "num_local_experts": 8,
             "num_experts_per_tok": 2, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu",
             "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import onnxruntime as ort
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = map_config(HF_CONFIG)
    print(f"total parameters of the 16-layer model: {cfg.num_parameters() / 1e9:.2f}B")
    torch.manual_seed(0)
    ours = MoeMlp(cfg).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-2 if p.dim() == 3 else 1] ** 0.5)
    hf = MixtralSparseMoeBlock(transformers.AutoConfig.for_model(**HF_CONFIG)).eval()
    with torch.no_grad():  # transformers 5 holds (E, 2I, h) and (E, h, I): ours transposed
        hf.gate.weight.copy_(ours.router.weight)
        hf.experts.gate_up_proj.copy_(ours.gate_up.transpose(1, 2))
        hf.experts.down_proj.copy_(ours.down.transpose(1, 2))
    x = torch.randn(1, 1, cfg.hidden_size)
    with torch.no_grad():
        err = (ours(x) - hf(x)).abs().max().item()
    print(f"max |ours - transformers| on one token: {err:.2e}")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "moe.onnx"
        torch.onnx.export(ours, (x,), str(path), dynamo=True, opset_version=24, input_names=["x"],
                          output_names=["y"], external_data=True)
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = a.threads, 1
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        xn = x.numpy()
        print(f"max |ort - eager|: {np.abs(sess.run(None, {'x': xn})[0] - ours(x).detach().numpy()).max():.2e}")
        runs = {"transformers eager (top-2 experts)": lambda: hf(x),
                "kvexport MoeMlp eager (8 experts, dense)": lambda: ours(x),
                "kvexport MoeMlp in ONNX Runtime (dense)": lambda: sess.run(None, {"x": xn})}
        ratios: dict[str, list[float]] = {k: [] for k in runs}
        with torch.no_grad():
            for r in range(a.rounds):
                t = {k: seconds_per_call(fn, a.iters) for k, fn in runs.items()}
                base = t["transformers eager (top-2 experts)"]
                for k in runs:
                    ratios[k].append(t[k] / base)
                print(f"round {r}: " + ", ".join(f"{k} {t[k] * 1e3:.2f} ms" for k in runs))
    for k, v in ratios.items():
        print(f"{k}: median time ratio to transformers {statistics.median(v):.2f}x")


if __name__ == "__main__":
    main()
