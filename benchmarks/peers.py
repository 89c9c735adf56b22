"""Time kvexport artifacts beside the peers users would pick instead, built from the same checkpoint.

The peers are onnxruntime-genai (its model builder's ONNX models) and OpenVINO GenAI (models from
`optimum-cli export openvino`). They live in their own virtualenv, benchmarks/.peers-venv, made by
`setup` from benchmarks/peers-requirements.txt under benchmarks/peers-constraints.txt (torch stays
the CPU build kvexport pins): kvexport does not depend on them.

    python benchmarks/peers.py setup
    python benchmarks/peers.py build out/bench-1b -o out/peers --group-size 32 --modes fp32,int4
    python benchmarks/peers.py bench out/b1-int4.kvx out/peers/ortgenai-int4-g32 out/peers/openvino-int4-g32 \
        --prompt-lens 32,512 --rounds 3
    python benchmarks/peers.py bench out/b125-kv8.kvx out/peers/openvino-fp32@kv=u8 out/peers/openvino-fp32@kv=f32 \
        --prompt-lens 4096 --rounds 3

An OpenVINO system written `FOLDER@kv=u8` keeps that KV cache precision (f32, f16, bf16 or u8) whatever --ov-kv
says, so one run can time the same peer with both caches; `FOLDER@precision=bf16,kv=bf16` runs it in bf16
(its INFERENCE_PRECISION_HINT; f32 otherwise); `FOLDER@batched_tokens=256` cuts its prefill
into scheduler steps of that many tokens. A kvexport system written `ART@piece=4096` prefills in engine
calls of that many tokens instead of the runtime's PREFILL_PIECE (before against after, in one run);
an intel artifact written `ART@paged_min=100000` prefills every prompt in one stateful call, as before the
paged prefill (the intel load option paged_prefill_min), and `ART@precision=fp32` runs it in fp32 where the CPU
would take bf16 (the intel load option precision), `ART@paged_split=all` cuts its paged form's packed
projections (the intel load option paged_split: none, qkv, all; prompt_split the same for a second form
that runs prompts), `ART@kv_precision=i8` holds kvexport's own int8 cache (the intel
load option kv_precision); a cpu artifact written `ART@huge_pages=false` keeps its
repacked weights in small pages (the cpu load option huge_pages; where each engine's weights lie is printed), and
`ART@native_attention=false` or `ART@native_matmul=false` runs ONNX Runtime's kernels in place of kvexport's own.

`bench` runs the protocol of docs/benchmarks.md: greedy, 64 new tokens, batch 1, 2 threads, every
system warmed up (an 8-token prompt at load, then one untimed pass at each prompt length before its
rounds: a long prompt's first allocations, paid once per process, are not round 1's alone; skip it with
--no-length-warmup) and then timed back to back in each round; it reports each system's best round
and the median of its per-round ratios to the first system. Each system runs in a worker process
of its own (kvexport artifacts in this interpreter's environment, peers in the peers' virtualenv),
loaded once; only one works at a time. Prompts are token ids fed to each engine directly, so no
tokenizer is timed. Time to first token is the prompt's forward pass plus picking the first token;
decode tok/s is the following tokens over their wall time, as `kvexport bench` counts them.

`bench --step-blocks N` pairs blocks of N decode steps instead of whole runs: every system holds the same prompt
and they decode N steps each in turn, each timed in its own process, a block's first step (right after another
process ran) not counted; ratios are medians of the paired blocks' ratios (docs/benchmarks.md). The OpenVINO peer
then runs as a ContinuousBatchingPipeline driven one step() at a time.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV = HERE / ".peers-venv"
PEER_PYTHON = VENV / "bin" / "python"
REQUIREMENTS = HERE / "peers-requirements.txt"
OV_KV = ("f32", "u8", "f16", "bf16")  # OpenVINO's KV_CACHE_PRECISION values a peer may be timed with
OV_PRECISION = ("f32", "bf16")  # its INFERENCE_PRECISION_HINT (bf16: only on a CPU with AMX-BF16 or AVX512-BF16)
CONSTRAINTS = HERE / "peers-constraints.txt"


# --- systems and their workers --------------------------------------------------------------
def kind_of(path: Path) -> str:
    """kvexport artifact, onnxruntime-genai model folder or OpenVINO model folder, by the files it holds."""
    if (path / "manifest.json").is_file():
        return "kvexport"
    if (path / "genai_config.json").is_file():
        return "ortgenai"
    if (path / "openvino_model.xml").is_file():
        return "openvino"
    sys.exit(f"error: {path} is neither a kvexport artifact (manifest.json), an onnxruntime-genai model "
             "(genai_config.json) nor an OpenVINO model (openvino_model.xml); make peers with `peers.py build`")


def prompt_ids(n: int, vocab: int) -> list[int]:
    """The ids `kvexport bench` uses: seeded bytes of the byte-level tokenizer (ids 3..258)."""
    import numpy as np

    return [int(t) for t in np.random.default_rng(0).integers(3, min(vocab, 259), n)]


class KvexportRunner:
    def __init__(self, path: Path, threads: int, options: dict[str, str]):
        import kvexport
        from kvexport.runtime import session

        if "piece" in options:
            session.PREFILL_PIECE = int(options["piece"])
        # paged_min: the intel target's long-prompt threshold, its load option paged_prefill_min
        load: dict[str, object] = {"paged_prefill_min": int(options["paged_min"])} if "paged_min" in options else {}
        for key in SPEC_KEYS["kvexport"]:
            if key in options and key not in ("piece", "paged_min"):  # the others are load options of those names:
                load[key] = options[key]  # cpu: the repacked weights in huge pages, kvexport's own kernels (or not);
                # intel: the precision it runs in, the paged forms' projections cut, the cache precision it holds
        self.engine = kvexport.load(str(path), threads=threads, **load)
        self.vocab = self.engine.vocab_size
        target = self.engine.manifest.target or {}
        self.info = {"kvexport": kvexport.__version__, "backend": target.get("backend"),
                     "weights": target.get("weights"), "kv": target.get("kv"), "prefill_piece": session.PREFILL_PIECE}
        facts = self.engine.session.describe()
        if "paged_compile" in facts:  # intel: whether the long prompts' paged form was compiled at load (not timed)
            self.info["paged_compile"] = facts["paged_compile"]
        if "huge_pages" in facts:  # cpu: where the repacked weights lie (a failed placement shows here)
            self.info["huge_pages"] = facts["huge_pages"]["detail"]

    def run(self, ids: list[int], new: int) -> dict[str, float]:
        from kvexport.bench import bench_engine

        engine = self.engine
        assert ids == prompt_ids(len(ids), engine.vocab_size)  # bench_engine draws the same ids
        r = bench_engine(engine, len(ids), new)
        return {"ttft_s": r["ttft_s"], "decode_tok_s": r["decode_tok_s"], "tokens": new}

    # --step-blocks: one request held across calls, decoded a block of steps at a time
    def start(self, ids: list[int], new: int) -> dict[str, float]:
        engine = self.engine
        engine.check_fits(len(ids), new)
        t0 = time.perf_counter()
        self.batch = engine.prefill(ids, new, copy=False)
        self.tok = self.batch.logits.argmax(-1)
        return {"ttft_s": time.perf_counter() - t0, "token": int(self.tok[0])}

    def step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        self.tok = self.engine.decode(self.batch, self.tok, copy=False).argmax(-1)
        return {"step_s": time.perf_counter() - t0, "token": int(self.tok[0])}

    def end(self) -> None:
        self.engine.session.release(self.batch.state)
        del self.batch


class OrtGenaiRunner:
    """onnxruntime-genai: its threads are set in genai_config.json (`build` writes them)."""

    def __init__(self, path: Path, threads: int, options: dict[str, str]):
        import onnxruntime_genai as og

        self.og = og
        cfg = json.loads((path / "genai_config.json").read_text())
        so = cfg["model"]["decoder"].get("session_options", {})
        if so.get("intra_op_num_threads") != threads:
            sys.exit(f"error: {path}/genai_config.json runs {so.get('intra_op_num_threads')} threads, not {threads}; "
                     "rebuild it with `peers.py build --threads N`")
        self.model = og.Model(str(path))
        self.vocab = int(cfg["model"]["vocab_size"])
        self.info = {"onnxruntime-genai": og.__version__, "session_options": so}

    def run(self, ids: list[int], new: int) -> dict[str, float]:
        og = self.og
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(ids) + new, min_length=len(ids) + new, do_sample=False)
        gen = og.Generator(self.model, params)
        t0 = time.perf_counter()
        gen.append_tokens([ids])  # the prompt's forward pass
        gen.generate_next_token()  # picks the first token from its logits
        ttft = time.perf_counter() - t0
        t1 = time.perf_counter()
        n = 1
        while n < new and not gen.is_done():
            gen.generate_next_token()  # forward pass of the last token, then the pick
            n += 1
        return {"ttft_s": ttft, "decode_tok_s": (n - 1) / (time.perf_counter() - t1), "tokens": n}

    def start(self, ids: list[int], new: int) -> dict[str, float]:
        og = self.og
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(ids) + new, min_length=len(ids) + new, do_sample=False)
        self.gen = og.Generator(self.model, params)
        t0 = time.perf_counter()
        self.gen.append_tokens([ids])
        self.gen.generate_next_token()
        ttft = time.perf_counter() - t0
        return {"ttft_s": ttft, "token": int(self.gen.get_next_tokens()[0])}

    def step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        self.gen.generate_next_token()
        dt = time.perf_counter() - t0
        return {"step_s": dt, "token": int(self.gen.get_next_tokens()[0])}

    def end(self) -> None:
        del self.gen


class OpenVinoRunner:
    """OpenVINO GenAI's LLMPipeline on CPU. Properties that differ silently from kvexport's are set
    (threads, one stream, f32 inference precision) or reported: the CPU plugin keeps a u8 KV cache by
    default on x86, so the cache precision is set explicitly (--ov-kv, default f32 like kvexport's
    default cache), prefix caching is off (every round sends the same prompt), its prompt is prefilled in one
    step as LLMPipeline does by default (the bare SchedulerConfig would cut it into 256-token chunks), and its dynamic
    quantization of activations (what MatMulNBits calls accuracy level) is printed as the plugin
    reports it."""

    def __init__(self, path: Path, threads: int, options: dict[str, str]):
        import openvino as ov
        import openvino_genai as ov_genai

        self.ov, self.ov_genai = ov, ov_genai
        kv = options.get("ov_kv", "f32")
        props = {"INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1,
                 "INFERENCE_PRECISION_HINT": options.get("precision", "f32"),
                 "KV_CACHE_PRECISION": kv, "PERFORMANCE_HINT": "LATENCY"}
        # its scheduler caches prompt prefixes by default: the same prompt in the next round would skip
        # its prefill (measured: TTFT 0.2 s for 512 tokens); every engine here computes every prompt
        sched = ov_genai.SchedulerConfig()
        sched.enable_prefix_caching = False
        # the bare SchedulerConfig batches 256 tokens a step, so a long prompt's prefill would run in 256-token
        # chunks; LLMPipeline's own latency default (the one it picks without a scheduler config) is unlimited
        sched.max_num_batched_tokens = int(options.get("batched_tokens", 2**63 - 1))
        if options.get("steps") == "true":
            # --step-blocks: the pipeline LLMPipeline runs for a scheduler config on CPU, driven one step() at a time
            self.pipe = ov_genai.ContinuousBatchingPipeline(str(path), sched, "CPU", props)
            self.request = 0
        else:
            self.pipe = ov_genai.LLMPipeline(str(path), "CPU", scheduler_config=sched, **props)
        props = {**props, "enable_prefix_caching": False, "max_num_batched_tokens": sched.max_num_batched_tokens}
        core = ov.Core()
        self.vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
        defaults = {}
        for key in ("KV_CACHE_PRECISION", "DYNAMIC_QUANTIZATION_GROUP_SIZE", "INFERENCE_PRECISION_HINT"):
            try:
                defaults[key] = str(core.get_property("CPU", key))
            except RuntimeError as e:  # a property this plugin version does not report
                defaults[key] = f"not reported ({str(e).splitlines()[0][:60]})"
        self.info = {"openvino": ov.__version__, "openvino-genai": ov_genai.__version__, "set": props,
                     "cpu_plugin_defaults": defaults, "pipeline": type(self.pipe).__name__}

    def _config(self, new: int):  # type: ignore[no-untyped-def]
        cfg = self.ov_genai.GenerationConfig()
        cfg.max_new_tokens = cfg.min_new_tokens = new
        cfg.do_sample = False
        cfg.ignore_eos = True
        return cfg

    def run(self, ids: list[int], new: int) -> dict[str, float]:
        import numpy as np

        ov_genai = self.ov_genai
        cfg = self._config(new)
        stamps: list[float] = []

        class Stamps(ov_genai.StreamerBase):
            def write(self, token):  # type: ignore[no-untyped-def]
                stamps.extend([time.perf_counter()] * (len(token) if isinstance(token, list) else 1))
                return ov_genai.StreamingStatus.RUNNING

            def end(self) -> None:
                pass

        t0 = time.perf_counter()
        self.pipe.generate(self.ov.Tensor(np.array([ids], dtype=np.int64)), cfg, Stamps())
        return {"ttft_s": stamps[0] - t0, "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
                "tokens": len(stamps)}

    def _token(self) -> int:
        outputs = self.handle.read()  # the tokens made since the last read: this step's one
        if len(outputs) != 1:
            sys.exit(f"error: one step of OpenVINO GenAI's pipeline gave {len(outputs)} outputs, not one")
        return int(next(iter(outputs.values())).generated_ids[-1])

    def start(self, ids: list[int], new: int) -> dict[str, float]:
        import numpy as np

        self.request += 1
        self.handle = self.pipe.add_request(self.request, self.ov.Tensor(np.array([ids], dtype=np.int64)),
                                            self._config(new))
        t0 = time.perf_counter()
        self.pipe.step()  # the whole prompt in one step (max_num_batched_tokens unlimited), then the first pick
        ttft = time.perf_counter() - t0
        return {"ttft_s": ttft, "token": self._token()}

    def step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        self.pipe.step()
        dt = time.perf_counter() - t0
        return {"step_s": dt, "token": self._token()}

    def end(self) -> None:
        while self.pipe.has_non_finished_requests():  # nothing left after its last token; a cut run drains here
            self.pipe.step()


RUNNERS = {"kvexport": KvexportRunner, "ortgenai": OrtGenaiRunner, "openvino": OpenVinoRunner}


def worker(a: argparse.Namespace) -> None:
    """Load one system, warm it up, then answer `RUN prompt_len new_tokens` lines with one JSON line each."""
    path = Path(a.path)
    options = json.loads(a.options)
    runner = RUNNERS[kind_of(path)](path, a.threads, options)
    if options.get("steps") == "true":  # warm-up: first-call allocations and kernel selection
        runner.start(prompt_ids(8, runner.vocab), 4)
        for _ in range(3):
            runner.step()
        runner.end()
    else:
        runner.run(prompt_ids(8, runner.vocab), 4)
    print(json.dumps({"ready": True, "info": runner.info, "vocab": runner.vocab}), flush=True)
    for line in sys.stdin:  # RUN p n | START p n | STEPS n | END
        word, *args = line.split()
        if word == "RUN":
            out = runner.run(prompt_ids(int(args[0]), runner.vocab), int(args[1]))
        elif word == "START":
            out = runner.start(prompt_ids(int(args[0]), runner.vocab), int(args[1]))
        elif word == "STEPS":  # a block of decode steps, each timed
            outs = [runner.step() for _ in range(int(args[0]))]
            out = {"step_s": [x["step_s"] for x in outs], "tokens": [x["token"] for x in outs]}
        else:
            runner.end()
            out = {}
        print(json.dumps(out), flush=True)


class Worker:
    def __init__(self, path: Path, threads: int, options: dict[str, str], label: str | None = None):
        self.path, self.kind = path, kind_of(path)
        self.label = label or str(path)
        python = sys.executable if self.kind == "kvexport" else str(PEER_PYTHON)
        if self.kind != "kvexport" and not PEER_PYTHON.is_file():
            sys.exit(f"error: {self.kind} runs in {VENV}, which does not exist; run `python {__file__} setup` first")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.proc = subprocess.Popen([python, __file__, "worker", str(path), "--threads", str(threads),
                                      "--options", json.dumps(options)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.ready = self._read()
        self.info = self.ready["info"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            sys.exit(f"error: the worker for {self.path} ({self.kind}) exited with {self.proc.wait()}; see its errors above")
        return json.loads(line)

    def send(self, line: str) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._read()

    def run(self, prompt_len: int, new: int) -> dict:
        return self.send(f"RUN {prompt_len} {new}")

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait()


SPEC_KEYS = {"openvino": ("kv", "batched_tokens", "precision"),
             "kvexport": ("piece", "paged_min", "huge_pages", "native_matmul", "native_attention", "precision",
                          "paged_split", "prompt_split", "kv_precision", "dynamic_quant_group"),
             "ortgenai": ()}
# the worded options; the others are positive integers (dynamic_quant_group: 0 or more)
CHOICES = {"kv": OV_KV, "precision": OV_PRECISION, **{k: ("true", "false") for k in
                                                      ("huge_pages", "native_matmul", "native_attention")}}
KVEXPORT_CHOICES = {"precision": ("fp32", "bf16"),  # the intel target's load options
                    "paged_split": ("none", "qkv", "all"),
                    "prompt_split": ("same", "none", "qkv", "all"),
                    "kv_precision": ("f32", "f16", "bf16", "u8", "i8")}


def system_spec(text: str, ov_kv: str) -> tuple[Path, dict[str, str]]:
    """`FOLDER` or `FOLDER@key=value,...`: the system's folder and its worker options. An OpenVINO peer takes
    kv=f32|f16|bf16|u8 (its cache precision; --ov-kv where not given), precision=f32|bf16 (its inference precision,
    f32 where not given; under bf16 its paged cache must be bf16 or u8) and batched_tokens=N (its scheduler's
    max_num_batched_tokens; unlimited where not given, as LLMPipeline's own latency default); a kvexport
    artifact takes piece=N (the prompt tokens one engine call takes, kvexport.runtime.session.PREFILL_PIECE), on
    the intel target paged_min=N (the shortest prompt prefilled through paged attention: the load option
    paged_prefill_min), precision=fp32|bf16 (the precision it runs in, its load option), paged_split=none|qkv|all,
    prompt_split=same|none|qkv|all, kv_precision=f32|f16|bf16|u8|i8 and dynamic_quant_group=N (its load options), on
    the cpu target huge_pages, native_matmul and native_attention=true|false (its load options)."""
    folder, _, tail = text.partition("@")
    kind = kind_of(Path(folder))
    options = {"ov_kv": ov_kv}
    for item in filter(None, tail.split(",")):
        key, _, value = item.partition("=")
        choices = (KVEXPORT_CHOICES if kind == "kvexport" else {}).get(key) or CHOICES.get(key)
        least = 0 if key == "dynamic_quant_group" else 1
        if key not in SPEC_KEYS[kind] or not (value in choices if choices else value.isdigit() and int(value) >= least):
            sys.exit(f"error: {text!r}: a {kind} system takes {', '.join(f'{k}=' for k in SPEC_KEYS[kind]) or 'no'} "
                     f"options after its folder, not {item!r}")
        options["ov_kv" if key == "kv" else key] = value
    return Path(folder), options


def _rounds(workers: list[Worker], p: int, a: argparse.Namespace) -> dict:
    """Whole greedy runs, each system in turn, every other round in reverse order; ratios per round."""
    runs: dict[str, list[dict]] = {w.label: [] for w in workers}
    if a.length_warmup:  # untimed: a long prompt's first-call allocations are not round 1's alone
        for w in workers:
            w.run(p, 2)
    for r in range(a.rounds):
        # every other round runs the systems in reverse order, so that on a host whose load drifts
        # the later (or earlier) slots of a round do not always fall to the same systems
        for w in workers if r % 2 == 0 else workers[::-1]:
            runs[w.label].append(w.run(p, a.new_tokens))
        print(f"prompt {p} round {r + 1}: " + ", ".join(
            f"{Path(k).name} {v[-1]['decode_tok_s']:.1f} tok/s ttft {v[-1]['ttft_s']:.2f} s" for k, v in runs.items()),
              flush=True)
    first = runs[workers[0].label]
    row = {}
    for key, rs in runs.items():
        paired = [x["decode_tok_s"] / y["decode_tok_s"] for x, y in zip(rs, first)]
        row[key] = {"decode_tok_s": max(x["decode_tok_s"] for x in rs), "ttft_s": min(x["ttft_s"] for x in rs),
                    "tokens": min(x["tokens"] for x in rs), "decode_tok_s_per_round": [x["decode_tok_s"] for x in rs],
                    "ttft_s_per_round": [x["ttft_s"] for x in rs],
                    "decode_ratio_vs_first": statistics.median(paired)}
    return row


def _step_blocks(workers: list[Worker], p: int, a: argparse.Namespace) -> dict:
    """Every system holds the same prompt, then they decode a block of --step-blocks steps each in turn (the order
    cycling through the systems' permutations), each on its own greedy tokens and timed inside its own process.
    A block's first step, the one right after another process ran, is not counted (in blocks of more than one
    step), and each block gives the median of its other steps: on 2 cores ONNX Runtime's steps ran 1.5x as long
    as in a run of their own for tens of milliseconds after another process's (the other's pool threads spin
    after a run), so ONNX Runtime systems need blocks of ~100 ms or more. A block and its pair run well under a
    second apart, so the host's drift moves both alike. Ratios are per block pair: the first system's block time
    over each system's (its speed over the first's); TTFT pairs per round."""
    n = a.step_blocks
    if a.length_warmup:
        for w in workers:
            w.send(f"START {p} {n + 1}")
            w.send(f"STEPS {n}")
            w.send("END")
    blocks: dict[str, list[float]] = {w.label: [] for w in workers}
    tokens: dict[str, list[int]] = {w.label: [] for w in workers}
    ttft: dict[str, list[float]] = {w.label: [] for w in workers}
    # the orders cycle through every permutation (rotations and their reverses past four systems), so that no
    # system always runs first, last or right after the same other one
    orders = (list(itertools.permutations(workers)) if len(workers) <= 4 else
              [workers[i:] + workers[:i] for i in range(len(workers))] +
              [(workers[i:] + workers[:i])[::-1] for i in range(len(workers))])
    k = 0
    for r in range(a.rounds):
        for w in orders[r % len(orders)]:
            out = w.send(f"START {p} {a.new_tokens}")
            ttft[w.label].append(out["ttft_s"])
            tokens[w.label].append(out["token"])
        left, done = a.new_tokens - 1, len(blocks[workers[0].label])
        while left >= (2 if n > 1 else 1):  # a last block of one step would be its uncounted step alone
            size = min(n, left)
            left -= size
            k += 1
            for w in orders[k % len(orders)]:
                out = w.send(f"STEPS {size}")
                blocks[w.label].append(statistics.median(out["step_s"][1:] if n > 1 else out["step_s"]))
                tokens[w.label].extend(out["tokens"])
        for w in workers:
            w.send("END")
        print(f"prompt {p} round {r + 1}: " + ", ".join(
            f"{Path(key).name} step {statistics.median(v[done:]) * 1e3:.1f} ms ttft {ttft[key][-1]:.2f} s"
            for key, v in blocks.items()), flush=True)
    import numpy as np

    first = np.asarray(blocks[workers[0].label])
    row = {}
    for key, bl in blocks.items():
        ratio = first / np.asarray(bl)
        q25, q50, q75 = (float(x) for x in np.quantile(ratio, [0.25, 0.5, 0.75]))
        row[key] = {"decode_tok_s": 1.0 / statistics.median(bl), "ttft_s": min(ttft[key]),
                    "tokens": a.new_tokens, "step_ms_median": statistics.median(bl) * 1e3,
                    "ttft_s_per_round": ttft[key], "decode_ratio_vs_first": q50,
                    "decode_ratio_quartiles": [q25, q75], "paired_blocks": int(ratio.size),
                    # greedy tokens shared with the first system (its own numerics may part from it on a near-tie)
                    "same_tokens_as_first": sum(x == y for x, y in zip(tokens[key], tokens[workers[0].label])),
                    "tokens_compared": len(tokens[key])}
    return row


def bench(a: argparse.Namespace) -> None:
    if a.step_blocks < 0:
        sys.exit(f"error: --step-blocks takes a number of decode steps (1 or more), not {a.step_blocks}")
    specs = [(label, *system_spec(label, a.ov_kv)) for label in a.systems]
    paths = [Path(label) for label, _, _ in specs]
    prompts = [int(x) for x in a.prompt_lens.split(",")]
    how = (f"{a.rounds} rounds of paired blocks (each system {a.step_blocks} decode steps in turn, the order "
           "cycling; a block's first step not counted)"
           if a.step_blocks else f"{a.rounds} interleaved rounds (every other one in reverse order)")
    print(f"cpu: {_cpu_name()}; {a.threads} threads, {a.new_tokens} new tokens, greedy, batch 1, {how}"
          + (", one untimed pass per system at each prompt length first" if a.length_warmup else ""), flush=True)
    workers: list[Worker] = []
    for label, p, options in specs:  # loaded one after another; each warms itself up before it says ready
        repeats = sum(w.path == p and w.label.partition("#")[0] == label for w in workers)
        label += f"#{repeats + 1}" if repeats else ""  # the same system twice (an A/A run) keeps two rows
        w = Worker(p, a.threads, {**options, "steps": "true"} if a.step_blocks else options, label)
        print(f"  {label} [{w.kind}]: {json.dumps(w.info)}", flush=True)
        workers.append(w)
    report: dict = {"systems": {w.label: {"kind": w.kind, "info": w.info} for w in workers}, "prompts": {},
                    "timing": "step_blocks" if a.step_blocks else "rounds"}
    try:
        for p in prompts:
            row = (_step_blocks if a.step_blocks else _rounds)(workers, p, a)
            first = row[workers[0].label]["ttft_s_per_round"]
            for v in row.values():
                v["ttft_ratio_vs_first"] = v["ttft_s"] / min(first)
                v["ttft_ratio_vs_first_median_round"] = statistics.median(
                    x / y for x, y in zip(v["ttft_s_per_round"], first))
            report["prompts"][str(p)] = row
    finally:
        for w in workers:
            w.close()
    if a.json:
        print(json.dumps(report, indent=2))
        return
    how = ("median of paired block ratios [quartiles]" if a.step_blocks
           else "median of per-round paired decode ratios")
    for p, row in report["prompts"].items():
        print(f"prompt {p} (ratios to {paths[0].name}: {how}; best TTFT over best, "
              "and the median of per-round paired TTFT ratios):")
        for key, v in row.items():
            short = "" if v["tokens"] == a.new_tokens else f"  (stopped after {v['tokens']} tokens)"
            digits = 3 if a.step_blocks else 2  # a median of tens of block pairs, not of a few rounds
            spread = (f" [{v['decode_ratio_quartiles'][0]:.2f}-{v['decode_ratio_quartiles'][1]:.2f}]"
                      if "decode_ratio_quartiles" in v else "")
            same = (f"  same tokens as the first {v['same_tokens_as_first']}/{v['tokens_compared']}"
                    if "same_tokens_as_first" in v else "")
            ratio = f"x{v['decode_ratio_vs_first']:.{digits}f}{spread}"
            print(f"  {Path(key).name:28s} decode {v['decode_tok_s']:7.1f} tok/s  {ratio}   "
                  f"ttft {v['ttft_s'] * 1e3:8.1f} ms  x{v['ttft_ratio_vs_first']:.2f} "
                  f"(per-round median x{v['ttft_ratio_vs_first_median_round']:.2f}){short}{same}")


def _cpu_name() -> str:
    try:
        from kvexport.doctor import cpu_info

        info = cpu_info()
        isa = [name for name, present in info["isa"].items() if present]
        return f"{info['model']} ({', '.join(isa) or 'no ISA extension reported'})"
    except ImportError:
        return "unknown (kvexport not importable here)"


# --- setup and build ------------------------------------------------------------------------
def setup(a: argparse.Namespace) -> None:
    if not PEER_PYTHON.is_file():
        venv.EnvBuilder(with_pip=True).create(VENV)
    subprocess.run([str(PEER_PYTHON), "-m", "pip", "install", "-r", str(REQUIREMENTS), "-c", str(CONSTRAINTS)],
                   check=True)
    # optimum-intel pulls torchvision, whose wheel here is built for CUDA torch and breaks `import transformers`
    # models (operator torchvision::nms does not exist); no peer needs it for text models
    subprocess.run([str(PEER_PYTHON), "-m", "pip", "uninstall", "-y", "torchvision"], check=True)
    torch = subprocess.run([str(PEER_PYTHON), "-c", "import torch; print(torch.__version__)"], capture_output=True,
                           text=True, check=True).stdout.strip()
    if "+cu" in torch or not torch.startswith("2.13.0"):
        sys.exit(f"error: the peers' virtualenv got torch {torch}, not the CPU build 2.13.0; check {CONSTRAINTS}")
    print(f"peers installed in {VENV} (torch {torch})")


def build(a: argparse.Namespace) -> None:
    """The peers' own converters on the same checkpoint: onnxruntime-genai's model builder (fp32; int8 and
    int4 at --group-size) and optimum-cli's OpenVINO export (fp32; int8 per channel as NNCF's INT8_ASYM; int4 at
    --group-size, every layer: --ratio 1.0)."""
    if not PEER_PYTHON.is_file():
        sys.exit(f"error: {VENV} does not exist; run `python {__file__} setup` first")
    ckpt, out = Path(a.checkpoint), Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    modes = a.modes.split(",")
    bad = sorted(set(modes) - {"fp32", "int8", "int4"})
    if bad:
        sys.exit(f"error: --modes takes fp32, int8 and int4, not {', '.join(bad)}")
    peers = a.peers.split(",")
    if not peers or set(peers) - {"ortgenai", "openvino"}:
        sys.exit(f"error: --peers takes ortgenai and openvino, not {a.peers}")
    bindir = VENV / "bin"
    ckpt = _with_architectures(ckpt, out / ".checkpoint")
    for mode in modes:
        tag = mode + (f"-g{a.group_size}" if mode == "int4" else "")  # optimum's int8 is per channel
        if "ortgenai" in peers:
            dest = out / ("ortgenai-" + (mode if mode == "fp32" else f"{mode}-g{a.group_size}"))
            # its MatMulNBits: symmetric blocks of block_size, accuracy_level 4 (int8 compute) on cpu by default
            extra = ["--extra_options", f"block_size={a.group_size}"] if mode != "fp32" else []
            _run([str(PEER_PYTHON), "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(dest),
                  "-p", mode, "-e", "cpu", "-c", str(out / ".hf-cache"), *extra])
            cfg_path = dest / "genai_config.json"
            cfg = json.loads(cfg_path.read_text())
            cfg["model"]["decoder"].setdefault("session_options", {}).update(
                intra_op_num_threads=a.threads, inter_op_num_threads=1)
            cfg_path.write_text(json.dumps(cfg, indent=4))
        if "openvino" not in peers:
            continue
        dest = out / f"openvino-{tag}"
        weight = ["--weight-format", mode] + (["--group-size", str(a.group_size), "--ratio", "1.0"] if mode == "int4" else [])
        _run([str(bindir / "optimum-cli"), "export", "openvino", "-m", str(ckpt), "--task", "text-generation-with-past",
              *weight, str(dest)])
    print(f"peers written under {out}")


def _with_architectures(ckpt: Path, staged: Path) -> Path:
    """The peers' converters pick their model class from config.json's `architectures`, which checkpoints
    made by kvexport before it wrote one leave empty: a folder of links to the same files with it filled in."""
    from kvexport.architectures import get_arch

    cfg = json.loads((ckpt / "config.json").read_text())
    if cfg.get("architectures"):
        return ckpt
    staged.mkdir(parents=True, exist_ok=True)
    for f in ckpt.iterdir():
        link = staged / f.name
        if f.name != "config.json" and not link.exists():
            link.symlink_to(f.resolve())
    cfg["architectures"] = [get_arch(cfg["model_type"]).hf_class]
    (staged / "config.json").write_text(json.dumps(cfg, indent=2))
    return staged


def _run(cmd: list[str]) -> None:
    print("+ " + " ".join(cmd), flush=True)
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    print(f"  done in {time.perf_counter() - t:.0f}s", flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("setup", help=f"make {VENV} with the pinned peers").set_defaults(fn=setup)
    s = sub.add_parser("build", help="the peers' models from one checkpoint")
    s.add_argument("checkpoint")
    s.add_argument("-o", "--output", required=True)
    s.add_argument("--modes", default="fp32,int8,int4")
    s.add_argument("--peers", default="ortgenai,openvino", help="which peers to build (comma-separated)")
    s.add_argument("--group-size", type=int, default=32, help="int4 block size (use the kvexport artifact's)")
    s.add_argument("--threads", type=int, default=2)
    s.set_defaults(fn=build)
    s = sub.add_parser("bench", help="time kvexport artifacts and peer models in interleaved rounds")
    s.add_argument("systems", nargs="+", help="kvexport artifacts and peer model folders; ratios are to the first")
    s.add_argument("--prompt-lens", default="32,512")
    s.add_argument("--new-tokens", type=int, default=64)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--ov-kv", choices=OV_KV, default="f32",
                   help="OpenVINO's KV cache precision (its CPU plugin defaults to u8 on x86; kvexport's default cache is fp32)")
    s.add_argument("--no-length-warmup", dest="length_warmup", action="store_false",
                   help="skip the untimed pass of every system at each prompt length before its rounds")
    s.add_argument("--step-blocks", type=int, default=0, metavar="N",
                   help="pair blocks of N decode steps across the systems instead of whole runs (1: single steps, "
                        "for OpenVINO systems; ONNX Runtime ones need blocks of 100 ms or more; a block's first "
                        "step is not counted where N > 1)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=bench)
    s = sub.add_parser("worker", help=argparse.SUPPRESS)
    s.add_argument("path")
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--options", default="{}")
    s.set_defaults(fn=worker)
    return p


def main() -> None:
    a = parser().parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()
