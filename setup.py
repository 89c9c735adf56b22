"""Builds kvexport's native ops for ONNX Runtime (kvexport/native/: the 4-bit matmul qmatmul.c, the
attention over an int8 or fp32 cache attention.c) into one library beside the package.

Everything else is declared in pyproject.toml. The library needs ONNX Runtime's C API headers, which the
onnxruntime wheel does not ship: they are taken from $KVEXPORT_ORT_INCLUDE, else from build/ort-include/
(kvexport/native/fetch_ort_headers.sh puts them there). Without headers or a C compiler the install still
succeeds, the library is left out, and `cpu` engines run ONNX Runtime's own MatMulNBits and GroupQueryAttention
(`kvexport doctor` says which kernels run and why).
"""
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


def ort_headers() -> Path | None:
    for folder in (os.environ.get("KVEXPORT_ORT_INCLUDE"), HERE / "build" / "ort-include"):
        if folder and (Path(folder) / "onnxruntime_c_api.h").is_file():
            return Path(folder)
    return None


class BuildNative(build_ext):
    def build_extensions(self) -> None:
        include = ort_headers()
        if include is None:
            print("kvexport: ONNX Runtime C API headers not found (set KVEXPORT_ORT_INCLUDE or run "
                  "kvexport/native/fetch_ort_headers.sh): the native ops are not built", file=sys.stderr)
            self.extensions = []
            return
        for ext in self.extensions:
            ext.include_dirs.append(str(include))
        try:
            super().build_extensions()
        except Exception as e:  # no compiler, or one without the intrinsics: the engines fall back
            print(f"kvexport: the native ops did not build ({e}); cpu engines use ONNX Runtime's kernels",
                  file=sys.stderr)
            self.extensions = []

    def get_ext_filename(self, fullname: str) -> str:
        # a plain shared library that ONNX Runtime loads, not a Python module: no ABI tag in its name
        return os.path.join(*fullname.split(".")) + ".so"


setup(
    ext_modules=[Extension("kvexport.native.libkvexport_native",
                           sources=["kvexport/native/qmatmul.c", "kvexport/native/attention.c"],
                           depends=["kvexport/native/ops.h", "kvexport/native/simd_math.h"],
                           extra_compile_args=["-O3", "-std=c11", "-Wall"], libraries=["m"])],
    cmdclass={"build_ext": BuildNative},
)
