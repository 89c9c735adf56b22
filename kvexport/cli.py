"""The `kvexport` command line: export, build, run, verify, bench, inspect, doctor, make-checkpoint."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvexport.errors import InputError, KvexportError


class _Progress:
    """Progress lines on stderr with the elapsed time, so long steps show they are alive."""

    def __init__(self, quiet: bool = False):
        self.t0, self.quiet = time.perf_counter(), quiet

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in pairs:
        if "=" not in p:
            raise InputError(f"--option takes key=value, got {p!r}")
        k, v = p.split("=", 1)
        out[k] = json.loads(v) if v[:1].isdigit() or v in ("true", "false", "null") else v
    return out


def _load(path: str, a: argparse.Namespace, threads: int | None = None, options: list[str] | None = None) -> Any:
    """kvexport.load with the load options this artifact's backend takes (threads only where it has them);
    `options` (KEY=VALUE) replaces the command's --option."""
    import kvexport
    from kvexport import backends
    from kvexport.artifact import open_artifact

    _, m = open_artifact(path, verify_hashes=False)  # load() below checks the hashes
    opts: dict[str, Any] = {}
    if m.target is not None and threads is not None and backends.get(m.target["backend"]).capabilities().threads_option:
        opts["threads"] = threads
    if getattr(a, "no_rebuild", False):
        opts["no_rebuild"] = True
    # backend load options, e.g. kv_precision=u8, numa_node=0
    opts.update(_options(getattr(a, "option", []) if options is None else options))
    return kvexport.load(path, **opts)


def cmd_export(a: argparse.Namespace) -> int:
    from kvexport.architectures import config_problems
    from kvexport.checkpoint import read_hf_config, weight_files

    if a.check:
        raw = read_hf_config(Path(a.model_dir))
        _, problems = config_problems(raw)
        if not problems:
            try:
                weight_files(Path(a.model_dir))
            except KvexportError as e:
                problems.append(str(e))
        if problems:
            print("not supported:\n  - " + "\n  - ".join(problems))
            return 2
        print(f"{a.model_dir}: supported ({raw.get('model_type')})")
        return 0
    if not a.output:
        raise InputError("export needs -o OUT.kvx")
    from kvexport.artifact import export_artifact

    export_artifact(a.model_dir, a.output, max_seq=a.max_seq, cache_style=a.cache,
                    last_token_only=not a.all_logits, progress=_Progress(a.quiet))
    return 0


def cmd_build(a: argparse.Namespace) -> int:
    from kvexport.backends import BuildOptions
    from kvexport.build import build

    extra = _options(a.option)
    if a.numa_node is not None:
        extra["numa_node"] = a.numa_node
    if a.defer:
        extra["defer"] = True
    opts = BuildOptions(precision=a.precision, threads=a.threads, max_batch=a.max_batch, extra=extra)
    build(a.model_dir, a.output, target=a.target, max_seq=a.max_seq, options=opts, verify=not a.no_verify,
          progress=_Progress(a.quiet))
    return 0


def cmd_run(a: argparse.Namespace) -> int:
    engine = _load(a.artifact, a, a.threads)
    prompt: Any = [int(t) for t in a.prompt.split(",")] if a.ids else a.prompt
    if a.chat or a.messages:  # the artifact's chat template, rendered as `kvexport serve` renders it
        from kvexport.chat import run_chat_ids

        prompt = run_chat_ids(engine, a.prompt, a.messages)
    stop = [int(s) if s.isdigit() else s for s in a.stop]
    n = 0
    t0 = time.perf_counter()
    for ev in engine.stream(prompt, a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                            seed=a.seed, stop=stop):
        n += 1
        sys.stdout.write(str(ev.token_id) + " " if a.ids or engine.tokenizer is None else ev.text)
        sys.stdout.flush()
    dt = time.perf_counter() - t0
    print(file=sys.stdout)
    print(f"[{n} tokens in {dt:.2f}s]", file=sys.stderr)
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from kvexport.server import serve

    return serve(a.artifact, host=a.host, port=a.port, max_batch=a.max_batch, max_queue=a.max_queue,
                 prefill_chunk=a.prefill_chunk, threads=a.threads, model_name=a.model_name,
                 load_options=_options(a.option))


def cmd_verify(a: argparse.Namespace) -> int:
    from kvexport.build import run_verify

    result = run_verify(a.artifact, a.reference, decode_steps=a.steps, progress=_Progress(a.quiet),
                        raise_on_fail=False, no_rebuild=a.no_rebuild, self_check=a.self_check)
    if a.json:
        print(json.dumps(result, indent=2))
    if not result["passed"]:
        print(f"error: verification failed; see {Path(a.artifact) / 'verify.json'}", file=sys.stderr)
        return 4
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from kvexport.bench import rss_mb, format_report, run_bench

    # bad arguments are refused before any engine is loaded
    if a.rounds < 1:
        raise InputError(f"--rounds must be at least 1, got {a.rounds}")
    if a.reference is not None and not Path(a.reference).is_dir():
        raise InputError(f"--reference {a.reference} is not a checkpoint folder")
    prompts = tuple(int(x) for x in a.prompts.split(","))
    rss0 = rss_mb()
    engine = _load(a.artifact, a, a.threads)
    engine_load_rss = rss_mb() - rss0
    others = [(p, _load(p, a, a.threads, options=[])) for p in a.compare]  # --option is the main artifact's
    for variant in a.variant:  # the same artifact loaded with other load options, e.g. kv_precision=u8
        others.append((f"{a.artifact} [{variant}]", _load(a.artifact, a, a.threads, [*a.option, *variant.split(",")])))
    r = run_bench(engine, reference=Path(a.reference) if a.reference else None, prompt_lens=prompts,
                  new_tokens=a.new_tokens, threads=a.threads, others=others, baselines=not a.no_baselines,
                  floor=not a.no_floor, rounds=a.rounds, engine_load_rss_mb=engine_load_rss,
                  progress=_Progress(a.quiet))
    print(json.dumps(r, indent=2) if a.json else format_report(r))
    return 0


def cmd_inspect(a: argparse.Namespace) -> int:
    from kvexport.artifact import open_artifact

    folder, m = open_artifact(a.artifact, verify_hashes=not a.no_hash_check)
    if a.json:
        print(m.to_json())
        return 0
    cfg, cache, target = m.config, m.cache, m.target
    per_slot = 2 * cache["num_layers"] * cache["kv_heads"] * cache["head_dim"] * (4 if cache["dtype"] == "float32" else 2)
    print(f"{folder}: {m.raw['model']['family']} '{m.raw['model']['name']}', {m.raw['model']['num_parameters'] / 1e6:.1f}M parameters")
    print(f"  dims: hidden {cfg.hidden_size}, layers {cfg.num_hidden_layers}, heads {cfg.num_attention_heads} "
          f"(kv {cfg.num_key_value_heads}), head_dim {cfg.head_dim}, mlp {cfg.intermediate_size}, vocab {cfg.vocab_size}")
    print(f"  IR: {m.raw['ir']['file']} opset {m.raw['ir']['opset']}, {cache['style']} cache {cache['layout']} "
          f"{cache['dtype']}, max_seq {cache['max_seq']}, last-token logits {m.raw['ir']['last_token_only']}")
    print(f"  KV cache: {per_slot} bytes per slot per row; {per_slot * cache['max_seq'] / 2**20:.1f} MiB per row at max_seq")
    print("  inputs:")
    for io in m.inputs:
        print(f"    {io['name']:32s} {io['dtype']:8s} {io['shape']}")
    print("  outputs:")
    for io in m.outputs:
        print(f"    {io['name']:32s} {io['dtype']:8s} {io['shape']}")
    if target:
        print(f"  target: {target['backend']} {target['precision']}, engine files {', '.join(target['engine_files'])}")
        print(f"  fingerprint: {json.dumps(target['fingerprint'])}")
    else:
        print("  target: none (IR only; `kvexport build` makes an engine)")
    v = m.raw.get("verification")
    print(f"  verified: {json.dumps(v) if v else 'no'}")
    return 0


def cmd_doctor(a: argparse.Namespace) -> int:
    from kvexport.doctor import format_report, report

    r = report()
    print(json.dumps(r, indent=2) if a.json else format_report(r))
    return 0


def cmd_make_checkpoint(a: argparse.Namespace) -> int:
    import torch

    from kvexport.zoo import NAMED_MODELS, write_checkpoint

    if a.name not in NAMED_MODELS:
        raise InputError(f"unknown model name {a.name!r}; choose one of {', '.join(sorted(NAMED_MODELS))}")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[a.dtype]
    shard = int(a.shard_mb * 2**20) if a.shard_mb else None
    write_checkpoint(NAMED_MODELS[a.name], a.output, seed=a.seed, dtype=dtype, shard_bytes=shard)
    print(f"wrote {a.output}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvexport", description="Export decoder-only LLMs with an explicit KV cache "
                                "and build engines for cpu, intel, nvidia and amd targets.")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("-q", "--quiet", action="store_true", help="no progress lines")

    s = sub.add_parser("export", help="HF checkpoint folder -> ONNX IR + manifest (no engine)")
    s.add_argument("model_dir")
    s.add_argument("-o", "--output")
    s.add_argument("--max-seq", type=int, default=None, help="cache capacity bound (default: max_position_embeddings)")
    s.add_argument("--cache", choices=("static", "concat"), default="static")
    s.add_argument("--all-logits", action="store_true", help="logits for every position, not the last only")
    s.add_argument("--check", action="store_true", help="list every unsupported feature and exit")
    common(s)
    s.set_defaults(fn=cmd_export)

    s = sub.add_parser("build", help="export, lower for a target, verify; no MODEL_DIR builds the embedded default")
    s.add_argument("model_dir", nargs="?", default=None)
    s.add_argument("-o", "--output", required=True)
    s.add_argument("--target", default="cpu")
    s.add_argument("--max-seq", type=int, default=None)
    s.add_argument("--precision", default=None)
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--max-batch", type=int, default=8)
    s.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="backend-specific option")
    s.add_argument("--numa-node", type=int, default=None, help="pin threads and memory to this NUMA node (targets that place)")
    s.add_argument("--defer", action="store_true", help="package the prepared IR; build the engine at first load")
    s.add_argument("--no-verify", action="store_true")
    common(s)
    s.set_defaults(fn=cmd_build)

    s = sub.add_parser("run", help="stream generated text")
    s.add_argument("artifact")
    s.add_argument("--prompt", required=True)
    s.add_argument("--ids", action="store_true", help="the prompt is comma-separated token ids")
    s.add_argument("--max-new-tokens", type=int, default=32)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--stop", action="append", default=[], help="stop string or token id (repeatable)")
    s.add_argument("--chat", action="store_true", help="--prompt is a user message, rendered by the model's chat template")
    s.add_argument("--messages", default=None, metavar="FILE.json",
                   help="with --chat: earlier turns, a JSON list of {role, content}; --prompt is the next user message")
    s.add_argument("--no-rebuild", action="store_true",
                   help="fail instead of rebuilding when the engine was built for another device or SDK")
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="backend load option")
    s.set_defaults(fn=cmd_run)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching (docs/serving.md)")
    s.add_argument("artifact")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-batch", type=int, default=8, help="requests decoded together (cache rows)")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting for a row before 429")
    s.add_argument("--prefill-chunk", type=int, default=64, help="prompt tokens per prefill step")
    s.add_argument("--model-name", default=None, help="the model id the API reports (default: the artifact's name)")
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="backend load option")
    s.set_defaults(fn=cmd_serve)

    s = sub.add_parser("verify", help="compare the engine with the PyTorch reference; writes verify.json")
    s.add_argument("artifact")
    s.add_argument("--reference", required=True, help="the HF checkpoint folder the artifact came from")
    s.add_argument("--steps", type=int, default=32)
    s.add_argument("--no-rebuild", action="store_true",
                   help="fail instead of rebuilding when the engine was built for another device or SDK")
    s.add_argument("--self-check", action="store_true",
                   help="without transformers: compare with kvexport's own eager decoder (recorded as a self-check)")
    s.add_argument("--json", action="store_true")
    common(s)
    s.set_defaults(fn=cmd_verify)

    s = sub.add_parser("bench", help="BENCHMARKS.md protocol with same-run baselines; prints ratios")
    s.add_argument("artifact")
    s.add_argument("--reference", default=None, help="HF checkpoint folder for the transformers baselines")
    s.add_argument("--compare", action="append", default=[], help="another artifact to time in the same run")
    s.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                   help="also time this artifact loaded with these load options (e.g. kv_precision=u8)")
    s.add_argument("--prompts", default="32,512")
    s.add_argument("--new-tokens", type=int, default=64)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds (engine, --compare engines, transformers back to back in each)")
    s.add_argument("--no-rebuild", action="store_true",
                   help="fail instead of rebuilding when the engine was built for another device or SDK")
    s.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="load option of the main artifact (and its --variant runs), not of --compare ones")
    s.add_argument("--no-baselines", action="store_true", help="skip the transformers baselines")
    s.add_argument("--no-floor", action="store_true",
                   help="skip the GEMV floor (the model's weight matrices timed as bare ONNX Runtime MatMuls)")
    s.add_argument("--json", action="store_true")
    common(s)
    s.set_defaults(fn=cmd_bench)

    s = sub.add_parser("inspect", help="dims, IO, cache bytes, target and fingerprint of an artifact")
    s.add_argument("artifact")
    s.add_argument("--json", action="store_true")
    s.add_argument("--no-hash-check", action="store_true")
    s.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("doctor", help="installed targets and why the others are not, CPU ISA, NUMA, GPUs")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_doctor)

    s = sub.add_parser("make-checkpoint", help="write a seeded random HF checkpoint (bench-125m, default, tiny-*)")
    s.add_argument("name")
    s.add_argument("-o", "--output", required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    s.add_argument("--shard-mb", type=float, default=None, help="split weights into shards of this size")
    s.set_defaults(fn=cmd_make_checkpoint)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except KvexportError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
