"""Every precision figure docs/performance.md keeps per CPU kind, measured in one unattended run on this CPU.

The quantized modes (int8 / int4 weights, bf16, the int8 KV cache) promise figures that only hold on the CPU that
measured them: decode against fp32 and against the GEMV floor, against the peers' own engines (onnxruntime-genai,
OpenVINO GenAI), prompts of 4096, perplexity on the trained default model, the memory an export of bench-1b takes.
This script makes what they need in one work folder (checkpoints, artifacts, the peers' models), runs each
measurement with the commands the docs give, keeps each command's output, and prints one table: each bar, the figure
this run measured, and whether it was met. A step whose output is already in the folder is not run again, so an
interrupted run resumes where it stopped and `report` re-reads the figures without running anything.

    python benchmarks/bars.py run --work out/bars            # everything (about an hour on 2 cores, 59 GiB of disk)
    python benchmarks/bars.py run --work out/bars --only cpu  # one group: cpu, intel, kv, long, quality, export
    python benchmarks/bars.py run --work out/bars --dry-run   # the plan for this CPU, nothing run
    python benchmarks/bars.py report --work out/bars         # the table from what is there (--json for the figures)

The peers need their virtualenv (`python benchmarks/peers.py setup`; made here when it is missing). Bars that need a
feature this CPU lacks (bf16 against OpenVINO GenAI's bf16 needs AMX-BF16) say so instead of a figure. Nothing here
is a unit test: it times, so it belongs to no test run (tests/test_bars_script.py checks its plan and its arithmetic).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvexport.doctor import cpu_info, read_cpu_flags
from kvexport_intel.isa import has_bf16  # the intel target's own test: the peers run the precision it picks

HERE = Path(__file__).resolve().parent
PEERS = HERE / "peers.py"
DEFAULT_MODEL = HERE.parent / "kvexport" / "default_model"  # the trained default model (docs/default-model.md)
MIN_FREE = 16 * 2**30  # bytes of disk a step that makes something may need
GROUPS = ("export", "cpu", "intel", "kv", "long", "quality")


def cpu_kind(flags: set[str]) -> str:
    if "amx_bf16" in flags:
        return "AMX (AVX-512, AMX-BF16/INT8)"
    if "avx512f" in flags:
        extra = [n for f, n in (("avx512_vnni", "VNNI"), ("avx512_bf16", "AVX512-BF16")) if f in flags]
        return "AVX-512" + (f" ({', '.join(extra)}; no AMX)" if extra else " (no AMX)")
    return "AVX2 only" if "avx2" in flags else "no AVX2"


@dataclass
class Step:
    name: str  # also the file its output is kept in: results/NAME.json
    group: str
    argv: list[str]
    makes: str | None = None  # the folder it writes (a build): not made again once complete
    parse_json: bool = False  # the command prints --json output (after progress lines)


@dataclass
class Plan:
    work: Path
    flags: set[str]
    steps: list[Step] = field(default_factory=list)

    @property
    def bf16(self) -> bool:
        return has_bf16(self.flags)

    def p(self, name: str) -> str:
        return str(self.work / name)


def kvexport_cmd() -> list[str]:
    return [sys.executable, "-m", "kvexport"]


def make_plan(work: Path, flags: set[str], rounds: int = 3) -> Plan:
    """The steps, in the order they run: what each measurement needs comes before it."""
    plan = Plan(work, flags)
    kx, peers, r = kvexport_cmd(), [sys.executable, str(PEERS)], str(rounds)
    add = plan.steps.append
    b1, b125, dm = plan.p("bench-1b"), plan.p("bench-125m"), str(DEFAULT_MODEL)
    for name, folder, group in (("bench-1b", b1, "export"), ("bench-125m", b125, "kv")):
        add(Step(f"checkpoint-{name}", group, [*kx, "make-checkpoint", name, "-o", folder], makes=folder))

    def build(name: str, group: str, ckpt: str, *args: str, max_seq: str = "1024") -> None:
        out = plan.p(name + ".kvx")  # verified on its own (quality) or not at all (random weights)
        add(Step(f"build-{name}", group, [*kx, "build", ckpt, "-o", out, "--max-seq", max_seq, *args, "--no-verify"],
                 makes=out))

    # bench-1b: the fp32 cpu build is also the export's memory bar (its peak RSS, export included)
    build("b1-cpu-fp32", "export", b1, "--target", "cpu", "--weights", "fp32")
    build("b1-cpu-int8", "cpu", b1, "--target", "cpu", "--weights", "int8")
    build("b1-cpu-int4", "cpu", b1, "--target", "cpu", "--weights", "int4", "--group-size", "32")
    build("b1-intel-int8", "intel", b1, "--target", "intel", "--weights", "int8")
    build("b1-intel-int4-g128", "intel", b1, "--target", "intel", "--weights", "int4", "--group-size", "128")
    if plan.bf16:  # bf16 activations over bf16 weights, as the peer's fp32 model runs under its bf16 hint
        build("b1-intel-bf16", "intel", b1, "--target", "intel", "--weights", "bf16")
    # bench-125m at 4096
    for name, args in (("b125-cpu-fp32", ("--target", "cpu", "--weights", "fp32")),
                       ("b125-intel-fp32", ("--target", "intel", "--weights", "fp32")),
                       ("b125-cpu-int4-kvfp32", ("--target", "cpu", "--weights", "int4", "--group-size", "32")),
                       ("b125-cpu-int4-kvint8", ("--target", "cpu", "--weights", "int4", "--group-size", "32",
                                                 "--kv", "int8")),
                       ("b125-intel-int4-kvint8", ("--target", "intel", "--weights", "int4", "--group-size", "32",
                                                   "--kv", "int8"))):
        build(name, "long" if "fp32" in name and "kv" not in name else "kv", b125, *args, max_seq="4160")
    # the trained default model, one artifact a mode, each then verified against the tolerance table
    quality = [("def-cpu-int8", ("--target", "cpu", "--weights", "int8")),
               ("def-cpu-int4-g32", ("--target", "cpu", "--weights", "int4", "--group-size", "32")),
               ("def-cpu-int4-g128", ("--target", "cpu", "--weights", "int4", "--group-size", "128")),
               ("def-cpu-kvint8", ("--target", "cpu", "--weights", "fp32", "--kv", "int8")),
               ("def-intel-int8", ("--target", "intel", "--weights", "int8")),
               ("def-intel-int4-g32", ("--target", "intel", "--weights", "int4", "--group-size", "32")),
               ("def-intel-kvint8", ("--target", "intel", "--weights", "fp32", "--kv", "int8"))]
    if plan.bf16:
        quality.append(("def-intel-bf16", ("--target", "intel", "--weights", "bf16")))
    for name, args in quality:
        build(name, "quality", dm, *args, max_seq="512")
        add(Step(f"verify-{name}", "quality", [*kx, "verify", plan.p(name + ".kvx"), "--reference", dm, "--json",
                                               "-q"], parse_json=True))

    # the peers, from the same checkpoints
    p1, p125 = plan.p("peers1b"), plan.p("peers125")
    add(Step("peers-setup", "cpu", [*peers, "setup"], makes=str(HERE / ".peers-venv")))
    for name, group, ckpt, out, args in (
            ("peers1b-ortgenai-int4-g32", "cpu", b1, p1, ("--peers", "ortgenai", "--modes", "int4", "--group-size", "32")),
            ("peers1b-openvino-int8", "intel", b1, p1, ("--peers", "openvino", "--modes", "int8")),
            ("peers1b-openvino-int4-g128", "intel", b1, p1, ("--peers", "openvino", "--modes", "int4", "--group-size",
                                                            "128")),
            ("peers125-openvino-fp32", "long", b125, p125, ("--peers", "openvino", "--modes", "fp32")),
            ("peers125-openvino-int4-g32", "kv", b125, p125, ("--peers", "openvino", "--modes", "int4", "--group-size",
                                                             "32"))):
        folder = out + "/" + name.split("-", 1)[1]
        add(Step(f"build-{name}", group, [*peers, "build", ckpt, "-o", out, *args], makes=folder))
    if plan.bf16:
        add(Step("build-peers1b-openvino-fp32", "intel", [*peers, "build", b1, "-o", p1, "--peers", "openvino",
                                                            "--modes", "fp32"], makes=p1 + "/openvino-fp32"))

    # the measurements
    def bench(name: str, group: str, *args: str) -> None:
        add(Step(name, group, [*kx, "bench", *args, "--rounds", r, "--no-baselines", "--json", "-q"], parse_json=True))

    def vs_peers(name: str, group: str, *args: str) -> None:
        add(Step(name, group, [*peers, "bench", *args, "--rounds", r, "--json"], parse_json=True))

    act = "bf16" if plan.bf16 else "f32"  # the intel engines' own pick, given to the peer too
    # each quantized engine loaded first, beside fp32 alone: three bench-1b engines and their floors at once left
    # too little free memory to place the last engine's weights in huge pages while its floor got them
    for mode in ("int8", "int4"):
        bench(f"cpu-{mode}", "cpu", plan.p(f"b1-cpu-{mode}.kvx"), "--compare", plan.p("b1-cpu-fp32.kvx"),
              "--prompt-lens", "32,512")
    vs_peers("cpu-vs-ortgenai", "cpu", plan.p("b1-cpu-int4.kvx"), p1 + "/ortgenai-int4-g32", "--prompt-lens", "32,512")
    vs_peers("intel-int8-vs-openvino", "intel", plan.p("b1-intel-int8.kvx"),
             f"{p1}/openvino-int8@precision={act},kv={act}", "--prompt-lens", "32,512", "--step-blocks", "1")
    vs_peers("intel-int4-vs-openvino", "intel", plan.p("b1-intel-int4-g128.kvx"),
             f"{p1}/openvino-int4-g128@precision={act},kv={act}", "--prompt-lens", "32,512", "--step-blocks", "1")
    if plan.bf16:
        vs_peers("intel-bf16-vs-openvino", "intel", plan.p("b1-intel-bf16.kvx"),
                 f"{p1}/openvino-fp32@precision=bf16,kv=bf16", "--prompt-lens", "32,512", "--step-blocks", "1")
    bench("cpu-kv-4096", "kv", plan.p("b125-cpu-int4-kvint8.kvx"), "--compare", plan.p("b125-cpu-int4-kvfp32.kvx"),
          "--prompt-lens", "4096", "--no-floor")
    bench("intel-kv-4096", "kv", plan.p("b125-intel-int4-kvint8.kvx"), "--option", "precision=fp32", "--variant",
          "kv_precision=f32", "--prompt-lens", "4096", "--no-floor", "--step-pairs")
    vs_peers("long-fp32-vs-openvino", "long", plan.p("b125-intel-fp32.kvx") + "@precision=fp32",
             plan.p("b125-cpu-fp32.kvx"), p125 + "/openvino-fp32@kv=f32,precision=f32", "--prompt-lens", "4096",
             "--step-blocks", "16")
    vs_peers("long-kv8-vs-openvino", "kv", plan.p("b125-intel-int4-kvint8.kvx") + "@precision=fp32",
             plan.p("b125-cpu-int4-kvint8.kvx"), p125 + "/openvino-int4-g32@kv=u8,precision=f32",
             "--prompt-lens", "4096", "--step-blocks", "16")
    return plan


# --- running ------------------------------------------------------------------------------------
def result_path(work: Path, name: str) -> Path:
    return work / "results" / f"{name}.json"


def last_json(text: str) -> object:
    """The JSON document a command printed last (peers.py prints progress lines before it)."""
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(("{", "[")):
            try:
                return json.loads("\n".join(lines[i:]))
            except json.JSONDecodeError:
                continue
    raise ValueError("no JSON document in the command's output")


def execute(step: Step, log: Path) -> dict:
    """Runs one step with its output in log; returns what results/NAME.json keeps: the command, its exit status,
    wall time, peak RSS (the kernel's own figure for it and everything it waited for: wait4) and the JSON it
    printed, if it prints one."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(step.argv, stdout=subprocess.PIPE if step.parse_json else out, stderr=out, text=True)
        stdout = proc.stdout.read() if proc.stdout else ""
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.write(stdout)
    rec: dict = {"argv": step.argv, "rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1),
                 "peak_rss_bytes": usage.ru_maxrss * 1024}
    if step.parse_json and proc.returncode == 0:
        rec["output"] = last_json(stdout)
    return rec


def needed(plan: Plan, groups: set[str]) -> list[Step]:
    """The groups' steps and every step that makes something they use, in plan order."""
    keep = {s.name for s in plan.steps if s.group in groups}
    while True:
        used = " ".join(" ".join(s.argv) for s in plan.steps if s.name in keep)
        more = {s.name for s in plan.steps if s.name not in keep and s.makes and
                (s.makes in used or (s.name == "peers-setup" and str(PEERS) in used))}
        if not more:
            return [s for s in plan.steps if s.name in keep]
        keep |= more


def complete(folder: Path) -> bool:
    """A folder a step makes, whole: an artifact (its manifest, written last), a checkpoint, a peer's model or the
    peers' virtualenv; a folder without its file is what an interrupted or failed step left."""
    return (any((folder / f).is_file() for f in ("manifest.json", "genai_config.json", "openvino_model.xml",
                                                 "bin/python")) or any(folder.glob("*.safetensors")))


def run(a: argparse.Namespace) -> None:
    work = Path(a.work).resolve()
    plan = make_plan(work, read_cpu_flags(), a.rounds)
    only = set(a.only.split(",")) if a.only else set(GROUPS)
    if only - set(GROUPS):
        sys.exit(f"error: --only takes {', '.join(GROUPS)}, not {', '.join(sorted(only - set(GROUPS)))}")
    steps = needed(plan, only)
    work.mkdir(parents=True, exist_ok=True)
    print(f"cpu: {cpu_kind(plan.flags)}; work folder {work} ({shutil.disk_usage(work).free / 2**30:.0f} GiB free); "
          f"{len(steps)} steps", flush=True)
    for s in steps:
        done = result_path(work, s.name)
        state = "kept" if done.is_file() else "exists" if s.makes and complete(Path(s.makes)) else "to run"
        if state == "to run" and s.makes and Path(s.makes).exists():
            print(f"  {s.name}: {s.makes} is there but incomplete (an interrupted or failed step): made again",
                  flush=True)
        if a.dry_run:
            print(f"  [{state}] {s.name}: {' '.join(s.argv)}")
            continue
        if state != "to run":
            print(f"  {s.name}: {state}, not run again", flush=True)
            continue
        free = shutil.disk_usage(work).free
        if s.makes and free < MIN_FREE:  # a bench-1b artifact takes 5-11 GiB, its build more while it writes
            sys.exit(f"error: {free / 2**30:.1f} GiB free under {work}; {s.name} needs {MIN_FREE / 2**30:.0f} GiB or "
                     "more (a whole run keeps about 60 GiB): free some, or give --work another disk, and run again")
        print(f"  {s.name}: running ({' '.join(s.argv[1:4])} ...)", flush=True)
        rec = execute(s, work / "logs" / f"{s.name}.log")
        print(f"    rc {rec['rc']}, {rec['wall_s']:.0f} s, peak RSS {rec['peak_rss_bytes'] / 2**30:.2f} GiB", flush=True)
        if rec["rc"] == 0:
            done.parent.mkdir(parents=True, exist_ok=True)
            done.write_text(json.dumps(rec, indent=1))
        else:
            print(f"    failed: see {work / 'logs' / (s.name + '.log')}; its bars read 'not run'", flush=True)
    if not a.dry_run:
        report(a)


# --- the bars -----------------------------------------------------------------------------------
def load(work: Path, name: str) -> dict | None:
    f = result_path(work, name)
    return json.loads(f.read_text()) if f.is_file() else None


def _other(row: dict, artifact: str) -> dict:
    """A --compare (or --variant) entry of a `kvexport bench` prompt row, by the artifact's file name."""
    for key, v in row.items():
        if key.startswith("other:") and Path(key[6:].split(" [")[0]).name == artifact:
            return v
    raise KeyError(artifact)


def _peer(out: dict, p: str, prefix: str) -> dict:
    for key, v in out["prompts"][p].items():
        if Path(key.split("@")[0]).name.startswith(prefix):
            return v
    raise KeyError(prefix)


def verdict(ok: bool | None) -> str:
    return "not run" if ok is None else "met" if ok else "**missed**"


def bars(work: Path, flags: set[str]) -> list[tuple[str, str, str]]:
    """(bar, figure, verdict) for every bar, from the results in work."""
    rows: list[tuple[str, str, str]] = []

    def add(bar: str, figure: str, ok: bool | None) -> None:
        rows.append((bar, figure, verdict(ok)))

    def guarded(bar: str, name: str, fn) -> None:  # type: ignore[no-untyped-def]
        rec = load(work, name)
        if rec is None or "output" not in rec:
            add(bar, f"`{name}` has not run", None)
            return
        try:
            figure, ok = fn(rec["output"])
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            add(bar, f"`{name}`'s output lacks {e}", None)
            return
        rows.append((bar, figure, "inconclusive" if ok is None else verdict(ok)))

    # export memory
    rec, ck = load(work, "build-b1-cpu-fp32"), work / "bench-1b"
    if rec and ck.is_dir():
        weights = sum(f.stat().st_size for f in ck.glob("*.safetensors"))
        ratio = rec["peak_rss_bytes"] / weights
        add("exporting bench-1b (and its cpu build): peak RSS <= 2x its fp32 weight bytes",
            f"{rec['peak_rss_bytes'] / 2**30:.2f} GiB, {ratio:.2f}x the weights' {weights / 2**30:.2f} GiB, "
            f"{rec['wall_s']:.0f} s", ratio <= 2.0)
    else:
        add("exporting bench-1b: peak RSS <= 2x its fp32 weight bytes", "`build-b1-cpu-fp32` has not run", None)

    # cpu modes against fp32 and their floors
    for mode, need in (("int8", 2.5), ("int4", 4.0)):
        def modes(out: dict, need: float = need) -> tuple[str, bool | None]:
            parts, ok, differs = [], True, None
            for p in ("32", "512"):
                row = out["prompts"][p]
                e, fp32 = row["engine"], _other(row, "b1-cpu-fp32.kvx")  # ratios are fp32's over the engine's
                speed, floor = 1 / fp32["decode_ratio_vs_main_median_round"], 1 / fp32["floor_ratio_vs_main"]
                own = e["fraction_of_own_floor_median_round"]
                bar = min(need, 0.9 * floor)  # where the floors' own ratio is below the bar: 90% of it
                parts.append(f"{p}: {speed:.2f}x fp32 (floors {floor:.2f}x), {own:.0%} of its floor")
                ok = ok and speed >= bar and own >= 0.85
                differs = differs or e.get("floor_placement_differs")
            if differs:  # a placed read against an unplaced one: the fraction says nothing either way
                return "; ".join(parts) + f" -- but {differs.split(' (')[0]}", None
            return "; ".join(parts), ok
        guarded(f"`cpu` {mode} decode >= {need}x fp32 (or 90% of the floors' ratio), >= 85% of its own floor",
                f"cpu-{mode}", modes)

    def vs_ort(out: dict) -> tuple[str, bool]:
        parts, ok = [], True
        for p in ("32", "512"):
            peer = _peer(out, p, "ortgenai")
            parts.append(f"{p}: {1 / peer['decode_ratio_vs_first']:.2f}x")
            ok = ok and 1 / peer["decode_ratio_vs_first"] >= 1.1
        return "decode over the peer's, " + ", ".join(parts), ok
    guarded("`cpu` int4 decode >= 1.1x onnxruntime-genai int4 (g32)", "cpu-vs-ortgenai", vs_ort)

    def ttft_ort(out: dict) -> tuple[str, bool]:
        peer = _peer(out, "512", "ortgenai")
        ratio = 1 / peer["ttft_ratio_vs_first_median_round"]
        return f"TTFT {ratio:.2f}x the peer's (per-round median)", ratio <= 0.8
    guarded("`cpu` int4 TTFT at 512 <= 0.8x onnxruntime-genai int4's", "cpu-vs-ortgenai", ttft_ort)

    def vs_ov(need: float):  # type: ignore[no-untyped-def]
        def fn(out: dict) -> tuple[str, bool]:
            parts, ok = [], True
            for p in ("32", "512"):
                peer = _peer(out, p, "openvino")
                q = peer.get("decode_ratio_quartiles", [peer["decode_ratio_vs_first"]] * 2)
                parts.append(f"{p}: {1 / peer['decode_ratio_vs_first']:.3f}x [{1 / q[1]:.2f}-{1 / q[0]:.2f}]")
                ok = ok and 1 / peer["decode_ratio_vs_first"] >= need
            return "paired steps over the peer's, " + ", ".join(parts), ok
        return fn
    guarded("`intel` int8 decode >= 1.0x OpenVINO GenAI int8 (INT8_ASYM)", "intel-int8-vs-openvino", vs_ov(1.0))
    guarded("`intel` int4 g128 decode >= 1.0x OpenVINO GenAI int4 g128", "intel-int4-vs-openvino", vs_ov(1.0))
    if "amx_bf16" in flags:
        guarded("`intel` bf16 decode >= 1.1x OpenVINO GenAI bf16 (AMX)", "intel-bf16-vs-openvino", vs_ov(1.1))
    elif has_bf16(flags):
        rec = load(work, "intel-bf16-vs-openvino")
        fig = vs_ov(1.1)(rec["output"])[0] if rec and "output" in rec else "`intel-bf16-vs-openvino` has not run"
        rows.append(("`intel` bf16 decode >= 1.1x OpenVINO GenAI bf16 (a bar for AMX CPUs)", fig + " (AVX512-BF16)",
                     "not applicable: no AMX"))
    else:
        rows.append(("`intel` bf16 decode >= 1.1x OpenVINO GenAI bf16 (a bar for AMX CPUs)", "no bf16 hardware",
                     "not applicable"))

    # KV int8: bytes, and decode at 4096 with int4 weights
    for target, art in (("cpu", "b125-cpu-int4-kvint8.kvx"), ("intel", "b125-intel-int4-kvint8.kvx")):
        m = work / art / "manifest.json"
        if not m.is_file():
            add(f"`{target}` KV int8 cache bytes <= 0.27x fp32 (scales included)", f"`{art}` not built", None)
            continue
        man = json.loads(m.read_text())
        c, kv = man["cache"], man["target"]["kv"]
        fp32 = 2 * c["num_layers"] * c["kv_heads"] * c["head_dim"] * 4
        ratio = (kv["bytes_per_token"] + int(kv.get("scale_bytes") or 0) / c["max_seq"]) / fp32
        fmt = kv.get("format", kv["dtype"]).split(":")[0]
        add(f"`{target}` KV int8 cache bytes <= 0.27x fp32 (scales included)",
            f"{ratio:.3f}x ({kv['bytes_per_token']} bytes a token against {fp32}; {fmt})", ratio <= 0.27)

    def kv_cpu(out: dict) -> tuple[str, bool]:
        o = _other(out["prompts"]["4096"], "b125-cpu-int4-kvfp32.kvx")
        ratio = 1 / o["decode_ratio_vs_main_median_round"]
        return f"{ratio:.2f}x (median round)", ratio >= 1.15
    guarded("`cpu` KV int8 with int4 weights at 4096: decode >= 1.15x the fp32 cache (bench-125m)", "cpu-kv-4096",
            kv_cpu)

    def kv_intel(out: dict) -> tuple[str, bool]:
        o = next(v for k, v in out["prompts"]["4096"].items() if k.startswith("other:"))
        paired, rounds = 1 / o["step_pairs"]["median"], 1 / o["decode_ratio_vs_main_median_round"]
        return f"{paired:.2f}x paired steps, {rounds:.2f}x by rounds (f32 activations)", min(paired, rounds) >= 1.15
    guarded("`intel` KV int8 with int4 weights at 4096: decode >= 1.15x the fp32 cache (bench-125m)",
            "intel-kv-4096", kv_intel)

    # prompt 4096 against OpenVINO GenAI
    def long(out: dict, kvname: str) -> tuple[str, bool]:
        row = out["prompts"]["4096"]
        peer = _peer(out, "4096", "openvino")
        cpu = next(v for k, v in row.items() if "-cpu-" in Path(k.split("@")[0]).name)
        intel_ttft = 1 / peer["ttft_ratio_vs_first_median_round"]
        cpu_ttft = cpu["ttft_ratio_vs_first_median_round"] * intel_ttft
        intel_dec = 1 / peer["decode_ratio_vs_first"]
        cpu_dec = cpu["decode_ratio_vs_first"] * intel_dec
        ok = intel_ttft <= 1.0 and cpu_ttft <= 1.2 and intel_dec >= 1.0 and cpu_dec >= 1.0
        return (f"{kvname}: `intel` TTFT {intel_ttft:.2f}x, decode {intel_dec:.2f}x; `cpu` TTFT {cpu_ttft:.2f}x, "
                f"decode {cpu_dec:.2f}x the peer's"), ok
    guarded("prompt 4096 (bench-125m): `intel` TTFT <= 1.0x, `cpu` <= 1.2x OpenVINO GenAI's, decode >= 1.0x, "
            "fp32 cache", "long-fp32-vs-openvino", lambda out: long(out, "fp32 weights, f32 cache"))
    guarded("the same at an 8-bit cache (int4 g32 weights; the peer's u8)", "long-kv8-vs-openvino",
            lambda out: long(out, "int4 g32, 8-bit caches"))

    # quality on the trained default model
    for name, limit in (("def-cpu-int8", 1.0), ("def-cpu-int4-g32", 8.0), ("def-cpu-int4-g128", None),
                        ("def-cpu-kvint8", 1.0), ("def-intel-int8", 1.0), ("def-intel-int4-g32", 8.0),
                        ("def-intel-kvint8", 1.0), ("def-intel-bf16", 1.0)):
        rec = load(work, f"verify-{name}")
        if name == "def-intel-bf16" and not has_bf16(flags):
            continue
        if rec is None or "output" not in rec:
            add(f"quality {name}: perplexity change" + (f" <= {limit}%" if limit else " (reported)"),
                f"`verify-{name}` has not run", None)
            continue
        q = quality_of(rec["output"])
        fig = (f"ppl {q['ppl_change_pct']:+.2f}%, top-1 {q['top1']:.4f}, mean KL {q['mean_kl']:.2e}; its tolerance "
               f"row {'passed' if q['passed'] else 'FAILED'}" if q else "no lossy figures in its output")
        add(f"quality {name}: perplexity change" + (f" <= {limit}%" if limit else " (reported)"), fig,
            None if not q else (True if limit is None else abs(q["ppl_change_pct"]) <= limit))
    return rows


def quality_of(out: dict) -> dict | None:
    """The lossy figures of a `kvexport verify --json` report on the held-out text: perplexity change (%), top-1
    agreement and mean KL against the reference, and whether the tolerance table's row passed."""
    text = out.get("text") or {}
    if not {"ppl_change", "top1_agreement", "mean_kl"} <= text.keys():
        return None
    return {"ppl_change_pct": 100 * float(text["ppl_change"]), "top1": float(text["top1_agreement"]),
            "mean_kl": float(text["mean_kl"]), "passed": bool(out.get("passed"))}


def report(a: argparse.Namespace) -> None:
    work = Path(a.work).resolve()
    flags = read_cpu_flags()
    rows = bars(work, flags)
    if getattr(a, "json", False):
        print(json.dumps({"cpu": cpu_kind(flags), "bars": [dict(zip(("bar", "figure", "verdict"), r)) for r in rows]},
                         indent=1))
        return
    print(f"\n{cpu_info()['model']}: {cpu_kind(flags)}; figures from {work}\n")
    print("| bar | this run | |\n|---|---|---|")
    for bar, figure, v in rows:
        print(f"| {bar} | {figure} | {v} |")
    counts = {k: sum(r[2] == k for r in rows) for k in ("met", "**missed**", "inconclusive", "not run")}
    print(f"\n{counts['met']} met, {counts['**missed**']} missed, {counts['inconclusive']} inconclusive, "
          f"{counts['not run']} not run")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("run", help="make what is missing, measure, and print the table")
    s.add_argument("--work", required=True, help="the folder that holds everything (resumable)")
    s.add_argument("--only", default="", help=f"comma-separated groups: {', '.join(GROUPS)}")
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--dry-run", action="store_true", help="print the plan and what is already there")
    s.set_defaults(fn=run)
    s = sub.add_parser("report", help="the table from the results in --work")
    s.add_argument("--work", required=True)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=report)
    return ap


def main() -> None:
    a = parser().parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()
