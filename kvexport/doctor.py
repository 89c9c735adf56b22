"""`kvexport doctor`: what this machine offers (ISA, NUMA, GPUs) and which targets can build here."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

from kvexport import backends
from kvexport.errors import KvexportError

ISA_FLAGS = {
    "avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX512-BF16", "avx512_vnni": "AVX512-VNNI",
    "amx_tile": "AMX-TILE", "amx_bf16": "AMX-BF16", "amx_int8": "AMX-INT8",
}


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
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
            targets[name] = {"ready": not reasons, "why_not": reasons, "description": caps.description,
                             "default_precision": caps.default_precision, **facts}
        except KvexportError as e:
            targets[name] = {"ready": False, "why_not": [str(e)]}
    return {"kvexport": kvexport.__version__, "python": platform.python_version(), "cpu": cpu_info(),
            "numa_nodes": numa_nodes(), "gpus": gpus(), "targets": targets}


def format_report(r: dict[str, Any]) -> str:
    cpu = r["cpu"]
    isa = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["isa"].items())
    lines = [f"kvexport {r['kvexport']} on Python {r['python']}",
             f"CPU: {cpu['model']} ({cpu['logical_cpus']} logical CPUs)", f"ISA: {isa}",
             "NUMA: " + (", ".join(f"{n} cpus {c}" for n, c in r["numa_nodes"].items()) or "no sysfs NUMA info"),
             "GPUs: " + (", ".join(" ".join(g.values()) for g in r["gpus"]) or "none found"), "targets:"]
    for name, t in r["targets"].items():
        if t["ready"]:
            extra = {k: v for k, v in t.items() if k not in ("ready", "why_not", "description")}
            lines.append(f"  {name:7s} ready   {t.get('description', '')}  {extra}")
        else:
            facts = {k: v for k, v in t.items() if k not in ("ready", "why_not", "description", "default_precision")}
            lines.append(f"  {name:7s} missing {'; '.join(t['why_not'])}" + (f"  (sees {facts})" if facts else ""))
    return "\n".join(lines)
