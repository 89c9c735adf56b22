"""What a TensorRT engine was built for, what this machine offers, and what loading must do about it.

A serialized engine runs only with the TensorRT version and GPU model it was built for. The
manifest records the build's fingerprint; at load the runtime compares it with the machine's and
uses the engine, rebuilds it from the lowered IR into a cache folder, or (with no_rebuild) fails
with a message that says how to get a matching engine. The decision is a pure function so it is
tested without a GPU.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from kvexport.errors import ArtifactError

# Every field binds: TensorRT plans are not portable across TensorRT versions or GPU models, and
# a driver change is rare and cheap to rebuild for, where a wrong guess would mean a crash.
FIELDS = ("tensorrt", "gpu_name", "compute_capability", "driver")


@dataclass(frozen=True)
class DeviceInfo:
    tensorrt: str
    gpu_name: str
    compute_capability: str  # "9.0"
    driver: str

    def fingerprint(self) -> dict[str, str]:
        return asdict(self)

    def describe(self) -> str:
        return f"TensorRT {self.tensorrt} on {self.gpu_name} (sm {self.compute_capability}, driver {self.driver})"


class Action(str, Enum):
    USE = "use"  # the packaged engine matches this machine
    BUILD = "build"  # deferred artifact: no engine yet
    REBUILD = "rebuild"  # engine from another GPU/TensorRT: rebuild from the lowered IR


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str


def decide(target: dict[str, Any], current: DeviceInfo) -> Decision:
    """What to do with the artifact's engine on this machine (no side effects)."""
    if is_deferred(target):
        return Decision(Action.BUILD, f"the engine was deferred to first load; building it for {current.describe()}")
    stored = target.get("fingerprint") or {}
    diffs = [f for f in FIELDS if str(stored.get(f)) != str(getattr(current, f))]
    if not diffs:
        return Decision(Action.USE, f"engine matches {current.describe()}")
    was = ", ".join(f"{f} {stored.get(f)!r}" for f in diffs)
    now = ", ".join(f"{f} {getattr(current, f)!r}" for f in diffs)
    return Decision(Action.REBUILD, f"the engine was built for {was}; this machine has {now}")


def is_deferred(target: dict[str, Any]) -> bool:
    return bool(target.get("deferred") or (target.get("options") or {}).get("deferred"))


def require_usable(decision: Decision, *, no_rebuild: bool, artifact: Path) -> None:
    """With no_rebuild, anything but USE is an error that says how to get a matching engine."""
    if no_rebuild and decision.action is not Action.USE:
        raise ArtifactError(
            f"{artifact}: {decision.reason}, and rebuilding was turned off (no_rebuild). Load without "
            f"--no-rebuild to build a matching engine from the packaged IR (minutes, cached afterwards), "
            f"or run `kvexport build --target nvidia` on this machine."
        )


def cache_root() -> Path:
    """Where rebuilt engines go: $KVEXPORT_CACHE/nvidia, else ~/.cache/kvexport/nvidia."""
    base = os.environ.get("KVEXPORT_CACHE") or Path.home() / ".cache" / "kvexport"
    return Path(base) / "nvidia"


def cache_key(ir_sha256: str, fingerprint: dict[str, str], build_options: dict[str, Any]) -> str:
    """One folder per (lowered IR, machine, build options): a different GPU never reuses a plan."""
    blob = json.dumps({"ir": ir_sha256, "fp": fingerprint, "opts": build_options}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


# --- probing the machine (cheap; nothing here imports TensorRT) -------------------------------
def nvidia_smi() -> tuple[dict[str, str] | None, str]:
    """(first GPU's name/driver/compute capability, or None) and why not, from nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "nvidia-smi is not on PATH: no NVIDIA driver is installed"
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,driver_version,compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=15, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"nvidia-smi failed to run ({e})"
    line = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
    if out.returncode != 0 or not line:
        return None, f"nvidia-smi sees no GPU ({(out.stderr or out.stdout).strip()[:200]})"
    return parse_smi_line(line), ""


def parse_smi_line(line: str) -> dict[str, str]:
    parts = [p.strip() for p in line.split(",")]
    if len(parts) < 3:
        raise ValueError(f"unexpected nvidia-smi line {line!r}")
    # GPU names can hold commas in principle: the last two fields are fixed
    return {"gpu_name": ",".join(parts[:-2]), "driver": parts[-2], "compute_capability": parts[-1]}
