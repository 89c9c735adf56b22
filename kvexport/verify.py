"""Verification: the engine against the PyTorch reference, plus the cache checks of DESIGN.md §6."""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvexport.errors import CheckpointError
from kvexport.runtime.engine import Engine
from kvexport.tolerances import Tolerance, precision_key, tolerance

Progress = Callable[[str], None]
LOW_PRECISION_SELF_LIMIT = 0.25


class Reference:
    """Full-sequence logits from `transformers` (when installed) or the owned decoder in eager torch."""

    def __init__(self, model_dir: Path, max_seq: int, prefer_transformers: bool = True):
        import torch

        self.torch = torch
        self.kind = "kvexport-eager"
        self.model: Any = None
        if prefer_transformers:
            try:
                import transformers
            except ImportError:
                transformers = None  # type: ignore[assignment]
            if transformers is not None:
                transformers.logging.set_verbosity_error()
                transformers.utils.logging.disable_progress_bar()
                self.model = transformers.AutoModelForCausalLM.from_pretrained(
                    str(model_dir), dtype=torch.float32, attn_implementation="eager"
                ).eval()
                self.kind = f"transformers {transformers.__version__}"
        if self.model is None:
            from kvexport.checkpoint import load_checkpoint

            self.decoder = load_checkpoint(model_dir, max_seq=max_seq, hash_sources=False).decoder
            self.decoder.last_token_only = False

    def logits(self, ids: list[int]) -> np.ndarray:
        """(len(ids), vocab) float32 logits of one unpadded sequence."""
        torch = self.torch
        x = torch.tensor([ids], dtype=torch.long)
        with torch.inference_mode():
            if self.model is not None:
                return self.model(x).logits[0].float().numpy()
            S = len(ids)
            dec = self.decoder
            cfg = dec.cfg
            caches = [torch.zeros(dec.cache_shape(1, S)) for _ in range(2 * cfg.num_hidden_layers)]
            i = torch.arange(S)
            mask = i[None, :] <= i[:, None]
            if cfg.sliding_window:
                mask &= (i[:, None] - i[None, :]) < cfg.sliding_window
            out = dec(x, i[None], torch.zeros(1, dtype=torch.long), mask[None, None], *caches)[0]
            return out[0].float().numpy()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare(ref: np.ndarray, eng: np.ndarray) -> dict[str, float]:
    """Row-wise comparison of (N, V) logits: max/mean abs diff, greedy agreement, mean KL(ref||eng)."""
    lr, le = _log_softmax(ref), _log_softmax(eng)
    kl = (np.exp(lr) * (lr - le)).sum(axis=-1)
    return {
        "max_abs_logit": float(np.abs(ref - eng).max()),
        "mean_abs_logit": float(np.abs(ref - eng).mean()),
        "greedy_agreement": float((ref.argmax(-1) == eng.argmax(-1)).mean()),
        "mean_kl": float(max(kl.mean(), 0.0)),
    }


@dataclass
class VerifyReport:
    backend: str
    precision: str
    reference: str
    tolerance: dict[str, float]
    cases: list[dict[str, Any]] = field(default_factory=list)
    checks: dict[str, float] = field(default_factory=dict)
    summary: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    kv_precision_cost: dict[str, Any] | None = None  # memory saved / agreement lost by a lossy KV cache

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "passed": self.passed}, indent=2) + "\n"


def _prompt(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    lo = 3 if vocab > 3 else 0  # avoid the special ids of kvexport's byte tokenizer
    return [int(t) for t in rng.integers(lo, min(vocab, 259), n)]


def verify_engine(engine: Engine, reference_dir: str | Path, *, decode_steps: int = 32,
                  prompt_lengths: tuple[int, ...] = (1, 7, 33), seed: int = 0,
                  prefer_transformers: bool = True, progress: Progress | None = None) -> VerifyReport:
    """Prefill + greedy decode on several prompts, compared step by step with the reference."""
    say = progress or (lambda _m: None)
    t0 = time.perf_counter()
    target = engine.manifest.target or {}
    backend, precision = target.get("backend", "?"), precision_key(target)
    tol: Tolerance = tolerance(backend, precision)
    if not Path(reference_dir).is_dir():
        raise CheckpointError(f"reference {reference_dir} is not a checkpoint folder")
    ref = Reference(Path(reference_dir), engine.max_seq, prefer_transformers)
    report = VerifyReport(backend, precision, ref.kind, asdict(tol))
    rng = np.random.default_rng(seed)
    vocab = engine.vocab_size
    lengths = [n for n in prompt_lengths if n + decode_steps <= engine.max_seq] or [1]
    all_ref, all_eng = [], []
    for n in lengths:
        say(f"verify: prompt {n} + {decode_steps} decode steps against {ref.kind}")
        prompt = _prompt(rng, n, vocab)
        batch = engine.prefill(prompt, decode_steps)
        eng_logits, tokens = [batch.logits[0].copy()], []
        for _ in range(decode_steps - 1):
            tok = int(eng_logits[-1].argmax())
            tokens.append(tok)
            eng_logits.append(engine.decode(batch, np.array([tok]))[0].copy())
        engine.session.release(batch.state)
        r = ref.logits(prompt + tokens)[n - 1 :]
        e = np.stack(eng_logits)
        case = {"prompt_len": n, "steps": decode_steps, **compare(r, e)}
        report.cases.append(case)
        all_ref.append(r)
        all_eng.append(e)
    report.summary = compare(np.concatenate(all_ref), np.concatenate(all_eng))
    report.checks = cache_checks(engine, rng, say)
    if (target.get("options") or {}).get("kv_precision_cost"):
        report.kv_precision_cost = target["options"]["kv_precision_cost"]
    _judge(report, tol)
    report.seconds = time.perf_counter() - t0
    return report


def cache_checks(engine: Engine, rng: np.random.Generator, say: Progress) -> dict[str, float]:
    """prefill(N)+decode(1) == prefill(N+1) at several N; batch rows independent of each other."""
    say("verify: cache consistency and batch independence")
    worst = 0.0
    n_max = min(engine.max_seq - 1, 48)
    seq = _prompt(rng, n_max + 1, engine.vocab_size)
    for n in sorted({1, 2, n_max // 3, n_max // 2, n_max}):
        b = engine.prefill(seq[:n], 1)
        stepped = engine.decode(b, np.array([seq[n]]))[0].copy()
        engine.session.release(b.state)
        b = engine.prefill(seq[: n + 1], 0)
        whole = b.logits[0].copy()
        engine.session.release(b.state)
        worst = max(worst, float(np.abs(stepped - whole).max()))
    rows = [_prompt(rng, n, engine.vocab_size) for n in (5, 17, min(29, engine.max_seq - 4))]
    together = engine.prefill(rows, 3)
    tog = [together.logits.copy()]
    for _ in range(3):
        tog.append(engine.decode(together, tog[-1].argmax(-1)).copy())
    engine.session.release(together.state)
    batch_diff = 0.0
    for i, row in enumerate(rows):
        alone = engine.prefill(row, 3)
        al = [alone.logits[0].copy()]
        for _ in range(3):
            al.append(engine.decode(alone, np.array([al[-1].argmax()]))[0].copy())
        engine.session.release(alone.state)
        batch_diff = max(batch_diff, max(float(np.abs(a - t[i]).max()) for a, t in zip(al, tog)))
    return {"prefill_decode_max_abs": worst, "batch_independence_max_abs": batch_diff}


def _judge(report: VerifyReport, tol: Tolerance) -> None:
    s = report.summary
    if s["max_abs_logit"] > tol.max_abs_logit:
        report.failures.append(f"max |logit diff| {s['max_abs_logit']:.3g} > {tol.max_abs_logit:.3g}")
    if s["greedy_agreement"] < tol.min_greedy_agreement:
        report.failures.append(f"greedy agreement {s['greedy_agreement']:.4f} < {tol.min_greedy_agreement}")
    if s["mean_kl"] > tol.max_mean_kl:
        report.failures.append(f"mean KL {s['mean_kl']:.3g} > {tol.max_mean_kl:.3g}")
    # cache checks compare the engine with itself: held to the logit tolerance, or to
    # LOW_PRECISION_SELF_LIMIT where the precision has none (fp16/bf16 reorder their sums)
    limit = tol.max_abs_logit if np.isfinite(tol.max_abs_logit) else LOW_PRECISION_SELF_LIMIT
    for name, v in report.checks.items():
        if v > limit:
            report.failures.append(f"{name} {v:.3g} > {limit:.3g}")
