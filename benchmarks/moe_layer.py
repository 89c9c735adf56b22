"""Same-run timings (2 threads) of one bench-sized mixture-of-experts layer (hidden 2048, 8 experts of width
1024, top-2; 16 such layers with their attention and a 32000-token vocabulary make 1.10B parameters), all with
the same weights, at decode (1 token) and at a 32-token prefill: transformers' MixtralSparseMoeBlock (eager, a
loop over the experts that have tokens) against kvexport's MoeMlp exported to ONNX Runtime in each form (dense:
every expert; gathered: the chosen experts' weights gathered; the IR's If that picks one by token count) and
ONNX Runtime's fused com.microsoft MoE kernel on the same weights; prints each round and the median per-round
ratio to transformers.

    python benchmarks/moe_layer.py [--rounds 7] [--iters 50] [--threads 2] [--tokens 1,32]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch

from kvexport.architectures import map_config
from kvexport.backends.cpu import session_options
from kvexport.backends.cpu_fusion import moe_op_model
from kvexport.decoder import MoeMlp
from timing import seconds_per_call  # benchmarks/timing.py, beside this script

HF_CONFIG = {"model_type": "mixtral", "hidden_size": 2048, "intermediate_size": 1024, "num_local_experts": 8,
             "num_experts_per_tok": 2, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu",
             "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
BASE = "transformers eager"


def export_form(moe: MoeMlp, form: MoeMlp.Form, path: Path) -> Path:
    """MoeMlp alone as an ONNX graph of x (B, S, h) -> y, batch and seq symbolic (so `auto` keeps its If)."""
    moe.form = form
    seq = torch.export.Dim("seq", min=1, max=4096)
    torch.onnx.export(moe, (torch.randn(1, 3, moe.gate_up.shape[1]),), str(path), dynamo=True, opset_version=24,
                      input_names=["x"], output_names=["y"], dynamic_shapes=({1: seq},), external_data=True)
    moe.form = "auto"
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="1,32", help="token counts to time, comma-separated")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import onnxruntime as ort
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = map_config(HF_CONFIG)
    print(f"total parameters of the 16-layer model: {cfg.num_parameters() / 1e9:.2f}B")
    torch.manual_seed(0)
    ours = MoeMlp(cfg).eval().requires_grad_(False)
    for p in ours.parameters():
        p.copy_(torch.randn(p.shape) / p.shape[-2 if p.dim() == 3 else 1] ** 0.5)
    hf = MixtralSparseMoeBlock(transformers.AutoConfig.for_model(**HF_CONFIG)).eval().requires_grad_(False)
    # transformers 5 holds (E, 2I, h) and (E, h, I): ours transposed
    hf.gate.weight.copy_(ours.router.weight)
    hf.experts.gate_up_proj.copy_(ours.gate_up.transpose(1, 2))
    hf.experts.down_proj.copy_(ours.down.transpose(1, 2))
    with tempfile.TemporaryDirectory() as d:
        sessions = {f"ONNX Runtime, {form}": ort.InferenceSession(
            str(export_form(ours, form, Path(d) / f"{form}.onnx")), session_options(a.threads),
            providers=["CPUExecutionProvider"]) for form in ("dense", "gathered", "auto")}
        fused = moe_op_model(ours.router.weight.numpy().T, ours.gate_up.numpy(), ours.down.numpy(),
                             top_k=cfg.num_experts_per_tok, renormalise=cfg.norm_topk_prob)
        sessions["ONNX Runtime, com.microsoft MoE"] = ort.InferenceSession(
            fused.SerializeToString(), session_options(a.threads), providers=["CPUExecutionProvider"])
        for tokens in (int(t) for t in a.tokens.split(",")):
            x = torch.randn(1, tokens, cfg.hidden_size)
            xn = x.numpy()
            want = hf(x)
            want = (want[0] if isinstance(want, tuple) else want).numpy()
            runs = {BASE: lambda: hf(x)}
            for name, s in sessions.items():
                err = np.abs(s.run(None, {"x": xn})[0] - want).max()
                print(f"{tokens} token(s): max |{name} - transformers| {err:.2e}")
                runs[name] = lambda s=s: s.run(None, {"x": xn})
            ratios: dict[str, list[float]] = {k: [] for k in runs}
            for r in range(a.rounds):
                t = {k: seconds_per_call(fn, a.iters) for k, fn in runs.items()}
                for k in runs:
                    ratios[k].append(t[k] / t[BASE])
                print(f"{tokens} token(s), round {r}: " + ", ".join(f"{k} {t[k] * 1e3:.2f} ms" for k in runs))
            for k, v in ratios.items():
                print(f"{tokens} token(s): {k}: median time ratio to transformers {statistics.median(v):.2f}x "
                      f"(per round {', '.join(f'{x:.2f}' for x in v)})")


if __name__ == "__main__":
    main()
