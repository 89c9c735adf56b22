"""`kvexport bench`: the protocol of docs/benchmarks.md, every figure a ratio against baselines of the same run."""
from __future__ import annotations

import os
import resource
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvexport.config import DecoderConfig
from kvexport.native import Kernel
from kvexport.precision import kv_of
from kvexport.runtime.engine import Engine
from kvexport.runtime.hugepages import Placement

Progress = Callable[[str], None]
# an engine and its floor whose shares of weight bytes in huge pages differ by more than this are not read alike
PLACEMENT_TOLERANCE = 0.25
# a floor label's tail where its 4-bit matrices ran kvexport's native kernel (kvexport.native), as its engine's do
QMATMUL_TAG = " (kvexport QMatMul)"


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
    """(K, N) of every weight matrix one decode step reads, as the cpu fp32 engine multiplies them
    (q|k|v packed, gate|up packed), then the lm_head. The embedding tables are gathered, not read. (A quantized
    cpu engine cuts gate|up in two; its floor reads its own graph's matrices: onnx_gemvs.)"""
    h = cfg.hidden_size
    mlp_in = (2 if cfg.mlp_kind == "gated" else 1) * cfg.intermediate_size
    attn = [(h, cfg.q_size + 2 * cfg.kv_size), (cfg.q_size, h)]
    mlp = [(h, mlp_in), (cfg.intermediate_size, h)]
    # a routed layer: the router, then the chosen experts' gate|up and down (at decode the cpu engine reads
    # only the top k of them: MoeMlp's gathered form, or ONNX Runtime's MoE kernel that it is lowered to)
    moe = [(h, cfg.num_experts)] + [(h, 2 * cfg.moe_intermediate_size), (cfg.moe_intermediate_size, h)] * cfg.num_experts_per_tok
    layers = [s for i in range(cfg.num_hidden_layers) for s in attn + (moe if cfg.is_moe_layer(i) else mlp)]
    return layers + [(h, cfg.vocab_size)]


@dataclass(frozen=True)
class Gemv:
    """One weight matrix of a decode step as its engine multiplies it: fp32 MatMul (bits None) or
    MatMulNBits with `bits`-bit blocks of `block_size` rows sharing one scale."""

    k: int
    n: int
    bits: int | None = None
    block_size: int = 0
    accuracy_level: int = 0
    zero_points: bool = False

    @property
    def blocks(self) -> int:
        return -(-self.k // self.block_size)

    @property
    def nbytes(self) -> int:
        if self.bits is None:
            return self.k * self.n * 4
        zp = self.n * -(-self.blocks * self.bits // 8) if self.zero_points else 0
        return self.n * self.blocks * (self.block_size * self.bits // 8 + 4) + zp

    def tag(self) -> str:
        return "fp32" if self.bits is None else f"int{self.bits}-g{self.block_size}"


def fp32_gemvs(cfg: DecoderConfig) -> list[Gemv]:
    return [Gemv(k, n) for k, n in linear_shapes(cfg)]


# MatMulNBits' largest block (ONNX Runtime 1.31 takes 16, 32, 64, 128 and 256)
NBITS_MAX_BLOCK = 256


def per_channel_block(k: int) -> int:
    """The block a floor gives a matrix quantized with one scale per output channel (NNCF's int8, group -1, as the
    intel target records it; no group recorded): MatMulNBits has no such block, so its largest, or the smallest
    power of two from 16 that covers a narrower k. Its scales then take 4 bytes per 256 weights instead of per row
    (+1.4% of an int8 matrix's bytes at k = 2048)."""
    return min(NBITS_MAX_BLOCK, max(16, 1 << (k - 1).bit_length()))


def nominal_gemvs(cfg: DecoderConfig, weights: str, group_size: int | None) -> list[Gemv]:
    """Every matrix at the artifact's recorded mode: what a floor can assume of an engine it cannot read."""
    bits = {"int8": 8, "int4": 4}.get(weights)
    if bits is None:
        return fp32_gemvs(cfg)
    return [Gemv(k, n, bits, group_size if group_size and group_size > 0 else per_channel_block(k))
            for k, n in linear_shapes(cfg)]


def onnx_gemvs(path: Path) -> list[Gemv]:
    """The MatMulNBits nodes of an ONNX engine graph (K, N, bits, block size, accuracy level, zero
    points as the engine has them) and its MatMuls by a 2-D fp32 weight; weights are not read."""
    import onnx
    from onnx import helper

    model = onnx.load(str(path), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    out = []
    for node in model.graph.node:
        a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
        if node.op_type == "MatMulNBits":
            zp = len(node.input) > 3 and node.input[3] != ""
            out.append(Gemv(int(a["K"]), int(a["N"]), int(a["bits"]), int(a["block_size"]),
                            int(a.get("accuracy_level", 0)), zp))
        elif node.op_type == "MatMul" and node.input[1] in inits:
            w = inits[node.input[1]]
            if len(w.dims) == 2 and w.data_type == onnx.TensorProto.FLOAT:
                out.append(Gemv(int(w.dims[0]), int(w.dims[1])))
    return out


def engine_gemvs(engine: Engine) -> list[Gemv]:
    """The weight matrices `engine` reads per step, as its kernels take them: read from its ONNX engine
    graph when it has one with quantized weights, else the matrices of its recorded weight mode."""
    target = engine.manifest.target or {}
    weights = target.get("weights") or {"dtype": target.get("precision", "fp32"), "group_size": None}
    if weights["dtype"] in ("int8", "int4"):
        graphs = [f for f in target.get("engine_files", []) if f.endswith(".onnx")]
        found = onnx_gemvs(engine.folder / graphs[0]) if graphs else []
        if any(g.bits is not None for g in found):
            return found
    return nominal_gemvs(engine.config, str(weights["dtype"]), weights.get("group_size"))


def floor_label(gemvs: list[Gemv]) -> str:
    """`fp32`, `int4-g32`, or the mix by bytes, e.g. `int4-g32 + int8-g32 (1 matrix)`."""
    tags: dict[str, int] = {}
    for g in gemvs:
        tags[g.tag()] = tags.get(g.tag(), 0) + 1
    order = sorted(tags, key=lambda t: -sum(g.nbytes for g in gemvs if g.tag() == t))
    return order[0] + "".join(f" + {t} ({tags[t]} {'matrix' if tags[t] == 1 else 'matrices'})" for t in order[1:])


class GemvFloor:
    """A decode step that does nothing but read its weights: one ONNX Runtime MatMul (M=1) per fp32
    weight matrix, one MatMulNBits per quantized one (random weights, the engine's bits, block size,
    accuracy level and zero points), the engine's threads and session options.

    An engine can approach this rate, not pass it: what separates them is everything else a step
    does (attention over the cache, norms, rotary, kernel launches, Python). The bandwidth bound
    says what the memory could give; this says what the matrix kernels on this machine do give.
    The weights go through an external-data file so no 2 GB protobuf is built in memory."""

    def __init__(self, cfg: DecoderConfig | None, threads: int, seed: int = 0, gemvs: list[Gemv] | None = None,
                 huge_pages: bool = True, qmm: Kernel | None = None):
        import onnx
        from onnx import TensorProto, helper

        from kvexport.backends.cpu import open_ort_session

        if gemvs is None:
            assert cfg is not None, "GemvFloor needs a config or its matrices"
            gemvs = fp32_gemvs(cfg)
        self.gemvs = gemvs
        self.shapes = [(g.k, g.n) for g in gemvs]
        self.label = floor_label(gemvs)
        rng = np.random.default_rng(seed)
        nodes, inits, outputs = [], [], []
        with tempfile.TemporaryDirectory(prefix="kvexport-floor-") as tmp:
            offset = 0
            with open(Path(tmp) / "w.bin", "wb") as f:

                def external(name: str, w: np.ndarray, dtype: int) -> str:
                    nonlocal offset
                    w.tofile(f)
                    t = TensorProto(name=name, data_type=dtype, dims=list(w.shape), data_location=TensorProto.EXTERNAL)
                    for key, value in (("location", "w.bin"), ("offset", str(offset)), ("length", str(w.nbytes))):
                        t.external_data.add(key=key, value=value)
                    offset += w.nbytes
                    inits.append(t)
                    return name

                for i, g in enumerate(gemvs):
                    if g.bits is None:
                        w = external(f"w{i}", rng.standard_normal((g.k, g.n), dtype=np.float32), TensorProto.FLOAT)
                        nodes.append(helper.make_node("MatMul", [f"x{g.k}", w], [f"y{i}"]))
                    else:  # (N, blocks, bytes per block) packed weights, one fp32 scale per block
                        blob = g.block_size * g.bits // 8
                        ins = [f"x{g.k}",
                               external(f"w{i}", rng.integers(0, 256, (g.n, g.blocks, blob), dtype=np.uint8),
                                        TensorProto.UINT8),
                               external(f"s{i}", (0.01 * rng.random(g.n * g.blocks, dtype=np.float32) + 1e-3),
                                        TensorProto.FLOAT)]
                        if g.zero_points:
                            ins.append(external(f"z{i}", rng.integers(0, 256, g.n * -(-g.blocks * g.bits // 8),
                                                                      dtype=np.uint8), TensorProto.UINT8))
                        nodes.append(helper.make_node("MatMulNBits", ins, [f"y{i}"], domain="com.microsoft",
                                                      K=g.k, N=g.n, bits=g.bits, block_size=g.block_size,
                                                      accuracy_level=g.accuracy_level))
                    outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, g.n]))
            ks = sorted({k for k, _ in self.shapes})
            graph = helper.make_graph(nodes, "gemv_floor",
                                      [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [1, k]) for k in ks],
                                      outputs, inits)
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                            helper.make_opsetid("com.microsoft", 1)], ir_version=10)
            onnx.save_model(model, str(Path(tmp) / "floor.onnx"))
            # ONNX Runtime pre-packs each weight into memory of its own while the session is made; that memory
            # is placed as the cpu engine's is (huge pages where the system allows), or the floor would not be
            # the same matrices read the same way
            # and its quantized matrices run the kernel the engine runs (`qmm`: kvexport's where the engine's load
            # swapped it in)
            self.sess, self.huge_pages, self.swapped, _, _ = open_ort_session(Path(tmp) / "floor.onnx", threads,
                                                                        huge_pages, qmm=qmm)
            if self.swapped:
                self.label += QMATMUL_TAG
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
        return sum(g.nbytes for g in self.gemvs)

    def measure(self, steps: int = 20) -> float:
        """Steps per second over `steps` back-to-back steps (a rate over a run, like decode tok/s)."""
        self.sess.run_with_iobinding(self.binding)
        t = time.perf_counter()
        for _ in range(steps):
            self.sess.run_with_iobinding(self.binding)
        return steps / (time.perf_counter() - t)


def other_key(label: str) -> str:
    """The report's key for a compared engine."""
    return f"other:{label}"


def placement(engine: Engine) -> Placement | None:
    """Where the engine's repacked weights lie (kvexport.runtime.hugepages); None for an engine that places none."""
    p = getattr(engine.session, "huge_pages", None)
    return p if isinstance(p, Placement) else None


class Floors:
    """One GEMV floor per kind of weights among the engines of a run, each placed in memory as the engine it was
    made for (huge pages, or not where that engine's load option says not). Make each engine's floor just after
    the engine loads (`add`): placing needs free 2 MiB pages, and a floor made after every engine has loaded (a
    10 GB fp32 one among them) can find none where its engine found them."""

    def __init__(self, threads: int, progress: Progress | None = None):
        self.threads, self.say = threads, progress or (lambda _m: None)
        self.floors: dict[str, GemvFloor] = {}  # by label
        self.floor_of: dict[str, str] = {}  # engine key -> label

    def add(self, key: str, engine: Engine) -> GemvFloor:
        from kvexport import native

        gemvs = engine_gemvs(engine)
        qmm = (getattr(engine.session, "qmm", None) or {}).get("nodes", 0) > 0  # the engine runs kvexport's kernel
        label = floor_label(gemvs) + (QMATMUL_TAG if qmm else "")
        if label not in self.floors:
            self.say(f"preparing the {label} GEMV floor (the step's weight matrices alone, in ONNX Runtime)")
            placed = placement(engine)
            self.floors[label] = GemvFloor(None, self.threads, gemvs=gemvs,
                                           huge_pages=placed.asked if placed is not None else True,
                                           qmm=native.kernel() if qmm else None)
        self.floor_of[key] = label
        return self.floors[label]


def parse_prompt_lens(text: str) -> tuple[int, ...]:
    """`32,512,4096` -> (32, 512, 4096); anything else is refused before an engine is loaded."""
    from kvexport.errors import InputError

    try:
        lens = tuple(int(x) for x in text.split(","))
    except ValueError as e:
        raise InputError(f"--prompt-lens takes comma-separated token counts such as 32,512,4096, not {text!r}") from e
    if not lens or min(lens) < 1:
        raise InputError(f"--prompt-lens takes positive token counts, not {text!r}")
    return lens


def check_comparable(main: Path, others: list[Path]) -> None:
    """Ratios between artifacts mean something only for one model: every --compare artifact must hold the
    main one's model config (its weight and cache modes, max_seq and target may differ). Reads manifests only."""
    from kvexport.errors import InputError
    from kvexport.manifest import read

    # through DecoderConfig, so a field an older kvexport did not write compares as its default
    want = read(Path(main)).config.to_dict()
    for other in others:
        got = read(Path(other)).config.to_dict()
        diff = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
        if diff:
            raise InputError(f"--compare {other} holds another model than {main} (config differs in "
                             f"{', '.join(diff[:6])}); compare artifacts built from one checkpoint")


def mode_of(engine: Engine) -> str:
    """The engine's precision key (`fp32`, `int8`, `int4-g32+kv-int8`, ...) from its manifest target, with the cache
    it holds as loaded where the backend says (intel's `kv_precision` load option, or an f32 cache loaded at f32
    activations from an artifact built at bf16, holds another cache than the one recorded)."""
    from kvexport.precision import canonical
    from kvexport.tolerances import precision_key

    target = dict(engine.manifest.target or {})
    held = engine.session.describe().get("kv_precision")
    if held:
        target["kv"] = {**(target.get("kv") or {}), "dtype": canonical(str(held))}
    return precision_key(target)


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


def paired_steps(timed: list[tuple[str, Engine]], prompt_len: int, steps: int) -> dict[str, list[float]]:
    """Every engine prefills the same prompt and holds it; then each decodes `steps` greedy tokens (its own argmax),
    one step of each engine after another, every other step in reverse order. A step and its pair run milliseconds
    apart, so the host's drift over seconds, which moves whole runs (one engine's round against another's), moves
    both alike. Returns each engine's step times in seconds, in order."""
    ids = _prompt(prompt_len, timed[0][1].vocab_size)
    for _, e in timed:
        e.check_fits(prompt_len, steps + 1)  # every engine before any holds a cache
    batches: dict[str, Any] = {}
    times: dict[str, list[float]] = {key: [] for key, _ in timed}
    try:
        tokens = {}
        for key, e in timed:
            batches[key] = e.prefill(ids, steps + 1, copy=False)
            tokens[key] = batches[key].logits.argmax(-1)
        for s in range(steps):
            for key, e in timed if s % 2 == 0 else timed[::-1]:
                t0 = time.perf_counter()
                logits = e.decode(batches[key], tokens[key], copy=False)
                times[key].append(time.perf_counter() - t0)
                tokens[key] = logits.argmax(-1)
    finally:
        for key, e in timed:
            if key in batches:
                e.session.release(batches[key].state)
    return times


def step_pair_figures(main: list[float], other: list[float]) -> dict[str, Any]:
    """The other engine's speed over the main one's, step by step (main's step time over the other's)."""
    ratio = np.asarray(main) / np.asarray(other)
    q25, q50, q75 = (float(x) for x in np.quantile(ratio, [0.25, 0.5, 0.75]))
    return {"steps": int(ratio.size), "median": q50, "quartiles": [q25, q75],
            "step_ms": float(np.median(other)) * 1e3, "main_step_ms": float(np.median(main)) * 1e3}


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


def check_prompts_fit(prompt_lens: tuple[int, ...], new_tokens: int, max_seq: int) -> None:
    """Refuse a run in which no prompt length fits the engine (each one alone is skipped, said why)."""
    from kvexport.errors import InputError

    if all(p + new_tokens > max_seq for p in prompt_lens):
        raise InputError(f"no --prompt-lens fits this artifact: a prompt plus --new-tokens {new_tokens} must be at most "
                         f"its max_seq {max_seq}; give shorter prompts or rebuild with a larger --max-seq")


def run_bench(engine: Engine, *, reference: Path | None, prompt_lens: tuple[int, ...] = (32, 512),
              new_tokens: int = 64, threads: int = 2, others: list[tuple[str, Engine]] | None = None,
              baselines: bool = True, floor: bool = True, rounds: int = 3, engine_load_rss_mb: float | None = None,
              progress: Progress | None = None, prepared: Floors | None = None,
              step_pairs: bool = False) -> dict[str, Any]:
    """Engine, other engines and the transformers baseline are timed back to back in each round,
    so a burst of load from elsewhere hits all of them; each keeps its best round. `prepared`: the engines'
    floors, each made just after its engine loaded (`Floors`, keys "engine" and other_key(label)); made here
    otherwise. `step_pairs`: after the rounds, each prompt's decode is also timed step against step
    (paired_steps), `rounds` times new_tokens - 1 pairs, for every other engine against the main one."""
    say = progress or (lambda _m: None)
    check_prompts_fit(prompt_lens, new_tokens, engine.max_seq)
    cfg = engine.config
    report: dict[str, Any] = {
        "artifact": str(engine.folder), "threads": threads, "new_tokens": new_tokens, "cpu_count": os.cpu_count(),
        "backend": (engine.manifest.target or {}).get("backend"), "max_seq": engine.max_seq, "rounds": rounds,
        "prompts": {},
    }
    bw = 0.0  # best read bandwidth seen in any round: the bound is an upper limit, so take the highest
    timed = [("engine", engine), *((other_key(label), other) for label, other in others or [])]
    modes = {key: mode_of(e) for key, e in timed}
    kv_token_bytes = kv_of(engine.manifest)[1]  # K and V of one token, every layer, at the cache's own width
    gemvs = {key: engine_gemvs(e) for key, e in timed}
    # per token: every weight matrix is read once (the embedding tables are gathered, one row each)
    weight_bytes = sum(g.nbytes for g in gemvs["engine"])
    probe = BandwidthProbe(threads)  # before the baseline: its RSS is not the transformers model's
    placed = {key: p for key, e in timed if (p := placement(e)) is not None}
    if not floor:
        prepared = None
    elif prepared is None:
        prepared = Floors(threads, say)
        for key, e in timed:
            prepared.add(key, e)
    floors = prepared.floors if prepared is not None else {}
    floor_of = prepared.floor_of if prepared is not None else {}
    assert not floors or set(floor_of) == {key for key, _ in timed}, "a floor for each engine timed, made by Floors.add"
    report["native_kernels"] = {key: k for key, e in timed if (k := native_kernels(e))}
    report["huge_pages"] = {key: p.record() for key, p in placed.items()}
    for key, e in timed:  # an engine that places memory its floor does not mirror (the intel target's plugin copies)
        if key not in placed and isinstance(record := e.session.describe().get("huge_pages"), dict):
            report["huge_pages"][key] = record
    report["huge_pages"].update({f"{label} floor": f.huge_pages.record() for label, f in floors.items()})
    hf = HFBaseline(reference, threads) if baselines and reference is not None else None
    engine_rss = 0.0
    for p in prompt_lens:
        if p + new_tokens > engine.max_seq:
            say(f"skip prompt {p}: exceeds max_seq {engine.max_seq}")
            continue
        runs: dict[str, list[dict[str, Any]]] = {key: [] for key, _ in timed}
        runs["hf_cache"] = []
        floor_rates = dict.fromkeys(floors, 0.0)  # each floor's best run at this prompt
        # each engine's floor, timed for as many steps as the engine decodes just before each of its runs: this
        # host's speed drifts over minutes, so an engine's run and a floor timed at another moment (once per round,
        # ahead of every engine) can land in different drifts; the per-round fraction pairs them
        paired_floor: dict[str, list[float]] = {key: [] for key in floor_of}
        for r in range(rounds):
            say(f"prompt {p}, round {r + 1}/{rounds}")
            bw = max(bw, probe.measure())
            for key, e in timed if r % 2 == 0 else timed[::-1]:  # every other round reversed: drift hits all alike
                if key in floor_of:
                    rate = floors[floor_of[key]].measure(steps=new_tokens - 1)
                    paired_floor[key].append(rate)
                    floor_rates[floor_of[key]] = max(floor_rates[floor_of[key]], rate)
                runs[key].append(bench_engine(e, p, new_tokens))
                if key == "engine":
                    engine_rss = max(engine_rss, rss_mb())
            if hf is not None:
                runs["hf_cache"].append(hf.run(p, new_tokens, True))
        row: dict[str, Any] = {k: _best(v) for k, v in runs.items() if v}
        kv_read = kv_token_bytes * (p + new_tokens // 2)
        bound = bw * 1e9 / (weight_bytes + kv_read)
        row["bandwidth_bound_tok_s"] = bound
        row["fraction_of_bound"] = row["engine"]["decode_tok_s"] / bound
        if floors:
            main_floor = floor_rates[floor_of["engine"]]
            row["gemv_floor_tok_s"] = main_floor
            row["fraction_of_floor"] = row["engine"]["decode_tok_s"] / main_floor
            row["floors"] = {label: {"tok_s": rate, "weight_bytes": floors[label].weight_bytes,
                                     "ratio_vs_main_floor": rate / main_floor} for label, rate in floor_rates.items()}
        for key, _ in timed:
            row[key]["mode"] = modes[key]
            if key in floor_of:
                row[key]["floor"] = floor_of[key]
                row[key]["fraction_of_own_floor"] = row[key]["decode_tok_s"] / floor_rates[floor_of[key]]
                fractions = [x["decode_tok_s"] / f for x, f in zip(runs[key], paired_floor[key])]
                row[key]["fraction_of_own_floor_per_round"] = fractions
                row[key]["fraction_of_own_floor_median_round"] = float(np.median(fractions))
                differs = placement_differs(placed.get(key), floors[floor_of[key]].huge_pages,
                                            sum(g.nbytes for g in gemvs[key]))
                if differs:
                    row[key]["floor_placement_differs"] = differs
        for key, _ in timed[1:]:
            o, e = row[key], row["engine"]
            # each round's runs are back to back: the median of the paired ratios is the figure the host's drift moves least
            paired = [x["decode_tok_s"] / y["decode_tok_s"] for x, y in zip(runs[key], runs["engine"])]
            o["decode_ratio_vs_main"] = o["decode_tok_s"] / e["decode_tok_s"]
            o["decode_ratio_vs_main_per_round"] = paired
            o["decode_ratio_vs_main_median_round"] = float(np.median(paired))
            o["ttft_ratio_vs_main"] = o["ttft_s"] / e["ttft_s"]
            if key in floor_of:  # how much of what its floor gains over the main one's the engine keeps
                o["floor_ratio_vs_main"] = floor_rates[floor_of[key]] / floor_rates[floor_of["engine"]]
        if step_pairs and len(timed) > 1:
            stepped: dict[str, list[float]] = {key: [] for key, _ in timed}
            for r in range(rounds):
                say(f"prompt {p}: decode steps paired one by one, pass {r + 1}/{rounds}")
                for key, t in paired_steps(timed if r % 2 == 0 else timed[::-1], p, new_tokens - 1).items():
                    stepped[key] += t
            for key, _ in timed[1:]:
                row[key]["step_pairs"] = step_pair_figures(stepped["engine"], stepped[key])
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
            if floors:  # the most any engine on these kernels could show against transformers
                row["ratios"]["floor_vs_hf_cache"] = row["gemv_floor_tok_s"] / h["decode_tok_s"]
        report["prompts"][str(p)] = row
    report["read_bandwidth_gbs"] = bw
    report["rss_mb_engine"] = engine_rss
    report["peak_rss_mb"] = _peakrss_mb()
    if engine_load_rss_mb is not None and hf is not None:
        report["memory"] = {"engine_load_rss_mb": engine_load_rss_mb, "hf_load_rss_mb": hf.load_rss_mb,
                            "ratio": engine_load_rss_mb / max(hf.load_rss_mb, 1e-9)}
    return report


def placement_differs(engine: Placement | None, floor: Placement, weight_bytes: int) -> str | None:
    """Why an engine and its floor do not read their weights from alike pages (None: they do, or neither was
    placed). Placing needs free 2 MiB pages: with memory short, one of the two can be placed and the other not,
    and the fraction of floor then compares a placed read with an unplaced one."""
    if engine is None or not (engine.asked or floor.asked):
        return None
    share = [min(1.0, p.huge_bytes / max(weight_bytes, 1)) for p in (engine, floor)]
    if abs(share[0] - share[1]) < PLACEMENT_TOLERANCE:
        return None
    return (f"the engine has {share[0] * 100:.0f}% of its weights' bytes in huge pages and its floor "
            f"{share[1] * 100:.0f}% ({engine.detail}; floor: {floor.detail}): free memory and run again, or "
            "load with huge_pages=false")


def _kv(e: dict[str, Any]) -> str:
    """The engine's cache figures as measured, or `not measured (why)`."""
    why = e.get("not_measured", {})
    kv = (f"kv {e['kv_cache_bytes'] / 2**20:.1f} MiB" if e["kv_cache_bytes"] is not None
          else f"kv not measured ({why.get('cache_bytes', 'no figure from this backend')})")
    copied = e["cache_bytes_copied_per_decode_step"]
    return kv + ("   copied/step " + (f"{copied:.0f} B" if copied is not None else
                                     f"not measured ({why.get('cache_bytes_copied', 'no figure from this backend')})"))


def _of_floor_rounds(e: dict[str, Any]) -> str:
    """An engine's fraction of its floor timed just before each of its runs: per round and the median."""
    rounds = ", ".join(f"{x * 100:.0f}%" for x in e["fraction_of_own_floor_per_round"])
    return f"{e['fraction_of_own_floor_median_round'] * 100:.0f}% median of the paired rounds ({rounds})"


def native_kernels(engine: Any) -> dict[str, int]:
    """kvexport's own kernels the engine's load swapped in (kvexport.native), by name, with the nodes each took;
    empty where ONNX Runtime's run everywhere (or the target is not `cpu`)."""
    facts = engine.session.describe()
    return {rec["kernel"]: rec["nodes"] for key in ("quantized_matmul", "cache_attention")
            if (rec := facts.get(key)) and rec.get("nodes")}


def format_report(r: dict[str, Any]) -> str:
    lines = [f"kvexport bench: {r['artifact']} ({r['backend']}, {r['threads']} threads, max_seq {r['max_seq']}, "
             f"{r['new_tokens']} new tokens, greedy, best of {r['rounds']} interleaved rounds)",
             f"read bandwidth (best seen in this run): {r['read_bandwidth_gbs']:.1f} GB/s"]
    if r.get("native_kernels"):
        lines.append("kvexport's kernels: " + "; ".join(
            f"{key}: " + ", ".join(f"{name} in {n} nodes" for name, n in kernels.items())
            for key, kernels in r["native_kernels"].items()))
    if r.get("huge_pages"):
        lines.append("huge pages: " + "; ".join(f"{k}: {v['detail']}" for k, v in r["huge_pages"].items()))
    for p, row in r["prompts"].items():
        e = row["engine"]
        lines.append(f"prompt {p}:")
        lines.append(f"  engine      decode {e['decode_tok_s']:7.1f} tok/s   ttft {e['ttft_s'] * 1e3:7.1f} ms   {_kv(e)}"
                     + (f"   python overhead {e['python_overhead'] * 100:.1f}%" if e["python_overhead"] is not None else "")
                     + (f"   [{e['mode']}]" if "mode" in e else ""))
        lines.append(f"  bound       {row['bandwidth_bound_tok_s']:7.1f} tok/s (weights + KV / bandwidth): "
                     f"engine reaches {row['fraction_of_bound'] * 100:.0f}%")
        for label, f in row.get("floors", {}).items():
            kernel = ("ONNX Runtime MatMul" if label == "fp32" else "kvexport QMatMul for the 4-bit matrices, ONNX "
                      "Runtime MatMulNBits for the rest" if label.endswith(QMATMUL_TAG) else "ONNX Runtime MatMulNBits")
            lines.append(f"  floor       {f['tok_s']:7.1f} tok/s (the weight GEMVs alone, {kernel}, {label}, "
                         f"{f['weight_bytes'] / 2**20:.0f} MiB)" + ("" if label != e.get("floor") else
                                                                   f": engine reaches {row['fraction_of_floor'] * 100:.0f}% "
                                                                   f"best over best, {_of_floor_rounds(e)}"))
        if "floor_placement_differs" in e:
            lines.append(f"  ! engine and floor placed differently: {e['floor_placement_differs']}")
        for k, v in row.items():
            if k.startswith("other:"):
                rounds = ", ".join(f"{x:.2f}" for x in v["decode_ratio_vs_main_per_round"])
                lines.append(f"  {k[6:]}" + (f" [{v['mode']}]" if "mode" in v else "") + ":")
                lines.append(f"      decode {v['decode_tok_s']:.1f} tok/s = {v['decode_ratio_vs_main']:.3f}x the main engine "
                             f"(per round {rounds}, median {v['decode_ratio_vs_main_median_round']:.3f}x), "
                             f"ttft {v['ttft_s'] * 1e3:.1f} ms = {v['ttft_ratio_vs_main']:.2f}x, {_kv(v)}")
                if "step_pairs" in v:
                    sp = v["step_pairs"]
                    lines.append(f"      steps paired one by one: {sp['median']:.3f}x the main engine's speed (median of "
                                 f"{sp['steps']} paired steps, quartiles {sp['quartiles'][0]:.3f}-{sp['quartiles'][1]:.3f}x); "
                                 f"median step {sp['step_ms']:.2f} ms against {sp['main_step_ms']:.2f} ms")
                if "fraction_of_own_floor" in v:
                    lines.append(f"      reaches {v['fraction_of_own_floor'] * 100:.0f}% of its {v['floor']} floor best over "
                                 f"best, {_of_floor_rounds(v)}; its floor is "
                                 f"{v['floor_ratio_vs_main']:.2f}x the main engine's, its decode "
                                 f"{v['decode_ratio_vs_main']:.2f}x ({v['decode_ratio_vs_main'] / v['floor_ratio_vs_main'] * 100:.0f}% "
                                 "of the floors' ratio)")
                if "floor_placement_differs" in v:
                    lines.append(f"      ! placed otherwise than its floor: {v['floor_placement_differs']}")
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
