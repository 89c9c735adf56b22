"""What this machine offers the amd target (ROCm GPU, other GPU, or CPU) and the build fingerprint."""
from __future__ import annotations

import platform
import shutil
from dataclasses import dataclass, field
from typing import Any, Literal

from kvexport.doctor import read_cpu_flags
from kvexport.errors import BackendUnavailableError

DeviceKind = Literal["rocm", "cuda", "cpu"]
DeviceChoice = Literal["auto", "gpu", "cpu"]

# CPU features an AOTInductor CPU library may use: it is compiled with -march=native, so a
# package built where these exist can die of SIGILL where they do not.
_ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "bmi", "vnni")


@dataclass(frozen=True)
class DeviceInfo:
    """One device the package can be compiled for. gfx_arch is set on ROCm only."""

    kind: DeviceKind
    name: str
    torch: str
    hip: str | None = None
    cuda: str | None = None
    gfx_arch: str | None = None
    compute_capability: str | None = None
    cpu_flags: tuple[str, ...] = field(default_factory=tuple)

    @property
    def torch_device(self) -> str:
        return "cpu" if self.kind == "cpu" else "cuda"  # ROCm builds of torch also say "cuda"

    def fingerprint(self) -> dict[str, Any]:
        """What the compiled package depends on; load() compares it with this machine's."""
        fp: dict[str, Any] = {"device_kind": self.kind, "device_name": self.name, "torch": self.torch,
                              "machine": platform.machine()}
        if self.kind == "rocm":
            fp.update(hip=self.hip, gfx_arch=self.gfx_arch)
        elif self.kind == "cuda":
            fp.update(cuda=self.cuda, compute_capability=self.compute_capability)
        else:
            fp["cpu_flags"] = list(self.cpu_flags)
        return fp


def cpu_flags() -> tuple[str, ...]:
    """ISA flags of this CPU that compiled kernels may rely on (Linux /proc/cpuinfo; empty elsewhere)."""
    return tuple(sorted(x for x in read_cpu_flags() if x.startswith(_ISA_PREFIXES)))


def gpu_present() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)


def probe_gpu(index: int = 0) -> DeviceInfo:
    """The GPU torch sees (ROCm or CUDA build). Callers check gpu_present() first."""
    import torch

    props = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        # gcnArchName is like "gfx90a:sramecc+:xnack-": the feature suffixes matter to the code object
        return DeviceInfo(kind="rocm", name=props.name, torch=torch.__version__, hip=str(torch.version.hip),
                          gfx_arch=str(getattr(props, "gcnArchName", "unknown")))
    return DeviceInfo(kind="cuda", name=props.name, torch=torch.__version__, cuda=str(torch.version.cuda),
                      compute_capability=f"{props.major}.{props.minor}")


def probe_cpu() -> DeviceInfo:
    import torch

    return DeviceInfo(kind="cpu", name=platform.processor() or platform.machine(), torch=torch.__version__,
                      cpu_flags=cpu_flags())


def no_gpu_reason() -> str:
    """Why there is no GPU for the amd target, in words a user can act on."""
    import torch

    if torch.version.hip is None and torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is a CPU-only build, so it cannot see a ROCm GPU; on the AMD "
                "machine install the ROCm build of PyTorch (https://pytorch.org/get-started/locally/, ROCm wheel)")
    if torch.version.hip is not None:
        return (f"torch is a ROCm build (HIP {torch.version.hip}) but sees no GPU; check `rocminfo`, that the user "
                "is in the render/video groups and HIP_VISIBLE_DEVICES")
    return (f"torch is a CUDA build (CUDA {torch.version.cuda}), not ROCm, and sees no GPU; install the ROCm build "
            "of PyTorch on the AMD machine")


def select(choice: DeviceChoice) -> DeviceInfo:
    """auto: the GPU if torch sees one, else the CPU; gpu: a GPU or BackendUnavailableError."""
    if choice not in ("auto", "gpu", "cpu"):
        raise BackendUnavailableError(f"unknown device {choice!r}; pass --option device=auto|gpu|cpu")
    if choice == "cpu":
        return probe_cpu()
    if gpu_present():
        return probe_gpu()
    if choice == "gpu":
        raise BackendUnavailableError(
            f"the amd target was asked for the GPU but there is none: {no_gpu_reason()}. "
            "Or build for the CPU here with --option device=cpu (fp32)"
        )
    return probe_cpu()


def cxx_compiler() -> str | None:
    """The C++ compiler AOTInductor will call (it compiles the package at build time)."""
    import os

    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx)
    for name in ("g++", "clang++", "c++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def mismatches(built: dict[str, Any], here: DeviceInfo) -> list[str]:
    """Why a package compiled with fingerprint `built` cannot run on `here` (empty list: it can)."""
    problems = []
    if built.get("torch") != here.torch:
        problems.append(f"compiled with torch {built.get('torch')}, this machine has torch {here.torch} "
                        "(AOTInductor libraries are tied to the torch they were compiled with)")
    if built.get("machine") != platform.machine():
        problems.append(f"compiled for {built.get('machine')}, this machine is {platform.machine()}")
    kind = built.get("device_kind")
    if kind != here.kind:
        problems.append(f"compiled for a {kind} device, this machine offers {here.kind}")
    elif kind == "rocm":
        if built.get("gfx_arch") != here.gfx_arch:
            problems.append(f"compiled for {built.get('gfx_arch')}, this GPU is {here.gfx_arch}")
        if built.get("hip") != here.hip:
            problems.append(f"compiled with HIP {built.get('hip')}, this torch has HIP {here.hip}")
    elif kind == "cuda":
        if built.get("compute_capability") != here.compute_capability:
            problems.append(f"compiled for compute capability {built.get('compute_capability')}, "
                            f"this GPU is {here.compute_capability}")
        if built.get("cuda") != here.cuda:
            problems.append(f"compiled with CUDA {built.get('cuda')}, this torch has CUDA {here.cuda}")
    else:
        missing = sorted(set(built.get("cpu_flags", [])) - set(here.cpu_flags))
        if missing:
            problems.append(f"compiled on a CPU with {', '.join(missing)}, which this CPU lacks")
    return problems
