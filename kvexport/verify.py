"""Verification: the engine against the fp32 PyTorch reference, plus the cache checks of the design's §6.

Two ways of judging, chosen by the tolerance row (kvexport.tolerances):
- strict (fp32): greedy decoding of seeded prompts, logits compared step by step;
- teacher-forced (bf16, fp16, a lossy KV cache): the engine fed a fixed text token by token (the
  reference checkpoint's held-out text when it ships one), its next-token distribution at each
  position compared with the reference's: top-1 agreement, mean/max KL and the perplexity change.
Both are measured and recorded every time; the row says which one decides.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvexport.checkpoint import HELDOUT_FILE
from kvexport.errors import ReferenceMismatchError, ReferenceUnavailableError
from kvexport.manifest import Manifest
from kvexport.runtime.engine import Engine
from kvexport.tolerances import Tolerance, precision_key, tolerance

Progress = Callable[[str], None]
LOW_PRECISION_SELF_LIMIT = 0.25
INSTALL_HINT = "pip install 'kvexport[verify]'"
SELF_CHECK = "kvexport-eager (self-check)"
TEXT_POSITIONS = 384  # teacher-forced positions judged per verify
TEXT_WINDOW = 256  # tokens per window: the first quarter prefilled, the rest fed one decode step at a time
# The fixed text when the reference ships no held-out text (deterministic, any tokenizer).
BUILTIN_TEXT = (
    "The cache is the model's memory of what it has read. Each new token looks back at every slot "
    "written before it, so a slot written in the wrong place, or a position counted one too far, "
    "changes every word that follows. A careful engine writes each key and value once, at the index "
    "the runtime names, and reads them with the same heads that wrote them.\n\n"
    "def greedy(engine, prompt, steps):\n"
    "    batch = engine.prefill(prompt, steps)\n"
    "    tokens = []\n"
    "    for _ in range(steps):\n"
    "        tokens.append(int(batch.logits[0].argmax()))\n"
    "        engine.decode(batch, [tokens[-1]])\n"
    "    return tokens\n\n"
    "Numbers rounded to fewer bits drift a little at every layer; the question verify answers is "
    "whether that drift stays small enough that the next word is still the same word, and the text "
    "as a whole is still as likely as the full-precision model says it is.\n"
)


def require_reference(self_check: bool = False) -> None:
    """Refuse, with the install command, when transformers is missing and no self-check was asked for."""
    if self_check:
        return
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ReferenceUnavailableError(
            f"verify compares the engine with the transformers implementation, which is not installed; "
            f"install it with `{INSTALL_HINT}`, or ask for a self-check against kvexport's own eager decoder "
            "(`kvexport verify --self-check`, verify_engine(..., self_check=True)), which cannot catch a bug "
            "the engine shares with kvexport's decoder"
        ) from e


# Compared first, by these names: what a user recognises in the message.
_SHAPE_FIELDS = {"model_type": "family", "vocab_size": "vocabulary", "num_hidden_layers": "layers",
                 "num_attention_heads": "attention heads", "num_key_value_heads": "KV heads",
                 "hidden_size": "hidden size", "head_dim": "head_dim"}


def check_reference(manifest: Manifest, reference_dir: str | Path) -> None:
    """The reference must be the model the artifact holds: same family and dimensions, every config field."""
    from kvexport.architectures import map_config
    from kvexport.checkpoint import read_hf_config

    ref = map_config(read_hf_config(Path(reference_dir)))
    mine = manifest.config
    diff = [f"{label}: artifact {getattr(mine, n)!r}, reference {getattr(ref, n)!r}"
            for n, label in _SHAPE_FIELDS.items() if getattr(mine, n) != getattr(ref, n)]
    other = [f.name for f in dataclasses.fields(mine)
             if f.name not in _SHAPE_FIELDS and getattr(mine, f.name) != getattr(ref, f.name)]
    if other:
        diff.append(f"config fields {', '.join(other)}")
    if diff:
        raise ReferenceMismatchError(
            f"{reference_dir} is not the model this artifact was built from ({'; '.join(diff)}); pass the "
            "checkpoint folder the artifact was exported from as --reference"
        )


class Reference:
    """Full-sequence fp32 logits from `transformers`, or (self_check) the owned decoder in eager torch."""

    def __init__(self, model_dir: Path, max_seq: int, *, self_check: bool = False):
        import torch

        self.torch = torch
        self.model: Any = None
        if not self_check:
            require_reference()
            import transformers

            transformers.logging.set_verbosity_error()
            transformers.utils.logging.disable_progress_bar()
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                str(model_dir), dtype=torch.float32, attn_implementation="eager"
            ).eval()
            self.kind = f"transformers {transformers.__version__}"
        else:
            from kvexport.checkpoint import load_checkpoint

            self.kind = SELF_CHECK
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
            mask = i[None, :] <= i[:, None]  # causal; the decoder bands its sliding-window layers itself
            out = dec(x, i[None], torch.zeros(1, dtype=torch.long), mask[None, None], *caches)[0]
            return out[0].float().numpy()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _kl(lr: np.ndarray, le: np.ndarray) -> np.ndarray:
    """KL(reference || engine) per row, from log-probabilities; rounding below 0 clipped."""
    return np.maximum((np.exp(lr) * (lr - le)).sum(axis=-1), 0.0)


def compare(ref: np.ndarray, eng: np.ndarray) -> dict[str, float]:
    """Row-wise comparison of (N, V) logits: max/mean abs diff, greedy agreement, mean KL(ref||eng)."""
    lr, le = _log_softmax(ref), _log_softmax(eng)
    return {
        "max_abs_logit": float(np.abs(ref - eng).max()),
        "mean_abs_logit": float(np.abs(ref - eng).mean()),
        "greedy_agreement": float((ref.argmax(-1) == eng.argmax(-1)).mean()),
        "mean_kl": float(_kl(lr, le).mean()),
    }


def text_metrics(ref: np.ndarray, eng: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """Teacher-forced (N, V) logits predicting `targets` (N,): top-1 agreement, mean/max KL, perplexities."""
    lr, le = _log_softmax(ref), _log_softmax(eng)
    kl = _kl(lr, le)
    rows = np.arange(len(targets))
    ppl_ref = math.exp(float(-lr[rows, targets].mean()))
    ppl_eng = math.exp(float(-le[rows, targets].mean()))
    return {
        "positions": int(len(targets)),
        "top1_agreement": float((ref.argmax(-1) == eng.argmax(-1)).mean()),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "max_abs_logit": float(np.abs(ref - eng).max()),
        "ppl_reference": ppl_ref,
        "ppl_engine": ppl_eng,
        "ppl_change": ppl_eng / ppl_ref - 1.0,
    }


@dataclass
class VerifyReport:
    backend: str
    precision: str
    reference: str
    tolerance: dict[str, float | None]
    mode: str  # "strict" or "teacher-forced": which measurements the tolerance row judges
    cases: list[dict[str, Any]] = field(default_factory=list)
    checks: dict[str, float] = field(default_factory=dict)
    summary: dict[str, float] = field(default_factory=dict)  # the greedy cases together
    text: dict[str, Any] = field(default_factory=dict)  # the teacher-forced text
    # the same text with its prefills sent down the path fresh prompts do not take by default (Session.other_prompt_path)
    other_text: dict[str, Any] = field(default_factory=dict)
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


def fixed_text(engine: Engine, reference_dir: Path, seed: int = 0) -> tuple[str, list[int]]:
    """(source, ids): the reference's held-out text, else the built-in text, else seeded ids (no tokenizer)."""
    held = reference_dir / HELDOUT_FILE
    if held.is_file() and engine.tokenizer is not None:
        return HELDOUT_FILE, engine.encode(held.read_text(encoding="utf-8"))
    if engine.tokenizer is not None:
        return "built-in text", engine.encode(BUILTIN_TEXT)
    return "seeded ids", _prompt(np.random.default_rng(seed), TEXT_POSITIONS + 1, engine.vocab_size)


def teacher_forced(engine: Engine, ref: Reference, ids: list[int], *, positions: int = TEXT_POSITIONS,
                   say: Progress = lambda _m: None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Feed `ids` window by window: prefill a window's first quarter, then one decode step per token.

    Returns (reference logits, engine logits, targets) over the judged positions: each window's
    last prefilled token and every decoded one, so both the prefill and the decode path are judged.
    """
    W = min(engine.max_seq, TEXT_WINDOW)
    P = max(1, W // 4)
    refs, engs, targets = [], [], []
    n = 0
    for start in range(0, len(ids), W):
        w = ids[start : start + W]
        if len(w) < P + 1 or n >= positions:
            break
        w = w[: P + min(len(w) - P, positions - n)]
        say(f"verify: text window at token {start}: prefill {P}, {len(w) - P - 1} decode steps")
        batch = engine.prefill(w[:P], len(w) - P)
        got = [batch.logits[0].copy()]  # decode returns a view of a buffer the next step reuses
        for t in w[P:-1]:
            got.append(engine.decode(batch, np.array([t]))[0].copy())
        engine.session.release(batch.state)
        engs.append(np.stack(got))
        refs.append(ref.logits(w)[P - 1 : -1])
        targets.append(np.asarray(w[P:], dtype=np.int64))
        n += len(w) - P
    return np.concatenate(refs), np.concatenate(engs), np.concatenate(targets)


def verify_engine(engine: Engine, reference_dir: str | Path, *, decode_steps: int = 32,
                  prompt_lengths: tuple[int, ...] = (1, 7, 33), seed: int = 0, self_check: bool = False,
                  text_positions: int = TEXT_POSITIONS, reference: Reference | None = None,
                  progress: Progress | None = None) -> VerifyReport:
    """Greedy decoding of seeded prompts and the teacher-forced text, both against the fp32 reference.

    `reference`: a Reference already loaded from reference_dir, to reuse across engines."""
    say = progress or (lambda _m: None)
    t0 = time.perf_counter()
    target = engine.manifest.target or {}
    backend, precision = target.get("backend", "?"), precision_key(target)
    tol: Tolerance = tolerance(backend, precision)
    reference_dir = Path(reference_dir)
    check_reference(engine.manifest, reference_dir)
    ref = reference or Reference(reference_dir, engine.max_seq, self_check=self_check)
    report = VerifyReport(backend, precision, ref.kind, asdict(tol),
                          "teacher-forced" if tol.teacher_forced else "strict")
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
    source, ids = fixed_text(engine, reference_dir, seed)
    r, e, targets = teacher_forced(engine, ref, ids, positions=text_positions, say=say)
    report.text = {"source": source, "tokens": len(ids), **text_metrics(r, e, targets)}
    report.other_text = other_path_text(engine, ref, ids, source, text_positions, say)
    report.checks = cache_checks(engine, rng, say)
    # an artifact built before verify measured it holds the build's record; otherwise the session measures it
    report.kv_precision_cost = (target.get("options") or {}).get("kv_precision_cost")
    if report.kv_precision_cost is None:
        report.kv_precision_cost = engine.session.lossy_cache_cost(say)
    _judge(report, tol)
    report.seconds = time.perf_counter() - t0
    return report


def other_path_text(engine: Engine, ref: Reference, ids: list[int], source: str, positions: int,
                    say: Progress) -> dict[str, Any]:
    """The teacher-forced text again with every window's prefill sent down the path such prompts do not take by
    default, where the engine has two (the intel target: paged attention, with its own block layout under a u8
    cache, and the fused attention with state), so that both are verified; {} where every prompt takes one path."""
    window = min(engine.max_seq, TEXT_WINDOW)
    path = engine.session.other_prompt_path(max(1, window // 4))  # teacher_forced's prefill length
    if path is None:
        return {}
    say("verify: the text again through the other prompt path")
    with path as note:
        r, e, targets = teacher_forced(engine, ref, ids, positions=positions, say=say)
    return {"source": source, "tokens": len(ids), "path": note["path"], **text_metrics(r, e, targets)}


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
    # an engine compiled for fewer rows (amd's --max-batch) checks as many as it holds; one row has no neighbour
    rows = rows[: getattr(engine.session, "max_batch", None) or len(rows)]
    if len(rows) < 2:
        say("verify: batch independence not checked: this engine runs one row at a time")
        return {"prefill_decode_max_abs": worst}
    together = engine.prefill(rows, 3)
    tog = [together.logits.copy()]
    for _ in range(3):
        tog.append(engine.decode(together, tog[-1].argmax(-1)).copy())
    engine.session.release(together.state)
    batch_diff = 0.0
    for i, row in enumerate(rows):
        # each row alone takes the batch's path (the intel target pages a lone row's prompt, a batch's runs the fused
        # attention with state: other_path_text judges the two apart), and is fed the tokens the batch fed it, so a
        # near-tie broken otherwise does not compare two different continuations
        with engine.session.batch_row_path():
            alone = engine.prefill(row, 3)
        al = [alone.logits[0].copy()]
        for k in range(3):
            al.append(engine.decode(alone, np.array([tog[k][i].argmax()]))[0].copy())
        engine.session.release(alone.state)
        batch_diff = max(batch_diff, max(float(np.abs(a - t[i]).max()) for a, t in zip(al, tog)))
    return {"prefill_decode_max_abs": worst, "batch_independence_max_abs": batch_diff}


def _judge_text(t: dict[str, Any], tol: Tolerance, label: str) -> list[str]:
    """What a teacher-forced text's figures break of a lossy row, each failure named by `label`."""
    assert tol.min_top1_agreement is not None
    failures = []
    if t["top1_agreement"] < tol.min_top1_agreement:
        failures.append(f"{label} top-1 agreement {t['top1_agreement']:.4f} < {tol.min_top1_agreement}")
    if t["mean_kl"] > tol.max_mean_kl:
        failures.append(f"{label} mean KL {t['mean_kl']:.3g} > {tol.max_mean_kl:.3g}")
    if t["max_kl"] > tol.max_max_kl:
        failures.append(f"{label} max KL {t['max_kl']:.3g} > {tol.max_max_kl:.3g}")
    # a perplexity means something only on text the model was not trained on
    if t["source"] == HELDOUT_FILE and abs(t["ppl_change"]) > tol.max_ppl_change:
        failures.append(f"{label}: held-out perplexity {t['ppl_engine']:.4g} vs reference {t['ppl_reference']:.4g} "
                        f"({t['ppl_change']:+.2%}, limit ±{tol.max_ppl_change:.0%})")
    return failures


def _judge(report: VerifyReport, tol: Tolerance) -> None:
    other_text = report.other_text
    if tol.teacher_forced:
        report.failures += _judge_text(report.text, tol, "text")
        if other_text:
            report.failures += _judge_text(other_text, tol, "other prompt path text")
    else:
        if other_text and other_text["max_abs_logit"] > tol.max_abs_logit:
            report.failures.append(f"other prompt path text max |logit diff| {other_text['max_abs_logit']:.3g} > "
                                   f"{tol.max_abs_logit:.3g}")
        s = report.summary
        if s["max_abs_logit"] > tol.max_abs_logit:
            report.failures.append(f"max |logit diff| {s['max_abs_logit']:.3g} > {tol.max_abs_logit:.3g}")
        if s["greedy_agreement"] < tol.min_greedy_agreement:
            report.failures.append(f"greedy agreement {s['greedy_agreement']:.4f} < {tol.min_greedy_agreement}")
        if s["mean_kl"] > tol.max_mean_kl:
            report.failures.append(f"mean KL {s['mean_kl']:.3g} > {tol.max_mean_kl:.3g}")
    limit = self_consistency_limit(tol)
    for name, v in report.checks.items():
        if v > limit:
            report.failures.append(f"{name} {v:.3g} > {limit:.3g}")


def self_consistency_limit(tol: Tolerance) -> float:
    """What the cache checks (the engine against itself) are held to: the logit tolerance, or
    LOW_PRECISION_SELF_LIMIT where the precision has none (fp16/bf16 reorder their sums)."""
    return tol.max_abs_logit if np.isfinite(tol.max_abs_logit) else LOW_PRECISION_SELF_LIMIT
