"""`kvexport doctor`: what this machine offers (ISA, NUMA, GPUs) and which targets can build here."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import textwrap
from pathlib import Path
from typing import Any

from kvexport import backends
from kvexport.errors import KvexportError

ISA_FLAGS = {
    "avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX512-BF16", "avx512_vnni": "AVX512-VNNI",
    "amx_tile": "AMX-TILE", "amx_bf16": "AMX-BF16", "amx_int8": "AMX-INT8",
}


def _cpuinfo_text(cpuinfo: Path | str | None) -> str:
    """/proc/cpuinfo's text (cpuinfo None), another file's (a Path), or the given text (a str)."""
    if isinstance(cpuinfo, str):
        return cpuinfo
    try:
        return (cpuinfo or Path("/proc/cpuinfo")).read_text()
    except OSError:
        return ""


def read_cpu_flags(cpuinfo: Path | str | None = None) -> set[str]:
    """The ISA `flags` of the first processor (Linux /proc/cpuinfo names; empty elsewhere): the one reader
    that core, doctor and every backend use."""
    for line in _cpuinfo_text(cpuinfo).splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    model = platform.processor() or "unknown"
    text = _cpuinfo_text(cpuinfo)
    for line in text.splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    flags = read_cpu_flags(text)
    return {"model": model, "logical_cpus": os.cpu_count(), "isa": {name: f in flags for f, name in ISA_FLAGS.items()}}


def numa_nodes(root: Path = Path("/sys/devices/system/node")) -> dict[str, str]:
    """node name -> its cpulist as sysfs writes it (`0-3,8-11`)."""
    if not root.is_dir():
        return {}
    return {p.name: (p / "cpulist").read_text().strip() for p in sorted(root.glob("node[0-9]*")) if (p / "cpulist").is_file()}


def gpus() -> list[dict[str, str]]:
    """GPUs visible through the vendor tools (no Python SDK needed)."""
    found: list[dict[str, str]] = []
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,compute_cap", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10).stdout
            for line in out.strip().splitlines():
                name, driver, cc = (s.strip() for s in line.split(",", 2))
                found.append({"vendor": "NVIDIA", "name": name, "driver": driver, "compute_capability": cc})
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
    if Path("/dev/kfd").exists():
        found.append({"vendor": "AMD", "name": "ROCm device (/dev/kfd present)"})
    return found


def report() -> dict[str, Any]:
    import kvexport

    targets: dict[str, Any] = {}
    for name in backends.names():
        try:
            b = backends.get(name)
            reasons = b.availability()
            caps = b.capabilities()
            facts = b.doctor()  # what it sees (a GPU without its SDK, say) matters most when it is not ready
            t = {"ready": not reasons, "why_not": reasons, "description": caps.description,
                 "default_precision": caps.default_precision, "devices": list(caps.devices),
                 "deferred_build": caps.deferred_build, **facts}
        except KvexportError as e:
            t = {"ready": False, "why_not": [str(e)]}
        t["status"], t["would_build"] = _status(t)
        targets[name] = t
    return {"kvexport": kvexport.__version__, "python": platform.python_version(), "cpu": cpu_info(),
            "numa_nodes": numa_nodes(), "gpus": gpus(), "targets": targets}


CPU_ONLY = "cpu build only, no GPU"


def _status(t: dict[str, Any]) -> tuple[str, str]:
    """(status, what `kvexport build --target NAME` would make here) from a target's report entry.

    A target whose devices include a GPU but that would compile for the CPU here (no GPU visible) is
    not reported as plainly ready: its status says so.
    """
    devices = t.get("devices") or []
    gpu_target = any(d != "cpu" for d in devices)
    if not t["ready"]:
        if t.get("deferred_build"):
            return "not available", "nothing here; --defer packages the IR and the engine builds at first load on its device"
        return "not available", "nothing here"
    precision, _, why = str(t.get("would_pick_precision") or t.get("default_precision") or "").partition(": ")
    why = f" ({why})" if why else ""
    builds_for = t.get("builds_for") or (devices[0] if devices else "")
    if gpu_target and builds_for == "cpu":
        return CPU_ONLY, f"{precision} engine compiled for this CPU ({platform.machine()}){why}"
    device = "this CPU" if builds_for == "cpu" else (t.get("gpu") or builds_for)
    return "ready", f"{precision} engine for {device}{why}"


_NOT_FACTS = {"ready", "why_not", "description", "default_precision", "devices", "deferred_build", "status",
              "would_build", "note", "isa", "numa_nodes", "offline_cpus", "cpu_flags", "would_pick_precision",
              "builds_for", "amx"}


def _wrap(text: str, width: int, indent: str) -> list[str]:
    return textwrap.wrap(text, width=max(40, width), initial_indent=indent, subsequent_indent=indent + "  ",
                         break_on_hyphens=False, break_long_words=False) or [indent]


def format_report(r: dict[str, Any], width: int | None = None) -> str:
    """The report as a person reads it: a targets table, then the CPU (ISA, NUMA) and GPUs."""
    width = width or min(shutil.get_terminal_size((100, 24)).columns, 120)
    lines = [f"kvexport {r['kvexport']} on Python {r['python']}", ""]
    rows = [(name, t["status"], t["would_build"]) for name, t in sorted(r["targets"].items())]
    w_name = max(len("target"), *(len(n) for n, _, _ in rows))
    w_status = max(len("status"), *(len(s) for _, s, _ in rows))
    lines.append(f"{'target':{w_name}}  {'status':{w_status}}  would build")
    lines.append(f"{'-' * w_name}  {'-' * w_status}  {'-' * 11}")
    pad = " " * (w_name + 2)
    for (name, status, would), t in zip(rows, (r["targets"][n] for n, _, _ in rows)):
        first, *rest = _wrap(would, width - w_name - w_status - 4, "") or [""]
        lines.append(f"{name:{w_name}}  {status:{w_status}}  {first}".rstrip())
        lines += [" " * (w_name + w_status + 4) + ln.strip() for ln in rest]
        for why in t.get("why_not", []):
            lines += _wrap(f"why not: {why}", width, pad)
        if t.get("note") and t["status"] != "ready":
            lines += _wrap(f"why: {t['note']}", width, pad)
        said = " ".join(t.get("why_not", []))
        facts = ", ".join(f"{k} {v}" for k, v in t.items() if k not in _NOT_FACTS and isinstance(v, str | int | float)
                          and not isinstance(v, bool) and str(v) not in said)
        if facts:
            lines += _wrap(f"sees: {facts}", width, pad)
    cpu = r["cpu"]
    isa = "  ".join(f"{name} {'yes' if on else 'no'}" for name, on in cpu["isa"].items())
    numa = r["numa_nodes"]
    gpus_found = r["gpus"]
    lines += ["", f"{'CPU':6s}{cpu['model']}, {cpu['logical_cpus']} logical CPUs, {platform.machine()}"]
    lines += _wrap(f"ISA   {isa}", width, "")
    lines.append("NUMA  " + (f"{len(numa)} node{'s' if len(numa) > 1 else ''}: "
                             + ", ".join(f"{n} (cpus {c})" for n, c in numa.items()) if numa else "no sysfs NUMA info"))
    lines.append("GPUs  " + ("; ".join(", ".join(f"{k} {v}" if k != "vendor" and k != "name" else str(v)
                                                  for k, v in g.items()) for g in gpus_found) or "none found"))
    return "\n".join(lines)
