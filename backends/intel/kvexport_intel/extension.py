"""kvexport's OpenVINO extension ops (kvexport_intel/native/*.cpp), each compiled from its one source file the first
time an engine asks for it, with the C++ compiler on PATH (`c++`, or $CXX) against the headers the openvino wheel
ships, for the CPU it runs on (-march=native), and kept under $KVEXPORT_CACHE_DIR (default ~/.cache/kvexport) by a
name that holds the source's hash, OpenVINO's version, the CPU's flags and the compiler's flags: a few seconds once.
Nothing of it comes from an artifact."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import kvexport
from kvexport.doctor import read_cpu_flags
from kvexport.errors import BackendUnavailableError

NATIVE = Path(__file__).parent / "native"
# the folder of the vector math the ops share with kvexport's ONNX Runtime kernels (kvexport/native/simd_math.h)
SHARED = Path(kvexport.__file__).parent / "native"
# the compiler's flags: for this CPU, 512-bit vectors where it has them (GCC's default for some AVX-512 CPUs is 256);
# never unloaded (-z nodelete): OpenVINO closes a library when the last Core or NodeFactory that loaded it goes,
# while nodes made from its code may live on; a library whose inline code from OpenVINO's headers binds to another
# such library's copy (the first loaded owns it) was otherwise closed under them, and the process crashed
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp-simd", "-fno-math-errno", "-std=c++17",
         "-shared", "-fPIC", "-DNDEBUG", "-Wl,-z,nodelete")


def missing_compiler() -> str | None:
    """The C++ compiler the ops are compiled with (`c++`, or $CXX) where it is not on PATH; None where it is."""
    cxx = os.environ.get("CXX") or "c++"
    return cxx if shutil.which(cxx) is None else None


def compile_op(source: Path, stem: str, what: str, instead: str, extra: tuple[str, ...] = ()) -> Path:
    """The extension library of `source` (under NATIVE), compiled here the first time; BackendUnavailableError where
    it cannot be, saying `what` needs it and what to do `instead`."""
    import openvino as ov

    include = Path(ov.__file__).parent / "include"
    libs = Path(ov.__file__).parent / "libs"
    flags = FLAGS + extra
    text = source.read_bytes() + (SHARED / "simd_math.h").read_bytes()
    cpu = " ".join(sorted(read_cpu_flags()))
    key = hashlib.sha256(b" ".join([text, ov.__version__.encode(), cpu.encode(), *(f.encode() for f in flags)]))
    cache = Path(os.environ.get("KVEXPORT_CACHE_DIR") or Path.home() / ".cache" / "kvexport")
    lib = cache / f"libkvexport_ov_{stem}_{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    missing = missing_compiler()
    if missing is not None:
        raise BackendUnavailableError(f"{what} is compiled with a C++ compiler and {missing!r} is not there: install "
                                      f"g++ (or set CXX to one), or {instead}")
    cxx = os.environ.get("CXX") or "c++"
    openvino = sorted(libs.glob("libopenvino.so*"))
    tbb = sorted(libs.glob("libtbb.so*"))
    if not include.is_dir() or not openvino or not tbb:
        raise BackendUnavailableError(f"the openvino package at {include.parent} lacks its C++ headers or libraries, "
                                      f"which {what} is compiled against: {instead}")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        out = Path(tmp) / lib.name
        cmd = [cxx, *flags, str(source), f"-I{include}", f"-I{SHARED}", str(openvino[0]), str(tbb[0]),
               f"-Wl,-rpath,{libs}", "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise BackendUnavailableError(f"compiling {what} failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}\n"
                                          f"{instead}")
        os.replace(out, lib)  # atomic: another process compiling the same key lands the same file
    return lib
