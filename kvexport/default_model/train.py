"""Train the embedded default model on the Python standard library's own sources.

    python -m kvexport.default_model.train [--out kvexport/default_model] [--steps N] [--seed 0]

A small Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over bytes: ids
3..258 are the 256 byte values, 0..2 are <pad>, <s>, </s> (never seen in training). The text is a
fixed, sorted list of the top-level `.py` files of the running interpreter's standard library,
less the held-out files, so nothing is downloaded. Deterministic given --seed, the Python version
(its stdlib is the data) and the torch build: fixed file order, fixed thread count, seeded
batches and init. Writes model.safetensors (fp32, Hugging Face llama weight names), config.json,
the byte tokenizer, heldout.txt and training.json (what was trained on, how long, final losses).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

# Two threads that spin-wait on a shared, busy machine lose most of their time to each other:
# wait passively (read when the OpenMP runtime loads, so before torch is imported).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from kvexport.doctor import cpu_info  # noqa: E402

HERE = Path(__file__).resolve().parent

# The held-out text: stdlib files that are never trained on (their concatenation is heldout.txt).
HELDOUT_FILES = ("textwrap.py", "shlex.py")
HELDOUT_BYTES = 30_000  # heldout.txt is the first 30 KB of their concatenation, cut at a line end

CONFIG: dict = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    "vocab_size": 259, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "torch_dtype": "float32",
}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def training_files() -> list[Path]:
    """Every top-level .py of the stdlib, sorted by name, less the held-out files."""
    return sorted((p for p in stdlib_dir().glob("*.py") if p.name not in HELDOUT_FILES), key=lambda p: p.name)


def heldout_text() -> str:
    text = "".join((stdlib_dir() / n).read_text(encoding="utf-8") for n in HELDOUT_FILES)
    return text[: text.rindex("\n", 0, HELDOUT_BYTES) + 1]


def byte_ids(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).astype(np.int64) + 3


# --- the model: Hugging Face llama, written out so that its state_dict keys are llama's -------
class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        h, d = c["hidden_size"], c["head_dim"]
        self.nq, self.nkv, self.d = c["num_attention_heads"], c["num_key_value_heads"], d
        self.q_proj = nn.Linear(h, self.nq * d, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * d, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * d, bias=False)
        self.o_proj = nn.Linear(self.nq * d, h, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.nq, self.d).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.nkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.nkv, self.d).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, self.nq * self.d))


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF llama's rotate_half RoPE (first half / second half pairs)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class MLP(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        h, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MLP(c)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Block(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class Llama(nn.Module):
    """state_dict keys are LlamaForCausalLM's: model.embed_tokens.weight, model.layers.0..., lm_head.weight."""

    def __init__(self, c: dict):
        super().__init__()
        self.model = Body(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        d = c["head_dim"]
        inv = 1.0 / (c["rope_parameters"]["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.arange(c["max_position_embeddings"], dtype=torch.float64)[:, None] * inv[None, :]
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)

    def forward(self, ids: Tensor) -> Tensor:
        S = ids.shape[1]
        cos, sin = self.cos[:S], self.sin[:S]
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))


def init_weights(m: Llama, c: dict) -> None:
    """GPT-2 style: N(0, 0.02), residual-output projections scaled by 1/sqrt(2 * layers)."""
    out_std = 0.02 / math.sqrt(2 * c["num_hidden_layers"])
    for name, p in m.named_parameters():
        if p.dim() == 1:
            nn.init.ones_(p)
        else:
            nn.init.normal_(p, 0.0, out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.inference_mode()
def perplexity(model: Llama, ids: np.ndarray, window: int) -> float:
    """exp(mean NLL) per byte over non-overlapping windows; each window predicts its tokens 1..n-1."""
    nll, n = 0.0, 0
    for s in range(0, len(ids) - 1, window):
        chunk = torch.from_numpy(ids[s: s + window])[None]
        if chunk.shape[1] < 2:
            break
        logits = model(chunk)
        nll += F.cross_entropy(logits[0, :-1], chunk[0, 1:], reduction="sum").item()
        n += chunk.shape[1] - 1
    return math.exp(nll / n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvexport.default_model.train", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(HERE), help="folder for the checkpoint (default: the package's own)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=20)
    a = ap.parse_args(argv)

    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True)
    files = training_files()
    data = b"".join(p.read_bytes() for p in files)
    ids = byte_ids(data)
    held = byte_ids(heldout_text().encode("utf-8"))
    print(f"python {platform.python_version()}: {len(files)} stdlib files, {len(data)} training bytes, "
          f"{len(held)} held-out bytes", flush=True)

    c = dict(CONFIG)
    model = Llama(c)
    init_weights(model, c)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params} parameters", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    g = np.random.default_rng(a.seed)
    data_t = torch.from_numpy(ids)
    t0 = time.perf_counter()
    losses: list[float] = []
    for step in range(a.steps):
        starts = g.integers(0, len(ids) - a.seq - 1, a.batch)
        batch = torch.stack([data_t[s: s + a.seq + 1] for s in starts])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a.steps, a.lr, a.warmup)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, c["vocab_size"]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if (step + 1) % a.log_every == 0 or step == 0:
            el = time.perf_counter() - t0
            print(f"step {step + 1}/{a.steps} loss {np.mean(losses[-a.log_every:]):.4f} "
                  f"lr {lr_at(step, a.steps, a.lr, a.warmup):.2e} {el:.0f}s "
                  f"({(step + 1) * a.batch * a.seq / el:.0f} tok/s)", flush=True)
    wall = time.perf_counter() - t0
    model.eval()
    ppl = perplexity(model, held, a.seq)
    final_loss = float(np.mean(losses[-50:]))
    print(f"trained {a.steps} steps in {wall:.0f}s; final train loss {final_loss:.4f} "
          f"(ppl {math.exp(final_loss):.2f}); held-out per-byte perplexity {ppl:.3f}", flush=True)
    save(model, c, Path(a.out), record={
        "command": "python -m kvexport.default_model.train", "options": {k: v for k, v in vars(a).items() if k != "out"},
        "python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
        "processor": cpu_info()["model"], "threads": a.threads,
        "seed": a.seed, "steps": a.steps, "batch": a.batch, "seq": a.seq, "lr": a.lr, "warmup": a.warmup,
        "tokens_seen": a.steps * a.batch * a.seq, "parameters": n_params,
        "training_files": [p.name for p in files], "training_bytes": len(data),
        "heldout_files": list(HELDOUT_FILES), "heldout_bytes": len(held),
        "wall_s": round(wall, 1), "final_train_loss": round(final_loss, 4),
        "heldout_perplexity_per_byte": round(ppl, 4), "heldout_window": a.seq,
    })
    return 0


def save(model: Llama, c: dict, out: Path, record: dict) -> None:
    from safetensors.torch import save_file

    from kvexport.zoo import write_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().float() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    write_tokenizer(out, c["vocab_size"])
    (out / "heldout.txt").write_text(heldout_text(), encoding="utf-8")
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
