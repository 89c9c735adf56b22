"""The `kvexport` command line: export, build, run, verify, bench, inspect, doctor, make-checkpoint."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, TextIO

from kvexport.errors import InputError, KvexportError


class _Progress:
    """Progress of a long step on stderr, with the elapsed time, so that it shows it is alive.

    Where stderr is a terminal: each finished step stays as a `[  12.3s] step` line and the current one
    is a live line (spinner, step, pulsing bar, elapsed time). Elsewhere (pipes, logs, CI, tests): one
    timestamped line per step, nothing else. `tty` and `file` force the choice and the stream (tests).
    """

    _open: list[_Progress] = []

    def __init__(self, quiet: bool = False, *, tty: bool | None = None, file: TextIO | None = None):
        self.t0, self.quiet, self.file = time.perf_counter(), quiet, file
        self.tty = _is_terminal(file or sys.stderr) if tty is None else tty
        self._bar: Any = None
        self._task: Any = None
        self._last: tuple[float, str] | None = None

    def __call__(self, msg: str) -> None:
        if self.quiet:
            return
        now = time.perf_counter() - self.t0
        if not self.tty:
            print(f"[{now:6.1f}s] {msg}", file=self.file or sys.stderr, flush=True)
            return
        if self._bar is None:
            self._start()
        self._finish_line()
        self._last = (now, msg)
        self._bar.update(self._task, description=msg)

    def _start(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        console = Console(file=self.file or sys.stderr, force_terminal=True, highlight=False)
        self._bar = Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False),
                             BarColumn(bar_width=24), TimeElapsedColumn(), console=console, transient=True,
                             redirect_stdout=False, redirect_stderr=True, refresh_per_second=8)
        self._bar.start()
        self._task = self._bar.add_task("", total=None)  # no total: the bar pulses while the step runs
        _Progress._open.append(self)

    def _finish_line(self) -> None:
        """The step that just ended, as the line a non-terminal run prints."""
        if self._last is not None:
            t, msg = self._last
            self._bar.console.print(f"[{t:6.1f}s] {msg}", markup=False, highlight=False, soft_wrap=True)
            self._last = None

    def close(self) -> None:
        if self._bar is not None:
            self._finish_line()
            self._bar.stop()
            self._bar = None
        if self in _Progress._open:
            _Progress._open.remove(self)

    @classmethod
    def close_all(cls) -> None:
        for p in list(cls._open):
            p.close()


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty()) and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


class _Notices:
    """The CLI's filter between libraries and the user (the library API keeps Python's usual warnings).

    Python warnings are recorded instead of printed: kvexport's own ones become one `warning: ...`
    line each, other libraries' one `notice:` line per kind (category and package), with the full text
    in a log file. Output that native code and child processes write straight to the stderr file
    descriptor (compilers, OpenVINO, torch's compile workers) goes to the same log. `--verbose` turns
    all of this off and shows everything as it comes.
    """

    def __init__(self, command: str, verbose: bool):
        self.command, self.verbose = command, verbose
        self.records: list[tuple[str, str, str, str]] = []  # (category, origin, message, formatted)
        self.log_path: Path | None = None
        self._log: TextIO | None = None
        self._saved_fd: int | None = None
        self._saved_stderr: Any = None

    def __enter__(self) -> _Notices:
        if self.verbose:
            return self
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.showwarning = self._record
        if sys.stderr is sys.__stderr__ and _has_fd(sys.stderr):
            try:
                self._capture_fd()  # not when stderr is already redirected in-process (pytest's capsys)
            except OSError:
                pass  # no writable log folder: native output passes through, warnings are still summed up
        return self

    def _open_log(self) -> TextIO:
        if self._log is None:
            folder = Path(os.environ.get("KVEXPORT_LOG_DIR") or Path(tempfile.gettempdir()) / "kvexport-logs")
            folder.mkdir(parents=True, exist_ok=True)
            self.log_path = folder / f"{self.command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
            self._log = open(self.log_path, "a", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
        return self._log

    def _capture_fd(self) -> None:
        log = self._open_log()
        sys.stderr.flush()
        self._saved_fd = os.dup(2)
        self._saved_stderr = sys.stderr
        os.dup2(log.fileno(), 2)  # O_APPEND: the log's own writes and fd 2's interleave safely
        sys.stderr = open(os.dup(self._saved_fd), "w", buffering=1, encoding=sys.__stderr__.encoding,  # noqa: SIM115
                          errors="backslashreplace", closefd=True)

    def _record(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
                file: TextIO | None = None, line: str | None = None) -> None:
        text = warnings.formatwarning(message, category, filename, lineno, line)
        origin = _origin(filename, category)
        if _in_stdlib(filename):  # attributed to the standard library (copyreg, say): name the package that called it
            frame = sys._getframe(1)
            while frame is not None and (frame.f_code.co_filename, frame.f_lineno) != (filename, lineno):
                frame = frame.f_back  # type: ignore[assignment]  # up to the frame the warning names
            while frame is not None and _in_stdlib(frame.f_code.co_filename):
                frame = frame.f_back  # type: ignore[assignment]
            if frame is not None:
                origin = _origin(frame.f_code.co_filename, category)
        self.records.append((category.__name__, origin, " ".join(str(message).split()), text))
        try:
            self._open_log().write(text)
        except OSError:
            pass

    def __exit__(self, *exc: object) -> None:
        if self.verbose:
            return
        native = ""
        if self._saved_fd is not None:
            sys.stderr.flush()
            os.dup2(self._saved_fd, 2)
            os.close(self._saved_fd)
            sys.stderr.close()
            sys.stderr = self._saved_stderr
            assert self._log is not None and self.log_path is not None
            self._log.flush()
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                native = f.read()
        self._catch.__exit__(None, None, None)
        if self._log is not None:
            self._log.close()
        for line in self._summary(native):
            print(line, file=sys.stderr)
        if self.log_path is not None and not self.records and not native.strip():
            self.log_path.unlink(missing_ok=True)  # nothing was said: leave no empty log behind

    def _summary(self, log_text: str) -> list[str]:
        """One line per kvexport warning; one per kind (category, package) of anyone else's."""
        out: list[str] = []
        kinds: dict[tuple[str, str], list[str]] = {}
        for category, origin, message, _ in self.records:
            if origin == "kvexport":
                out.append(f"warning: {message}")
            else:
                kinds.setdefault((category, origin), []).append(message)
        for _, _, _, text in self.records:  # what is left was written by native code or child processes
            log_text = log_text.replace(text, "", 1)
        other_lines, lines = 0, log_text.splitlines()
        for i, ln in enumerate(lines):
            m = re.match(r"^(\S+?):\d+: (\w+Warning): (.*)$", ln)  # a child process's Python warning
            if m:
                kinds.setdefault((m.group(2), _origin(m.group(1), Warning)), []).append(m.group(3))
            elif ln.strip() and not (i and ln.startswith("  ") and re.match(r"^\S+?:\d+: \w+Warning: ", lines[i - 1])):
                other_lines += 1
        where = f"details in {self.log_path} or rerun with --verbose" if self._log else "rerun with --verbose for details"
        for (category, origin), messages in sorted(kinds.items()):
            n, first = len(messages), " ".join(messages[0].split())
            first = first if len(first) <= 70 else first[:67] + "..."
            out.append(f"notice: {n} {category}{'s' if n > 1 else ''} from {origin} ({first}); {where}")
        if other_lines:
            out.append(f"notice: {other_lines} line{'s' if other_lines > 1 else ''} of library output on stderr; {where}")
        return out


def _has_fd(stream: Any) -> bool:
    try:
        stream.fileno()
        return True
    except (AttributeError, OSError, ValueError):
        return False


def _in_stdlib(filename: str) -> bool:
    import sysconfig

    stdlib = sysconfig.get_paths()["stdlib"]
    return filename.startswith(stdlib) and "-packages" not in filename or filename.startswith("<frozen")


def _origin(filename: str, category: type[Warning]) -> str:
    """The package a warning came from: kvexport (and its backends), else the top-level package or module."""
    if (category.__module__ or "").startswith("kvexport"):
        return "kvexport"
    parts = Path(filename).parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts and parts.index(marker) + 1 < len(parts):
            top = parts[parts.index(marker) + 1]
            return "kvexport" if top.startswith("kvexport") else Path(top).stem
    here = Path(__file__).resolve().parents[1]  # a source checkout (pip install -e)
    try:
        rel = Path(filename).resolve().relative_to(here)
        if rel.parts[0] in ("kvexport", "backends"):
            return "kvexport"
    except (ValueError, OSError, IndexError):
        pass
    return Path(filename).stem or "python"


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
    text = None
    if a.calibration_text is not None:
        path = Path(a.calibration_text)
        if not path.is_file():
            raise InputError(f"--calibration-text {path}: no such file; give a UTF-8 text file of the kind of text "
                             "the model will see, or drop the option")
        text = path.read_text(encoding="utf-8", errors="replace")
    opts = BuildOptions(precision=a.precision, weights=a.weights, group_size=a.group_size, kv=a.kv,
                        threads=a.threads, max_batch=a.max_batch, extra=extra, calibration_text=text)
    build(a.model_dir, a.output, target=a.target, max_seq=a.max_seq, options=opts, verify=not a.no_verify,
          progress=_Progress(a.quiet))
    return 0


def cmd_run(a: argparse.Namespace) -> int:
    engine = _load(a.artifact, a, a.threads)
    prompt: Any = a.prompt
    if a.ids:
        try:
            prompt = [int(t) for t in a.prompt.split(",")]
        except ValueError:
            raise InputError(f"--ids takes the prompt as comma-separated token ids (e.g. 1,15,42), got {a.prompt!r}") from None
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
    if a.ray or a.replicas is not None or a.ray_address is not None:
        from kvexport.ray_serve import serve_ray

        return serve_ray(a.artifact, address=a.ray_address, host=a.host, port=a.port,
                         replicas=2 if a.replicas is None else a.replicas, max_batch=a.max_batch,
                         max_queue=a.max_queue, prefill_chunk=a.prefill_chunk,
                         prefill_budget=a.prefill_budget, threads=a.threads,
                         model_name=a.model_name, load_options=_options(a.option), num_cpus=a.replica_cpus,
                         one_per_node=not a.many_per_node)
    from kvexport.server import serve

    return serve(a.artifact, host=a.host, port=a.port, max_batch=a.max_batch, max_queue=a.max_queue,
                 prefill_chunk=a.prefill_chunk, prefill_budget=a.prefill_budget, threads=a.threads,
                 model_name=a.model_name,
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
    # bad arguments are refused before any engine is loaded, and before kvexport.bench imports torch
    if a.rounds < 1:
        raise InputError(f"--rounds must be at least 1, got {a.rounds}")
    if a.new_tokens < 2:
        raise InputError(f"--new-tokens must be at least 2 (decode is timed over the tokens after the first), "
                         f"got {a.new_tokens}")
    if a.reference is not None and not Path(a.reference).is_dir():
        raise InputError(f"--reference {a.reference} is not a checkpoint folder")
    if a.step_pairs and not (a.compare or a.variant):
        raise InputError("--step-pairs times other engines' decode steps against the main one's: give --compare "
                         "ARTIFACT or --variant KEY=VALUE")
    from kvexport.bench import (Floors, check_comparable, check_prompts_fit, format_report, other_key, parse_prompt_lens,
                                rss_mb, run_bench)

    prompts = parse_prompt_lens(a.prompts)
    check_comparable(Path(a.artifact), [Path(p) for p in a.compare])
    progress = _Progress(a.quiet)
    floors = None if a.no_floor else Floors(a.threads, progress)  # each made just after its engine loads
    rss0 = rss_mb()
    engine = _load(a.artifact, a, a.threads)
    engine_load_rss = rss_mb() - rss0
    check_prompts_fit(prompts, a.new_tokens, engine.max_seq)  # before any floor is made
    if floors is not None:
        floors.add("engine", engine)
    loads = [(p, p, []) for p in a.compare]  # --option is the main artifact's
    # the same artifact loaded with other load options, e.g. kv_precision=u8
    loads += [(f"{a.artifact} [{v}]", a.artifact, [*a.option, *v.split(",")]) for v in a.variant]
    others = []
    for label, path, options in loads:
        other = _load(path, a, a.threads, options)
        others.append((label, other))
        if floors is not None:
            floors.add(other_key(label), other)
    r = run_bench(engine, reference=Path(a.reference) if a.reference else None, prompt_lens=prompts,
                  new_tokens=a.new_tokens, threads=a.threads, others=others, baselines=not a.no_baselines,
                  floor=not a.no_floor, rounds=a.rounds, engine_load_rss_mb=engine_load_rss,
                  progress=progress, prepared=floors, step_pairs=a.step_pairs)
    print(json.dumps(r, indent=2) if a.json else format_report(r))
    return 0


def cmd_inspect(a: argparse.Namespace) -> int:
    from kvexport.artifact import open_artifact

    folder, m = open_artifact(a.artifact, verify_hashes=not a.no_hash_check)
    if a.json:
        print(m.to_json())
        return 0
    from kvexport.precision import kv_of

    cfg, cache, target = m.config, m.cache, m.target
    kv_mode, per_slot = kv_of(m)
    print(f"{folder}: {m.raw['model']['family']} '{m.raw['model']['name']}', {m.raw['model']['num_parameters'] / 1e6:.1f}M parameters")
    print(f"  dims: hidden {cfg.hidden_size}, layers {cfg.num_hidden_layers}, heads {cfg.num_attention_heads} "
          f"(kv {cfg.num_key_value_heads}), head_dim {cfg.head_dim}, mlp {cfg.intermediate_size}, vocab {cfg.vocab_size}")
    print(f"  IR: {m.raw['ir']['file']} opset {m.raw['ir']['opset']}, {cache['style']} cache {cache['layout']} "
          f"{cache['dtype']}, max_seq {cache['max_seq']}, last-token logits {m.raw['ir']['last_token_only']}")
    fixed = int(((target or {}).get("kv") or {}).get("scale_bytes") or 0)  # per-channel scales: once, not per token
    print(f"  KV cache: {kv_mode}, {per_slot} bytes per token per row"
          + (f" (+ {fixed} bytes of per-channel scales, once per engine)" if fixed else "")
          + f"; {per_slot * cache['max_seq'] / 2**20:.1f} MiB per row at max_seq")
    for key in ("format", "why"):  # a backend's own record of which cache it holds, and why it chose it
        if ((target or {}).get("kv") or {}).get(key):
            print(f"    {key}: {target['kv'][key]}")
    from kvexport.runtime.ring import RingSpec, cache_bytes

    ring = RingSpec.of(m)  # the IR's rings, or the engine's own (intel's state)
    if ring is not None:
        item = max(1, per_slot // (2 * cache["num_layers"] * cache["kv_heads"] * cache["head_dim"]))  # bytes an element
        held, swap, full = cache_bytes(m, cache["max_seq"], item)
        swapped = (f" ({swap} bytes of them the rings' swap buffers: the engine writes each ring into a second "
                   "buffer that swaps with it every step)") if swap else ""
        print(f"  sliding layers on rings: {len(ring.layers)} of {cache['num_layers']} keep {ring.window} slots; "
              f"{held} bytes ({held / 2**20:.2f} MiB) per row at max_seq{swapped} beside {full} bytes "
              f"({full / 2**20:.2f} MiB) were every layer full length"
              + (f"; positions up to {ring.max_positions} (past max_seq)" if ring.every_layer else ""))
    from kvexport.precision import canonical

    # the lists below are the IR's contract; an engine may keep its cache in another type (an int8 cache)
    held = f"; the engine keeps the cache buffers as {kv_mode}" if kv_mode != canonical(cache["dtype"]) else ""
    print(f"  inputs (the IR's{held}):")
    for io in m.inputs:
        print(f"    {io['name']:32s} {io['dtype']:8s} {io['shape']}")
    print("  outputs (the IR's):")
    for io in m.outputs:
        print(f"    {io['name']:32s} {io['dtype']:8s} {io['shape']}")
    if target:
        print(f"  target: {target['backend']} {target['precision']}, engine files {', '.join(target['engine_files'])}")
        w = target.get("weights")
        if w:
            block = f", group size {w['group_size']}" if w.get("group_size") else ""
            other = {b: n for b, n in (w.get("blocks") or {}).items() if int(b) != w.get("group_size")}
            block += "".join(f", {n} matrices at block {b} (fitted to their rows)" for b, n in other.items())
            print(f"  weights: {w['dtype']}{block}, {w['bytes']} bytes ({w['bytes'] / 2**20:.1f} MiB, scales included)")
            files = [folder / f for f in target.get("engine_files", [])]
            disk = sum(f.stat().st_size for f in files if f.is_file())
            if disk and abs(disk - w["bytes"]) > 0.1 * w["bytes"]:
                # intel bf16: the file holds f32 weights, which the plugin converts when it compiles
                print(f"  engine files on disk: {disk / 2**20:.1f} MiB; the weights above are counted as the runtime "
                      f"holds them ({w['dtype']})")
            if w.get("method") == "gptq":
                cal = w.get("calibration") or {}
                print(f"  rounding: gptq, {w.get('matrices')} matrices against their inputs on {cal.get('tokens')} "
                      f"tokens ({cal.get('source')}); the lm_head round-to-nearest")
            elif w.get("data_aware"):  # the intel target: NNCF's corrections
                cal = w.get("calibration") or {}
                print(f"  rounding: NNCF {' + '.join(w['data_aware'])} on {cal.get('tokens')} tokens "
                      f"({cal.get('source')}, {cal.get('items')} windows); the embedding and lm_head data-free")
        if target.get("auto"):
            print(f"  auto picked: {target['auto']['reason']}")
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

    from kvexport.zoo import NAMED_MODELS, write_named

    if a.name not in NAMED_MODELS:
        raise InputError(f"unknown model name {a.name!r}; choose one of {', '.join(sorted(NAMED_MODELS))}")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[a.dtype]
    shard = int(a.shard_mb * 2**20) if a.shard_mb else None
    write_named(a.name, a.output, seed=a.seed, dtype=dtype, shard_bytes=shard)
    print(f"wrote {a.output}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvexport", description="Export decoder-only LLMs with an explicit KV cache "
                                "and build engines for cpu, intel, nvidia and amd targets.")
    verbose_help = ("show every warning and library message in full as it comes (by default they are summed up "
                    "in one notice line each, with the details in a log file)")
    p.add_argument("-v", "--verbose", action="store_true", help=verbose_help)
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
    s.add_argument("--weights", default=None, metavar="MODE",
                   help="weights: fp32, fp16, bf16, int8, int4 (block-wise) or auto (the fastest mode this CPU or GPU "
                        "runs that has a tolerance row; the pick and its reason are printed and kept in the manifest); "
                        "default: the target's own")
    s.add_argument("--precision", default=None, metavar="MODE", help="another name for --weights")
    s.add_argument("--group-size", type=int, default=None, metavar="N",
                   help="int8/int4 weights: 32, 64 or 128 weights share one scale (default: the target's; on cpu 32 for "
                        "int4, 128 for int8)")
    s.add_argument("--kv", default=None, metavar="MODE",
                   help="KV cache: fp32, fp16, bf16, int8 or auto (default: fp32, or the weights' type on targets "
                        "that keep the cache in it)")
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--max-batch", type=int, default=8)
    s.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="backend-specific option")
    s.add_argument("--numa-node", type=int, default=None, help="pin threads and memory to this NUMA node (targets that place)")
    s.add_argument("--calibration-text", metavar="FILE", default=None,
                   help="UTF-8 text of the kind the model will see, for what the build calibrates (cpu: --kv int8 "
                        "scales, --option quantizer=gptq; its last 2048 tokens); default: the checkpoint's "
                        "heldout.txt, else a built-in sample")
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
    s.add_argument("--prefill-chunk", type=int, default=64, help="prompt tokens per prefill call")
    s.add_argument("--prefill-budget", type=int, default=None,
                   help="prompt tokens prefilled between two decode steps (default: 4 chunks)")
    s.add_argument("--model-name", default=None, help="the model id the API reports (default: the artifact's name)")
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="backend load option")
    s.add_argument("--ray", action="store_true", help="serve replicas on a Ray cluster behind Ray Serve's router "
                   "(pip install 'kvexport[ray]'; docs/serving.md)")
    s.add_argument("--replicas", type=int, default=None, help="--ray: engine replicas (default 2)")
    s.add_argument("--ray-address", default=None,
                   help="--ray: the cluster to join (e.g. auto, or HEAD:6379); default: start a local one")
    s.add_argument("--replica-cpus", type=float, default=None, help="--ray: CPUs each replica asks Ray for "
                   "(default: --threads, else 1)")
    s.add_argument("--many-per-node", action="store_true",
                   help="--ray: allow several replicas on one Ray node (default: at most one per node)")
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

    s = sub.add_parser("bench", help="the protocol of docs/benchmarks.md, with same-run baselines; prints ratios",
                       description="Time an artifact by the protocol of docs/benchmarks.md (greedy, batch 1, "
                       "interleaved rounds) and print every figure as a ratio against baselines measured in the "
                       "same run: the GEMV floor, read bandwidth, transformers, other artifacts.")
    s.add_argument("artifact")
    s.add_argument("--reference", default=None, help="HF checkpoint folder for the transformers baselines")
    s.add_argument("--compare", action="append", default=[], help="another artifact to time in the same run")
    s.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                   help="also time this artifact loaded with these load options (e.g. kv_precision=u8)")
    s.add_argument("--prompt-lens", "--prompts", dest="prompts", default="32,512",
                   help="prompt lengths in tokens, comma-separated (default 32,512; add 4096 for cache work)")
    s.add_argument("--new-tokens", type=int, default=64)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds (engine, --compare engines, transformers back to back in each)")
    s.add_argument("--no-rebuild", action="store_true",
                   help="fail instead of rebuilding when the engine was built for another device or SDK")
    s.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="load option of the main artifact (and its --variant runs), not of --compare ones")
    s.add_argument("--step-pairs", action="store_true",
                   help="also time decode step against step: every engine holds the prompt, then they decode one "
                        "step each in turn, and each --compare/--variant engine gets the median of its paired step "
                        "ratios (a pair runs milliseconds apart, so the host's drift moves both alike)")
    s.add_argument("--no-baselines", action="store_true", help="skip the transformers baselines")
    s.add_argument("--no-floor", action="store_true",
                   help="skip the GEMV floors (each engine's weight matrices alone, as bare ONNX Runtime MatMul or "
                        "MatMulNBits, timed just before each of its runs)")
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

    s = sub.add_parser("make-checkpoint", help="write an HF checkpoint: the trained default, or seeded random bench-125m, tiny-*")
    s.add_argument("name")
    s.add_argument("-o", "--output", required=True)
    s.add_argument("--seed", type=int, default=0, help="random-init seed; for `default`, 0 is the trained model and any other seed random weights")
    s.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    s.add_argument("--shard-mb", type=float, default=None, help="split weights into shards of this size")
    s.set_defaults(fn=cmd_make_checkpoint)
    for sp in sub.choices.values():
        sp.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=verbose_help)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    with _Notices(args.command, getattr(args, "verbose", False)):
        try:
            if (getattr(args, "threads", None) or 0) < 0:
                raise InputError(f"--threads must be 1 or more (or left out, or 0, for the target's default), "
                                 f"got {args.threads}")
            return int(args.fn(args))
        except KvexportError as e:
            _Progress.close_all()
            print(f"error: {e}", file=sys.stderr)
            return e.exit_code
        except KeyboardInterrupt:
            _Progress.close_all()
            print("interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:  # `kvexport doctor | head`: the reader left; say nothing more
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141
        finally:
            _Progress.close_all()


if __name__ == "__main__":
    sys.exit(main())
